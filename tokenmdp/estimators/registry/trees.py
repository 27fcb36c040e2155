"""Registry entries for branching (tree) rollouts: estimators that need a tree batch.

A tree batch (:mod:`tokenmdp.trees`) holds one sequence per leaf, root-to-leaf, with
``token_extras['tree_node']`` naming each token's node; build one with
:func:`tokenmdp.trees.batch_from_trees`. Every entry here reads the node ids and refuses a batch
without them, so :func:`~tokenmdp.estimators.names` lists them only when asked
(``names(trees=True)``, or ``trees=None`` for every entry).

**The weight of a shared-prefix token.** Every entry here aggregates over the *expanded* paths:
a token of node ``n`` appears once in each of its ``|L(n)|`` paths and its loss weight is the
sum over them (the packed tree, each node once, reproduces that sum with per-token weights). So
under ``seq-mean-token-sum`` a node's gradient weight is ``Σ_{i ∈ L(n)} A_{i,t}/S`` and under
``token-mean`` it is ``Σ_{i ∈ L(n)} A_{i,t}/N`` with ``N`` the expanded token count. A node's
advantage is the same in every path for the node-value parts, so its weight is ``|L(n)|`` times a
path's. TreeRL trains on the expanded paths and damps that factor to ``sqrt(|L(n)|)`` by its
reweighting; none of these entries counts each node once.
"""

from __future__ import annotations

from tokenmdp.estimators.advantages.group import GroupNormalized, LeaveOneOut
from tokenmdp.estimators.advantages.tree import NodeValueDifference, ReturnMinusNodeValue, TreeLeaves
from tokenmdp.estimators.advantages.tree_credit import TreeRLAdvantage, VinePPOTree
from tokenmdp.estimators.aggregation import Aggregation
from tokenmdp.estimators.estimator import Estimator

# every earlier entry first: the registry lists entries in registration order
from tokenmdp.estimators.registry import baselines  # noqa: F401  (its entries are registered first)
from tokenmdp.estimators.registry.entry import _register
from tokenmdp.estimators.surrogates.clipped import PPOClip
from tokenmdp.estimators.surrogates.token import Reinforce

_EXPANDED = ("a shared token counts once per leaf below it (the sum over its paths), "
             "{agg} over the expanded paths")


@_register("tree_grpo", formula="-1/S Σ_i 1/|y_i| Σ_t min(r Â_i, clip(r) Â_i), Â_i = (R_i - "
                                "mean_tree R)/std_tree R over the tree's leaves i",
           paper="Shao et al. (GRPO), arXiv 2402.03300, on a tree's leaves as in TreeRL's "
                 "ChainRL-vs-tree comparison (Hou et al., arXiv 2506.11902)",
           aliases="-- (GRPO on the root-to-leaf paths of a tree rollout; "
                   + _EXPANDED.format(agg="seq-mean-token-mean") + ")")
def tree_grpo() -> Estimator:
    """GRPO over a tree's leaves: each leaf's group mean/std advantage (sample std, ε 1e-6) on
    every token of its path, PPO clip 0.2, sequence-mean of token means over the expanded paths
    (a shared token's weight is the sum over its leaves), no KL."""
    return Estimator(name="tree_grpo", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=TreeLeaves(GroupNormalized(ddof=1, eps=1e-6)),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)


@_register("tree_rloo", formula="-1/S Σ_i Σ_t (R_i - mean_{j≠i} R_j) log π(y_it), i, j the "
                                "tree's leaves",
           paper="Kool et al. 2019 (ICLR DeepRLStructPred); Ahmadian et al., arXiv 2402.14740; "
                 "on a tree's leaves",
           aliases="-- (RLOO on the root-to-leaf paths of a tree rollout; "
                   + _EXPANDED.format(agg="seq-mean-token-sum") + ")")
def tree_rloo() -> Estimator:
    """RLOO over a tree's leaves: the leave-one-out baseline from the other leaves (correlated
    with the path through shared prefixes, so no longer independent of it), weighted NLL,
    sequence-mean of token sums over the expanded paths."""
    return Estimator(name="tree_rloo", surrogate=Reinforce(), advantage=TreeLeaves(LeaveOneOut()),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("tree_value_diff", formula="-1/S Σ_i Σ_t [V̂(n_it) - V̂(p(n_it))] log π(y_it), "
                                      "V̂(n) = mean_{j ∈ L(n)} R_j",
           paper="Schulman et al., arXiv 1506.02438, Eq. 10 (γ = λ = 1), with TreeRL's node "
                 "values (Hou et al., arXiv 2506.11902, Sec. 3.2)",
           aliases="-- (" + _EXPANDED.format(agg="seq-mean-token-sum")
                   + "; the advantage is zero except at a branch's first token)")
def tree_value_diff() -> Estimator:
    """Node-value differences: token t's advantage is ``V̂(s_{t+1}) - V̂(s_t)``, the values the
    mean returns of the leaves below each prefix; weighted NLL, sequence-mean of token sums over
    the expanded paths (a node's weight is ``|L(n)|/S`` times its one advantage)."""
    return Estimator(name="tree_value_diff", surrogate=Reinforce(),
                     advantage=NodeValueDifference(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("tree_return_minus_value",
           formula="-1/S Σ_i Σ_t [R_i - V̂(p(n_it))] log π(y_it), V̂(n) = mean_{j ∈ L(n)} R_j",
           paper="Williams 1992, Machine Learning 8:229 (a state-value baseline), with TreeRL's "
                 "node values (Hou et al., arXiv 2506.11902, Sec. 3.2)",
           aliases="-- (" + _EXPANDED.format(agg="seq-mean-token-sum") + ")")
def tree_return_minus_value() -> Estimator:
    """Return minus node value: token t's advantage is ``R_i - V̂(s_t)``, the baseline the mean
    return of the leaves below the prefix before t (the tree's mean at the first token); weighted
    NLL, sequence-mean of token sums over the expanded paths."""
    return Estimator(name="tree_return_minus_value", surrogate=Reinforce(),
                     advantage=ReturnMinusNodeValue(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("treerl", formula="-1/N Σ_i Σ_t min(r Â_it, clip(r) Â_it), Â_it = [(V̂(n) - V̂(root))"
                             " + (V̂(n) - V̂(p_seg(n)))] / sqrt|L(n)|, n = n_it",
           paper="Hou et al. (TreeRL), arXiv 2506.11902, Eqs. 2-4 (global and local "
                 "advantage, their sum) and its 1/sqrt|L(s_n)| leaf-count reweighting",
           aliases="THUDM/TreeRL (its EPTree code centres each leaf's reward by the mean of the "
                   "other leaves before averaging up the tree, and its training scripts pass "
                   "use_state_value_reward, which adds V̂(n) to the process reward: neither is "
                   "this entry); "
                   + _EXPANDED.format(agg="token-mean")
                   + ", the 1/sqrt|L(n)| factor damping a shared token's total weight to "
                   "sqrt|L(n)| times a path's")
def treerl() -> Estimator:
    """TreeRL: each token gets its segment's global plus local advantage divided by the square
    root of its leaf count, PPO clip 0.2, token mean over the expanded paths (this entry's
    choice of normalizer), no KL."""
    return Estimator(name="treerl", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=TreeRLAdvantage(reweight=True),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("vineppo_tree", formula="-1/N Σ_i Σ_t min(r Â_it, clip(r) Â_it), Â_it = V̂_{-i}(n_it)"
                                   " - V̂_{-i}(p(n_it)), V̂_{-i}(n) = mean_{j ∈ L(n), j≠i} R_j "
                                   "(R_i if L(n) = {i})",
           paper="Kazemnejad et al. (VinePPO), arXiv 2410.01679, with the continuations of a "
                 "tree as its Monte Carlo rollouts",
           aliases="-- (VinePPO samples K extra continuations per state and does not train on "
                   "them; here the values come from the tree's other leaves, which are trained "
                   "on; " + _EXPANDED.format(agg="token-mean") + ")")
def vineppo_tree() -> Estimator:
    """VinePPO-style values on a tree: token t's advantage is ``V̂(s_{t+1}) - V̂(s_t)``, each
    value the mean return of the *other* leaves below the prefix; PPO clip 0.2 (the paper's),
    token mean over the expanded paths, no KL."""
    return Estimator(name="vineppo_tree", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=VinePPOTree(), aggregation=Aggregation.TOKEN_MEAN)
