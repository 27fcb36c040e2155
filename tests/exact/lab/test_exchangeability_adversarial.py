"""Adversarial checks of the exchangeability method's types (issue 17), against the enumeration.

The method reduces the other samples of a group to their *types* (effective reward; the counted
and the loss tokens where a part reads them, :func:`~tokenmdp.exact.lab.exchangeability.
others_counts_matter`; each part's ``exchangeable_type``). These tests recombine the parts by
hand (``Estimator(...)`` with any surrogate, correction, advantage, KL term, aggregation and
sequence count, user-written subclasses among them) on generated MDPs whose rewards tie across
lengths or depend on them, and compare ``method="exchangeability"`` with
``method="enumeration"``:

* a length-aware advantage with a reject that leaves the normalizer: the advantage reads every
  loss token, the counted tokens miss the rejected ones, so both counts are in the types (two
  responses of 2 loss tokens, one with a rejected token, share their counted tokens but not
  their baseline weight; the types without the loss tokens were off by 5% of the mean);
* custom parts: an advantage that reads the lengths (a :meth:`per_sequence` override), one that
  reads the rewards only (``__call__``), a surrogate with a step-wide ``prepare_step``;
* the other options of :func:`~tokenmdp.exact.moments` the method refuses (a loss callable,
  ``filter_groups``, several prompts per batch) raise instead of answering;
* :class:`~tokenmdp.exact.lab.moments.MomentsWorkspace` against a fresh :func:`moments` call, bit
  for bit, after each change of what its tables read: an optimizer step, ``load_state_dict``,
  ``μ``'s temperature and rounding, a neural policy's buffer, a policy or the reference
  swapped on the workspace, the MDP's prompt probabilities in place (a workspace that misses
  the temperature is caught).
"""

import dataclasses
import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import estimators as E
from tokenmdp.estimators import Aggregation, Estimator, SequenceCount
from tokenmdp.estimators._common import loss_token_counts, to_tokens
from tokenmdp.exact import NeuralPolicy, TabularPolicy, TokenMDP, inference_copy, stale_copy
from tokenmdp.exact.lab.exchangeability import others_counts_matter, reduces_to_types
from tokenmdp.exact.lab.moments import MomentsWorkspace, moments
from tokenmdp.exact.world.rewards import ExactMatch, LengthReward, Parity, TokenCount
from tokenmdp.testing.strategies import mdps

M = importlib.import_module("tokenmdp.exact.lab.moments")   # the module (the package's name is the function)

#: float64 round-off of the same moments summed in another order (enumeration vs types).
EXACT_TOL = 1e-11


def world(mdp: TokenMDP, seed: int, noise: float = 0.8):
    """``π_θ``, and ``π_old`` 0.4 away with ``μ`` its noisy inference copy (the noise large
    enough that a ratio band of [0.5, 2] rejects some tokens)."""
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(seed))
    away = torch.randn(pi.table.numel(), generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    old = stale_copy(mdp, pi, direction=away, distance=0.4)
    mu = inference_copy(old, noise_std=noise, generator=torch.Generator().manual_seed(seed + 2))
    return pi, dict(behavior=mu, old=old, reference=old)


def assert_same(a, b, tol=EXACT_TOL):
    scale = max(1.0, float(b.mean.abs().max()))
    torch.testing.assert_close(a.mean, b.mean, rtol=0, atol=tol * scale)
    assert abs(a.total_variance - b.total_variance) <= tol * max(1.0, b.total_variance)


# ----------------------------------------------------------------------- user-written parts
@dataclasses.dataclass(frozen=True)
class LengthShaped(E.Advantage):
    """``A_i = R_i - mean_g R - c (|y_i| - mean_g |y|)``: reads the others' lengths through
    :meth:`per_sequence` (as a user's length-penalized baseline would)."""

    c: float = 0.3

    def __call__(self, reward_S, group_S, step_S=None):
        return E.group_mean_advantage(reward_S, group_S)

    def per_sequence(self, reward_S, group_S, length_S, step_S=None):
        centred = E.group_mean_advantage(length_S.to(reward_S.dtype), group_S)
        return E.group_mean_advantage(reward_S, group_S) - self.c * centred

    def describe(self) -> str:
        return f"R - group mean - {self.c} (|y| - group mean)"


@dataclasses.dataclass(frozen=True)
class GroupMaxBaseline(E.Advantage):
    """``A_i = R_i - max_g R``: a reward-only group baseline written as ``__call__`` alone."""

    def __call__(self, reward_S, group_S, step_S=None):
        index = torch.unique(group_S, return_inverse=True)[1]
        top = reward_S.new_zeros(int(index.max()) + 1).scatter_reduce(
            0, index, reward_S, "amax", include_self=False)
        return reward_S - top[index]

    def describe(self) -> str:
        return "R - group max"


@dataclasses.dataclass(frozen=True)
class StepTokenScaled(E.Reinforce):
    """REINFORCE with the advantages divided by the step's loss tokens, set in ``prepare_step``
    (a step-wide statistic of the others' counts, outside the aggregation)."""

    def prepare_step(self, batch, step):
        counts = loss_token_counts(batch)
        step = torch.zeros_like(counts, dtype=torch.long) if step is None else step
        total = counts.new_zeros(int(step.max()) + 1).index_add_(0, step, counts)[step]
        return batch.replace(advantage=batch.advantage / to_tokens(total.clamp(min=1), batch))


# ----------------------------------------------------------------------------- part pools
def _distinct(parts):
    out = {}
    for part in parts:
        out.setdefault(repr(part), part)
    return tuple(out.values())


_REGISTRY = [E.get(n) for n in E.names() if reduces_to_types(E.get(n))]
SURROGATES = _distinct([e.surrogate for e in _REGISTRY if not isinstance(e.surrogate, E.CTPOClip)]
                       + [StepTokenScaled()])
REJECTS = tuple(E.RejectionSampling.from_verl(option, "0.5_2.0", masked_in_normalizer=inside)
                for option in ("token_k1", "seq_sum_k1") for inside in (False, True))
CORRECTIONS = _distinct([e.correction for e in _REGISTRY] + list(REJECTS)
                        + [E.SelfNormalizedIS(), E.SelfNormalizedIS(level="sequence")])
ADVANTAGES = _distinct([e.advantage for e in _REGISTRY]
                       + [LengthShaped(), GroupMaxBaseline(), E.OPOBaseline()])
KL_TERMS = (None, E.get("grpo").kl, E.get("reinforce_pp_kl").kl)
REWARDS = (Parity(1), TokenCount(0), ExactMatch((0, 1)),
           LengthReward(-0.25, content=Parity(1)), LengthReward(0.5))


@st.composite
def compositions(draw):
    """An estimator recombined from the pools, every field drawn."""
    return Estimator(surrogate=draw(st.sampled_from(SURROGATES)),
                     advantage=draw(st.sampled_from(ADVANTAGES)),
                     correction=draw(st.sampled_from(CORRECTIONS)),
                     aggregation=draw(st.sampled_from(tuple(Aggregation))),
                     kl=draw(st.sampled_from(KL_TERMS)),
                     sequence_count=draw(st.sampled_from(tuple(SequenceCount))))


def with_reward(mdp: TokenMDP, reward) -> TokenMDP:
    return TokenMDP(mdp.vocab_size, mdp.max_len, reward, prompts=mdp.prompts,
                    prompt_probs=mdp.prompt_probs.tolist())


def both_methods(mdp, est, G, seed):
    pi, kw = world(mdp, seed)
    ws = MomentsWorkspace(mdp, pi, **kw)
    return (ws.moments(est, group_size=G, method="exchangeability"),
            ws.moments(est, group_size=G, method="enumeration"))


# --------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("advantage", [E.OPOBaseline(), E.ReinforcePPBaseline(), LengthShaped()],
                         ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("option", ["token_k1", "seq_sum_k1"])
@pytest.mark.parametrize("aggregation", [Aggregation.SEQUENCE_MEAN_TOKEN_SUM,
                                         Aggregation.TOKEN_MEAN])
def test_a_length_aware_advantage_with_rejects_leaving_the_normalizer(advantage, option,
                                                                      aggregation):
    """The advantage weighs the others by their loss tokens, the normalizer by their counted
    ones: responses that share the counted tokens but not the loss tokens are different types
    (without the loss tokens in the types the mean was off by 5-10%)."""
    mdp = TokenMDP(3, 3, Parity(1), prompts=[(0,), (1,)], prompt_probs=[0.3, 0.7])
    est = Estimator(surrogate=E.PPOClip(), advantage=advantage, aggregation=aggregation,
                    correction=E.RejectionSampling.from_verl(option, "0.5_2.0"))
    assert others_counts_matter(est)
    fast, exact = both_methods(mdp, est, 3, seed=4)
    assert float(exact.mean.norm()) > 1e-3
    assert_same(fast, exact)


def test_which_custom_parts_keep_the_counts():
    grpo = E.get("grpo")
    assert others_counts_matter(grpo.replace(advantage=LengthShaped()))
    assert not others_counts_matter(grpo.replace(advantage=GroupMaxBaseline()))
    assert others_counts_matter(grpo.replace(surrogate=StepTokenScaled()))
    assert others_counts_matter(grpo.replace(correction=E.SelfNormalizedIS()))
    for reject in REJECTS:                       # own counts only: |y_i| of seq-mean-token-mean
        assert not others_counts_matter(grpo.replace(correction=reject))


@pytest.mark.parametrize("change", [dict(advantage=LengthShaped()),
                                    dict(advantage=GroupMaxBaseline()),
                                    dict(surrogate=StepTokenScaled()),
                                    dict(correction=E.SelfNormalizedIS(level="sequence"))],
                         ids=lambda c: type(next(iter(c.values()))).__name__)
def test_custom_parts_against_the_enumeration(change):
    """Each user-written part in an estimator whose aggregation reads no other counts (so only
    the part's own clause of :func:`others_counts_matter` keeps them), rewards tied across
    lengths."""
    mdp = TokenMDP(3, 3, Parity(1), prompts=[(0,), (1,)], prompt_probs=[0.4, 0.6])
    est = E.get("rloo").replace(**change)
    fast, exact = both_methods(mdp, est, 3, seed=2)
    assert float(exact.mean.norm()) > 1e-3
    assert_same(fast, exact)


@settings(max_examples=60, deadline=None)
@given(mdps(max_vocab_size=3, max_len=3, max_prompts=2), st.sampled_from(REWARDS),
       compositions(), st.integers(2, 3), st.integers(0, 1000))
def test_recombined_parts_on_generated_mdps(mdp, reward, est, G, seed):
    """Any composition of the pools (user-written parts among them), rewards that tie across
    lengths or depend on them, one or two prompts, responses down to the EOS alone."""
    fast, exact = both_methods(with_reward(mdp, reward), est, G, seed)
    assert_same(fast, exact)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(ADVANTAGES), st.sampled_from(CORRECTIONS),
       st.sampled_from(tuple(Aggregation)), st.integers(0, 1000))
def test_length_one_responses(advantage, correction, aggregation, seed):
    """``max_len = 1``: every response one token (the EOS, or a token cut at the limit), so the
    counted tokens are 0 or 1 and ties in reward are ties in type."""
    mdp = TokenMDP(3, 1, LengthReward(0.5, content=Parity(1)), prompts=[(0,), (1, 2)],
                   prompt_probs=[0.5, 0.5])
    est = Estimator(surrogate=E.PPOClip(), advantage=advantage, correction=correction,
                    aggregation=aggregation)
    fast, exact = both_methods(mdp, est, 3, seed)
    assert_same(fast, exact)


def test_what_the_method_refuses_raises():
    mdp = TokenMDP(3, 2, Parity(1), prompts=[(0,), (1,)], prompt_probs=[0.5, 0.5])
    pi, kw = world(mdp, 0)
    ws = MomentsWorkspace(mdp, pi, **kw)

    def loss_fn(logprobs_RC, batch):
        return -(logprobs_RC * batch.loss_mask).sum()

    for estimator, options in ((loss_fn, {}), (E.get("grpo"), dict(filter_groups=True)),
                               (E.get("grpo"), dict(prompts_per_batch=2)),
                               (E.get("clip_cov"), {})):
        with pytest.raises(ValueError, match="method: exchangeability"):
            ws.moments(estimator, group_size=2, method="exchangeability", **options)


# ------------------------------------------------------------------------------ workspace
def _fresh(ws, est, G):
    return moments(ws.mdp, ws.policy, est, group_size=G, behavior=ws.behavior, old=ws.old,
                   reference=ws.reference, method="exchangeability")


def test_a_workspace_follows_every_change_of_what_its_tables_read():
    mdp = TokenMDP(3, 3, Parity(1), prompts=[(0,), (1,)], prompt_probs=[0.3, 0.7])
    pi, kw = world(mdp, 4, noise=0.4)
    other_pi, other_kw = world(mdp, 9, noise=0.4)
    ws = MomentsWorkspace(mdp, pi, **kw)
    est = E.get("grpo")
    optimizer = torch.optim.SGD(pi.parameters(), lr=0.5)

    def step():
        pi.table.grad = torch.randn(pi.table.shape, generator=torch.Generator().manual_seed(1),
                                    dtype=torch.float64)
        optimizer.step()

    changes = [step, lambda: kw["old"].load_state_dict(other_kw["old"].state_dict()),
               lambda: setattr(kw["behavior"], "temperature", 0.7),
               lambda: setattr(kw["behavior"], "rounding", "bf16"),
               lambda: setattr(ws, "behavior", other_kw["behavior"]),
               lambda: setattr(ws, "reference", other_pi),
               lambda: mdp.prompt_probs.copy_(mdp.prompt_probs.flip(0))]
    before = ws.moments(est, group_size=3, method="exchangeability")
    for change in changes:
        change()
        now = ws.moments(est, group_size=3, method="exchangeability")
        fresh = _fresh(ws, est, 3)
        assert torch.equal(now.mean, fresh.mean) and now.total_variance == fresh.total_variance
        assert torch.equal(now.true_gradient, fresh.true_gradient)
        assert not torch.equal(now.mean, before.mean)          # the change mattered
        before = now
    assert ws._tables() is ws._tables()                         # no change: no rebuild


def test_a_workspace_that_misses_a_temperature_is_caught(monkeypatch):
    mdp = TokenMDP(3, 2, Parity(1), prompts=[(0,), (1,)], prompt_probs=[0.5, 0.5])
    pi, kw = world(mdp, 4, noise=0.4)
    ws = MomentsWorkspace(mdp, pi, **kw).build()
    kw["behavior"].temperature = 0.5
    monkeypatch.setattr(M, "_same", lambda now, then: True)     # the settings not watched
    stale = ws.moments(E.get("dapo"), group_size=2, method="exchangeability")
    assert float((stale.mean - _fresh(ws, E.get("dapo"), 2).mean).abs().max()) > 1e-6


def test_a_workspace_follows_a_neural_policy_and_a_late_reference():
    mdp = TokenMDP(3, 2, LengthReward(0.5, content=Parity(1)), prompts=[(0,), (1,)],
                   prompt_probs=[0.5, 0.5])
    pi = NeuralPolicy(mdp, generator=torch.Generator().manual_seed(1))
    ws = MomentsWorkspace(mdp, pi).build()
    with pytest.raises(ValueError, match="reference"):
        ws.moments(E.get("grpo"), group_size=2)               # a KL term, no reference
    before = ws.moments(E.get("dapo"), group_size=2, method="exchangeability")
    pi.prompt_last.copy_(pi.prompt_last.flip(0))               # a buffer, in place
    now = ws.moments(E.get("dapo"), group_size=2, method="exchangeability")
    assert torch.equal(now.mean, _fresh(ws, E.get("dapo"), 2).mean)
    assert not torch.equal(now.mean, before.mean)
    ws.reference = stale_copy(mdp, pi, distance=0.3)
    late = ws.moments(E.get("grpo"), group_size=2, method="exchangeability")
    assert torch.equal(late.mean, _fresh(ws, E.get("grpo"), 2).mean)
