"""The fused loss's value is a tensor of its own: a caller adds to it in place (as verl's actor
loss adds its KL and entropy terms) and the gradient is that of the sum."""

import torch

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch


def test_the_loss_value_takes_an_in_place_addition():
    batch = TokenBatch.from_sequences([[0], [0]], [[1, 2, 3], [2, 1]], rewards=[1.0, 0.0],
                                      groups=[0, 0])
    est = estimators.get("dapo_verl")
    lp = torch.full(batch.tokens.shape, -1.0, dtype=torch.float64)
    fields = {"old_logprob": lp.clone(), "behavior_logprob": lp.clone()}
    prepared = estimators.prepare(batch.replace(**fields), est, max_len=4)
    x = lp.clone().requires_grad_(True)
    value, _ = estimators.loss(x, prepared, est, metrics=False)
    (want,) = torch.autograd.grad(value, x, retain_graph=True)
    extra = (x * x).sum()
    value += extra                                  # raised before: a view of the input
    (got,) = torch.autograd.grad(value, x)
    assert torch.allclose(got, want + 2 * x.detach(), rtol=0, atol=1e-15)
