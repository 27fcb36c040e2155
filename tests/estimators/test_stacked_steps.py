"""``prepare(..., step=...)``: independent optimizer steps stacked in one batch are prepared
exactly as if each step were prepared on its own (the exact lab relies on this)."""

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch
from tokenmdp import estimators as E

EXACT_TOL = 1e-15


def three_steps():
    """Steps of 4, 2 and 3 sequences (groups of 2, 2, 3), varied lengths, rewards and log-probs.

    Returns the stacked batch, its step ids, and each step built as a batch of its own."""
    g = torch.Generator().manual_seed(0)
    specs = [  # per step: (groups, response lengths)
        ([0, 0, 1, 1], [1, 3, 2, 2]),
        ([0, 0], [4, 1]),
        ([0, 0, 0], [2, 2, 3]),
    ]
    per_step, stacked = [], {"prompts": [], "responses": [], "rewards": [], "groups": [],
                             "old": [], "behavior": [], "ref": []}
    steps, group_offset = [], 0
    for k, (groups, lengths) in enumerate(specs):
        prompts = [[1, 2]] * len(lengths)
        responses = [[3] * n for n in lengths]
        rewards = torch.rand(len(lengths), generator=g, dtype=torch.float64).round(decimals=1)
        lp = {name: [(-torch.rand(n, generator=g, dtype=torch.float64)).tolist()
                     for n in lengths] for name in ("old", "behavior", "ref")}
        per_step.append(make_batch(prompts, responses, rewards=rewards.tolist(), groups=groups,
                                   capacity=6, **lp))
        stacked["prompts"] += prompts
        stacked["responses"] += responses
        stacked["rewards"] += rewards.tolist()
        stacked["groups"] += [group_offset + gr for gr in groups]
        for name in ("old", "behavior", "ref"):
            stacked[name] += lp[name]
        steps += [k] * len(lengths)
        group_offset += max(groups) + 1
    batch = make_batch(stacked.pop("prompts"), stacked.pop("responses"), capacity=6, **stacked)
    return batch, torch.tensor(steps), per_step


@pytest.mark.parametrize("name", E.names())
def test_stacked_steps_are_prepared_like_separate_steps(name):
    est = E.get(name)
    batch, step, parts = three_steps()
    stacked = E.prepare(batch, est, step=step, max_len=6)
    rows = 0
    for part in parts:
        alone = E.prepare(part, est, max_len=6)
        sel = slice(rows, rows + part.num_rows)
        torch.testing.assert_close(stacked.advantage[sel], alone.advantage, rtol=0,
                                   atol=EXACT_TOL)
        torch.testing.assert_close(stacked.loss_weight[sel], alone.loss_weight, rtol=0,
                                   atol=EXACT_TOL)
        rows += part.num_rows
    # and it is not a no-op: without step the token-mean weights differ
    if est.aggregation is E.Aggregation.TOKEN_MEAN:
        assert not torch.equal(E.prepare(batch, est, max_len=6).loss_weight, stacked.loss_weight)


def test_batch_normalization_is_per_step():
    batch, step, parts = three_steps()
    adv = E.BatchNormalized(ddof=1, eps=0.0)
    a = adv(batch.reward, batch.group, step)
    first = adv(parts[0].reward, parts[0].group)
    torch.testing.assert_close(a[:4], first, rtol=0, atol=EXACT_TOL)
    assert not torch.allclose(adv(batch.reward, batch.group)[:4], first)


def test_step_rejects_global_counts_and_bad_ids():
    batch, step, _ = three_steps()
    est = E.get("dapo")
    with pytest.raises(ValueError, match="step: stacked"):
        E.prepare(batch, est, step=step, num_tokens=100)
    with pytest.raises(ValueError, match="step: expected"):
        E.prepare(batch, est, step=step[:3])
    with pytest.raises(ValueError, match="step: contains negative"):
        E.prepare(batch, est, step=step - 1)
