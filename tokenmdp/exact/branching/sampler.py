"""Sampling tree rollouts in the exact world: :func:`sample_trees`.

Each tree is grown by the schedule's process (:mod:`~tokenmdp.exact.branching.process`), every
choice answered by inverse-CDF from uniforms of the caller's generator (a ``torch.Generator`` or
a ``numpy.random.Generator``; the only source of randomness). What comes back,
:class:`TreeSample`, gives the trees as :class:`~tokenmdp.trees.ResponseTree` (leaf rewards from
the MDP's reward table), the sampler's ``log μ`` of every node, each tree's probability and
generated tokens, and the expanded batch (:func:`~tokenmdp.trees.batch_from_trees`) that every
estimator reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.exact.branching.process import StateTable, grow
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import check_policy
from tokenmdp.tree_schedules import Schedule, as_schedule
from tokenmdp.trees import ResponseTree, batch_from_trees

__all__ = ["TreeSample", "sample_trees"]

#: Uniforms drawn from the generator at once.
UNIFORM_BLOCK = 4096


class _Chooser:
    """``choose(probs) -> index`` by inverse CDF from a generator's uniforms (drawn in blocks)."""

    def __init__(self, generator) -> None:
        if isinstance(generator, torch.Generator):
            self._draw = lambda n: torch.rand(n, generator=generator,
                                              dtype=torch.float64).numpy()
        elif isinstance(generator, np.random.Generator):
            self._draw = generator.random
        else:
            raise TypeError(f"generator: expected a torch.Generator or a numpy.random.Generator, "
                            f"got {type(generator).__name__}")
        self._buffer, self._next = np.empty(0), 0

    def __call__(self, probs: np.ndarray) -> int:
        if self._next == self._buffer.size:
            self._buffer, self._next = self._draw(UNIFORM_BLOCK), 0
        u = self._buffer[self._next]
        self._next += 1
        cdf = np.cumsum(probs)
        i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        if i >= probs.size or probs[i] <= 0:          # rounding at the top of the CDF
            i = int(np.flatnonzero(probs > 0)[-1])
        return i


@dataclasses.dataclass(frozen=True)
class TreeSample:
    """Trees drawn by :func:`sample_trees`.

    Parameters
    ----------
    mdp : TokenMDP
    schedule : Schedule
    grown : tuple of Grown
        The trees as grown (nodes in creation order).
    """

    mdp: TokenMDP
    schedule: Schedule
    grown: tuple

    @property
    def trees(self) -> list[ResponseTree]:
        """One :class:`~tokenmdp.trees.ResponseTree` per draw, leaf rewards filled in."""
        return [g.response_tree(self.mdp) for g in self.grown]

    @property
    def prompt_index(self) -> list[int]:
        """The prompt of each tree."""
        return [g.prompt_index for g in self.grown]

    @property
    def behavior_logprobs(self) -> list[list[float]]:
        """Per tree, the sampler's ``log μ`` of every node's token."""
        return [list(g.logp) for g in self.grown]

    @property
    def probability(self) -> torch.Tensor:
        """Float64 ``[n]``: each draw's probability as drawn — ``D(x)`` times ``μ`` of every
        node's token times each random fork choice's (siblings in the order drawn; the law of
        the tree up to sibling order, :func:`~tokenmdp.exact.branching.law.tree_law`, adds the
        orders up)."""
        return torch.tensor([g.probability for g in self.grown], dtype=torch.float64)

    @property
    def generated_tokens(self) -> torch.Tensor:
        """Long ``[n]``: the tokens each tree's sampler generated (its nodes)."""
        return torch.tensor([len(g.tokens) for g in self.grown], dtype=torch.long)

    def batch(self) -> TokenBatch:
        """The expanded float64 batch (:func:`~tokenmdp.trees.batch_from_trees`).

        Returns
        -------
        TokenBatch
            One sequence per leaf, one group per tree, ``token_extras["tree_node"]`` and
            ``behavior_logprob``.
        """
        return batch_from_trees(self.trees, prompt_index=self.prompt_index,
                                behavior_logprobs=self.behavior_logprobs)


def sample_trees(mdp: TokenMDP, behavior: nn.Module, schedule, num_trees: int, *,
                 generator: torch.Generator | np.random.Generator,
                 group_size: int | None = None, table: StateTable | None = None) -> TreeSample:
    """Draw ``num_trees`` trees, each from a prompt ``x ~ D``, grown by ``schedule`` from ``μ``.

    Parameters
    ----------
    mdp : TokenMDP
    behavior : policy module
        The sampler ``μ``: ``π`` on-policy, a stale or inference copy when mismatched.
    schedule : FixedForks, RandomForks or EntropyForks
        Where the trees fork (or an object with the same fields).
    num_trees : int
        ``>= 1``.
    generator : torch.Generator or numpy.random.Generator
        The only source of randomness.
    group_size : int, optional
        ``G``: checked to be the schedule's nominal leaves.
    table : StateTable, optional
        ``StateTable(mdp, behavior)``, when already built (many calls at one ``μ``).

    Returns
    -------
    TreeSample

    Raises
    ------
    ValueError
        A fork depth ``>= mdp.max_len`` (naming ``depths``), a branching budget of zero (naming
        ``branching``, from the schedule), ``group_size`` that is not the schedule's leaves,
        ``num_trees < 1``.
    """
    check_policy(mdp, behavior, name="behavior")
    schedule = as_schedule(schedule)
    schedule.check(mdp.max_len, group_size)
    if isinstance(num_trees, bool) or not isinstance(num_trees, int) or num_trees < 1:
        raise ValueError(f"num_trees: expected an int >= 1, got {num_trees!r}")
    choose = _Chooser(generator)
    table = StateTable(mdp, behavior) if table is None else table
    return TreeSample(mdp, schedule, tuple(grow(mdp, table, schedule, choose)
                                           for _ in range(num_trees)))

