"""Speed of every registered estimator's loss + backward, relative to the plain weighted NLL.

A step of about 10^6 tokens (prompts 16-64 tokens, responses 32-1024, packed into rows of 4096)
in float32. For each registry entry, ``prepare`` runs once (untimed); the timed part is
``loss(logprobs, batch, estimator)`` and its backward, metrics included. Two settings:

* ``loss only``: ``logprobs`` is a leaf tensor, so the time is the loss alone;
* ``with head``: ``logprobs`` comes from ``log_softmax`` over a ``V``-token vocabulary and a
  gather, as in training, where the loss is always downstream of the vocabulary projection.

Each figure is the median, over ``--repeats`` adjacent pairs of runs, of the estimator's time
divided by that of the plain weighted NLL ``-Σ loss_weight · advantage · log π`` in the same
setting (the two alternate, so each pair sees the same machine load). Targets (issue 3):
per-token surrogates <= 1.2x, sequence-level ones <= 1.5x.

    python benchmarks/losses.py [--tokens 1000000] [--vocab 32] [--repeats 11] [--threads N]
                                [--estimators grpo,dapo_mis]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import GSPO, GSPOToken, Level, SequenceRatio

ROW = 4096


def packed_step(num_tokens: int, *, generator: torch.Generator, dtype: torch.dtype) -> TokenBatch:
    """Sequences of random prompt and response lengths packed first-fit into rows of ``ROW``."""
    rows, current, used, total = [], [], 0, 0
    while total < num_tokens:
        p = int(torch.randint(16, 65, (1,), generator=generator))
        r = int(torch.randint(32, 1025, (1,), generator=generator))
        if used + p + r > ROW:
            rows.append(current)
            current, used = [], 0
        current.append((p, r))
        used += p + r
        total += p + r
    rows.append(current)
    R = len(rows)
    sequence_id = torch.full((R, ROW), -1, dtype=torch.long)
    position = torch.zeros(R, ROW, dtype=torch.long)
    loss_mask = torch.zeros(R, ROW, dtype=torch.bool)
    lengths, s = [], 0
    for i, row in enumerate(rows):
        col = 0
        for p, r in row:
            sequence_id[i, col:col + p + r] = s
            position[i, col:col + p + r] = torch.arange(p + r)
            loss_mask[i, col + p:col + p + r] = True
            lengths.append(r)
            col, s = col + p + r, s + 1
    S = s
    tokens = torch.randint(0, 32, (R, ROW), generator=generator) * (sequence_id >= 0)

    def logprobs(scale):
        lp = -torch.rand(R, ROW, generator=generator, dtype=dtype) * 3
        return torch.where(loss_mask, lp + scale * torch.randn(R, ROW, generator=generator,
                                                               dtype=dtype), 0.0)

    old = logprobs(0.0)
    ones = loss_mask.to(dtype)
    return TokenBatch(tokens=tokens, sequence_id=sequence_id, position=position,
                      loss_mask=loss_mask, advantage=ones, loss_weight=ones.clone(),
                      reward=torch.rand(S, generator=generator, dtype=dtype),
                      group=torch.arange(S) // 8, length=torch.tensor(lengths),
                      prompt_index=torch.arange(S) // 8,
                      behavior_logprob=torch.where(loss_mask, old - 0.05 * torch.randn(
                          R, ROW, generator=generator, dtype=dtype), 0.0),
                      old_logprob=old,
                      ref_logprob=torch.where(loss_mask, old + 0.1 * torch.randn(
                          R, ROW, generator=generator, dtype=dtype), 0.0))


def is_sequence_level(est: estimators.Estimator) -> bool:
    """True when the surrogate or the correction reduces over sequences."""
    level = getattr(est.correction, "level", Level.TOKEN)
    return isinstance(est.surrogate, (SequenceRatio, GSPO, GSPOToken)) or level is not Level.TOKEN


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def relative_time(fn, baseline, repeats: int) -> tuple[float, float]:
    """``(time of fn, its ratio to baseline)``: the time is fn's minimum over ``repeats`` runs
    (the least disturbed); runs alternate with the baseline's, and the ratio is the median over
    the ``repeats`` adjacent pairs of fn's time to the baseline's. A pair sees the same machine
    load, so on a shared machine (load that drifts or comes in bursts) the median ratio is far
    steadier than a ratio of minima, which pairs runs taken under different loads."""
    fn(), baseline()  # warm-up
    times, ratios = [], []
    for _ in range(repeats):
        base = _once(baseline)
        times.append(_once(fn))
        ratios.append(times[-1] / base)
    return min(times), statistics.median(ratios)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--vocab", type=int, default=32, help="vocabulary of the 'with head' run")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--estimators", default=None,
                        help="comma-separated registry names (default: all)")
    args = parser.parse_args(argv)
    names = estimators.names() if args.estimators is None else args.estimators.split(",")
    for name in names:
        estimators.get(name)  # an unknown name fails here, before any timing
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    batch = packed_step(args.tokens, generator=gen, dtype=torch.float32)
    # logits whose log-softmax at the batch's tokens is close to old_logprob (ratios near 1)
    logits = torch.randn(*batch.tokens.shape, args.vocab, generator=gen) * 0.1
    lp_leaf = (batch.old_logprob + 0.05 * torch.randn(batch.tokens.shape, generator=gen)
               * batch.loss_mask).requires_grad_(True)
    logits.requires_grad_(True)
    idx = batch.tokens[..., None]

    def head():
        return torch.log_softmax(logits, dim=-1).gather(-1, idx).squeeze(-1)

    def run(loss_fn, with_head):
        def go():
            lp = head() if with_head else lp_leaf
            loss_fn(lp).backward()
            (logits if with_head else lp_leaf).grad = None
        return go

    def nll(step):
        mask = step.loss_mask
        weights = step.loss_weight * step.advantage
        return lambda lp: -torch.where(mask, weights * lp, 0.0).sum()

    print(f"{batch}: {batch.num_real_tokens} tokens, {batch.num_loss_tokens} loss tokens, "
          f"float32, {torch.get_num_threads()} threads, best of {args.repeats}")
    base_step = estimators.prepare(batch, estimators.get("reinforce"))
    base = {h: run(nll(base_step), h) for h in (False, True)}
    base_ms = [relative_time(base[h], base[h], args.repeats)[0] * 1e3 for h in (False, True)]
    print(f"plain weighted NLL: loss only {base_ms[0]:.1f} ms, with head (V={args.vocab}) "
          f"{base_ms[1]:.1f} ms\n")
    header = f"{'estimator':16s} {'kind':9s} {'loss only':>10s} {'with head':>10s} {'target':>7s}"
    print(header + "\n" + "-" * len(header))
    for name in names:
        est = estimators.get(name)
        step = estimators.prepare(batch, est, max_len=1024)

        def fn(lp, step=step, est=est):
            return estimators.loss(lp, step, est)[0]
        ratios = [relative_time(run(fn, h), base[h], args.repeats)[1] for h in (False, True)]
        seq = is_sequence_level(est)
        target = 1.5 if seq else 1.2
        ok = "ok" if ratios[1] <= target else "MISS"
        print(f"{name:16s} {'sequence' if seq else 'token':9s} {ratios[0]:9.2f}x {ratios[1]:9.2f}x "
              f"{target:5.1f}x {ok}")


if __name__ == "__main__":
    main()
