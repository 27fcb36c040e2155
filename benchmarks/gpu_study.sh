#!/usr/bin/env bash
# The long-answer study (benchmarks/long_study.py --config gpu) on one GPU, beside gpu.sh: sized by
# estimate (not measured) for about 8 minutes on one H200; stopped after 9 minutes in any case.
#
#   bash benchmarks/gpu_study.sh [OUT_DIR]      # OUT_DIR defaults to $OUT/long_study or runs/long_study_gpu
#
# Exits 2 without CUDA, with the study's exit status otherwise (124 when it ran out of time).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PYTHON:-python3}
out="${1:-${OUT:+$OUT/long_study}}"
out="${out:-runs/long_study_gpu}"
mkdir -p "$out"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_study.sh: no CUDA device" >&2
    exit 2
fi
timeout 540 "$PY" benchmarks/long_study.py --config gpu --out "$out" 2>&1 | tee "$out/long_study.log"
rc=${PIPESTATUS[0]}
echo "gpu_study.sh: done in $SECONDS s, exit $rc"
exit "$rc"
