"""How a tree grows: each schedule's process, written once, for sampling and for enumeration.

A tree is grown by a sequence of *choices* — the prompt ``x ~ D``, each token ``a ~ μ(·|s)``,
each uniform draw of a fork state (:class:`~tokenmdp.tree_schedules.RandomForks`) —
made through one callable ``choose(probs) -> index``. The sampler
(:mod:`~tokenmdp.exact.branching.sampler`) answers it from a random generator; the exact law
(:mod:`~tokenmdp.exact.branching.law`) answers it by :func:`every_run`: it replays the process
once per sequence of choices of positive probability (an odometer over the choice points), so
the process the law enumerates is the very code the sampler runs.

The processes (``b`` = the MDP's non-EOS tokens, ``L`` its length limit):

* fixed forks: level ``j`` extends every branch from its fork state until depth ``D_j`` (or its
  end: EOS or ``L`` tokens); a branch alive at ``D_j`` becomes ``B_j`` branches, each drawing its
  own next token at that state; after the last fork every branch is extended to its end;
* rounds (random and entropy forks): one chain from the prompt to its end; then per round the
  candidate states — the prompt and every node with a child, not forked at before, in the order
  (depth, creation) — are ranked (entropy: by ``−H``, stable in that order) or drawn (random:
  uniformly, one at a time without replacement), and each chosen state gets ``T_i`` new
  branches, each extended to its end.

Nodes are numbered in creation order; a node records its token, parent, ``log μ`` of its token
and, at a leaf, the response's row in :meth:`TokenMDP.enumerate <tokenmdp.exact.TokenMDP.enumerate>`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from tokenmdp.exact.world.ground_truth import state_logprobs
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.tree_schedules import FixedForks, RandomForks, Schedule
from tokenmdp.trees import ResponseTree

__all__ = ["Grown", "StateTable", "TooManyRuns", "every_run", "grow"]


class StateTable:
    """The sampler's next-token distribution and entropy at every state, for lookups.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        The sampling policy ``μ`` (float64).

    Attributes
    ----------
    probs, logp : ndarray ``[num_states, V]``
        ``μ(a|s)`` and ``log μ(a|s)``, rows in global state order.
    entropy : ndarray ``[num_states]``
        ``H(μ(·|s))``.
    """

    def __init__(self, mdp: TokenMDP, policy: nn.Module) -> None:
        with torch.no_grad():
            levels = state_logprobs(mdp, policy)
        V = mdp.vocab_size
        self.mdp = mdp
        self.logp = np.concatenate([lv.detach().reshape(-1, V).numpy() for lv in levels])
        self.probs = np.exp(self.logp)
        self.entropy = -np.where(self.probs > 0, self.probs * self.logp, 0.0).sum(1)
        b, L = mdp.branching, mdp.max_len
        self._block = [sum(b ** j for j in range(k)) for k in range(L + 1)]
        self._rpp = mdp.responses_per_prompt

    def state(self, p: int, k: int, code: int) -> int:
        """Global id of the state of prompt ``p`` after the ``k`` tokens of prefix ``code``.

        Parameters
        ----------
        p, k, code : int
            Prompt, tokens so far, and the prefix's base-``V`` code.

        Returns
        -------
        int
        """
        return self.mdp.level_offsets[k] + p * self.mdp.branching ** k + code

    def terminal(self, p: int, k: int, code: int) -> int:
        """Enumeration row of the response of ``k`` non-EOS tokens (prefix ``code``) then EOS,
        or truncated when ``k = L``.

        Parameters
        ----------
        p, k, code : int
            Prompt, non-EOS tokens, and the prefix's base-``V`` code.

        Returns
        -------
        int
        """
        return p * self._rpp + self._block[k] + code


class Grown:
    """A tree being grown: nodes in creation order (see the module docstring).

    Parameters
    ----------
    prompt_index : int
        The prompt the tree answers.
    eos : int
        The MDP's EOS token.

    Attributes
    ----------
    tokens, parent : list of int
        Each node's token and parent (``-1``: the prompt).
    logp : list of float
        ``log μ`` of each node's token.
    after : list of tuple or None
        The state ``(prompt, depth, code)`` after each node, None at a leaf (EOS or ``L`` tokens).
    depth : list of int
        Response tokens up to and including the node.
    leaf_row : dict of int to int
        The enumeration row of each leaf's response.
    probability : float
        The product of every choice's probability (the prompt's included).
    """

    def __init__(self, prompt_index: int, eos: int) -> None:
        self.prompt_index, self.eos = prompt_index, eos
        self.tokens: list[int] = []
        self.parent: list[int] = []
        self.logp: list[float] = []
        self.after: list = []
        self.depth: list[int] = []
        self.has_child: list[bool] = []
        self.leaf_row: dict[int, int] = {}
        self.probability = 1.0

    def add(self, token: int, parent: int, logp: float, after, depth: int) -> int:
        self.tokens.append(token)
        self.parent.append(parent)
        self.logp.append(logp)
        self.after.append(after)
        self.depth.append(depth)
        self.has_child.append(False)
        if parent >= 0:
            self.has_child[parent] = True
        return len(self.tokens) - 1

    def leaves(self) -> list[int]:
        """Nodes without children, in creation order.

        Returns
        -------
        list of int
        """
        return [v for v, c in enumerate(self.has_child) if not c]

    def response_tree(self, mdp: TokenMDP) -> ResponseTree:
        """The tree as a :class:`~tokenmdp.trees.ResponseTree`.

        Parameters
        ----------
        mdp : TokenMDP
            Whose reward table gives the leaves' rewards.

        Returns
        -------
        ResponseTree
        """
        rewards = mdp.rewards
        return ResponseTree(mdp.prompts[self.prompt_index], self.tokens, self.parent,
                            depth=self.depth,
                            reward=[float(rewards[self.leaf_row[v]]) for v in self.leaves()])

    def canonical(self) -> tuple:
        """The tree up to the order of siblings.

        Returns
        -------
        tuple
            ``(prompt, children of the prompt)``, where a node's children are the sorted tuple
            of ``(token, children)`` of each child.
        """
        children: dict[int, list[int]] = {}
        for v, p in enumerate(self.parent):
            children.setdefault(p, []).append(v)

        def key(v):
            return tuple(sorted((self.tokens[c], key(c)) for c in children.get(v, ())))
        return (self.prompt_index, key(-1))

    def path(self, node: int) -> list[int]:
        """The nodes from the first response token to ``node``.

        Parameters
        ----------
        node : int
            The last node.

        Returns
        -------
        list of int
        """
        out = []
        while node != -1:
            out.append(node)
            node = self.parent[node]
        return out[::-1]


def _extend(tree: Grown, table: StateTable, node: int, state, until: int | None,
            choose: Callable) -> tuple[int, tuple | None]:
    """Draw tokens after ``node`` (at ``state``) until depth ``until`` (None: the end). Returns
    the last node and the state after it (None when the response ended)."""
    mdp = table.mdp
    b, eos, L = mdp.branching, mdp.eos, mdp.max_len
    p, k, code = state
    while until is None or k < until:
        sid = table.state(p, k, code)
        a = choose(table.probs[sid])
        tree.probability *= float(table.probs[sid, a])
        if a == eos or k + 1 == L:
            node = tree.add(a, node, float(table.logp[sid, a]), None, k + 1)
            tree.leaf_row[node] = (table.terminal(p, k, code) if a == eos
                                   else table.terminal(p, L, code * b + a))
            return node, None
        code, k = code * b + a, k + 1
        node = tree.add(a, node, float(table.logp[sid, a]), (p, k, code), k)
    return node, (p, k, code)


def _grow_fixed(schedule: FixedForks, table: StateTable, tree: Grown, choose: Callable) -> None:
    frontier = [(-1, (tree.prompt_index, 0, 0))]
    for j, until in enumerate(schedule.depths + (None,)):
        nxt = []
        for node, state in frontier:
            last, state = _extend(tree, table, node, state, until, choose)
            if state is not None and until is not None:       # alive at the fork depth
                nxt += [(last, state)] * schedule.branching[j]
        frontier = nxt


def _grow_rounds(schedule, table: StateTable, tree: Grown, choose: Callable) -> None:
    root = (tree.prompt_index, 0, 0)
    _extend(tree, table, -1, root, None, choose)
    forked: set[int] = set()
    uniform = isinstance(schedule, RandomForks)
    for n_forks, n_children in zip(schedule.forks, schedule.branching):
        # candidates: the prompt, then every node with a child, by (depth, creation order)
        cands = [-1] + sorted((v for v in range(len(tree.tokens)) if tree.has_child[v]),
                              key=lambda v: (tree.depth[v], v))
        cands = [c for c in cands if c not in forked]
        if uniform:
            chosen = []
            for _ in range(min(n_forks, len(cands))):
                i = choose(np.full(len(cands), 1.0 / len(cands)))
                tree.probability /= len(cands)
                chosen.append(cands.pop(i))
        else:
            def entropy(c):
                return table.entropy[table.state(*(root if c == -1 else tree.after[c]))]
            chosen = sorted(cands, key=lambda c: -entropy(c))[:n_forks]   # stable: ties keep order
        for c in chosen:
            forked.add(c)
            state = root if c == -1 else tree.after[c]
            for _ in range(n_children):
                _extend(tree, table, c, state, None, choose)


def grow(mdp: TokenMDP, table: StateTable, schedule: Schedule, choose: Callable) -> Grown:
    """Grow one tree, every choice made by ``choose(probs) -> index``.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP (its prompt distribution is the first choice).
    table : StateTable
        The sampler's distributions.
    schedule : FixedForks, RandomForks or EntropyForks
        The fork schedule (checked by the caller).
    choose : callable
        ``choose(probs: ndarray) -> int``, an index with ``probs[index] > 0``.

    Returns
    -------
    Grown
        The tree, with the probability of the choices made.
    """
    pprobs = mdp.prompt_probs.numpy()
    p = choose(pprobs)
    tree = Grown(p, mdp.eos)
    tree.probability = float(pprobs[p])
    if isinstance(schedule, FixedForks):
        _grow_fixed(schedule, table, tree, choose)
    else:
        _grow_rounds(schedule, table, tree, choose)
    return tree


class TooManyRuns(RuntimeError):
    """Raised by :func:`every_run` past its ``max_runs``."""


class _Replay:
    """``choose`` of one replayed run: the scripted choices first, then first options."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.taken = script, []

    def __call__(self, probs: np.ndarray) -> int:
        pos = len(self.taken)
        idx = self.script[pos] if pos < len(self.script) else int(np.argmax(probs > 0))
        self.taken.append((probs, idx))
        return idx

    def next_script(self) -> list[int] | None:
        """The odometer's next sequence of choices, None after the last."""
        while self.taken:
            probs, idx = self.taken.pop()
            later = np.flatnonzero(probs[idx + 1:] > 0)
            if later.size:
                return [i for _, i in self.taken] + [idx + 1 + int(later[0])]
        return None


def every_run(run: Callable[[Callable], Grown], *, max_runs: int | None = None) -> Iterator[Grown]:
    """Every outcome of ``run(choose)`` with positive probability, once per choice sequence.

    Depth-first over the choice points: the first run takes the first option of positive
    probability everywhere; each next run replays the recorded choices up to the last point
    that has a later option of positive probability, takes it, and continues with first options.

    Parameters
    ----------
    run : callable
        ``run(choose) -> Grown``, deterministic given the answers of ``choose``.
    max_runs : int, optional
        Raise :class:`TooManyRuns` after this many outcomes.

    Yields
    ------
    Grown
        Each outcome; its ``probability`` is that of its choice sequence.
    """
    script: list[int] | None = []
    count = 0
    while script is not None:
        if max_runs is not None and count >= max_runs:
            raise TooManyRuns(f"more than {max_runs} outcomes")
        replay = _Replay(script)
        yield run(replay)
        count += 1
        script = replay.next_script()
