"""The exact law of a schedule's trees: every tree (up to the order of siblings) with its
probability.

Two ways, one answer:

* ``"replay"`` — any schedule: :func:`~tokenmdp.exact.branching.process.every_run` runs the
  sampler's own process once per sequence of choices of positive probability, and trees equal
  up to the order of siblings (:meth:`Grown.canonical <tokenmdp.exact.branching.process.Grown.canonical>`)
  are merged, their probabilities added;
* ``"recursion"`` — fixed forks only, much faster: the children of a fork are i.i.d., so the
  law of what grows below a state is built bottom-up, and a fork's ``B`` children are a
  multiset of the child law with its multinomial probability (as
  :func:`~tokenmdp.exact.lab.group_draws.multisets` counts an i.i.d. group).

Merging siblings assumes what the lab assumes of a group (``order_invariant``): the estimator
does not care in which order the leaves are listed. :class:`TreeLaw` also gives the exact
marginal law of the leaves (:meth:`TreeLaw.leaf_marginal`) and the expected generated tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import torch
from torch import nn

from tokenmdp.exact.branching.process import Grown, StateTable, TooManyRuns, every_run, grow
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import check_policy
from tokenmdp.tree_schedules import FixedForks, Schedule, as_schedule

__all__ = ["LAW_METHODS", "MAX_TREES", "TreeLaw", "slots", "tree_law"]

LAW_METHODS = ("auto", "recursion", "replay")
#: Default cap on the trees (replay: runs) an exact law may enumerate before it gives up.
MAX_TREES = 300_000


def slots(schedule: Schedule, tree: Grown, leaf: int) -> int:
    """The nominal leaves a leaf of a fixed-fork tree stands for: the product of the branching
    factors of the forks its response ended before (1 for a schedule of rounds).

    Parameters
    ----------
    schedule : Schedule
        The tree's schedule.
    tree : Grown
        The tree.
    leaf : int
        One of its leaves.

    Returns
    -------
    int
    """
    if not isinstance(schedule, FixedForks):
        return 1
    # the response's non-EOS tokens: a fork at depth d was reached alive iff d <= that count
    alive = tree.depth[leaf] - (tree.tokens[leaf] == tree.eos)
    return math.prod(b for d, b in zip(schedule.depths, schedule.branching) if d > alive)


@dataclasses.dataclass(frozen=True)
class TreeLaw:
    """Every tree of a schedule under a sampler, with its probability (sums to 1).

    Parameters
    ----------
    mdp : TokenMDP
    schedule : Schedule
    trees : tuple of Grown
        One representative per tree up to the order of siblings.
    prob : Tensor ``[D]``
        Float64 probability of each (summed over its sibling orders).
    method : str
        ``"recursion"`` or ``"replay"``.
    """

    mdp: TokenMDP
    schedule: Schedule
    trees: tuple
    prob: torch.Tensor
    method: str

    @property
    def num_trees(self) -> int:
        """Trees of positive probability."""
        return len(self.trees)

    def expected(self, what: str) -> float:
        """An expected count per tree under the law.

        Parameters
        ----------
        what : {"generated_tokens", "expanded_tokens", "leaves"}
            ``E[generated tokens]`` (nodes), ``E[expanded tokens]`` (the leaves' response
            tokens) or ``E[leaves]``.

        Returns
        -------
        float
        """
        return float(self.prob @ _per_tree(self.trees, what))

    def leaf_marginal(self, weights: str = "slots") -> torch.Tensor:
        """The exact law of one leaf, ``[N]`` over the rows of ``mdp.enumerate()``.

        Parameters
        ----------
        weights : {"slots", "leaves"}
            ``"slots"``: ``E[Σ_leaves m_leaf 1{y_leaf = y}] / G`` with ``m`` the nominal leaves a
            leaf stands for (:func:`slots`) — a fixed-fork tree's every slot is then marginally
            the sampler's response law (for rounds, whose missing leaves stand for nothing, the
            weights sum to ``E[n]/G``: use ``"leaves"``); ``"leaves"``:
            ``E[(1/n) Σ_leaves 1{y_leaf = y}]``, a leaf picked uniformly among the ``n`` the tree has.

        Returns
        -------
        Tensor ``[N]``
            Float64, summing to 1 (but for ``"slots"`` of rounds, above).
        """
        if weights not in ("slots", "leaves"):
            raise ValueError(f"weights: expected 'slots' or 'leaves', got {weights!r}")
        out = torch.zeros(self.mdp.num_sequences, dtype=torch.float64)
        G = self.schedule.leaves
        for tree, p in zip(self.trees, self.prob.tolist()):
            leaves = tree.leaves()
            for v in leaves:
                w = slots(self.schedule, tree, v) / G if weights == "slots" else 1 / len(leaves)
                out[tree.leaf_row[v]] += p * w
        return out


def _per_tree(trees, what: str) -> torch.Tensor:
    if what == "generated_tokens":
        values = [len(t.tokens) for t in trees]
    elif what == "expanded_tokens":
        values = [sum(t.depth[v] for v in t.leaves()) for t in trees]
    elif what == "leaves":
        values = [len(t.leaves()) for t in trees]
    else:
        raise ValueError(f"what: expected generated_tokens, expanded_tokens or leaves, got "
                         f"{what!r}")
    return torch.tensor(values, dtype=torch.float64)


def _by_replay(mdp, table, schedule, max_trees):
    merged: dict = {}
    for tree in every_run(lambda choose: grow(mdp, table, schedule, choose),
                          max_runs=max_trees):
        key = tree.canonical()
        if key in merged:
            merged[key][1] += tree.probability
        else:
            merged[key] = [tree, tree.probability]
    return [t for t, _ in merged.values()], [p for _, p in merged.values()]


def _by_recursion(mdp, table, schedule: FixedForks, max_trees):
    """The law of canonical trees bottom-up (module docstring); each tree is then rebuilt."""
    b, eos, L = mdp.branching, mdp.eos, mdp.max_len
    depths, branching, m = schedule.depths, schedule.branching, len(schedule.depths)
    memo: dict = {}

    def branch(state, j):                 # one branch at level j from state: (token, below)
        key = ("branch", state, j)
        if key not in memo:
            p, k, code = state
            sid = table.state(p, k, code)
            out: dict = {}
            for a in np.flatnonzero(table.probs[sid] > 0).tolist():
                pa = float(table.probs[sid, a])
                if a == eos or k + 1 == L:
                    out[(a, ())] = out.get((a, ()), 0.0) + pa
                    continue
                for sub, q in below((p, k + 1, code * b + a), j).items():
                    out[(a, sub)] = out.get((a, sub), 0.0) + pa * q
            memo[key] = out
        return memo[key]

    def below(state, j):                  # everything that grows below state, as children
        key = ("below", state, j)
        if key not in memo:
            if j < m and state[1] == depths[j]:
                items = list(branch(state, j + 1).items())
                n = branching[j]
                if math.comb(len(items) + n - 1, n) > max_trees:
                    raise TooManyRuns(f"more than {max_trees} trees")
                out = {}
                for combo in itertools.combinations_with_replacement(range(len(items)), n):
                    counts = np.bincount(combo)
                    coef = math.factorial(n) / math.prod(math.factorial(c) for c in counts)
                    out[tuple(sorted(items[i][0] for i in combo))] = coef * math.prod(
                        items[i][1] for i in combo)
            else:
                out = {(br,): q for br, q in branch(state, j).items()}
            memo[key] = out
        return memo[key]

    trees, prob = [], []
    pprobs = mdp.prompt_probs.tolist()
    for p in range(mdp.num_prompts):
        if pprobs[p] <= 0:
            continue
        for children, q in below((p, 0, 0), 0).items():
            trees.append(_rebuild(mdp, table, p, children))
            prob.append(pprobs[p] * q)
            if len(trees) > max_trees:
                raise TooManyRuns(f"more than {max_trees} trees")
    return trees, prob


def _rebuild(mdp, table, p, children) -> Grown:
    """A :class:`Grown` from a canonical tree, nodes in depth-first order."""
    tree = Grown(p, mdp.eos)
    b, eos, L = mdp.branching, mdp.eos, mdp.max_len

    def visit(node, state, kids):
        p_, k, code = state
        sid = table.state(p_, k, code)
        for a, sub in kids:
            logp = float(table.logp[sid, a])
            if a == eos or k + 1 == L:
                v = tree.add(a, node, logp, None, k + 1)
                tree.leaf_row[v] = (table.terminal(p_, k, code) if a == eos
                                    else table.terminal(p_, L, code * b + a))
            else:
                after = (p_, k + 1, code * b + a)
                v = tree.add(a, node, logp, after, k + 1)
                visit(v, after, sub)

    visit(-1, (p, 0, 0), children)
    return tree


def tree_law(mdp: TokenMDP, behavior: nn.Module, schedule, *, group_size: int | None = None,
             method: str = "auto", max_trees: int = MAX_TREES,
             table: StateTable | None = None) -> TreeLaw:
    """The exact law of the trees ``schedule`` grows when ``behavior`` samples.

    Parameters
    ----------
    mdp : TokenMDP
    behavior : policy module
        The sampler ``μ`` (``π`` on-policy; a stale or inference copy otherwise).
    schedule : FixedForks, RandomForks or EntropyForks
        (or an object with the same fields, :func:`~tokenmdp.tree_schedules.as_schedule`).
    group_size : int, optional
        ``G``: checked to be the schedule's nominal leaves.
    method : {"auto", "recursion", "replay"}
        See the module docstring; ``"auto"`` is the recursion for fixed forks, else replay.
    max_trees : int
        Give up (``ValueError``) past this many trees or runs.
    table : StateTable, optional
        ``StateTable(mdp, behavior)``, when already built.

    Returns
    -------
    TreeLaw

    Raises
    ------
    ValueError
        A schedule that does not fit ``mdp`` or ``group_size``; the recursion asked for a
        schedule of rounds; more than ``max_trees`` trees (naming ``max_trees``).
    """
    check_policy(mdp, behavior, name="behavior")
    schedule = as_schedule(schedule)
    schedule.check(mdp.max_len, group_size)
    if method not in LAW_METHODS:
        raise ValueError(f"method: expected one of {', '.join(LAW_METHODS)}, got {method!r}")
    if method == "recursion" and not isinstance(schedule, FixedForks):
        raise ValueError(f"method: the recursion needs i.i.d. children (fixed forks), not "
                         f"{schedule}; use 'replay'")
    table = StateTable(mdp, behavior) if table is None else table
    recursion = method == "recursion" or (method == "auto" and isinstance(schedule, FixedForks))
    try:
        trees, prob = (_by_recursion if recursion else _by_replay)(mdp, table, schedule,
                                                                   max_trees)
    except TooManyRuns:
        raise ValueError(f"max_trees: {schedule} has more than {max_trees} trees on {mdp!r}; "
                         "raise max_trees or use Monte Carlo") from None
    return TreeLaw(mdp, schedule, tuple(trees), torch.tensor(prob, dtype=torch.float64),
                   "recursion" if recursion else "replay")
