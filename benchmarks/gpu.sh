#!/usr/bin/env bash
# Every GPU check and benchmark of the model world in one run, sized for < 8 minutes on one H200.
#
#   bash benchmarks/gpu.sh [OUT_DIR]        # from anywhere; OUT_DIR defaults to $OUT or runs/gpu
#
# 1. benchmarks/gpu_checks.py: FlexAttention = SDPA (fp32, bf16), KV cache = recompute, R3 on
#    CUDA, a few trainer steps on CUDA.
# 2. benchmarks/model.py on CUDA in bfloat16 with the larger model (--size gpu): generation with
#    the KV cache vs recompute, packed vs padded training, routing-replay overhead, MFU, and the
#    training-inference gap per engine precision; once with SDPA, once with FlexAttention.
# Each stage has its own time limit and log (OUT_DIR/<stage>.log); the script goes on after a
# failed stage and exits 1 if any failed, 2 without CUDA. Needs torch, numpy, matplotlib on the
# machine; the package is imported from this checkout (no install).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
out="${1:-${OUT:-runs/gpu}}"
mkdir -p "$out"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu.sh: no CUDA device" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$out/gpu.txt"
status=0
stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit} s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}
stage checks 200 "$PY" benchmarks/gpu_checks.py
stage model_sdpa 100 "$PY" benchmarks/model.py --device cuda --dtype bfloat16 --attention sdpa \
    --size gpu --sequences 512 --repeats 5
stage model_flex 160 "$PY" benchmarks/model.py --device cuda --dtype bfloat16 --attention flex \
    --size gpu --sequences 512 --repeats 5
echo "gpu.sh: done in $SECONDS s, exit $status"
exit $status
