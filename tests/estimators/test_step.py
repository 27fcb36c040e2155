"""``prepare_step``: the step-wide hook of surrogate and correction parts, called once by
``prepare`` after advantages and loss weights, with the step ids; wrappers forward it."""

from __future__ import annotations

import dataclasses

import torch

from tests.estimators.estimator_helpers import make_batch
from tokenmdp import estimators
from tokenmdp.estimators import EntropyBonus, Estimator, OffPolicySequenceMask, PPOClip
from tokenmdp.estimators._common import to_tokens

EXACT = 1e-12


@dataclasses.dataclass(frozen=True)
class StepSelfNormalized(PPOClip):
    """A user's part: each step's loss weights rescaled to sum to 1 (records its calls)."""

    calls: list = dataclasses.field(default_factory=list, compare=False)

    def prepare_step(self, batch, step):
        self.calls.append(None if step is None else step.clone())
        ids = torch.zeros_like(batch.reward, dtype=torch.long) if step is None else step
        per_token = to_tokens(ids.to(batch.dtype), batch).long()
        totals = torch.zeros(int(ids.max()) + 1, dtype=batch.dtype)
        totals.index_add_(0, per_token[batch.loss_mask], batch.loss_weight[batch.loss_mask])
        scale = torch.where(batch.loss_mask, 1.0 / totals[per_token], 0.0)
        return batch.replace(loss_weight=batch.loss_weight * scale)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    responses = [[1, 2, 3], [4], [5, 6], [7, 1, 2, 3]]
    old = [(-torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in responses]
    return make_batch([[9]] * 4, responses, rewards=[1.0, 0.0, 0.5, 1.0], groups=[0, 0, 1, 1],
                      old=old, behavior=old)


def test_default_hook_changes_nothing():
    batch = _batch()
    est = estimators.get("dapo")
    plain = estimators.prepare(batch, est)
    assert PPOClip().prepare_step(plain, None) is plain
    assert estimators.NoCorrection().prepare_step(plain, None) is plain


def test_prepare_calls_the_hook_once_with_the_step_ids():
    batch = _batch(1)
    part = StepSelfNormalized(eps_low=0.2, eps_high=0.2)
    est = Estimator(surrogate=part)
    step = torch.arange(batch.num_sequences) % 2
    prepared = estimators.prepare(batch, est, step=step)
    assert len(part.calls) == 1 and torch.equal(part.calls[0], step)
    for s in (0, 1):
        rows = to_tokens((step == s).to(batch.dtype), batch).bool() & batch.loss_mask
        assert abs(float(prepared.loss_weight[rows].sum()) - 1.0) < EXACT


def test_wrappers_forward_the_hook():
    for wrap in (lambda b: EntropyBonus(b), lambda b: OffPolicySequenceMask(b)):
        part = StepSelfNormalized()
        estimators.prepare(_batch(2), Estimator(surrogate=wrap(part)))
        assert len(part.calls) == 1
