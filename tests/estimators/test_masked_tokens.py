"""Issue 33, gap 1: response tokens outside the loss mask are invisible to every registry entry.

A token outside ``loss_mask`` (a tool output, a masked span, a whole response left out) must not
move the loss or the gradient of any other token, through any field: its log-probs (current,
``π_old``, ``μ``, reference), its advantage or its weight; and it gets no gradient. A mistake
of the kind "``response_mask`` where ``loss_mask`` was meant" (in a normalizer, a sequence
weight, an SNIS mean, a rejection statistic, a covariance, a group statistic) fails this.

Every registry entry runs, on its fused and its autograd path, on a fixture holding a fully
masked response and a partly masked one, and on Hypothesis batches drawn with
``token_batches(edge_masks=True)``, which always hold both; the two paths also agree there.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.estimators.fused.test_fused_loss import assert_paths_agree, fixture
from tokenmdp import estimators as E
from tokenmdp.estimators import token_loss
from tokenmdp.testing import token_batches

#: float64: the same sums with other values at tokens that enter them multiplied by 0
EXACT = 1e-12
NAMES = E.names()
FIELDS = ("old_logprob", "behavior_logprob", "ref_logprob", "advantage", "loss_weight")


def edge_fixture():
    """The fused tests' fixture (one token of sequence 0 out of the loss), with sequence 3's
    whole response and one token of sequence 4 (a negative advantage) out of the loss too."""
    batch = fixture()
    mask = batch.loss_mask & (batch.sequence_id != 3) & ~((batch.sequence_id == 4)
                                                          & (batch.position == 5))
    return batch.replace(loss_mask=mask, advantage=torch.where(mask, batch.advantage, 0.0),
                         loss_weight=mask.to(batch.dtype))


def _off_loss(batch):
    return batch.response_mask & ~batch.loss_mask


def _scrambled(batch, seed):
    """``batch`` with other values in every float field at the response tokens outside the
    loss mask (log-probs stay <= 0)."""
    gen = torch.Generator().manual_seed(seed)
    off = _off_loss(batch)
    changes = {}
    for name in FIELDS:
        value = getattr(batch, name)
        if value is None:
            continue
        noise = torch.rand(value.shape, generator=gen, dtype=value.dtype)
        # far from the real values, so that a statistic that counted them would move: a
        # mean, a top-k order or a threshold (OPSM's δ, a rejection band) crossed
        other = -30 * noise if name.endswith("logprob") else 40 * noise - 20
        changes[name] = torch.where(off, other, value)
    return batch.replace(**changes)


def _run(batch, est, lp, fused):
    step = E.prepare(batch, est, max_len=8)
    lp = lp.clone().requires_grad_(True)
    value, _ = token_loss._loss(lp, step, est, metrics=False, fused=fused)
    (grad,) = torch.autograd.grad(value, lp)
    return value.detach(), grad, step


def check_masked_tokens_invisible(batch, name, fused, seed=0, scale=0.3, shift=0.0):
    """Loss and gradient unchanged when the off-loss tokens' inputs change; no gradient there.
    ``log π_θ = log π_old + shift + scale · noise`` (a shift of -1 takes every sequence past
    OPSM's δ; a scale of 1.5 some)."""
    assert bool(_off_loss(batch).any()), "the batch must have response tokens off the loss mask"
    est = E.get(name)
    gen = torch.Generator().manual_seed(seed + 1)
    lp = batch.old_logprob + shift + scale * torch.randn(batch.tokens.shape, generator=gen,
                                                         dtype=batch.dtype)
    value, grad, step = _run(batch, est, lp, fused)
    garbage = torch.where(_off_loss(batch), -30 * torch.rand(lp.shape, generator=gen,
                                                            dtype=lp.dtype), lp)
    value2, grad2, _ = _run(_scrambled(batch, seed), est, garbage, fused)
    label = (name, "fused" if fused else "autograd")
    assert bool(torch.isfinite(value)) and bool(torch.isfinite(grad).all()), label
    scale = max(1.0, float(grad.abs().max()))
    torch.testing.assert_close(value2, value, rtol=EXACT, atol=EXACT * scale, msg=str(label))
    torch.testing.assert_close(grad2, grad, rtol=EXACT, atol=EXACT * scale, msg=str(label))
    assert bool((grad[~step.loss_mask] == 0).all()), label
    return value, grad


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
@pytest.mark.parametrize("name", NAMES)
def test_tokens_outside_the_loss_mask_are_invisible(name, fused):
    batch = edge_fixture()
    for scale, shift in ((0.3, 0.0), (1.5, 0.0), (0.3, -1.0)):
        check_masked_tokens_invisible(batch, name, fused, scale=scale, shift=shift)


@pytest.mark.parametrize("name", NAMES)
def test_fused_and_autograd_agree_with_masked_responses(name):
    batch = edge_fixture()
    est = E.get(name)
    step = E.prepare(batch, est, max_len=8)
    gen = torch.Generator().manual_seed(5)
    lp = step.old_logprob + 0.5 * torch.randn(step.tokens.shape, generator=gen, dtype=step.dtype)
    assert_paths_agree(step, est, lp, name)


@settings(max_examples=40, deadline=None)
@given(token_batches(with_logprobs=True, edge_masks=True), st.data())
def test_masked_tokens_invisible_on_hypothesis_batches(batch, data):
    names = data.draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    seed = data.draw(st.integers(0, 2**16))
    scale, shift = data.draw(st.sampled_from([(0.3, 0.0), (1.5, 0.0), (0.3, -1.0)]))
    for name in names:
        for fused in (True, False):
            check_masked_tokens_invisible(batch, name, fused, seed, scale, shift)
        est = E.get(name)
        step = E.prepare(batch, est, max_len=8)
        lp = step.old_logprob + 0.3 * torch.randn(
            step.tokens.shape, generator=torch.Generator().manual_seed(seed), dtype=step.dtype)
        assert_paths_agree(step, est, lp, name)
