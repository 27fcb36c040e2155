"""Issue 17: ``loss(..., metrics=False)`` is the same loss and gradient, bit for bit, as the
default ``metrics=True`` (whose output is unchanged), for every registry estimator."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import estimators as E
from tokenmdp.testing.strategies import token_batches


def _loss_and_grad(batch, est, **kw):
    lp = (batch.old_logprob + 0.1 * torch.randn(batch.tokens.shape, dtype=batch.dtype,
                                                generator=torch.Generator().manual_seed(0))
          ).requires_grad_(True)
    value, metrics = E.loss(lp, batch, est, **kw)
    (grad,) = torch.autograd.grad(value, lp, allow_unused=True)
    return value.detach(), grad, metrics


@settings(max_examples=20, deadline=None)
@given(token_batches(with_logprobs=True), st.data())
def test_metrics_false_is_the_same_loss_and_gradient(batch, data):
    names = data.draw(st.lists(st.sampled_from(E.names()), min_size=1, max_size=4,
                               unique=True))
    for name in names:
        est = E.get(name)
        step = E.prepare(batch, est, max_len=8)
        v1, g1, m1 = _loss_and_grad(step, est)
        v0, g0, m0 = _loss_and_grad(step, est, metrics=False)
        assert m0 == {} and "tokens" in m1, name
        assert torch.equal(v0, v1), name
        assert (g0 is None and g1 is None) or torch.equal(g0, g1), name


def _fresh(batch):
    """The same batch as a new object (no step constants cached for it)."""
    return batch.replace(loss_weight=batch.loss_weight.clone())


@settings(max_examples=15, deadline=None)
@given(token_batches(with_logprobs=True))
def test_step_constants_are_recomputed_when_they_must_be(batch):
    a, b = E.get("dapo_tis"), E.get("grpo_mis")
    step_a, step_b = E.prepare(batch, a, max_len=8), E.prepare(batch, b, max_len=8)
    first = _loss_and_grad(step_a, a)[:2]
    again = _loss_and_grad(step_a, a)[:2]                          # cached
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    other = _loss_and_grad(step_a, b)[:2]                          # another estimator
    assert torch.equal(other[0], _loss_and_grad(_fresh(step_a), b)[0])
    step_a.loss_weight.mul_(2.0)                                   # an in-place change
    doubled = _loss_and_grad(step_a, a)[0]
    assert torch.equal(doubled, _loss_and_grad(_fresh(step_a), a)[0])
    assert torch.equal(_loss_and_grad(step_b, b)[0], _loss_and_grad(_fresh(step_b), b)[0])
