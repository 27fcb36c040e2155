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
