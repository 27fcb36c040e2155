"""``minibatch_loss``: the estimator's loss plus ``coef / world_size`` times the model's
load-balancing loss (each data-parallel rank adds its share, so the term summed over the ranks
is their mean), and the metric ``load_balancing`` without the coefficient. A stub module
returns fixed log-probs and a fixed balance loss, so the expected values are closed forms."""

from __future__ import annotations

import pytest
import torch

from tokenmdp import estimators as E
from tokenmdp.batch import TokenBatch
from tokenmdp.rl.update import minibatch_loss

EXACT = 1e-12
BALANCE = 0.37


class _Stub(torch.nn.Module):
    """``forward(batch, routing)`` = (log-probs -0.5 on real tokens, the balance loss)."""

    def __init__(self, with_balance: bool = True) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
        self.with_balance = with_balance

    def forward(self, batch, routing=None):
        lp = torch.where(batch.sequence_id >= 0, -0.5 * self.scale, 0.0)
        if not self.with_balance:
            return lp
        return lp, BALANCE * self.scale ** 2


def _batch() -> TokenBatch:
    batch = TokenBatch.from_sequences([[1], [1]], [[2, 3], [4]], rewards=[1.0, 0.0],
                                      groups=[0, 0])
    return E.prepare(batch.replace(old_logprob=torch.where(batch.response_mask, -0.5, 0.0)
                                   .to(torch.float64)), E.get("reinforce"))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("coef", [0.5, 2.0])
def test_the_load_balancing_term_is_divided_by_the_world_size(world_size, coef):
    est = E.get("reinforce")
    model = _Stub()
    base, _ = minibatch_loss(model, _batch(), est)
    loss, metrics = minibatch_loss(model, _batch(), est, load_balancing_coef=coef,
                                   world_size=world_size)
    (g_base,) = torch.autograd.grad(base, model.scale)
    (g,) = torch.autograd.grad(loss, model.scale)
    assert float((loss - base).detach()) == pytest.approx(coef * BALANCE / world_size, abs=EXACT)
    assert float(metrics["load_balancing"]) == pytest.approx(BALANCE, abs=EXACT)
    assert float(g - g_base) == pytest.approx(2 * coef * BALANCE / world_size, abs=EXACT)


def test_a_model_without_a_balance_loss_refuses_a_coefficient():
    est = E.get("reinforce")
    loss, metrics = minibatch_loss(_Stub(with_balance=False), _batch(), est)
    assert "load_balancing" not in metrics and torch.isfinite(loss)
    with pytest.raises(ValueError, match="load_balancing_coef"):
        minibatch_loss(_Stub(with_balance=False), _batch(), est, load_balancing_coef=0.1)
