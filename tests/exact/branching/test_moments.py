"""Tree moments against independent computations: the lab's i.i.d. moments (the degenerate
tree), Monte Carlo over sampled trees, and a gradient taken by autograd on the expanded batch."""

import pytest
import torch

from tokenmdp.estimators import get, loss, names, prepare
from tokenmdp.exact import moments
from tokenmdp.exact.branching.gradients import pack
from tokenmdp.exact.branching.moments import TreeWorkspace, at_budget, tree_moments
from tokenmdp.exact.branching.sampler import TreeSample, sample_trees
from tokenmdp.exact.world.ground_truth import flat_grad
from tokenmdp.tree_schedules import EntropyForks, FixedForks

#: The degenerate tree and the lab's enumeration sum the same float64 terms in other orders.
EXACT_TOL = 1e-12
#: Monte Carlo against exact: this many standard errors, plus round-off (coordinates whose
#: gradient is identically zero have a standard error of round-off size).
MC_SIGMAS = 5.0
MC_ATOL = 1e-10
LEAF_LEVEL = ("reinforce", "rloo", "grpo", "dr_grpo")


def _every_name():
    try:
        return names(trees=None)            # the tree entries are listed only when asked
    except TypeError:
        return names()


TREE_ENTRIES = tuple(n for n in ("tree_rloo", "tree_value_diff", "treerl") if n in _every_name())


@pytest.fixture
def stale_ws(mdp, pi, old, mu):
    return TreeWorkspace(mdp, pi, behavior=mu, old=old, reference=old)


@pytest.mark.parametrize("name", LEAF_LEVEL)
@pytest.mark.parametrize("G", [2, 3])
def test_the_root_fork_is_an_iid_group(mdp, pi, old, mu, stale_ws, name, G):
    tree = stale_ws.moments(name, FixedForks((0,), (G,)), method="exact")
    iid = moments(mdp, pi, get(name), group_size=G, behavior=mu, old=old, reference=old,
                  method="enumeration")
    torch.testing.assert_close(tree.mean, iid.mean, rtol=0, atol=EXACT_TOL)
    torch.testing.assert_close(tree.covariance, iid.covariance, rtol=0, atol=EXACT_TOL)
    assert tree.total_variance == pytest.approx(iid.total_variance, abs=EXACT_TOL)
    # cost: an i.i.d. group generates Σ|y_i|
    assert tree.generated_tokens == pytest.approx(stale_ws.iid(name, G).generated_tokens,
                                                  rel=EXACT_TOL)


@pytest.mark.parametrize("schedule", [FixedForks((1, 2), (2, 2)), EntropyForks((1,), (2,))],
                         ids=str)
@pytest.mark.parametrize("name", ("reinforce", "rloo") + TREE_ENTRIES[:1])
def test_exact_tree_moments_agree_with_monte_carlo(stale_ws, schedule, name):
    exact = stale_ws.moments(name, schedule, method="exact")
    mc = stale_ws.moments(name, schedule, method="monte_carlo", num_samples=6000,
                          generator=torch.Generator().manual_seed(0))
    assert exact.method == "enumeration" and mc.method == "monte_carlo"
    assert ((mc.mean - exact.mean).abs() <= MC_SIGMAS * mc.mean_se + MC_ATOL).all()
    assert abs(mc.total_variance - exact.total_variance) <= MC_SIGMAS * mc.total_variance_se
    assert abs(mc.generated_tokens - exact.generated_tokens) <= \
        MC_SIGMAS * mc.generated_tokens_se
    assert abs(mc.skipped - exact.skipped) <= MC_SIGMAS * (exact.skipped / 6000) ** 0.5 + 1e-12


@pytest.mark.parametrize("name", ("reinforce", "rloo", "grpo") + TREE_ENTRIES)
def test_a_tree_gradient_is_autograd_on_its_expanded_batch(mdp, pi, old, mu, stale_ws, name):
    # independent path: ResponseTree -> batch_from_trees -> prepare, loss, backward through π
    est = get(name)
    drawn = sample_trees(mdp, mu, FixedForks((1,), (3,)), 12,
                         generator=torch.Generator().manual_seed(5))
    by_leaves = pack(drawn.grown, mdp.max_len)
    for n, (packed, index) in by_leaves.items():
        if n == 1 and name == "rloo":
            continue
        lab = stale_ws._gradients(est, n)(packed)
        for row, i in enumerate(index.tolist()):
            one = TreeSample(mdp, drawn.schedule, (drawn.grown[i],))
            batch = one.batch()
            with torch.no_grad():
                batch = batch.replace(old_logprob=old.token_logprobs(batch),
                                      ref_logprob=old.token_logprobs(batch))
            batch = prepare(batch, est, max_len=mdp.max_len)
            value, _ = loss(pi.token_logprobs(batch), batch, est, metrics=False)
            torch.testing.assert_close(lab[row], -flat_grad(value, pi), rtol=0, atol=EXACT_TOL)


def test_one_fork_level_keeps_reinforce_unbiased_and_cuts_rloo_credit(mdp, pi):
    ws = TreeWorkspace(mdp, pi, reference=pi)
    assert ws.moments("reinforce", FixedForks((1,), (4,))).relative_bias < EXACT_TOL
    # leaf-level RLOO on a tree: the advantages of the leaves below a shared node sum to zero,
    # so the shared first token gets no gradient: biased
    rloo = ws.moments("rloo", FixedForks((1,), (4,)))
    iid = ws.iid("rloo", 4, method="enumeration")
    assert iid.relative_bias < EXACT_TOL < 0.1 < rloo.relative_bias


def test_at_budget_scales_the_variance_by_the_cost(mdp, pi):
    m = tree_moments(mdp, pi, "reinforce", FixedForks((1,), (2,)))
    half = at_budget(m, 2 * m.generated_tokens)
    assert half.total_variance == pytest.approx(m.total_variance / 2, rel=EXACT_TOL)
    torch.testing.assert_close(half.mean, m.mean)
    assert half.generated_tokens == 2 * m.generated_tokens and half.leaves == 2 * m.leaves
