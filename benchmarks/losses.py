"""Speed of every registered estimator's loss + backward, relative to the plain weighted NLL.

A step of about 10^6 tokens (prompts 16-64 tokens, responses 32-1024, packed into rows of 4096)
in float32. For each registry entry, ``prepare`` runs once (untimed); the timed part is
``loss(logprobs, batch, estimator)`` and its backward. Three settings:

* ``+metrics``: the loss alone (``logprobs`` a leaf tensor) with its metrics (the default
  ``metrics=True``);
* ``loss only``: the loss alone with ``metrics=False``, as an inner loop runs it;
* ``with head``: ``metrics=False``, ``logprobs`` from ``log_softmax`` over a ``V``-token
  vocabulary and a gather, as in training, where the loss is always downstream of the
  vocabulary projection.

Each figure is the median, over ``--repeats`` adjacent pairs of runs, of the estimator's time
divided by that of the plain weighted NLL ``-Σ loss_weight · advantage · log π`` in the same
setting (the two alternate, so each pair sees the same machine load). Times are the process's
CPU time (``time.process_time``) when torch runs one thread, so that other processes on a shared
machine do not count; wall time with several threads. Targets (issue 17): per-token estimators
<= 3x loss only and <= 1.1x with the head; sequence-coupled ones <= 1.5x with the head
(issue 3).

The ``kind`` column is measured, not declared. An estimator is *per-token* when the gradient of
its loss at a token, ``∂loss/∂log π_θ(y_t)``, depends only on that token's own ``log π_θ`` and
on the step's constants (advantages, loss weights, correction factors, a Clip-Cov or KL-Cov
selection, self-normalizers: everything ``prepare`` computes from the detached fields): its loss
is a sum of per-token functions, which a fused elementwise pass computes. It is
*sequence-coupled* when a token's gradient also depends on the current ``log π_θ`` of other
tokens, through a reduction over its sequence: a sequence ratio (sequence IS and sequence
SNIS's ``ρ(y)``, GSPO's and GSPO-token's geometric mean ``s_i``), GMPO's geometric mean of the
clipped token ratios (each token's gradient carries the whole sequence's ``g_i``), the prefix
products ``ρ_{1:t}`` of per-decision IS and CTPO, or OPSM's sequence mask (the mean
``log(μ/π_θ)`` over the sequence decides whether a token keeps its gradient). A correction
formed per sequence from the detached ``π_old/μ`` (TRL's sequence MIS, a sequence rejection)
is a step constant and leaves an estimator per-token. :func:`kind` tests this directly on a
small packed step: it evaluates the gradient at two random log-prob arrays ``a`` and ``b`` and
at their token-wise mix (``a`` on a random half of the tokens, ``b`` on the rest); the
estimator is per-token iff the mix's gradient is ``a``'s on the first half and ``b``'s on the
second.

Last, the token-level loss path against the bare loss block of verl, written here from its
documented formula (``verl.trainer.ppo.core_algos.compute_policy_loss``, the ``vanilla`` mode:
``r = exp(clamp(log π − log π_old, −20, 20))``, ``max(−Â r, −Â clip(r, 1−ε, 1+ε))``, the dual
clip ``min(·, −Â c)`` where ``Â < 0``, its ``pg_clipfrac``, ``ppo_kl`` and ``pg_clipfrac_lower``
masked means, then ``agg_loss(..., "token-mean")``) on the same packed tensors, against
tokenmdp's ``ppo_verl`` (the same loss): target <= 1.0x.

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


def kind(est: estimators.Estimator, *, tokens: int = 6000, seed: int = 1) -> str:
    """``"token"`` or ``"sequence"`` (coupled): whether the loss gradient at each token depends
    only on that token's log-prob (module docstring), tested in float64 on a packed step of
    about ``tokens`` tokens.

    Parameters
    ----------
    est : Estimator
        The estimator.
    tokens : int, default 6000
        Size of the test step.
    seed : int, default 1
        Seed of the step and of the two log-prob arrays.

    Returns
    -------
    str
        ``"token"`` or ``"sequence"``.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = packed_step(tokens, generator=gen, dtype=torch.float64)
    step = estimators.prepare(batch, est, max_len=1024)
    # b moves every token's log-prob down by 1 nat: sequence-level masks and caps (OPSM's
    # δ = 0.5 nat per token) flip between a, b and their mix
    a, b = (batch.old_logprob - shift + 0.3 * torch.randn(batch.tokens.shape, generator=gen,
                                                          dtype=torch.float64)
            for shift in (0.0, 1.0))
    half = torch.rand(batch.tokens.shape, generator=gen) < 0.5

    def grad(lp):
        lp = lp.clone().requires_grad_(True)
        return torch.autograd.grad(estimators.loss(lp, step, est, metrics=False)[0], lp)[0]
    expected = torch.where(half, grad(a), grad(b))
    mixed = grad(torch.where(half, a, b))
    return "token" if torch.allclose(mixed, expected, rtol=1e-12, atol=0.0) else "sequence"


def _clock():
    """CPU time of the process with one torch thread (other processes' load does not count),
    wall time otherwise."""
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def _once(fn) -> float:
    clock = _clock()
    start = clock()
    fn()
    return clock() - start


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

    clock = "CPU time" if _clock() is time.process_time else "wall time"
    print(f"{batch}: {batch.num_real_tokens} tokens, {batch.num_loss_tokens} loss tokens, "
          f"float32, {torch.get_num_threads()} threads, {clock}, median of {args.repeats} pairs")
    base_step = estimators.prepare(batch, estimators.get("reinforce"))
    base = {h: run(nll(base_step), h) for h in (False, True)}
    base_ms = [relative_time(base[h], base[h], args.repeats)[0] * 1e3 for h in (False, True)]
    print(f"plain weighted NLL: loss only {base_ms[0]:.1f} ms, with head (V={args.vocab}) "
          f"{base_ms[1]:.1f} ms\n")
    header = (f"{'estimator':16s} {'kind':9s} {'+metrics':>9s} {'loss only':>10s} "
              f"{'target':>7s} {'with head':>10s} {'target':>7s}")
    print(header + "\n" + "-" * len(header))
    for name in names:
        est = estimators.get(name)
        step = estimators.prepare(batch, est, max_len=1024)

        def fn(lp, step=step, est=est, metrics=False):
            return estimators.loss(lp, step, est, metrics=metrics)[0]

        def with_metrics(lp, step=step, est=est):
            return fn(lp, step, est, metrics=True)
        full = relative_time(run(with_metrics, False), base[False], args.repeats)[1]
        ratios = [relative_time(run(fn, h), base[h], args.repeats)[1] for h in (False, True)]
        seq = kind(est) == "sequence"
        only_target, head_target = (None, 1.5) if seq else (3.0, 1.1)
        only_ok = "" if only_target is None else (
            f"{only_target:5.1f}x " + ("ok" if ratios[0] <= only_target else "MISS"))
        head_ok = f"{head_target:5.1f}x " + ("ok" if ratios[1] <= head_target else "MISS")
        print(f"{name:16s} {'sequence' if seq else 'token':9s} {full:8.2f}x {ratios[0]:9.2f}x "
              f"{only_ok:>9s} {ratios[1]:9.2f}x {head_ok:>9s}")
    verl_comparison(batch, lp_leaf, args.repeats)


def verl_policy_loss(log_prob, old_log_prob, advantages, response_mask, *, clip_low=0.2,
                     clip_high=0.2, clip_ratio_c=3.0):
    """verl's vanilla ``compute_policy_loss`` + ``agg_loss(token-mean)``, from its documented
    formula (written here; no verl code): the loss and its three masked-mean metrics."""
    def masked_mean(x):
        return (x * response_mask).sum() / response_mask.sum()
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float())
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0)
                                    .float())
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = masked_mean(pg_losses)                 # agg_loss, loss_agg_mode="token-mean"
    return pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), pg_clipfrac_lower.detach()


def verl_comparison(batch: TokenBatch, lp_leaf: torch.Tensor, repeats: int) -> None:
    """tokenmdp's ``ppo_verl`` loss path against verl's bare loss block, same packed tensors."""
    est = estimators.get("ppo_verl")
    step = estimators.prepare(batch, est, max_len=1024)
    mask = step.loss_mask.to(step.dtype)
    adv, old = step.advantage, step.old_logprob

    def verl():
        verl_policy_loss(lp_leaf, old, adv, mask)[0].backward()
        lp_leaf.grad = None

    def ours(metrics):
        def go():
            estimators.loss(lp_leaf, step, est, metrics=metrics)[0].backward()
            lp_leaf.grad = None
        return go
    with torch.no_grad():   # the two compute the same loss (up to float32 round-off)
        a = float(verl_policy_loss(lp_leaf, old, adv, mask)[0])
        b = float(estimators.loss(lp_leaf, step, est, metrics=False)[0])
    print(f"\ntoken-level loss path against verl's vanilla compute_policy_loss + token-mean "
          f"(loss {a:.6g} vs {b:.6g}):")
    for label, metrics in (("metrics=False", False), ("metrics=True", True)):
        ratio = relative_time(ours(metrics), verl, repeats)[1]
        print(f"  tokenmdp ppo_verl ({label}) / verl block: {ratio:.2f}x "
              f"(target <= 1.0x: {'ok' if ratio <= 1.0 else 'MISS'})")


if __name__ == "__main__":
    main()
