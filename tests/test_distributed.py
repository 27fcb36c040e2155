"""Data parallel with real processes: two gloo ranks, a DDP-wrapped tabular model, one step.

Each rank holds part of a global batch (whole groups), prepares it with the all-reduced counts of
:func:`tokenmdp.distributed.global_counts`, accumulates two micro-batches (``no_sync`` on the
first) and scales its loss by :func:`tokenmdp.distributed.data_parallel_loss_scale`. After DDP's
all-reduce the gradient must equal the single-process gradient of the global batch (computed
here, in the parent). Variants show what each piece is for: local counts (the naive version)
give a mean of rank means, and no scale gives ``1/W`` of the gradient.

Every wait is bounded: collectives by the process group's timeout, the workers by a join
deadline after which they are terminated and the test fails.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from tests._ranks import join_group, leave_group, run_ranks
from tokenmdp import estimators as est_lib
from tokenmdp import packing
from tokenmdp.batch import TokenBatch
from tokenmdp.distributed import all_reduce_counts, data_parallel_loss_scale, global_counts
from tokenmdp.testing import TokenTable

WORLD_SIZE = 2
JOIN_TIMEOUT_S = 120           # the parent kills the workers after this
GRAD_TOL = 1e-10               # float64, only the order of summation differs
NAIVE_MIN_DIFF = 1e-3          # a different estimator differs by far more than rounding
MODES = (est_lib.Aggregation.TOKEN_MEAN, est_lib.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
# Sequences of each rank: "halves" gives each rank 4 of the 8 sequences (7 and 9 loss tokens),
# "uneven" gives 6 and 2 (13 and 3 loss tokens). Whole groups, so advantages are local.
SHARES = {"halves": ([0, 1, 2, 3], [4, 5, 6, 7]), "uneven": ([0, 1, 2, 3, 4, 5], [6, 7])}
VARIANTS = ("global", "naive", "unscaled")


def _estimator(mode: est_lib.Aggregation) -> est_lib.Estimator:
    return est_lib.Estimator(surrogate=est_lib.PPOClip(eps_low=0.2, eps_high=0.28),
                             advantage=est_lib.GroupMean(), aggregation=mode)


def _global_batch() -> TokenBatch:
    """Four groups of two responses (lengths 2, 1 | 1, 3 | 2, 4 | 1, 2), distinct rewards, old
    log-probs within a few percent of the initial model's (so some ratios clip)."""
    responses = [[1, 2], [3], [2], [1, 1, 3], [3, 3], [2, 2, 2, 1], [1], [2, 3]]
    batch = TokenBatch.from_sequences(
        [[g % 2] for g in range(4) for _ in range(2)], responses,
        rewards=[1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 1.0, 0.2], groups=[0, 0, 1, 1, 2, 2, 3, 3])
    with torch.no_grad():
        current = _model(batch)(batch)
    noise = 0.05 * torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(1),
                               dtype=torch.float64)
    return batch.replace(old_logprob=torch.where(batch.loss_mask, current + noise, 0.0))


def _model(batch: TokenBatch) -> TokenTable:
    return TokenTable.for_batch(batch, seed=0)


def _single_process_gradient(mode) -> torch.Tensor:
    batch = _global_batch()
    model = _model(batch)
    step = est_lib.prepare(batch, _estimator(mode))
    value, _ = est_lib.loss(model(step), step, _estimator(mode))
    value.backward()
    return model.logits_PTVV.grad


def _rank_gradient(rank: int, share: str, mode, variant: str) -> torch.Tensor:
    full = _global_batch()
    local = packing.select_sequences(full, SHARES[share][rank])
    est = _estimator(mode)
    if variant == "naive":                           # this rank's own counts
        step = est_lib.prepare(local, est)
    else:                                            # the whole step's counts
        counts = global_counts(local)
        step = est_lib.prepare(local, est, num_tokens=counts.num_loss_tokens,
                               num_sequences=counts.num_sequences)
    scale = data_parallel_loss_scale() if variant == "global" else 1
    model = _model(full)                             # same table (and seed) on every rank
    ddp = DistributedDataParallel(model)
    parts = packing.split_micro_batches(packing.padded_layout(step), 2)
    for i, part in enumerate(parts):
        sync = contextlib.nullcontext() if i == len(parts) - 1 else ddp.no_sync()
        with sync:
            value, _ = est_lib.loss(ddp(part.batch), part.batch, est)
            (value * scale).backward()
    return model.logits_PTVV.grad.clone()


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, WORLD_SIZE)
    grads = {(share, mode.value, variant): _rank_gradient(rank, share, mode, variant)
             for share in SHARES for mode in MODES for variant in VARIANTS}
    torch.save(grads, f"{out_dir}/grads{rank}.pt")
    leave_group()


@pytest.fixture(scope="module")
def rank_gradients(tmp_path_factory):
    """``[rank] -> {(share, mode, variant): gradient}`` from two spawned gloo processes."""
    out = tmp_path_factory.mktemp("ddp")
    run_ranks(_worker, WORLD_SIZE, out, join_timeout_s=JOIN_TIMEOUT_S)
    return [torch.load(out / f"grads{rank}.pt") for rank in range(WORLD_SIZE)]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("share", list(SHARES))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_ddp_step_with_global_counts_equals_the_single_process_gradient(rank_gradients, share,
                                                                        mode):
    reference = _single_process_gradient(mode)
    assert float(reference.abs().max()) > NAIVE_MIN_DIFF          # not a vacuous comparison
    for grads in rank_gradients:                                  # every rank holds it
        assert _max_diff(grads[(share, mode.value, "global")], reference) <= GRAD_TOL


@pytest.mark.parametrize("share", list(SHARES))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_without_the_loss_scale_the_gradient_is_one_over_world_size(rank_gradients, share, mode):
    got = rank_gradients[0][(share, mode.value, "unscaled")]
    assert _max_diff(got * WORLD_SIZE, _single_process_gradient(mode)) <= GRAD_TOL


@pytest.mark.parametrize("share", list(SHARES))
def test_naive_local_token_mean_differs(rank_gradients, share):
    # Ranks hold 7 and 9 (or 13 and 3) loss tokens: the mean of rank token-means is another
    # estimator.
    mode = est_lib.Aggregation.TOKEN_MEAN
    got = rank_gradients[0][(share, mode.value, "naive")]
    assert _max_diff(got, _single_process_gradient(mode)) > NAIVE_MIN_DIFF


def test_naive_local_sequence_mean_differs_unless_ranks_hold_equal_sequence_counts(
        rank_gradients):
    # DDP's mean of rank sequence-means is the global sequence-mean exactly when every rank
    # holds the same number of (counted) sequences: halves agree, an uneven share does not.
    mode = est_lib.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN
    reference = _single_process_gradient(mode)
    assert _max_diff(rank_gradients[0][("halves", mode.value, "naive")], reference) <= GRAD_TOL
    assert _max_diff(rank_gradients[0][("uneven", mode.value, "naive")], reference) > NAIVE_MIN_DIFF


# ------------------------------------------------------------------ counts in one process
def _counts_batch() -> TokenBatch:
    """Three sequences: 2 loss tokens, an empty response, 1 loss token and one masked out."""
    batch = TokenBatch.from_sequences([[0], [0], [0]], [[1, 2], [], [1, 2]])
    mask = batch.loss_mask.clone()
    mask[2, 2] = False
    return batch.replace(loss_mask=mask, loss_weight=mask.double())


def test_counts_without_a_process_group_match_the_estimators_count_step():
    batch = _counts_batch()
    # By default S counts every sampled sequence (3); counting only the sequences with a loss
    # token, the empty response is not in a sequence-mean: S = 2.
    assert global_counts(batch) == est_lib.count_step(batch) == (3, 3)
    with_tokens = "with-loss-tokens"
    assert global_counts(batch, sequences=with_tokens) == \
        est_lib.count_step(batch, sequences=with_tokens) == (3, 2)
    only_first = batch.loss_mask & (batch.sequence_id == 0)
    assert global_counts(batch, mask=only_first, sequences=with_tokens) == \
        est_lib.count_step(batch, only_first, sequences=with_tokens) == (2, 1)
    assert global_counts(batch, mask=only_first) == est_lib.count_step(batch, only_first) == (2, 3)
    assert all_reduce_counts((5, 4)) == (5, 4)
    assert data_parallel_loss_scale() == 1


@pytest.mark.parametrize(("call", "error", "argument"), [
    (lambda: global_counts("batch"), TypeError, "batch"),
    (lambda: global_counts(_counts_batch(), mask=torch.ones(2, 2, dtype=torch.bool)), ValueError,
     "mask"),
    (lambda: global_counts(_counts_batch(), mask=_counts_batch().sequence_id >= 0), ValueError,
     "mask"),
    (lambda: all_reduce_counts((1,)), TypeError, "counts"),
    (lambda: all_reduce_counts((1.5, 2)), TypeError, "counts"),
    (lambda: all_reduce_counts((-1, 0)), ValueError, "counts"),
])
def test_bad_counts_input_raises_naming_the_argument(call, error, argument):
    with pytest.raises(error, match=argument):
        call()
