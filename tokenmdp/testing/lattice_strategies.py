"""Hypothesis strategies for small lattice MDPs (:mod:`tokenmdp.exact.lattice`).

:func:`lattice_mdps` draws a random deterministic automaton (its unreachable states pruned and
the rest renumbered, so it always validates), rewards per state (0/1 or real), an optional
length reward and a length ``T``; every draw is small enough for the enumerable twin. Drawn with
``@st.composite`` from a seed the strategy carries, so examples shrink towards few states, two
tokens and short responses.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tokenmdp.exact.lattice.automaton import RewardAutomaton
from tokenmdp.exact.lattice.mdp import LatticeMDP

__all__ = ["random_automaton", "lattice_mdps"]


def random_automaton(num_states: int, vocab_size: int, seed: int, *,
                     binary: bool = True) -> RewardAutomaton:
    """A random automaton with at most ``num_states`` states, all reachable from state 0.

    Parameters
    ----------
    num_states : int
        States drawn before pruning, ``>= 1``.
    vocab_size : int
        ``V >= 2`` (EOS included).
    seed : int
        Seed of the NumPy generator that draws the table and the rewards.
    binary : bool, default True
        Rewards in ``{0, 1}`` (else uniform on ``[-1, 1]``); the truncation rewards are drawn
        separately.

    Returns
    -------
    RewardAutomaton
        The pruned, renumbered automaton.
    """
    rng = np.random.default_rng(seed)
    table = rng.integers(0, num_states, size=(num_states, vocab_size - 1))
    reach, frontier = {0}, [0]
    while frontier:
        frontier = [int(z) for z in np.unique(table[frontier]) if int(z) not in reach]
        reach.update(frontier)
    keep = sorted(reach)
    relabel = {z: i for i, z in enumerate(keep)}
    pruned = np.vectorize(relabel.get)(table[keep])
    K = len(keep)

    def draw() -> np.ndarray:
        return rng.integers(0, 2, K).astype(float) if binary else rng.uniform(-1, 1, K)

    return RewardAutomaton(pruned, draw(), truncation_reward=draw())


@st.composite
def lattice_mdps(draw, *, max_len: int = 4, max_states: int = 4, max_vocab: int = 3,
                 binary: bool | None = None) -> LatticeMDP:
    """A small :class:`~tokenmdp.exact.lattice.LatticeMDP` (``T <= max_len``, ``V <= max_vocab``).

    Parameters
    ----------
    draw : callable
        Hypothesis' draw (supplied by ``@st.composite``).
    max_len : int, default 4
        Largest ``T``.
    max_states : int, default 4
        Largest number of automaton states before pruning.
    max_vocab : int, default 3
        Largest ``V``.
    binary : bool, optional
        Force 0/1 rewards (True) or real ones (False); default: drawn. Real rewards may come
        with a length reward.

    Returns
    -------
    LatticeMDP
        The drawn lattice.
    """
    T = draw(st.integers(1, max_len))
    K = draw(st.integers(1, max_states))
    V = draw(st.integers(2, max_vocab))
    seed = draw(st.integers(0, 2 ** 16))
    is_binary = draw(st.booleans()) if binary is None else binary
    length = None if is_binary else draw(st.sampled_from([None, -0.1, 0.25]))
    return LatticeMDP(random_automaton(K, V, seed, binary=is_binary), T, length_reward=length)
