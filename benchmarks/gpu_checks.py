"""Correctness checks that need a CUDA device (run by ``benchmarks/gpu.sh``; CI has no GPU).

1. The document-masked FlexAttention path equals ``scaled_dot_product_attention`` with the
   boolean mask: same weights, a packed batch with several sequences per row, token log-probs
   and parameter gradients in float32 (tight) and bfloat16 (loose: bf16 rounds to 3 digits).
2. The rollout engine's KV-cache log-probs equal a full recompute on the GPU (float32).
3. R3 on the GPU: replaying the engine's routing makes the routing mismatch 0.
4. The trainer runs on CUDA: a few RL steps with a bf16 engine, R3 and two mini-batches give
   finite metrics (and tokens/s).

Each check prints PASS or FAIL with its measured figure; the exit status is 1 if any failed.

Usage: ``python benchmarks/gpu_checks.py [--out DIR]`` (on a machine with CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
import time
import traceback

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.model import ModelConfig, MoETransformer
from tokenmdp.packing import pack_first_fit_decreasing
from tokenmdp.rl import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    RolloutEngine,
    compute_old_logprobs,
    routing_mismatch_rate,
)
from tokenmdp.rl.config import TrainConfig
from tokenmdp.rl.trainer import train

CONFIG = ModelConfig(vocab_size=64, d_model=128, n_layers=3, n_heads=4, n_experts=8, top_k=2,
                     expert_hidden=128, init_std=0.05)
FLEX_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}   # max |Δ log-prob|
GRAD_RTOL = {torch.float32: 1e-3, torch.bfloat16: 1e-1}  # max |Δ grad| / max |grad|
CACHE_TOL = 1e-4


def _batch(device) -> TokenBatch:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 120, (48,), generator=gen).tolist()
    ps, rs = [], []
    for n in lengths:
        toks = torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist()
        ps.append(toks[: max(n // 4, 1)])
        rs.append(toks[max(n // 4, 1):])
    batch = TokenBatch.from_sequences(ps, rs, dtype=torch.float32)
    return pack_first_fit_decreasing(batch, 256).to(device)


def check_flex_equals_sdpa(device) -> tuple[bool, str]:
    batch = _batch(device)
    notes, ok = [], True
    for dtype in (torch.float32, torch.bfloat16):
        grads, logprobs = {}, {}
        for attention in ("sdpa", "flex"):
            model = MoETransformer(dataclasses.replace(CONFIG, attention=attention),
                                   generator=torch.Generator().manual_seed(1), device=device,
                                   dtype=dtype)
            lp = model.token_logprobs(batch)
            (-(lp.float() * batch.loss_mask).sum()).backward()
            logprobs[attention] = lp.detach().float()
            grads[attention] = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])
        d_lp = float((logprobs["flex"] - logprobs["sdpa"]).abs().max())
        d_grad = float((grads["flex"] - grads["sdpa"]).abs().max() / grads["sdpa"].abs().max())
        ok &= d_lp <= FLEX_TOL[dtype] and d_grad <= GRAD_RTOL[dtype]
        notes.append(f"{str(dtype).removeprefix('torch.')}: max |Δ logprob| {d_lp:.2e} "
                     f"(tol {FLEX_TOL[dtype]:g}), grad rel {d_grad:.2e} (tol {GRAD_RTOL[dtype]:g})")
    return ok, "; ".join(notes)


def check_kv_cache(device) -> tuple[bool, str]:
    model = MoETransformer(dataclasses.replace(CONFIG, attention="sdpa"),
                           generator=torch.Generator().manual_seed(2), device=device)
    engine = RolloutEngine(model)
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, CONFIG.vocab_size - 1, (32, 12), generator=gen).tolist()
    batch = engine.generate(prompts, max_new_tokens=64, eos_id=CONFIG.vocab_size - 1,
                            generator=torch.Generator(device=device).manual_seed(4))
    with torch.no_grad():
        full = engine.model.token_logprobs(batch, routing=batch.token_extras[ENGINE_ROUTING])
    diff = float(((full - batch.behavior_logprob) * batch.loss_mask).abs().max())
    return diff <= CACHE_TOL, f"max |cache - recompute| {diff:.2e} over {batch.num_loss_tokens} " \
                              f"tokens (tol {CACHE_TOL:g})"


def check_r3(device) -> tuple[bool, str]:
    model = MoETransformer(CONFIG, generator=torch.Generator().manual_seed(5), device=device)
    engine = RolloutEngine(model, precision="bf16")
    gen = torch.Generator().manual_seed(6)
    prompts = torch.randint(0, CONFIG.vocab_size - 1, (64, 8), generator=gen).tolist()
    batch = engine.generate(prompts, max_new_tokens=32, eos_id=CONFIG.vocab_size - 1,
                            generator=torch.Generator(device=device).manual_seed(7))
    rates = {}
    for replay in ("none", "r3"):
        step = compute_old_logprobs(model, batch, replay)
        rates[replay] = routing_mismatch_rate(step.token_extras[OLD_ROUTING],
                                              batch.token_extras[ENGINE_ROUTING])
    return rates["r3"] == 0.0, f"routing mismatch, bf16 engine: none {rates['none']:.4f}, " \
                               f"R3 {rates['r3']:.4f}"


def check_trainer(device) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(device=str(device), task="addition", estimator="minirl", replay="r3",
                          minibatches=2, rollout_precision="bf16", steps=4, prompts_per_step=32,
                          group_size=8, eval_size=64, eval_every=2, out_dir=out,
                          deterministic=False)
        start = time.perf_counter()
        rows = train(cfg)
        wall = time.perf_counter() - start
    finite = all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    return finite and len(rows) == 4, (f"{len(rows)} steps in {wall:.1f} s (first includes "
                                       f"compilation), last {rows[-1]['tokens_per_s']:.0f} tokens/s, "
                                       f"eval {rows[-1]['eval_accuracy']:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device")
        return 2
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    failed = 0
    for name, check in (("flex attention = sdpa", check_flex_equals_sdpa),
                        ("KV cache = recompute", check_kv_cache), ("R3 routing", check_r3),
                        ("trainer on CUDA", check_trainer)):
        start = time.perf_counter()
        try:
            ok, note = check(device)
        except Exception:  # report and go on: one run should show every check
            ok, note = False, traceback.format_exc()
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name} ({time.perf_counter() - start:.1f} s): {note}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
