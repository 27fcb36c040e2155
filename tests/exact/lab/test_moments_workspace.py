"""Issue 17: exact moments of many estimators fast, against the paths they replace.

* the types of the exchangeability method without the counted tokens, where no part reads the
  other samples' counts, against the full types (effective reward and counted tokens) and the
  enumeration, on the registry and on hypothesis-generated MDPs; dropping the counts where they
  matter is caught;
* one :class:`~tokenmdp.exact.lab.moments.MomentsWorkspace` for every estimator against one
  :func:`~tokenmdp.exact.moments` call each, bit for bit; a policy changed in place (also
  through ``.data``) rebuilds the workspace's tables, and a workspace that missed it is caught;
* the response types column by column against ``torch.unique(..., dim=0)``;
* the loss and its backward pass on the kept sequences of prepared batches only (the
  exchangeability method's padding slots left out) against the coefficients of every sequence.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.exact.conftest import make_policy
from tokenmdp import estimators as E
from tokenmdp.estimators import SequenceCount
from tokenmdp.exact import LogLinearPolicy, TabularPolicy, TokenMDP, inference_copy, stale_copy
from tokenmdp.exact.lab import exchangeability as EX
from tokenmdp.exact.lab._world_tables import WorldTables
from tokenmdp.exact.lab.exchangeability import others_counts_matter, reduces_to_types
from tokenmdp.exact.lab.group_draws import _row_ids
from tokenmdp.exact.lab.moments import MomentsWorkspace, moments
from tokenmdp.exact.lab.step_gradients import StepGradients
from tokenmdp.exact.world.rewards import ExactMatch, LengthReward, Parity, TokenCount
from tokenmdp.testing.strategies import estimators, mdps

#: float64 round-off of the same sums taken over other packings or orders.
EXACT_TOL = 1e-12
#: dropping the counts where they matter moves the mean by far more than round-off.
BROKEN_GAP = 1e-6
TYPED = tuple(n for n in E.names() if reduces_to_types(E.get(n)))


def world(mdp, seed=4):
    pi = make_policy(TabularPolicy, mdp, seed=seed)
    away = torch.randn(pi.table.numel(), generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)          # not ∇J, which a constant reward zeroes
    old = stale_copy(mdp, pi, direction=away, distance=0.4)
    mu = inference_copy(old, noise_std=0.4, generator=torch.Generator().manual_seed(seed + 1))
    return pi, dict(behavior=mu, old=old, reference=old)


@pytest.fixture(scope="module")
def scenario():
    """Two prompts, responses of 1-3 tokens, a reward that is not a function of the length."""
    mdp = TokenMDP(3, 3, LengthReward(0.0, content=ExactMatch((0, 1, 2))),
                   prompts=[(0,), (1,)], prompt_probs=[0.3, 0.7])
    return (mdp, *world(mdp))


def assert_same(a, b, tol=EXACT_TOL):
    torch.testing.assert_close(a.mean, b.mean, rtol=0, atol=tol)
    assert abs(a.total_variance - b.total_variance) <= tol * max(1.0, b.total_variance)
    if b.covariance is not None:
        torch.testing.assert_close(a.covariance, b.covariance, rtol=0, atol=tol)


def full_types(monkeypatch):
    """The exchangeability method with the counted tokens always in the types (before)."""
    monkeypatch.setattr(EX, "others_counts_matter", lambda estimator: True)


@pytest.mark.parametrize("name", TYPED)
def test_reduced_types_equal_the_full_types(scenario, name, monkeypatch):
    mdp, pi, kw = scenario
    est = E.get(name)
    fast = moments(mdp, pi, est, group_size=3, method="exchangeability", **kw)
    with monkeypatch.context() as m:
        full_types(m)
        full = moments(mdp, pi, est, group_size=3, method="exchangeability", **kw)
    assert_same(fast, full)
    if not others_counts_matter(est):      # fewer types: fewer batches
        assert fast.num_draws < full.num_draws
    assert full.mean.norm() > 1e-6


def test_dropping_the_counts_where_they_matter_is_caught(scenario, monkeypatch):
    mdp, pi, kw = scenario
    est = E.get("dapo")                     # token mean: N_tokens counts the other samples
    exact = moments(mdp, pi, est, group_size=3, method="enumeration", **kw)
    assert_same(moments(mdp, pi, est, group_size=3, method="exchangeability", **kw), exact)
    monkeypatch.setattr(EX, "others_counts_matter", lambda estimator: False)
    broken = moments(mdp, pi, est, group_size=3, method="exchangeability", **kw)
    assert float((broken.mean - exact.mean).abs().max()) > BROKEN_GAP


@pytest.mark.parametrize("name", ["reinforce_pp_baseline", "opo"])
@pytest.mark.parametrize("aggregation", ["SEQUENCE_MEAN_TOKEN_SUM", "CONSTANT"])
def test_a_length_aware_advantage_keeps_the_counts(scenario, name, aggregation):
    """Its baseline reads the others' lengths even where the aggregation does not."""
    mdp, pi, kw = scenario
    est = E.get(name).replace(aggregation=E.Aggregation[aggregation])
    assert others_counts_matter(est)
    assert_same(moments(mdp, pi, est, group_size=3, method="exchangeability", **kw),
                moments(mdp, pi, est, group_size=3, method="enumeration", **kw), tol=1e-11)


def test_which_estimators_keep_the_counts():
    assert not others_counts_matter(E.get("grpo"))
    assert not others_counts_matter(E.get("grpo_rs_seq"))     # its rejects leave |y_i| only
    assert not others_counts_matter(E.get("dr_grpo"))
    assert others_counts_matter(E.get("dapo"))                # N_tokens
    assert others_counts_matter(E.get("reinforce_pp_baseline"))   # a length-aware advantage
    assert others_counts_matter(E.get("grpo_opsm"))           # a prepare_step (wrapped)
    assert others_counts_matter(E.get("grpo").replace(
        sequence_count=SequenceCount.WITH_LOSS_TOKENS))      # S counts sequences with tokens
    assert others_counts_matter(E.get("grpo").replace(
        aggregation=E.Aggregation.PROMPT_MEAN_TOKEN_MEAN))


@settings(max_examples=30, deadline=None)
@given(mdps(max_vocab_size=3, max_len=3, max_prompts=2), st.sampled_from(TYPED),
       st.integers(2, 3), st.integers(0, 1000))
def test_reduced_types_on_generated_mdps(mdp, name, G, seed):
    pi, kw = world(mdp, seed)
    est = E.get(name)
    exact = moments(mdp, pi, est, group_size=G, method="enumeration", **kw)
    fast = moments(mdp, pi, est, group_size=G, method="exchangeability", **kw)
    with pytest.MonkeyPatch.context() as m:
        full_types(m)
        full = moments(mdp, pi, est, group_size=G, method="exchangeability", **kw)
    assert_same(fast, full)
    assert_same(fast, exact, tol=1e-11)


@settings(max_examples=40, deadline=None)
@given(mdps(max_vocab_size=3, max_len=3, max_prompts=2),
       st.sampled_from([Parity(1), TokenCount(0), ExactMatch((0, 1))]),
       estimators(names=TYPED, aggregations=tuple(E.Aggregation)),
       st.sampled_from(tuple(SequenceCount)), st.integers(0, 1000))
def test_reduced_types_under_any_aggregation(mdp, reward, est, count, seed):
    """The rule that drops the counts, on recombined parts (not only the registry's), with
    rewards that tie across lengths (so that types with and without the counts differ)."""
    mdp = TokenMDP(mdp.vocab_size, mdp.max_len, reward, prompts=mdp.prompts,
                   prompt_probs=mdp.prompt_probs.tolist())
    pi, kw = world(mdp, seed)
    est = est.replace(sequence_count=count)
    exact = moments(mdp, pi, est, group_size=3, method="enumeration", **kw)
    fast = moments(mdp, pi, est, group_size=3, method="exchangeability", **kw)
    assert_same(fast, exact, tol=1e-11)


def assert_identical(a, b):
    assert torch.equal(a.mean, b.mean) and a.total_variance == b.total_variance
    assert (a.covariance is None) == (b.covariance is None)
    assert a.covariance is None or torch.equal(a.covariance, b.covariance)
    assert torch.equal(a.true_gradient, b.true_gradient)
    assert (a.method, a.num_draws) == (b.method, b.num_draws)


def test_one_workspace_equals_one_call_per_estimator(scenario):
    mdp, pi, kw = scenario
    ws = MomentsWorkspace(mdp, pi, **kw)
    for name in E.names():
        for method in ("exact", "enumeration"):
            assert_identical(ws.moments(E.get(name), group_size=2, method=method),
                             moments(mdp, pi, E.get(name), group_size=2, method=method, **kw))
    mc = dict(group_size=3, method="monte_carlo", num_samples=64)
    a = ws.moments(E.get("grpo"), generator=torch.Generator().manual_seed(3), **mc)
    b = moments(mdp, pi, E.get("grpo"), generator=torch.Generator().manual_seed(3), **mc, **kw)
    assert_identical(a, b)
    assert torch.equal(a.mean_se, b.mean_se)


@settings(max_examples=15, deadline=None)
@given(mdps(max_vocab_size=3, max_len=2, max_prompts=2), st.integers(0, 1000))
def test_a_workspace_of_a_non_tabular_policy(mdp, seed):
    pi = make_policy(LogLinearPolicy, mdp, seed=seed)
    mu = inference_copy(pi, noise_std=0.3, generator=torch.Generator().manual_seed(seed))
    kw = dict(behavior=mu, reference=mu)
    ws = MomentsWorkspace(mdp, pi, **kw)
    for name in ("grpo", "dapo_tis", "gspo"):
        assert_identical(ws.moments(E.get(name), group_size=2),
                         moments(mdp, pi, E.get(name), group_size=2, **kw))


def test_a_policy_changed_in_place_rebuilds_the_tables(scenario, monkeypatch):
    mdp, _, _ = scenario
    pi, kw = world(mdp, seed=7)
    ws = MomentsWorkspace(mdp, pi, **kw)
    est = E.get("grpo")
    before = ws.moments(est, group_size=2)
    changes = [lambda: pi.table.mul_(1.5),                        # an in-place update
               lambda: pi.table.data[:, 0].add_(0.5),             # through .data: no _version
               lambda: kw["behavior"].noise.mul_(-1.0)]           # a buffer of the sampler
    for change in changes:
        with torch.no_grad():
            change()
        fresh = moments(mdp, pi, est, group_size=2, **kw)
        assert float((fresh.mean - before.mean).abs().max()) > BROKEN_GAP
        assert_identical(ws.moments(est, group_size=2), fresh)
        before = fresh
    monkeypatch.setattr(WorldTables, "current", lambda self: True)  # a workspace that missed it
    with torch.no_grad():
        pi.table.mul_(0.5)
    stale = ws.moments(est, group_size=2)
    assert float((stale.mean - moments(mdp, pi, est, group_size=2, **kw).mean).abs().max()) \
        > BROKEN_GAP


def test_a_given_jacobian_is_dropped_once_the_policy_changes():
    mdp = TokenMDP(3, 2, LengthReward(0.0, content=ExactMatch((0, 1))))
    pi = make_policy(LogLinearPolicy, mdp, seed=2)
    from tokenmdp.exact.lab.step_gradients import state_action_jacobian
    ws = MomentsWorkspace(mdp, pi, jacobian=state_action_jacobian(mdp, pi))
    est = E.get("reinforce")
    assert_identical(ws.moments(est, group_size=2), moments(mdp, pi, est, group_size=2))
    with torch.no_grad():
        pi.bias.add_(1.0)
    assert_identical(ws.moments(est, group_size=2), moments(mdp, pi, est, group_size=2))
    assert ws.jacobian is None


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), st.integers(0, 10_000))
def test_type_ids_column_by_column_equal_unique_rows(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-2, 3, (n, k), generator=g).to(torch.float64) / 4   # many ties
    assert torch.equal(_row_ids(keys), torch.unique(keys, dim=0, return_inverse=True)[1])


@pytest.mark.parametrize("name", E.names())
def test_the_loss_on_the_kept_sequences_only_gives_the_same_coefficients(scenario, name):
    mdp, pi, kw = scenario
    est = E.get(name)
    ws = MomentsWorkspace(mdp, pi, **kw)
    tables = ws._tables()
    steps = StepGradients(mdp, pi, est, tables.fields, 3, tables=tables.steps)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mdp.num_sequences, (40, 3), generator=g)
    keep = torch.rand(40, 3, generator=g) < 0.4
    draw, pair, coef = steps.coefficients(ids, per_sequence=True)
    kept = keep.reshape(-1)[draw]
    fast = steps.coefficients(ids, per_sequence=True, keep=keep)
    for a, b in zip(fast, (draw[kept], pair[kept], coef[kept])):
        assert torch.equal(a, b)
    assert kept.any() and not kept.all()
    first = steps.coefficients(ids, first_only=True)                 # the batch, not the slot
    fast = steps.coefficients(ids, first_only=True, keep=keep)
    only = keep[:, 0][first[0]]
    for a, b in zip(fast, (t[only] for t in first)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["grpo", "dapo_tis", "gspo"])
def test_small_blocks_of_sequences_give_the_same_moments(scenario, name, monkeypatch):
    mdp, pi, kw = scenario
    whole = moments(mdp, pi, E.get(name), group_size=3, method="exchangeability", **kw)
    monkeypatch.setattr(EX, "BLOCK_SEQUENCES", 7)               # two batches of 3 a block
    blocks = moments(mdp, pi, E.get(name), group_size=3, method="exchangeability", **kw)
    assert_same(blocks, whole)
    assert blocks.num_draws == whole.num_draws > 2
