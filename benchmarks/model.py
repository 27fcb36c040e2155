"""The MoE transformer and the rollout engine: generation and training throughput, the cost of
routing replay, and the training-inference gap per engine precision.

1. Generation tokens/s with the KV cache vs recomputing the whole prefix at every step
   (``--gen-tokens`` new tokens per sequence; target >= 5x at 128).
2. Training tokens/s (forward + backward of a weighted NLL), packed (first-fit decreasing) vs
   padded, on long-tailed lengths ``round(LogNormal(ln 48, 0.9))`` clipped to ``[4, 512]``
   (target >= 1.5x). Tokens/s counts real tokens only.
3. Overhead of routing replay: the same training step with and without a replayed trace
   (target <= 5%).
4. Routing mismatch rate and training-inference KL (k3) per engine precision against an fp32
   trainer (an fp32 copy of the benchmarked model), without replay and with R3, on one sampled
   batch.

5. Model FLOP utilization of the packed training step: ``6 x active parameters`` per token (the
   routed experts only) plus the document-masked attention (``3 x 4 d sum_s n_s(n_s+1)/2`` per
   layer), divided by the time and by ``--peak-tflops`` (H200 dense bf16: 989).
6. The trainer's ``old_logprob`` pass with the entropy metric: one forward pass
   (``compute_old_logprobs(..., entropy=True)``) vs the old-logprob pass plus a second pass for
   the full next-token distributions (what the trainer did before), R3, on one sampled batch.

Times are the best of ``--repeats`` runs, on the CPU with ``--threads`` intra-op threads (default
1: small kernels on a shared machine lose far more to thread hand-offs than they gain), or on
``--device cuda`` (synchronized), in ``--dtype`` (model weights and compute; ``bfloat16`` on a
GPU) with ``--attention`` (``flex`` is the document-masked FlexAttention path, CUDA only).
``--size gpu`` is a larger model for one GPU (``benchmarks/gpu.sh``).

Usage: ``python benchmarks/model.py [--gen-tokens 128] [--repeats 3] [--threads 1] [--quick]
[--device cuda --dtype bfloat16 --attention flex --size gpu]``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import numpy as np
import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.model import ModelConfig, MoETransformer
from tokenmdp.packing import pack_first_fit_decreasing, padded_layout
from tokenmdp.rl import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    PRECISIONS,
    RolloutEngine,
    compute_old_logprobs,
    replay_routing,
    routing_mismatch_rate,
    training_inference_kl,
)

CONFIG = ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_experts=8, top_k=2,
                     expert_hidden=128, init_std=0.05)
GPU_CONFIG = ModelConfig(vocab_size=256, d_model=512, n_layers=8, n_heads=8, n_experts=8, top_k=2,
                         expert_hidden=1024, init_std=0.02)
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size - 1, (n, length), generator=gen).tolist()


def bench_generation(model, gen_tokens: int, repeats: int) -> None:
    engine = RolloutEngine(model, precision="bf16" if model.embed.dtype == torch.bfloat16 else "fp32")
    ps = prompts(16, 16, 0)
    rates = {}
    for use_cache in (True, False):
        out = {}

        def run(use_cache=use_cache, out=out):
            # sequences may stop early at EOS; the rate counts the tokens actually generated
            out["b"] = engine.generate(ps, max_new_tokens=gen_tokens, eos_id=CONFIG.vocab_size - 1,
                                       generator=_generator(1), use_cache=use_cache)

        t = best_time(run, repeats)
        rates[use_cache] = int(out["b"].length.sum()) / t
    print(f"generation, 16 prompts x 16 tokens, {gen_tokens} new tokens each")
    print(f"  KV cache      {rates[True]:10.0f} tokens/s")
    print(f"  recompute     {rates[False]:10.0f} tokens/s")
    print(f"  speed-up      {rates[True] / rates[False]:10.1f}x   (target >= 5x)")


def long_tailed_batch(num_sequences: int, seed: int) -> TokenBatch:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(48), 0.9, num_sequences)), 4, 512).astype(int)
    ps, rs = [], []
    for n in lengths:
        toks = rng.integers(0, CONFIG.vocab_size, n).tolist()
        ps.append(toks[: n // 4 or 1])
        rs.append(toks[n // 4 or 1:])
    return TokenBatch.from_sequences(ps, rs, dtype=torch.float32).to(DEVICE)


def train_step(model, batch, routing=None) -> None:
    lp = model.token_logprobs(batch, routing=routing).float()
    loss = -(batch.loss_weight * batch.advantage * lp).sum() / max(batch.num_loss_tokens, 1)
    model.zero_grad(set_to_none=True)
    loss.backward()


def training_flops(config: ModelConfig, lengths: list[int]) -> float:
    """FLOPs of one forward + backward pass (3x the forward) over sequences of ``lengths``:
    ``2 x active parameters`` per token for the matrix products (attention projections, the
    ``top_k`` routed experts' SwiGLU, the router, the output head) and ``4 d`` per (query, key)
    pair of the causal document-masked attention. Embedding lookups, norms and softmaxes are
    not counted (the usual MFU convention)."""
    d, h = config.d_model, config.expert_hidden
    experts = 3 * d * h * (1 if config.dense else config.top_k)
    router = 0 if config.dense else d * config.n_experts
    per_token = config.n_layers * (4 * d * d + experts + router) + d * config.vocab_size
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    forward = 2 * per_token * sum(lengths) + config.n_layers * 4 * d * pairs
    return 3.0 * forward


def bench_training(model, repeats: int, num_sequences: int, peak_tflops: float | None) -> None:
    batch = long_tailed_batch(num_sequences, 0)
    longest = int(batch.sequence_lengths_total().max())
    padded = padded_layout(batch)
    packed = pack_first_fit_decreasing(batch, longest)
    n = batch.num_real_tokens
    train_step(model, packed)  # warm-up (allocator, first-call costs)
    t_pad = best_time(lambda: train_step(model, padded), repeats)
    t_pack = best_time(lambda: train_step(model, packed), repeats)
    print(f"training step, {num_sequences} sequences, {n} tokens, longest {longest}")
    print(f"  padded  {padded.num_rows:4d} x {padded.capacity:4d}  {n / t_pad:10.0f} tokens/s")
    print(f"  packed  {packed.num_rows:4d} x {packed.capacity:4d}  {n / t_pack:10.0f} tokens/s")
    print(f"  speed-up      {t_pad / t_pack:10.2f}x   (target >= 1.5x)")
    lengths = batch.sequence_lengths_total().tolist()
    flops = training_flops(model.config, lengths)
    mfu = ("" if peak_tflops is None else
           f" = {100 * flops / t_pack / (peak_tflops * 1e12):.3f}% MFU of {peak_tflops:g} TFLOP/s")
    print(f"  model FLOPs   {flops / t_pack / 1e12:10.4f} TFLOP/s packed{mfu}")
    with torch.no_grad():
        _, trace = model.token_logprobs(packed, record_routing=True)
    # interleaved, so that a change of machine load hits both alike
    t_plain = t_replay = float("inf")
    for _ in range(2 * repeats):
        t_plain = min(t_plain, best_time(lambda: train_step(model, packed), 1))
        t_replay = min(t_replay, best_time(lambda: train_step(model, packed, trace), 1))
    print(f"routing replay overhead on the packed step: {100 * (t_replay / t_plain - 1):+.1f}%   "
          "(target <= 5%)")


def bench_precisions(model, gen_tokens: int) -> None:
    """Each engine precision against an fp32 trainer (an fp32 copy of ``model``: with a bf16
    benchmark model the reference would otherwise be bf16 itself)."""
    model = copy.deepcopy(model).float()
    ps = prompts(64, 8, 2)
    print(f"training-inference gap vs an fp32 trainer, 64 prompts, {gen_tokens} new tokens "
          "(k3 KL per token)")
    print(f"  {'engine':8s} {'mismatch':>9s} {'KL none':>10s} {'KL R3':>10s} {'mismatch R3':>12s}")
    for precision in PRECISIONS:
        engine = RolloutEngine(model, precision=precision)
        batch = engine.generate(ps, max_new_tokens=gen_tokens, eos_id=CONFIG.vocab_size - 1,
                                generator=_generator(3))
        row = []
        for replay in ("none", "r3"):
            step = compute_old_logprobs(model, batch, replay)
            row.append((routing_mismatch_rate(step.token_extras[OLD_ROUTING],
                                              batch.token_extras[ENGINE_ROUTING]),
                        training_inference_kl(step)))
        print(f"  {precision:8s} {row[0][0]:9.4f} {row[0][1]:10.2e} {row[1][1]:10.2e} "
              f"{row[1][0]:12.4f}")


def bench_entropy_pass(model, repeats: int) -> None:
    batch = RolloutEngine(model).generate(prompts(64, 8, 4), max_new_tokens=16,
                                          eos_id=CONFIG.vocab_size - 1, generator=_generator(5))
    batch = pack_first_fit_decreasing(batch, int(batch.sequence_lengths_total().max()))

    def two_passes():
        step = compute_old_logprobs(model, batch, "r3")
        with torch.no_grad():
            lp = model.next_token_logprobs(step, routing=replay_routing(step, "r3"))
            return -torch.where(lp > -torch.inf, lp.exp() * lp, 0.0).sum(-1)

    def one_pass():
        return compute_old_logprobs(model, batch, "r3", entropy=True)[1]

    t_two = t_one = float("inf")
    for _ in range(2 * repeats):  # interleaved, as for the replay overhead
        t_two = min(t_two, best_time(two_passes, 1))
        t_one = min(t_one, best_time(one_pass, 1))
    print(f"old_logprob pass + entropy, {batch.num_real_tokens} tokens: one pass "
          f"{t_one / t_two:.2f}x the time of two passes")


def main(argv: list[str] | None = None) -> None:
    global CONFIG, DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "flex", "auto"])
    parser.add_argument("--size", default="cpu", choices=["cpu", "gpu"],
                        help="model size: the CPU one or a larger one for a GPU")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak dense TFLOP/s in --dtype, for MFU (default: 989, "
                             "H200 dense bf16, on CUDA; none on the CPU)")
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    DEVICE = torch.device(args.device)
    if args.attention == "flex" and DEVICE.type != "cuda":
        parser.error("--attention flex: FlexAttention has no backward on the CPU (training "
                     "steps); use it with --device cuda")
    if args.peak_tflops is None and DEVICE.type == "cuda":
        args.peak_tflops = 989.0
    if args.quick:
        args.gen_tokens, args.repeats, args.sequences = 16, 1, 16
    CONFIG = dataclasses.replace(GPU_CONFIG if args.size == "gpu" else CONFIG,
                                 attention=args.attention)
    model = MoETransformer(CONFIG, generator=torch.Generator().manual_seed(0), device=DEVICE,
                           dtype=getattr(torch, args.dtype))
    print(f"model: {CONFIG}; device {DEVICE}, {args.dtype}; torch threads: "
          f"{torch.get_num_threads()}\n")
    bench_generation(model, args.gen_tokens, args.repeats)
    print()
    bench_training(model, args.repeats, args.sequences, args.peak_tflops)
    print()
    bench_precisions(model, min(args.gen_tokens, 32))
    print()
    bench_entropy_pass(model, args.repeats)


if __name__ == "__main__":
    main()
