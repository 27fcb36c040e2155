"""Estimators end to end: on-policy equivalence, every aggregation, metrics, bad input."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.estimators.estimator_helpers import DTYPE, make_batch, repack
from tokenmdp import estimators
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    NoCorrection,
    PPOClip,
    Reinforce,
    loss,
    prepare,
)

EXACT = 1e-12  # float64, a few dozen operations
GRAD = 1e-10  # float64 gradients through a registry estimator
MAX_LEN = 6
REQUIRED = ("reinforce", "rloo", "ppo", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "cispo",
            "minirl", "grpo_tis", "grpo_mis", "minirl_no_is")


def _random_step(seed: int, *, on_policy: bool):
    """Nine sequences in three groups of three, uneven lengths, packed; every log-prob field."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 4, 2, 6, 3, 1, 2, 5, 3]

    def noise(scale):
        return (scale * torch.randn(sum(lengths), generator=gen, dtype=DTYPE)).split(lengths)

    old = [(-0.2 - torch.rand(n, generator=gen, dtype=DTYPE)).tolist() for n in lengths]
    shift = [x.tolist() for x in noise(0.0 if on_policy else 0.3)]
    behavior = [[o - s for o, s in zip(os_, ss, strict=True)] for os_, ss in zip(old, shift,
                                                                                   strict=True)]
    ref = [[o + s for o, s in zip(os_, ss.tolist(), strict=True)]
           for os_, ss in zip(old, noise(0.0 if on_policy else 0.3), strict=True)]
    batch = make_batch([[9]] * 9, [[1] * n for n in lengths],
                       rewards=torch.rand(9, generator=gen, dtype=DTYPE).tolist(),
                       groups=[0, 0, 0, 1, 1, 1, 2, 2, 2], old=old, behavior=behavior, ref=ref)
    batch = repack(batch, [[0, 1, 2], [3, 4], [5, 6, 7], [8]], capacity=12)
    step = 0.0 if on_policy else 0.4
    lp = batch.old_logprob + step * torch.randn(batch.tokens.shape, generator=gen,
                                                dtype=DTYPE) * batch.loss_mask
    return batch, lp.requires_grad_(True)


def _grad_of(est, batch, lp):
    value, _ = loss(lp, prepare(batch, est, max_len=MAX_LEN), est)
    (g,) = torch.autograd.grad(value, lp)
    return value, g


def test_registry_lists_the_required_estimators():
    assert set(REQUIRED) <= set(estimators.names())
    table = estimators.format_table()
    for name in estimators.names():
        est = estimators.get(name)
        assert isinstance(est, Estimator) and est.name == name
        assert name in table
        doc = estimators.describe(name)
        assert "Paper:" in doc and "Formula:" in doc and "Other names:" in doc


def test_unknown_estimator_name_is_a_clear_error():
    with pytest.raises(ValueError, match="grpo"):  # suggests the close match
        estimators.get("gpro")
    with pytest.raises(TypeError, match="name"):
        estimators.get(3)


@pytest.mark.parametrize("name", estimators.names())
def test_on_policy_every_estimator_has_the_reinforce_gradient(name):
    # current = old = behaviour = reference: every ratio is 1, no clip is active, every
    # correction factor is 1 and the KL terms have zero gradient at π = π_ref.
    batch, lp = _random_step(0, on_policy=True)
    est = estimators.get(name)
    if isinstance(est.surrogate, estimators.EntropyBonus):  # a regularizer, like the KL terms:
        est = est.replace(surrogate=est.surrogate.base)     # its gradient is not REINFORCE's
    plain = est.replace(surrogate=Reinforce(), correction=NoCorrection(), kl=None)
    _, g = _grad_of(est, batch, lp)
    _, g_ref = _grad_of(plain, batch, lp)
    assert g_ref.abs().max() > 1e-3
    assert torch.allclose(g, g_ref, atol=GRAD, rtol=0)


@pytest.mark.parametrize("name", estimators.names())
def test_every_aggregation_mode_changes_the_loss(name):
    batch, lp = _random_step(1, on_policy=False)
    base = estimators.get(name)
    values = {mode: _grad_of(base.replace(aggregation=mode), batch, lp)[0].item()
              for mode in Aggregation}
    for a, b in itertools.combinations(Aggregation, 2):
        assert abs(values[a] - values[b]) > 1e-6, (a, b, values)


@pytest.mark.parametrize("name", estimators.names())
def test_all_masked_batch_gives_zero_loss_zero_gradient_and_no_nan(name):
    # Prompts only (no response token anywhere); log-probs are NaN off the loss mask.
    batch = make_batch([[1, 2], [3], [4, 5], [6]], [[], [], [], []], rewards=[1.0, 0.0, 0.5, 0.2],
                       groups=[0, 0, 1, 1], old=[[], [], [], []], behavior=[[], [], [], []],
                       ref=[[], [], [], []])
    est = estimators.get(name)
    lp = torch.full(batch.tokens.shape, float("nan"), dtype=DTYPE, requires_grad=True)
    value, metrics = loss(lp, prepare(batch, est, max_len=1), est)
    (g,) = torch.autograd.grad(value, lp)
    assert value.item() == 0.0
    assert (g == 0).all()
    assert all(math.isfinite(v.item()) for v in metrics.values())
    assert metrics["tokens"].item() == 0.0


def test_hand_worked_metrics():
    # One sequence of three tokens, log π_old = log 0.5; r = 1.5, 1.0, 0.5 and
    # log(π_old/μ) = 0.1, -0.2, 0. PPO ε = 0.2, Â = +1 (reward 1, no baseline):
    #   clip fraction 1/3 (r = 1.5 > 1.2); r min/mean/max 0.5 / 1.0 / 1.5;
    #   ρ = r · π_old/μ = 1.5e^0.1, e^-0.2, 0.5;
    #   KL k1 = mean(log μ - log π_old) = (−0.1 + 0.2 + 0)/3 = 0.033333;
    #   KL k3 = mean(e^q - 1 - q) = (0.0051709 + 0.0187308 + 0)/3 = 0.0079672.
    old = [[math.log(0.5)] * 3]
    behavior = [[math.log(0.5) - 0.1, math.log(0.5) + 0.2, math.log(0.5)]]
    batch = make_batch([[7]], [[1, 2, 3]], rewards=[1.0], old=old, behavior=behavior)
    lp = batch.old_logprob + torch.log(torch.tensor([[1.0, 1.5, 1.0, 0.5]], dtype=DTYPE))
    est = Estimator(surrogate=PPOClip(eps_low=0.2, eps_high=0.2))
    _, m = loss(lp, prepare(batch, est), est)
    assert m["tokens"].item() == 3
    assert m["clip_fraction"].item() == pytest.approx(1 / 3, abs=EXACT)
    assert m["masked_fraction"].item() == 0.0
    assert [m["r_min"].item(), m["r_mean"].item(), m["r_max"].item()] == pytest.approx(
        [0.5, 1.0, 1.5], abs=EXACT)
    rho = [1.5 * math.exp(0.1), math.exp(-0.2), 0.5]
    assert [m["rho_min"].item(), m["rho_mean"].item(), m["rho_max"].item()] == pytest.approx(
        [min(rho), sum(rho) / 3, max(rho)], abs=EXACT)
    assert m["train_infer_kl_k1"].item() == pytest.approx(0.1 / 3, abs=EXACT)
    k3 = (math.exp(0.1) - 1.1 + math.exp(-0.2) - 0.8) / 3
    assert m["train_infer_kl_k3"].item() == pytest.approx(k3, abs=EXACT)


def test_loss_reads_the_prepared_weights_and_never_recomputes_them():
    batch, lp = _random_step(2, on_policy=False)
    est = estimators.get("dapo")
    step = prepare(batch, est)
    value, _ = loss(lp, step, est)
    doubled, _ = loss(lp, step.replace(loss_weight=2 * step.loss_weight), est)
    assert doubled.item() == pytest.approx(2 * value.item(), abs=EXACT)
    shifted, _ = loss(lp, step.replace(advantage=step.advantage + step.loss_mask), est)
    assert abs(shifted.item() - value.item()) > 1e-6


def test_kl_in_the_reward_enters_before_the_advantage():
    batch, _ = _random_step(3, on_policy=False)
    plain = Estimator(surrogate=Reinforce(), advantage=estimators.GroupMean())
    kl = plain.replace(kl=estimators.KLPenalty(coef=0.5, in_reward=True,
                                               estimator=estimators.kl_k1))
    a, b = prepare(batch, plain), prepare(batch, kl)
    assert torch.equal(b.reward, batch.reward)  # the environment reward is kept
    penalty = 0.5 * batch.sequence_sum((batch.old_logprob - batch.ref_logprob) * batch.loss_mask)
    expected = estimators.group_mean_advantage(batch.reward - penalty, batch.group)
    assert torch.allclose(b.advantage, batch.to_tokens(expected) * batch.loss_mask, atol=EXACT)
    assert not torch.allclose(a.advantage, b.advantage, atol=1e-6)


def test_given_advantages_replace_the_advantage_part_and_nothing_else():
    # A data-parallel rank passes advantages computed over the whole step; given the ones the
    # part would compute, prepare returns the same batch; other values change only advantage.
    batch, _ = _random_step(5, on_policy=False)
    est = estimators.get("grpo").replace(kl=estimators.KLPenalty(coef=0.3, in_reward=True))
    own = est.advantage(estimators.advantage_rewards(batch, est), batch.group)
    a, b = prepare(batch, est), prepare(batch, est, advantage_S=own)
    assert torch.equal(a.advantage, b.advantage) and torch.equal(a.loss_weight, b.loss_weight)
    other = prepare(batch, est, advantage_S=torch.ones_like(own))
    assert torch.equal(other.advantage, batch.loss_mask.to(DTYPE))
    assert torch.equal(other.loss_weight, a.loss_weight)
    for bad in (own[:-1], own.float(), own.tolist()):
        with pytest.raises(ValueError, match="advantage_S"):
            prepare(batch, est, advantage_S=bad)


def test_bad_inputs_are_clear_errors():
    batch, lp = _random_step(4, on_policy=False)
    est = estimators.get("ppo")
    step = prepare(batch, est)
    with pytest.raises(ValueError, match="logprobs_RC"):
        loss(lp[:, :-1], step, est)
    with pytest.raises(TypeError, match="logprobs_RC"):
        loss(lp.float(), step, est)
    with pytest.raises(ValueError, match="old_logprob"):
        loss(lp, step.replace(old_logprob=None), est)
    with pytest.raises(ValueError, match="behavior_logprob"):
        loss(lp, step.replace(behavior_logprob=None), estimators.get("ppo_tis"))
    with pytest.raises(ValueError, match="behavior_logprob"):
        prepare(batch.replace(behavior_logprob=None), estimators.get("grpo_mis"))
    with pytest.raises(ValueError, match="max_len"):
        prepare(batch, estimators.get("dr_grpo"))
    with pytest.raises(TypeError, match="aggregation"):
        Estimator(surrogate=Reinforce(), aggregation="token-mean")
    with pytest.raises(TypeError, match="surrogate"):
        Estimator(surrogate=estimators.reinforce_term)
    with pytest.raises(TypeError, match="batch"):
        loss(lp, {"tokens": batch.tokens}, est)
