"""Tree samplers and the exact tree law against independent computations: the response law of
the world (``sequence_probs``), the sampler's own frequencies (χ²), a plain-Python product of
token probabilities, and the two ways of computing the law."""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from tokenmdp.exact.branching.law import tree_law
from tokenmdp.exact.branching.sampler import TreeSample, sample_trees
from tokenmdp.exact.world.ground_truth import sequence_probs
from tokenmdp.tree_schedules import EntropyForks, FixedForks, RandomForks
from tokenmdp.trees import TREE_NODE, tree_structure

#: Sums of float64 probabilities over a few thousand trees.
PROB_TOL = 1e-12
#: χ² goodness of fit: reject only below this p-value (fixed seeds, so deterministic).
MIN_PVALUE = 1e-3
#: Expected count a χ² cell needs.
MIN_EXPECTED = 5.0

FIXED = [FixedForks((0,), (3,)), FixedForks((1,), (4,)), FixedForks((2,), (2,)),
         FixedForks((0, 2), (2, 2)), FixedForks((1, 2), (2, 2))]


def response_law(mdp, policy):
    """``D(x) μ(y|x)`` over the enumeration: the law one leaf should have."""
    return sequence_probs(mdp, policy).detach() * mdp.prompt_probs[mdp.terminal_prompt_index]


@pytest.mark.parametrize("schedule", FIXED, ids=str)
@pytest.mark.parametrize("sampler", ["pi", "mu"])
def test_every_slot_of_a_fixed_fork_tree_is_marginally_a_sample_of_the_sampler(
        mdp, schedule, sampler, request):
    policy = request.getfixturevalue(sampler)
    law = tree_law(mdp, policy, schedule)
    assert float(law.prob.sum()) == pytest.approx(1.0, abs=PROB_TOL)
    torch.testing.assert_close(law.leaf_marginal("slots"), response_law(mdp, policy),
                               rtol=0, atol=PROB_TOL)


def test_one_fork_level_makes_a_uniformly_picked_leaf_a_sample_too(mdp, pi):
    # one level: a tree has either B leaves or one that stands for all B, so 1/n = slots/G
    law = tree_law(mdp, pi, FixedForks((2,), (3,)))
    torch.testing.assert_close(law.leaf_marginal("leaves"), response_law(mdp, pi),
                               rtol=0, atol=PROB_TOL)


@pytest.mark.parametrize("schedule", [EntropyForks((1,), (3,)), RandomForks((2,), (1,))], ids=str)
def test_forks_chosen_after_the_chain_make_leaves_that_are_not_samples(mdp, pi, schedule):
    # the fork states depend on the chain drawn: the new branches' prefixes are not π-distributed
    law = tree_law(mdp, pi, schedule)
    gap = float((law.leaf_marginal("leaves") - response_law(mdp, pi)).abs().sum()) / 2
    assert gap > 0.01                                            # total variation


def test_recursion_and_replay_give_the_same_law(mdp, mu):
    for schedule in (FixedForks((1,), (3,)), FixedForks((0, 2), (2, 2))):
        a = tree_law(mdp, mu, schedule, method="recursion")
        b = tree_law(mdp, mu, schedule, method="replay")
        pa = {t.canonical(): float(p) for t, p in zip(a.trees, a.prob)}
        pb = {t.canonical(): float(p) for t, p in zip(b.trees, b.prob)}
        assert pa.keys() == pb.keys()
        assert max(abs(pa[k] - pb[k]) for k in pa) < PROB_TOL


@pytest.mark.parametrize("schedule", [FixedForks((1, 2), (2, 2)), EntropyForks((1,), (2,)),
                                      RandomForks((1, 1), (1, 1))], ids=str)
def test_sampled_trees_pass_chi_square_against_the_exact_law(mdp, mu, schedule):
    law = tree_law(mdp, mu, schedule)
    n = 20_000
    drawn = sample_trees(mdp, mu, schedule, n, generator=np.random.default_rng(0))
    index = {t.canonical(): i for i, t in enumerate(law.trees)}
    counts = np.zeros(law.num_trees)
    for g in drawn.grown:
        counts[index[g.canonical()]] += 1                # KeyError: a tree the law lacks
    expected = law.prob.numpy() * n
    big = expected >= MIN_EXPECTED                        # pool the rare trees into one cell
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    assert scipy.stats.chisquare(observed, expected).pvalue > MIN_PVALUE


def test_a_drawn_tree_has_the_probability_of_its_tokens(mdp, mu):
    drawn = sample_trees(mdp, mu, FixedForks((1,), (3,)), 50,
                         generator=torch.Generator().manual_seed(3))
    for g, tree, lp, p in zip(drawn.grown, drawn.trees, drawn.behavior_logprobs,
                              drawn.probability.tolist()):
        # plain Python: D(x) times μ of each node's token given its path
        prompt = g.prompt_index
        total = float(mdp.prompt_probs[prompt])
        for v, token in enumerate(tree.tokens):
            prefix = [tree.tokens[u] for u in tree.path(v)[:-1]]
            logits = mu.logits(torch.tensor([prompt]),
                               torch.tensor([prefix], dtype=torch.long).view(1, len(prefix)))
            logp = float(torch.log_softmax(logits, -1)[0, token])
            assert lp[v] == pytest.approx(logp, abs=1e-12)
            total *= math.exp(logp)
        assert p == pytest.approx(total, rel=1e-12)


def test_the_batch_is_one_group_per_tree_with_its_node_ids(mdp, mu):
    drawn = sample_trees(mdp, mu, FixedForks((1,), (2,)), 30,
                         generator=torch.Generator().manual_seed(4))
    batch = drawn.batch()
    mdp.check_batch(batch)
    structure = tree_structure(batch)
    assert structure.num_nodes == sum(len(t.tokens) + len(t.prompt) for t in drawn.trees)
    assert int(drawn.generated_tokens.sum()) == sum(len(t.tokens) for t in drawn.trees)
    assert batch.num_sequences == sum(len(t.leaves) for t in drawn.trees)
    assert TREE_NODE in batch.token_extras


def test_leaves_are_correlated_through_the_shared_prefix(mdp, pi):
    # E[R_1 R_2] − E[R_1] E[R_2] over two-leaf trees: 0 for an i.i.d. pair, > 0 after a shared
    # first token (both leaves' rewards depend on it)
    def reward_covariance(schedule):
        law = tree_law(mdp, pi, schedule)
        rewards = mdp.rewards
        e12 = e1 = 0.0
        for t, p in zip(law.trees, law.prob.tolist()):
            leaves = t.leaves()
            r = [float(rewards[t.leaf_row[v]]) for v in leaves]
            r = r if len(r) == 2 else r * 2                  # one leaf stands for both slots
            e12 += p * r[0] * r[1]
            e1 += p * (r[0] + r[1]) / 2
        return e12 - e1 * e1

    iid = reward_covariance(FixedForks((0,), (2,)))
    # the i.i.d. pair: the covariance of two draws from one prompt is the variance of the
    # prompt's mean reward, not 0 (two prompts); the shared prefix adds to it
    assert reward_covariance(FixedForks((1,), (2,))) > iid + 1e-3
    assert reward_covariance(FixedForks((2,), (2,))) > reward_covariance(FixedForks((1,), (2,)))


def test_samples_are_reproducible_from_the_generator(mdp, mu):
    a = sample_trees(mdp, mu, EntropyForks((1,), (2,)), 20, generator=np.random.default_rng(7))
    b = sample_trees(mdp, mu, EntropyForks((1,), (2,)), 20, generator=np.random.default_rng(7))
    assert [t.canonical() for t in a.grown] == [t.canonical() for t in b.grown]


def test_entropy_forks_fork_at_the_chains_highest_entropy_state(mdp, mu):
    # plain recomputation: H(μ(·|s)) from the world's state log-probs, over the chain's states
    from tokenmdp.exact.world.ground_truth import state_logprobs
    levels = [lp.detach() for lp in state_logprobs(mdp, mu)]
    drawn = sample_trees(mdp, mu, EntropyForks((1,), (2,)), 200,
                         generator=torch.Generator().manual_seed(6))
    b = mdp.branching
    for g in drawn.grown:
        chain = g.path(g.leaves()[0])                  # the first chain: nodes 0 .. its leaf
        assert chain == list(range(len(chain)))
        code, states = 0, [(0, 0)]                      # (depth, code) of the prompt, then nodes
        for v in chain[:-1]:
            code = code * b + g.tokens[v]
            states.append((g.depth[v], code))
        ent = [float(-(levels[k][g.prompt_index, c].exp() * levels[k][g.prompt_index, c]).sum())
               for k, c in states]
        forked = [v for v in [-1] + chain[:-1] if g.parent.count(v) > 1]
        assert len(forked) == 1
        best = max(range(len(ent)), key=lambda i: (ent[i], -i))   # ties: the shallower
        assert forked[0] == best - 1


def relabel(node_RC):
    """Each row's real node ids, renamed in order of first appearance."""
    names = {}
    return [[names.setdefault(int(v), len(names)) for v in row if v >= 0]
            for row in node_RC]


def test_the_lab_lays_each_tree_out_as_its_expanded_batch(mdp, pi, mu):
    # the stacked batch's node ids (one block of many trees) against batch_from_trees, tree by tree
    from tokenmdp.estimators import get
    from tokenmdp.exact.branching.gradients import TreeStepGradients, pack
    from tokenmdp.exact.lab._world_tables import WorldTables
    drawn = sample_trees(mdp, mu, FixedForks((0, 1), (2, 2)), 40,
                         generator=torch.Generator().manual_seed(8))
    tables = WorldTables(mdp, pi, mu, mu, None, None)
    for n, (packed, index) in pack(drawn.grown, mdp.max_len).items():
        steps = TreeStepGradients(mdp, pi, get("reinforce"), tables.fields, n,
                                  tables=tables.steps)
        steps._nodes = packed[:, n:].reshape(-1, mdp.max_len)
        batch, _ = steps._stacked(packed[:, :n])
        got = tree_structure(batch)
        for d, i in enumerate(index.tolist()):
            one = tree_structure(TreeSample(mdp, drawn.schedule, (drawn.grown[i],)).batch())
            mine = relabel(got.node_RC[d * n:(d + 1) * n])
            # same partition of the tokens into nodes (ids up to renaming), sequence by sequence
            assert mine == relabel(one.node_RC)
        assert got.num_nodes == sum(len(drawn.grown[i].tokens) + len(drawn.trees[i].prompt)
                                    for i in index.tolist())
