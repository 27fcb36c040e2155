"""Issue 33, gap 1: the step statistics against loops over plain Python lists, on batches that
hold a response with no loss token and a partly masked one (``token_batches(edge_masks=True)``).

Each loop reads only each sequence's *loss* tokens (in order) and states the definition:

* SNIS factors (:class:`~tokenmdp.estimators.SelfNormalizedIS`, filled by ``prepare``): token level
  ``w_t / mean of w over the step's loss tokens``; sequence level ``W_i = Π_t w_it`` (geometric:
  ``exp(mean_t log w_it)``) over the mean of ``W`` over the sequences that have a loss token;
  a cap truncates ``w_t`` (or ``W_i``) before the mean;
* the rejection statistics (:func:`~tokenmdp.estimators.rejection_statistic`, k1 ``-ℓ``, k2
  ``ℓ²/2``, k3 ``e^ℓ - 1 - ℓ`` per token, or their sum / mean / max per sequence) and
  :meth:`RejectionSampling.diagnostics` (rejected tokens over loss tokens, sequences with a
  rejected token over sequences with a loss token, mean and max of the statistic);
* the weight diagnostics (:func:`~tokenmdp.estimators.correction_diagnostics`):
  ``ESS/n = (Σw)² / (n Σw²)`` and ``χ̂² = Σw²/n - 1`` over the loss tokens' ``w_t`` and over
  the ``W_i`` of the sequences with a loss token;
* the aggregation weights (:func:`~tokenmdp.estimators.loss_weights`) of every mode, counting
  every sampled sequence or only those with a loss token.

A sequence without loss tokens that is counted anyway, or a masked token that enters a sum,
fails these.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import estimators as E
from tokenmdp.estimators import (
    SNIS_FACTOR,
    Level,
    RejectionSampling,
    SelfNormalizedIS,
    loss_weights,
    rejection_statistic,
)
from tokenmdp.estimators.corrections.diagnostics import correction_diagnostics
from tokenmdp.testing import token_batches

#: float64 sums of a few dozen terms, two orders
EXACT = 1e-10
EDGE = token_batches(with_logprobs=True, edge_masks=True, max_response_len=5)
EXAMPLES = settings(max_examples=30, deadline=None)


def _tokens(batch, values):
    """``values`` at each sequence's loss tokens in position order: a list of lists."""
    out = []
    for s in range(batch.num_sequences):
        sel = (batch.sequence_id == s) & batch.loss_mask
        out.append([float(v) for v in values[sel][torch.argsort(batch.position[sel])]])
    return out


def _log_w(batch):
    return torch.where(batch.loss_mask, batch.old_logprob - batch.behavior_logprob, 0.0)


def _check_edges(batch):
    counts = [len(row) for row in _tokens(batch, batch.loss_mask)]
    assert counts[0] == 0 < int(batch.length[0]) and 0 < counts[1] < int(batch.length[1])


def _assert_rows(got_RC, batch, want_rows, label):
    for got, want in zip(_tokens(batch, got_RC), want_rows, strict=True):
        assert got == pytest.approx(want, rel=EXACT, abs=EXACT), label
    off = got_RC[~batch.loss_mask]
    assert bool((off == 0).all()), label


@EXAMPLES
@given(EDGE, st.sampled_from(list(Level)), st.sampled_from([None, 1.3]), st.booleans())
def test_snis_factors_are_the_loop_definition(batch, level, cap, two_steps):
    _check_edges(batch)
    n = batch.num_sequences
    step = torch.tensor([s % 2 for s in range(n)]) if two_steps else None
    got = SelfNormalizedIS(level, cap=cap).prepare_step(batch, step).token_extras[SNIS_FACTOR]
    rows = _tokens(batch, _log_w(batch))
    steps = [s % 2 if two_steps else 0 for s in range(n)]

    def capped(x):
        return min(math.exp(x), cap) if cap is not None else math.exp(x)
    if level is Level.TOKEN:
        weights = [[capped(x) for x in row] for row in rows]
        pool = {k: [w for s, row in enumerate(weights) if steps[s] == k for w in row]
                for k in set(steps)}
    else:
        reduce = sum if level is Level.SEQUENCE else (lambda r: sum(r) / len(r))
        seq = [capped(reduce(row)) if row else None for row in rows]
        weights = [[w] * len(row) for w, row in zip(seq, rows, strict=True)]
        pool = {k: [w for s, w in enumerate(seq) if steps[s] == k and w is not None]
                for k in set(steps)}
    mean = {k: sum(v) / len(v) if v else 1.0 for k, v in pool.items()}
    want = [[w / mean[steps[s]] for w in row] for s, row in enumerate(weights)]
    _assert_rows(got, batch, want, (level, cap, two_steps))


def _statistic(kind, x):
    x = max(-20.0, min(20.0, x))
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.expm1(x) - x}[kind]


@EXAMPLES
@given(EDGE, st.sampled_from([("k1", "token"), ("k1", "sum"), ("k1", "mean"), ("k2", "token"),
                              ("k2", "max"), ("k3", "mean"), ("k3", "max"), ("k3", "sum")]))
def test_rejection_statistics_and_diagnostics_are_the_loop_definition(batch, option):
    _check_edges(batch)
    kind, reduce = option
    rows = [[_statistic(kind, x) for x in row] for row in _tokens(batch, _log_w(batch))]
    if reduce == "token":
        per_token = rows
    else:
        agg = {"sum": sum, "mean": lambda r: sum(r) / len(r), "max": max}[reduce]
        per_token = [[agg(row)] * len(row) if row else [] for row in rows]
    got = rejection_statistic(_log_w(batch), batch, statistic=kind, reduce=reduce)
    _assert_rows(got, batch, per_token, option)

    # a band that keeps some and rejects some: halfway between two of the values seen (a value
    # itself would sit on the edge, where the two roundings of a mean may fall either side)
    values = sorted(set(v for row in per_token for v in row))
    if kind == "k1":
        part = RejectionSampling(statistic="k1", reduce=reduce, high=2.0, low=0.7,
                                 masked_in_normalizer=False)
        kept = [[0.7 <= math.exp(v) <= 2.0 for v in row] for row in per_token]
    else:
        mid = len(values) // 2
        high = (values[mid - 1] + values[mid]) / 2 if len(values) > 1 else 2 * values[0] + 1e-6
        high = max(high, 1e-6)
        part = RejectionSampling(statistic=kind, reduce=reduce, high=high,
                                 masked_in_normalizer=True)
        kept = [[v <= high for v in row] for row in per_token]
    tokens = sum(len(row) for row in rows)
    with_tokens = [s for s, row in enumerate(rows) if row]
    seen = [v for row in per_token for v in row] if reduce == "token" \
        else [per_token[s][0] for s in with_tokens]
    want = {
        "rs_masked_fraction": sum(not k for row in kept for k in row) / tokens,
        "rs_seq_masked_fraction": sum(not all(kept[s]) for s in with_tokens) / len(with_tokens),
        "rs_statistic_mean": sum(seen) / len(seen),
        "rs_statistic_max": max(seen),
    }
    got = part.diagnostics(batch)
    assert set(got) == set(want)
    for key, value in want.items():
        assert float(got[key]) == pytest.approx(value, rel=EXACT, abs=EXACT), (option, key)


@EXAMPLES
@given(EDGE)
def test_weight_diagnostics_are_the_loop_definition(batch):
    _check_edges(batch)
    rows = _tokens(batch, _log_w(batch))

    def ess_chi2(ws):
        return sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws)), \
            sum(w * w for w in ws) / len(ws) - 1
    token = [math.exp(x) for row in rows for x in row]
    sequence = [math.exp(sum(row)) for row in rows if row]
    got = correction_diagnostics(batch, sequence=True)
    for key, value in zip(("is_ess", "is_chi2", "is_seq_ess", "is_seq_chi2"),
                          (*ess_chi2(token), *ess_chi2(sequence)), strict=True):
        assert float(got[key]) == pytest.approx(value, rel=EXACT, abs=EXACT), key


@EXAMPLES
@given(EDGE, st.sampled_from(list(E.Aggregation)), st.sampled_from(list(E.SequenceCount)))
def test_aggregation_weights_are_the_loop_definition(batch, mode, sequences):
    _check_edges(batch)
    lengths = [len(row) for row in _tokens(batch, batch.loss_mask)]
    counted = [n > 0 or sequences is E.SequenceCount.SAMPLED for n in lengths]
    n_tok, n_seq = max(sum(lengths), 1), max(sum(counted), 1)
    groups = [int(g) for g in batch.group]
    if mode is E.Aggregation.PROMPT_MEAN_TOKEN_MEAN:
        group_tokens = {g: sum(n for n, h in zip(lengths, groups, strict=True) if h == g)
                        for g in set(groups)}
        n_groups = sum(1 for g in group_tokens if group_tokens[g] > 0
                       or sequences is E.SequenceCount.SAMPLED)
    per_sequence = []
    for s, n in enumerate(lengths):
        per_sequence.append({
            E.Aggregation.TOKEN_MEAN: lambda: 1 / n_tok,
            E.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: lambda n=n: 1 / (max(n, 1) * n_seq),
            E.Aggregation.SEQUENCE_MEAN_TOKEN_SUM: lambda: 1 / n_seq,
            E.Aggregation.CONSTANT: lambda: 1 / (n_seq * 8),
            E.Aggregation.PROMPT_MEAN_TOKEN_MEAN: lambda s=s: 1 / (
                max(group_tokens[groups[s]], 1) * n_groups),
            E.Aggregation.TOKEN_SUM: lambda: 1.0,
        }[mode]())
    got = loss_weights(batch, mode, max_len=8, sequences=sequences)
    want = [[w] * n for w, n in zip(per_sequence, lengths, strict=True)]
    _assert_rows(got, batch, want, (mode, sequences))
