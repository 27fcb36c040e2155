"""Correctness checks that need a CUDA device (run by ``benchmarks/gpu.sh``; CI has no GPU).

1. The document-masked FlexAttention path equals ``scaled_dot_product_attention`` with the
   boolean mask: same weights and same experts (the flex pass replays the SDPA pass's routing),
   a packed batch with several sequences per row, token log-probs and parameter gradients in
   float32 (tight) and bfloat16 (loose: bf16 rounds to 3 digits).
2. The rollout engine's KV-cache log-probs equal a full recompute on the GPU (float32), with
   ragged prompts; the host syncs per decoding step are counted (a figure, not a check).
3. R3 on the GPU: a bf16 engine's routing differs from the fp32 trainer's; replaying it makes
   the routing mismatch 0 and lowers the training-inference KL.
4. Generators: CUDA generators are accepted for weights and selection noise; a CPU one for
   sampling on a CUDA engine is a clear ``ValueError``.
5. The trainer runs on CUDA: a few RL steps with a bf16 engine, R3, two mini-batches and the
   load-balancing term give
   finite metrics (and tokens/s).
6. The packed tree's FlexAttention block mask (each token attends to its ancestors: subtree
   intervals) equals the SDPA tree mask: log-probs and parameter gradients of a packed forest
   of response trees (issue 28), the routing of the SDPA pass replayed, float32 and bfloat16;
   then a few RL steps with tree rollouts (``--rollout-tree``) give finite metrics.

Each check prints PASS or FAIL with its measured figure (SKIP where the device cannot exercise
it); the exit status is 1 if any failed.

Usage: ``python benchmarks/gpu_checks.py`` on a machine with CUDA; ``--device cpu`` runs the same
code on the CPU as a smoke test (the test suite does, so the script cannot rot unseen).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import tempfile
import time
import traceback
import warnings

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
    training_inference_kl,
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


def _flex_against_sdpa(device, batch: TokenBatch, logprobs_of, seed: int) -> tuple[bool, str]:
    """Same weights, same experts (the flex pass replays the SDPA pass's routing, so a bf16
    rounding difference cannot flip an expert and cascade): log-probs and, where flex has a
    backward (CUDA), parameter gradients. ``logprobs_of(model, routing)`` returns the log-probs
    and the routing used."""
    backward = device.type == "cuda"
    notes, ok = [], True
    for dtype in (torch.float32, torch.bfloat16):
        grads, logprobs, trace = {}, {}, None
        for attention in ("sdpa", "flex"):
            model = MoETransformer(dataclasses.replace(CONFIG, attention=attention),
                                   generator=torch.Generator().manual_seed(seed), device=device,
                                   dtype=dtype)
            with torch.set_grad_enabled(backward):
                lp, used = logprobs_of(model, trace)
            trace = used if trace is None else trace
            logprobs[attention] = lp.detach().float()
            if backward:
                (-(lp.float() * batch.loss_mask).sum()).backward()
                grads[attention] = torch.cat([p.grad.float().reshape(-1)
                                              for p in model.parameters()])
        d_lp = float((logprobs["flex"] - logprobs["sdpa"]).abs().max())
        note = (f"{str(dtype).removeprefix('torch.')}: max |Δ logprob| {d_lp:.2e} "
                f"(tol {FLEX_TOL[dtype]:g})")
        ok &= d_lp <= FLEX_TOL[dtype]
        if backward:
            d_grad = float((grads["flex"] - grads["sdpa"]).abs().max()
                           / grads["sdpa"].abs().max())
            ok &= d_grad <= GRAD_RTOL[dtype]
            note += f", grad rel {d_grad:.2e} (tol {GRAD_RTOL[dtype]:g})"
        notes.append(note)
    return ok, "; ".join(notes) + ("" if backward else " (forward only: no flex backward on "
                                                       "the CPU)")


def check_flex_equals_sdpa(device) -> tuple[bool, str]:
    """The document-masked flex pass against SDPA on a packed batch."""
    batch = _batch(device)
    return _flex_against_sdpa(
        device, batch, lambda model, trace: model.token_logprobs(batch, routing=trace,
                                                                 record_routing=True), seed=1)


def check_kv_cache(device) -> tuple[bool, str]:
    model = MoETransformer(dataclasses.replace(CONFIG, attention="sdpa"),
                           generator=torch.Generator().manual_seed(2), device=device)
    engine = RolloutEngine(model)
    gen = torch.Generator().manual_seed(3)
    # ragged prompts (1 to 16 tokens): the prefill masks padding columns
    prompts = [torch.randint(0, CONFIG.vocab_size - 1, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 17, (32,), generator=gen)]
    with _count_syncs(device) as syncs:
        batch = engine.generate(prompts, max_new_tokens=64, eos_id=CONFIG.vocab_size - 1,
                                generator=torch.Generator(device=device).manual_seed(4))
    with torch.no_grad():
        full = engine.model.token_logprobs(batch, routing=batch.token_extras[ENGINE_ROUTING])
    diff = float(((full - batch.behavior_logprob) * batch.loss_mask).abs().max())
    steps = int(batch.length.max())  # one sampling step per response token of the longest
    if syncs is not None:  # the mode's own "prototype feature" warning is not a sync
        syncs = [w for w in syncs if "called a synchronizing" in str(w.message)]
    sync_note = (f"; {len(syncs) / steps:.1f} host syncs per decoding step (expected about "
                 f"{CONFIG.routed_layers} routed layers + 1 stop test)" if syncs is not None else "")
    return diff <= CACHE_TOL, (f"max |cache - recompute| {diff:.2e} over {batch.num_loss_tokens} "
                               f"tokens (tol {CACHE_TOL:g})" + sync_note)


@contextlib.contextmanager
def _count_syncs(device):
    """On CUDA, the host-device synchronizations inside the block (a list of warnings, from
    ``torch.cuda.set_sync_debug_mode``); None elsewhere."""
    if device.type != "cuda":
        yield None
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def check_r3(device) -> tuple[bool, str]:
    """A bf16 engine flips some experts (mismatch > 0 without replay); R3 replays them in the
    fp32 ``old_logprob`` pass: mismatch 0 and a smaller training-inference KL."""
    model = MoETransformer(CONFIG, generator=torch.Generator().manual_seed(5), device=device)
    engine = RolloutEngine(model, precision="bf16")
    gen = torch.Generator().manual_seed(6)
    prompts = torch.randint(0, CONFIG.vocab_size - 1, (64, 8), generator=gen).tolist()
    batch = engine.generate(prompts, max_new_tokens=32, eos_id=CONFIG.vocab_size - 1,
                            generator=torch.Generator(device=device).manual_seed(7))
    rates, kls = {}, {}
    for replay in ("none", "r3"):
        step = compute_old_logprobs(model, batch, replay)
        rates[replay] = routing_mismatch_rate(step.token_extras[OLD_ROUTING],
                                              batch.token_extras[ENGINE_ROUTING])
        kls[replay] = training_inference_kl(step)
    ok = rates["none"] > 0 and rates["r3"] == 0.0 and kls["r3"] < kls["none"]
    return ok, (f"bf16 engine: routing mismatch none {rates['none']:.4f}, R3 {rates['r3']:.4f}; "
                f"k3 KL none {kls['none']:.2e}, R3 {kls['r3']:.2e}")


def check_generators(device) -> tuple[bool | None, str]:
    """Generators on the GPU: model weights and the engine's selection noise may come from a
    CUDA generator; sampling with a CPU generator on a CUDA engine is a clear ValueError."""
    if device.type != "cuda":
        return None, "only a CUDA engine can mismatch its generator"
    cuda_gen = torch.Generator(device=device).manual_seed(8)
    model = MoETransformer(CONFIG, generator=cuda_gen, device=device)
    engine = RolloutEngine(model, selection_noise=0.1, generator=cuda_gen)
    try:
        engine.generate([[1, 2]], max_new_tokens=2, eos_id=0, generator=torch.Generator())
    except ValueError as err:
        return "generator" in str(err), f"CUDA generators accepted; CPU sampler: {err}"
    return False, "a CPU generator with a CUDA engine raised nothing"


def check_trainer(device, steps: int = 4) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(device=str(device), task="addition", estimator="minirl", replay="r3",
                          minibatches=2, rollout_precision="bf16", steps=steps,
                          prompts_per_step=32, group_size=8, eval_size=64, eval_every=2,
                          load_balancing_coef=0.01, out_dir=out, deterministic=False)
        start = time.perf_counter()
        rows = train(cfg)
        wall = time.perf_counter() - start
    finite = all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    return finite and len(rows) == steps, (f"{len(rows)} steps in {wall:.1f} s (first includes "
                                       f"compilation), last {rows[-1]['tokens_per_s']:.0f} tokens/s, "
                                       f"eval {rows[-1]['eval_accuracy']:.3f}")


def _forest(device):
    """A packed forest of response trees (every node once) and its expanded batch."""
    from tokenmdp.tree_packing import pack_tree
    from tokenmdp.trees import ResponseTree, batch_from_trees

    gen = torch.Generator().manual_seed(9)
    trees = []
    for _ in range(12):
        n = int(torch.randint(8, 60, (1,), generator=gen))
        parent = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)]
        tokens = torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist()
        prompt = torch.randint(0, CONFIG.vocab_size, (6,), generator=gen).tolist()
        trees.append(ResponseTree(prompt=prompt, tokens=tokens, parent=parent))
    batch = batch_from_trees(trees, dtype=torch.float32, device=device)
    return batch, pack_tree(batch)


def check_tree_flex_equals_sdpa(device) -> tuple[bool, str]:
    """The tree block mask against the SDPA tree mask, on a packed forest."""
    from tokenmdp.tree_training import packed_tree_logprobs

    batch, packed = _forest(device)
    ok, note = _flex_against_sdpa(
        device, batch, lambda model, trace: packed_tree_logprobs(
            model, batch, packed, routing=trace, record_routing=True), seed=10)
    shared = 1 - packed.valid_RC.sum().item() / max(int((batch.sequence_id >= 0).sum()), 1)
    return ok, f"{batch.num_sequences} leaves, {shared:.0%} of the expanded tokens shared; {note}"


def check_tree_trainer(device, steps: int = 4) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(device=str(device), task="addition", estimator="tree_grpo",
                          rollout_tree="fixed:0x2,1x2", group_size=4, replay="r3",
                          rollout_precision="bf16", steps=steps, prompts_per_step=32,
                          eval_size=64, eval_every=2, out_dir=out, deterministic=False)
        start = time.perf_counter()
        rows = train(cfg)
        wall = time.perf_counter() - start
    finite = all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    return finite and len(rows) == steps, (
        f"{len(rows)} steps in {wall:.1f} s, last {rows[-1]['tokens_per_s']:.0f} tokens/s, "
        f"{rows[-1]['generated_tokens']:.0f} generated and {rows[-1]['shared_tokens']:.0f} "
        "shared tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda",
                        help="cuda (the checks); cpu runs the same code as a smoke test (flex "
                             "forward only, a 2-step trainer run)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_checks: no CUDA device")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    failed = 0
    steps = 4 if device.type == "cuda" else 2
    for name, check in (("flex attention = sdpa", check_flex_equals_sdpa),
                        ("KV cache = recompute", check_kv_cache), ("R3 routing", check_r3),
                        ("generators", check_generators),
                        (f"trainer on {device.type}",
                         lambda d: check_trainer(d, steps)),
                        ("tree flex attention = sdpa", check_tree_flex_equals_sdpa),
                        (f"tree trainer on {device.type}",
                         lambda d: check_tree_trainer(d, steps))):
        start = time.perf_counter()
        try:
            ok, note = check(device)
        except Exception:  # report and go on: one run should show every check
            ok, note = False, traceback.format_exc()
        failed += ok is not None and not ok
        verdict = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        print(f"{verdict}  {name} ({time.perf_counter() - start:.1f} s): {note}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
