"""The engine mismatch modes measured on the long-answer study's model (issue 31).

``benchmarks/long_study.py`` dials the mismatch with *fresh* Gaussian logit noise, drawn anew at
every decoding step, which real inference engines do not do. The rollout engine has other modes
(:class:`~tokenmdp.exact.EngineMismatch`): ``fixed``, ``heavy`` and ``growing`` are functions of
the context, and the numeric mode is the engine's own precision. This script measures, on the
study's ``cpu`` model (``MODEL_CPU``, ``running_sum_64``) started from its SFT checkpoint (the
study's SFT until half the held-out answers sampled at temperature 1 are right; trained here, or
reused from ``--out``, or given by ``--init``), for each precision alone and for each mode at a
few scales on an fp32 engine:

* ``KL`` — per-token ``KL(μ ‖ π_old)`` at the states the engine visited, from the full
  distributions (the engine's by one forward pass over its samples,
  :meth:`~tokenmdp.rl.RolloutEngine.next_token_logprobs`; the trainer's fp32 model's), mean over
  the response tokens; for ``fresh`` each state's distribution is one new draw of the noise;
* ``KL k3`` — the sampled estimate the trainer logs (``train_infer_kl_k3``);
* ``χ²`` — per-token ``χ²(π_old ‖ μ) = Σ_v π_old²/μ − 1`` at the visited states, and ``χ̂²``, the
  trainer's ``is_chi2`` from the sampled weights ``w = π_old/μ``;
* ``E[w]`` — the sampled mean of ``w`` ± its standard error (1 in expectation, every mode);
  standard errors take the answers as the independent units;
* ``tail`` — the share of sampled tokens with ``w < 1/2`` or ``w > 2``.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/engine_mismatch.py [--out runs/engine_mismatch]
        [--init CHECKPOINT] [--prompts 1024] [--seed 0]
    OMP_NUM_THREADS=1 python benchmarks/engine_mismatch.py --quick --prompts 8 --out /tmp/q

Measured (the defaults: 1024 prompts, seed 0) in the documentation, *Concepts* › *The trainer world* ›
*Engine mismatch modes*.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _long_study_runs import CONFIGS  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8_w8a8", "fp4")
MODES = (
    ("fresh", (0.25, 1.0, 2.0), 1.0),
    ("fixed", (0.25, 1.0, 2.0), 1.0),
    ("heavy", (4.0, 8.0), 0.01),
    ("heavy", (4.0, 8.0), 0.05),
    ("growing", (0.05, 0.1, 0.25), 1.0),
)
"""(mode, scales, fraction) measured on an fp32 engine."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/engine_mismatch",
                   help="output folder (results.md, results.json; the SFT run sft_L64)")
    p.add_argument("--init", default=None,
                   help="a checkpoint of the study's cpu model on running_sum_64 (default: the "
                        "study's SFT, trained in --out or reused from there)")
    p.add_argument("--prompts", type=int, default=1024, help="held-out prompts sampled per row")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples (and mismatch seed)")
    p.add_argument("--quick", action="store_true",
                   help="smoke check: the study's quick sizes (running_sum_8, a 4-step SFT); "
                        "its numbers mean nothing")
    args = p.parse_args(argv)
    args.size = CONFIGS["quick" if args.quick else "cpu"]
    args.length = args.size["length"]
    if args.prompts < 2:
        p.error("--prompts: must be >= 2")
    return args


def start_model(args):
    """The study's model on ``running_sum_L``: the ``--init`` checkpoint, or its SFT start
    (``_long_study_runs.train_sft``, reused when ``--out`` holds it)."""
    import torch
    from _long_study_runs import base_config, train_sft

    from tokenmdp.rl.run_setup import build_model
    from tokenmdp.rl.tasks import get_task

    study = argparse.Namespace(size=args.size, out=args.out)
    init = args.init
    if init is None:
        init = train_sft(study, args.length)["checkpoint"]
    cfg = dataclasses.replace(base_config(study, args.length, "rl"), init=init, seed=args.seed)
    task = get_task(cfg.task)
    model = build_model(cfg, task.tokenizer.vocab_size)
    model.load_state_dict(torch.load(init, map_location="cpu", weights_only=True)["model"])
    return model.eval(), task, cfg


def measure(model, task, cfg, precision: str, mismatch, prompts: list, seed: int) -> dict:
    """One row: the engine of ``precision`` and ``mismatch`` samples one answer per prompt; the
    per-token divergences to the trainer's model at the visited states, and the sampled ones."""
    import torch

    from tokenmdp.estimators.corrections.diagnostics import (
        batch_weight_sums,
        diagnostics_from_sums,
    )
    from tokenmdp.rl import RolloutEngine, compute_old_logprobs, training_inference_kl

    engine = RolloutEngine(model, precision=precision, mismatch=mismatch)
    gen = torch.Generator().manual_seed(seed)
    batch = engine.generate(prompts, max_new_tokens=cfg.max_new_tokens,
                            eos_id=task.tokenizer.EOS, generator=gen)
    batch = compute_old_logprobs(model, batch, "none")
    mask = batch.loss_mask
    with torch.no_grad():
        lp_pi = model.next_token_logprobs(batch).double()
        lp_mu = engine.next_token_logprobs(batch, generator=gen).double()
    kl_RC = (lp_mu.exp() * (lp_mu - lp_pi)).sum(-1) * mask
    chi2_RC = (torch.exp(2 * lp_pi - lp_mu).sum(-1) - 1) * mask
    w_RC = torch.exp(batch.old_logprob - batch.behavior_logprob).double() * mask
    count_R = mask.double().sum(1)
    kl, kl_se = ratio_and_se(kl_RC.sum(1), count_R)
    w_mean, w_se = ratio_and_se(w_RC.sum(1), count_R)
    w = w_RC[mask]
    return {"precision": precision, "mode": mismatch.mode, "scale": mismatch.scale,
            "fraction": mismatch.fraction, "tokens": int(count_R.sum()),
            "kl": kl, "kl_se": kl_se, "kl_k3": training_inference_kl(batch, kind="k3"),
            "chi2": ratio_and_se(chi2_RC.sum(1), count_R)[0],
            "is_chi2": diagnostics_from_sums(batch_weight_sums(batch))["is_chi2"],
            "w_mean": w_mean, "w_se": w_se,
            "tail": float(((w < 0.5) | (w > 2)).double().mean())}


def ratio_and_se(sum_S, count_S) -> tuple[float, float]:
    """The per-token mean ``Σ sum / Σ count`` over sequences and its standard error with the
    sequences as the independent units (the delta method for a ratio: tokens of one answer are
    not independent)."""
    n = sum_S.numel()
    mean = float(sum_S.sum() / count_S.sum())
    resid = sum_S - mean * count_S
    return mean, float(resid.std() * math.sqrt(n) / count_S.sum())


def markdown(rows: list[dict]) -> str:
    lines = ["| engine | mode | scale | fraction | KL ± SE | KL k3 (sampled) | χ² | χ̂² (sampled) | "
             "E[π_old/μ] ± SE | w < 1/2 or > 2 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['mode']} | {r['scale']:g} | {r['fraction']:g} | "
                     f"{r['kl']:.2e} ± {r['kl_se']:.0e} | {r['kl_k3']:.2e} | {r['chi2']:.2e} | "
                     f"{r['is_chi2']:.2e} | "
                     f"{r['w_mean']:.4f} ± {r['w_se']:.4f} | {r['tail']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    import numpy as np
    import torch

    from tokenmdp.exact import EngineMismatch

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, task, cfg = start_model(args)
    examples = task.eval_split(args.prompts, cfg.eval_seed)
    prompts = [task.tokenizer.encode(ex.prompt) for ex in examples]
    rows = [measure(model, task, cfg, p, EngineMismatch(), prompts, args.seed)
            for p in PRECISIONS]
    for mode, scales, fraction in MODES:
        for scale in scales:
            rows.append(measure(model, task, cfg, "fp32",
                                EngineMismatch(mode, scale, fraction, seed=args.seed),
                                prompts, args.seed))
            print(f"  {mode} {scale:g} (fraction {fraction:g}): KL {rows[-1]['kl']:.2e}",
                  flush=True)
    table = markdown(rows)
    entropy_note = ""
    with torch.no_grad():  # how sharp the start is: the per-token entropy of its samples
        from tokenmdp.rl import RolloutEngine

        b = RolloutEngine(model).generate(prompts, max_new_tokens=cfg.max_new_tokens,
                                          eos_id=task.tokenizer.EOS,
                                          generator=torch.Generator().manual_seed(args.seed))
        lp = model.next_token_logprobs(b).double()[b.loss_mask]
        entropy_note = (f"Start: {cfg.init} (per-token entropy of its fp32 samples "
                        f"{float(-(lp.exp() * lp).sum(-1).mean()):.3f}, mean answer length "
                        f"{float(np.mean(b.length.tolist())):.1f} tokens). ")
    shape = {k: getattr(cfg, k) for k in ("d_model", "n_layers", "n_heads", "n_experts", "top_k",
                                          "expert_hidden")}
    header = (f"# Engine mismatch modes (running_sum_{args.length}, model {shape})\n\n{entropy_note}"
              f"{args.prompts} held-out prompts, one answer each, temperature 1, seed "
              f"{args.seed}; {time.perf_counter() - t0:.0f} s.\n\n")
    (out / "results.md").write_text(header + table)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print()
    print(header + table)
    print(f"wrote {out / 'results.md'}")
    return rows


if __name__ == "__main__":
    main()
