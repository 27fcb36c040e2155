"""Tutorial 11's computations and tables: branching rollouts on the course's exact MDP.

* :func:`score_matrix` — ``σ(y) = ∇_θ log π(y | x)`` of every enumerated response, one row each;
* :func:`leaf_weights` — the weight of each leaf of a grown tree in a leaf-level estimate:
  ``1/n`` (the leaves averaged) or its *slots* over ``G`` (the splitting weights);
* :func:`leaf_reinforce` — ``ĝ = Σ_leaves w_leaf R(y_leaf) σ(y_leaf)`` of every tree of a law
  or a sample, and :func:`exact_leaf_moments` / :func:`sampled_leaf_moments` — its mean and
  total variance exactly, or with standard errors;
* :func:`prompt_state_mask` — which parameters of a tabular policy belong to the prompt states
  (the stem's first token);
* :func:`tree_text` — one response tree drawn as indented text;
* :func:`budget_table` — estimators on trees and i.i.d. groups at equal generated-token budget.

The figures are :mod:`~tokenmdp.course.tutorials.t11_figures`'. Each function computes only
what the tutorial shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from tokenmdp.course.display import Printout
from tokenmdp.exact import TokenMDP
from tokenmdp.exact.branching import TreeWorkspace, at_budget, compare_at_budget
from tokenmdp.exact.branching.law import slots
from tokenmdp.reports.comparison import summary_row
from tokenmdp.trees import ResponseTree

__all__ = ["LeafMoments", "budget_table", "exact_leaf_moments", "leaf_reinforce",
           "leaf_weight_matrix", "leaf_weights", "prompt_state_mask", "sampled_leaf_moments",
           "score_matrix", "tree_text"]

WEIGHTS = ("leaves", "slots")


def score_matrix(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """``σ(y) = ∇_θ log π(y | x)`` of every response of ``mdp.enumerate()``, one row each.

    Parameters
    ----------
    mdp : TokenMDP
    policy : policy module
        Float64; its parameters in ``policy.parameters()`` order are the columns.

    Returns
    -------
    Tensor ``[N, P]``
        Float64, detached.
    """
    params = [p for p in policy.parameters() if p.requires_grad]
    logp_N = policy.token_logprobs(mdp.enumerate()).sum(-1)
    rows = []
    for i in range(logp_N.shape[0]):
        grads = torch.autograd.grad(logp_N[i], params, retain_graph=i + 1 < logp_N.shape[0])
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows).detach()


def leaf_weights(schedule, tree, weights: str) -> list[tuple[int, float]]:
    """``(enumeration row, weight)`` of each leaf of a grown tree.

    Parameters
    ----------
    schedule : FixedForks, RandomForks or EntropyForks
        The tree's schedule.
    tree : Grown
        A tree of a :class:`~tokenmdp.exact.branching.TreeLaw` or a
        :class:`~tokenmdp.exact.branching.TreeSample` (``.grown``).
    weights : {"leaves", "slots"}
        ``"leaves"``: ``1/n`` for the tree's ``n`` leaves, as a sequence mean over the leaves
        weighs them; ``"slots"``: the nominal leaves the leaf stands for over ``G``
        (:func:`tokenmdp.exact.branching.law.slots`; 1 for every leaf of a schedule of rounds).

    Returns
    -------
    list of (int, float)
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {WEIGHTS}, got {weights!r}")
    leaves = tree.leaves()
    G = schedule.leaves
    return [(tree.leaf_row[v], 1 / len(leaves) if weights == "leaves"
             else slots(schedule, tree, v) / G) for v in leaves]


def leaf_reinforce(trees, schedule, scores_NP: torch.Tensor, rewards_N: torch.Tensor,
                   weights: str) -> torch.Tensor:
    """Leaf-level REINFORCE ``ĝ = Σ_leaves w R(y) σ(y)`` of every tree.

    Parameters
    ----------
    trees : sequence of Grown
    schedule : FixedForks, RandomForks or EntropyForks
        The trees' schedule.
    scores_NP : Tensor ``[N, P]``
        :func:`score_matrix`.
    rewards_N : Tensor ``[N]``
        ``R`` of every enumerated response (``mdp.rewards``).
    weights : {"leaves", "slots"}
        :func:`leaf_weights`.

    Returns
    -------
    Tensor ``[T, P]``
        One gradient per tree.
    """
    return (leaf_weight_matrix(trees, schedule, scores_NP.shape[0], weights) * rewards_N) \
        @ scores_NP


def leaf_weight_matrix(trees, schedule, num_responses: int, weights: str) -> torch.Tensor:
    """``W[k, y]``: the total weight of the leaves of tree ``k`` whose response is ``y``
    (:func:`leaf_weights`); its mean over a sample estimates the leaf law, row by row.

    Parameters
    ----------
    trees : sequence of Grown
    schedule : FixedForks, RandomForks or EntropyForks
        The trees' schedule.
    num_responses : int
        ``N``, the rows of ``mdp.enumerate()``.
    weights : {"leaves", "slots"}
        :func:`leaf_weights`.

    Returns
    -------
    Tensor ``[T, N]``
        Float64.
    """
    W_TN = torch.zeros(len(trees), num_responses, dtype=torch.float64)
    for k, tree in enumerate(trees):
        for row, w in leaf_weights(schedule, tree, weights):
            W_TN[k, row] += w
    return W_TN


class LeafMoments(NamedTuple):
    """Mean and total variance of a per-tree gradient, against ``∇J``.

    Parameters
    ----------
    mean : Tensor ``[P]``
    mean_se : Tensor ``[P]`` or None
        Monte Carlo: the standard error of each component (None when exact).
    total_variance : float
        ``tr Cov[ĝ]``.
    relative_bias : float
        ``‖E ĝ − ∇J‖ / ‖∇J‖``.
    """

    mean: torch.Tensor
    mean_se: torch.Tensor | None
    total_variance: float
    relative_bias: float


def _summary(mean, se, second, true_grad) -> LeafMoments:
    total = float(second - mean @ mean)
    bias = float((mean - true_grad).norm() / true_grad.norm())
    return LeafMoments(mean, se, total, bias)


def exact_leaf_moments(law, scores_NP, rewards_N, true_grad, weights: str) -> LeafMoments:
    """Leaf-level REINFORCE's exact moments over a :class:`~tokenmdp.exact.branching.TreeLaw`.

    Parameters
    ----------
    law : TreeLaw
        The trees and their probabilities.
    scores_NP : Tensor ``[N, P]``
        :func:`score_matrix`.
    rewards_N : Tensor ``[N]``
        ``R`` of every enumerated response.
    true_grad : Tensor ``[P]``
        ``∇J``.
    weights : {"leaves", "slots"}
        :func:`leaf_weights`.

    Returns
    -------
    LeafMoments
        No standard errors (``mean_se`` None).
    """
    g_TP = leaf_reinforce(law.trees, law.schedule, scores_NP, rewards_N, weights)
    p = law.prob
    return _summary(p @ g_TP, None, p @ (g_TP * g_TP).sum(1), true_grad)


def sampled_leaf_moments(sample, scores_NP, rewards_N, true_grad, weights: str) -> LeafMoments:
    """Leaf-level REINFORCE's Monte Carlo moments over a
    :class:`~tokenmdp.exact.branching.TreeSample`, with standard errors.

    Parameters
    ----------
    sample : TreeSample
        Trees drawn by :func:`~tokenmdp.exact.branching.sample_trees`.
    scores_NP : Tensor ``[N, P]``
        :func:`score_matrix`.
    rewards_N : Tensor ``[N]``
        ``R`` of every enumerated response.
    true_grad : Tensor ``[P]``
        ``∇J``.
    weights : {"leaves", "slots"}
        :func:`leaf_weights`.

    Returns
    -------
    LeafMoments
        The sample mean with its standard errors, the sample's second moment less the
        squared mean.
    """
    g_TP = leaf_reinforce(sample.grown, sample.schedule, scores_NP, rewards_N, weights)
    n = g_TP.shape[0]
    mean = g_TP.mean(0)
    se = g_TP.std(0) / n ** 0.5
    return _summary(mean, se, (g_TP * g_TP).sum(1).mean(), true_grad)


def prompt_state_mask(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """The logits of the prompt states (no response token yet) of a tabular policy.

    Parameters
    ----------
    mdp : TokenMDP
    policy : TabularPolicy
        Its states are numbered level by level, the prompts' first.

    Returns
    -------
    BoolTensor ``[P]``
        In ``policy.parameters()`` order.
    """
    table = policy.table
    mask = torch.zeros(table.shape, dtype=torch.bool)
    mask[:mdp.num_prompts] = True
    return mask.reshape(-1)


def tree_text(tree: ResponseTree, *, eos: int | None = None) -> str:
    """One tree as indented text: a node per line, ``(k leaves)`` beside a shared node.

    Parameters
    ----------
    tree : ResponseTree
    eos : int, optional
        The EOS token, written ``EOS``.

    Returns
    -------
    str
    """
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parent):
        children.setdefault(p, []).append(i)
    below: dict[int, int] = {}
    for leaf in tree.leaves:
        for v in tree.path(leaf):
            below[v] = below.get(v, 0) + 1
    reward = dict(zip(tree.leaves, tree.reward or ()))
    lines = [f"prompt {list(tree.prompt)}"]

    def visit(node: int, indent: int) -> None:
        token = "EOS" if node >= 0 and tree.tokens[node] == eos else str(tree.tokens[node])
        note = f"  ({below[node]} leaves)" if below[node] > 1 else ""
        if node in reward:
            note += f"  R = {reward[node]:g}"
        lines.append("  " * indent + f"└ {token}{note}")
        for child in children.get(node, []):
            visit(child, indent + 1)

    for child in children.get(-1, []):
        visit(child, 1)
    return "\n".join(lines)


def budget_table(workspace: TreeWorkspace, names: Sequence[str], draws: Sequence,
                 multiples: Sequence[int] = (1, 16)) -> Printout:
    """Each estimator on each draw: bias, variance, cost and ``MSE(c*)`` at equal budgets.

    The budget is ``B`` = the generated tokens of an i.i.d. group of 4 (``4 E_μ|y|``), times each
    of ``multiples``; ``MSE(c*)`` is that of the mean of ``budget / cost`` steps after the best
    rescaling (:func:`tokenmdp.reports.comparison.summary_row`), and ``vs iid`` divides it by
    that of the same estimator on an i.i.d. group of 4 at the same budget (``< 1``: the draw wins).

    Parameters
    ----------
    workspace : TreeWorkspace
    names : sequence of str
        Registry names.
    draws : sequence of int or schedule
        ``4`` (the i.i.d. group) first, then schedules.
    multiples : sequence of int
        Budgets in units of ``B``.

    Returns
    -------
    Printout
        Rows ``(estimator, draw, rel. bias, cosine, var/step, generated tokens, var·tokens,
        MSE(c*) at each budget, vs iid at each budget)``.
    """
    budget = 4 * workspace.mean_length
    rows = []
    for row in compare_at_budget(workspace, names, draws, budget=budget):
        s = row.step
        mse = [summary_row(row.estimator, at_budget(s, k * budget))["mse_c_star"]
               for k in multiples]
        rows.append([row.estimator, row.draw, s.relative_bias, s.cosine, s.total_variance,
                     s.generated_tokens, s.total_variance * s.generated_tokens, *mse])
    base = {r[0]: r[7:] for r in rows if r[1].startswith("iid")}
    for r in rows:
        r.extend(m / b for m, b in zip(r[7:7 + len(multiples)], base[r[0]]))
    head = (f"{'estimator':>16} {'draw':>14} {'rel.bias':>8} {'cosine':>7} {'var/step':>9} "
            f"{'tokens':>7} {'var·tok':>8}"
            + "".join(f" {f'MSE@{k}B':>9}" for k in multiples)
            + "".join(f" {f'vs iid@{k}B':>10}" for k in multiples))
    lines = [f"B = {budget:.4f} generated tokens (an i.i.d. group of 4); "
             f"‖∇J‖² = {float(workspace.tables.true_grad.square().sum()):.4g}", head]
    for r in rows:
        lines.append(f"{r[0]:>16} {r[1]:>14} {r[2]:>8.4f} {r[3]:>7.4f} {r[4]:>9.4g} {r[5]:>7.3f} "
                     f"{r[6]:>8.4g}" + "".join(f" {m:>9.4g}" for m in r[7:7 + len(multiples)])
                     + "".join(f" {v:>10.3f}" for v in r[7 + len(multiples):]))
    headers = ["estimator", "draw", "relative_bias", "cosine", "total_variance",
               "generated_tokens", "variance_times_tokens",
               *(f"mse_c_star_{k}B" for k in multiples), *(f"vs_iid_{k}B" for k in multiples)]
    return Printout("\n".join(lines), [tuple(r) for r in rows], headers)
