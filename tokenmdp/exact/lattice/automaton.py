"""Reward automata: a deterministic finite automaton over the response tokens that computes ``R``.

A :class:`RewardAutomaton` has states ``z ∈ [K]``, a start state, a transition table
``δ[z, a]`` over the ``V − 1`` non-EOS tokens, and two reward tables over its states:

* EOS handling: EOS always ends the response and reads ``eos_reward[z]`` in the state ``z`` the
  automaton is in when EOS is drawn (the state after the response's non-EOS tokens);
* truncation: a response cut after ``T`` non-EOS tokens reads ``truncation_reward[z]`` (default:
  ``eos_reward``).

Since EOS is always available and always ends the response, no state can trap a response: a
state whose non-EOS transitions all loop to itself (the "pattern appeared" state) is left by EOS
or by truncation, and its reward is read then. The constructors cover the rewards of verifiable
RL: :func:`exact_match` (the prefix automaton of a target string), :func:`token_count` (a token's
count, capped or modulo ``k``, e.g. its parity) and :func:`pattern_appeared` (the
Knuth–Morris–Pratt automaton of a pattern). A length penalty is a property of the MDP
(:class:`~tokenmdp.exact.lattice.LatticeMDP`'s ``length_reward``), not of the automaton.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["RewardAutomaton", "exact_match", "token_count", "pattern_appeared"]


def _int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def _state_table(name: str, values, num_states: int) -> np.ndarray:
    """``values`` (a sequence of ``K`` numbers, or a mapping state -> number, missing states 0)
    as a finite float64 ``[K]`` array; states outside ``[0, K)`` are refused."""
    if isinstance(values, Mapping):
        out = np.zeros(num_states)
        for state, v in values.items():
            if isinstance(state, bool) or not isinstance(state, (int, np.integer)) \
                    or not 0 <= state < num_states:
                raise ValueError(f"{name}: reward for state {state!r}, outside the automaton's "
                                 f"states [0, {num_states})")
            out[int(state)] = float(v)
    else:
        out = np.asarray(values, dtype=np.float64)
        if out.shape != (num_states,):
            raise ValueError(f"{name}: expected one reward per state ({num_states}), got shape "
                             f"{out.shape}; rewards for states outside [0, {num_states}) are "
                             "not allowed")
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{name}: rewards must be finite")
    return out


class RewardAutomaton:
    """A deterministic automaton over the non-EOS tokens whose final state gives the reward.

    Parameters
    ----------
    transitions : array-like of int, shape ``[K, V - 1]``
        ``δ[z, a]``: the state after non-EOS token ``a`` in state ``z`` (``V`` is the vocabulary
        size, EOS the token ``V - 1``).
    eos_reward : sequence of float ``[K]`` or mapping state -> float
        The reward of a response that ends with EOS in state ``z`` (a mapping leaves the other
        states at 0).
    truncation_reward : as ``eos_reward``, optional
        The reward of a response truncated in state ``z`` (default: ``eos_reward``).
    start : int, default 0
        The state before the first token.

    Raises
    ------
    ValueError
        ``transitions`` not a non-empty 2-D integer table with entries in ``[0, K)``, or with
        states that cannot be reached from ``start`` (listed); ``start`` outside ``[0, K)``;
        rewards for states outside ``[0, K)`` or not finite.
    """

    def __init__(self, transitions, eos_reward, *, truncation_reward=None, start: int = 0) -> None:
        table = np.asarray(transitions)
        if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] < 1:
            raise ValueError(f"transitions: expected a [K, V - 1] table with K, V - 1 >= 1, got "
                             f"shape {table.shape}")
        if not np.issubdtype(table.dtype, np.integer):
            if not np.issubdtype(table.dtype, np.floating) or not np.all(table == np.round(table)):
                raise ValueError("transitions: entries must be integer state ids")
        table = table.astype(np.int64)
        K = table.shape[0]
        if table.min() < 0 or table.max() >= K:
            raise ValueError(f"transitions: entries must be states in [0, {K}), got values in "
                             f"[{table.min()}, {table.max()}]")
        start = _int("start", start, 0)
        if start >= K:
            raise ValueError(f"start: must be a state in [0, {K}), got {start}")
        reach = np.zeros(K, dtype=bool)
        reach[start] = True
        frontier = [start]
        while frontier:
            nxt = np.unique(table[frontier].reshape(-1))
            frontier = [int(z) for z in nxt if not reach[z]]
            reach[frontier] = True
        if not reach.all():
            missing = np.flatnonzero(~reach).tolist()
            raise ValueError(f"transitions: states {missing} cannot be reached from start state "
                             f"{start}; drop them (the lattice would carry them for nothing)")
        self.transitions = table
        self.start = start
        self.eos_reward = _state_table("eos_reward", eos_reward, K)
        self.truncation_reward = (self.eos_reward.copy() if truncation_reward is None else
                                  _state_table("truncation_reward", truncation_reward, K))

    @property
    def num_states(self) -> int:
        """``K``, the number of states."""
        return int(self.transitions.shape[0])

    @property
    def vocab_size(self) -> int:
        """``V``: the non-EOS tokens of the table plus EOS."""
        return int(self.transitions.shape[1]) + 1

    def run(self, tokens: Sequence[int]) -> int:
        """The state after reading non-EOS ``tokens`` from the start state.

        Parameters
        ----------
        tokens : sequence of int
            Non-EOS token ids, each in ``[0, V - 1)``.

        Returns
        -------
        int
            The final state.
        """
        z = self.start
        for a in tokens:
            if not 0 <= int(a) < self.vocab_size - 1:
                raise ValueError(f"tokens: {a!r} is not a non-EOS token of [0, "
                                 f"{self.vocab_size - 1})")
            z = int(self.transitions[z, int(a)])
        return z

    def __repr__(self) -> str:
        return (f"RewardAutomaton(num_states={self.num_states}, vocab_size={self.vocab_size}, "
                f"start={self.start})")


def _vocab(vocab_size) -> int:
    return _int("vocab_size", vocab_size, 2)


def _tokens(name: str, seq, vocab_size: int, *, empty_ok: bool) -> list[int]:
    out = [_int(name, a, 0) for a in seq]
    if not out and not empty_ok:
        raise ValueError(f"{name}: must not be empty")
    if any(a >= vocab_size - 1 for a in out):
        raise ValueError(f"{name}: tokens must be non-EOS ids in [0, {vocab_size - 1})")
    return out


def exact_match(target: Sequence[int], vocab_size: int, *, reward: float = 1.0) -> RewardAutomaton:
    """Reward ``reward`` iff the response is exactly ``target`` followed by EOS (else 0).

    The prefix automaton: state ``i <= n`` means "the first ``i`` tokens match", state ``n + 1``
    is the dead state (a mismatch, or a token after the full target). A truncated response earns
    nothing.

    Parameters
    ----------
    target : sequence of int
        Non-EOS token ids (may be empty: then only the empty response, EOS alone, is rewarded).
    vocab_size : int
        ``V``, EOS included.
    reward : float, default 1.0
        The reward of the exact match.

    Returns
    -------
    RewardAutomaton
        ``n + 2`` states.
    """
    V = _vocab(vocab_size)
    target = _tokens("target", target, V, empty_ok=True)
    n = len(target)
    dead = n + 1
    table = np.full((n + 2, V - 1), dead, dtype=np.int64)
    for i, a in enumerate(target):
        table[i, a] = i + 1
    return RewardAutomaton(table, {n: float(reward)}, truncation_reward={})


def token_count(token: int, vocab_size: int, *, modulus: int | None = None,
                cap: int | None = None, values: Sequence[float] | None = None) -> RewardAutomaton:
    """A reward that is a function of how often ``token`` occurs: modulo ``modulus`` or capped.

    Give exactly one of ``modulus`` (states are the count mod ``k``; ``modulus=2`` is the
    parity) and ``cap`` (states ``0 .. cap``, the count saturating at ``cap``).

    Parameters
    ----------
    token : int
        The counted non-EOS token.
    vocab_size : int
        ``V``, EOS included.
    modulus : int, optional
        ``k >= 2``.
    cap : int, optional
        ``c >= 1``.
    values : sequence of float, optional
        The reward of each state (length ``k`` or ``c + 1``); default ``1`` at residue 0 and 0
        elsewhere (modulus), or the capped count itself (cap). Read at EOS and at truncation.

    Returns
    -------
    RewardAutomaton
        ``k`` or ``c + 1`` states.
    """
    V = _vocab(vocab_size)
    (token,) = _tokens("token", [token], V, empty_ok=False)
    if (modulus is None) == (cap is None):
        raise ValueError("modulus, cap: give exactly one of them")
    if modulus is not None:
        k = _int("modulus", modulus, 2)
        table = np.tile(np.arange(k)[:, None], (1, V - 1))
        table[:, token] = (np.arange(k) + 1) % k
        default = np.eye(1, k)[0]
    else:
        c = _int("cap", cap, 1)
        k = c + 1
        table = np.tile(np.arange(k)[:, None], (1, V - 1))
        table[:, token] = np.minimum(np.arange(k) + 1, c)
        default = np.arange(k, dtype=np.float64)
    return RewardAutomaton(table, default if values is None else values)


def pattern_appeared(pattern: Sequence[int], vocab_size: int, *,
                     reward: float = 1.0) -> RewardAutomaton:
    """Reward ``reward`` iff ``pattern`` occurs as a contiguous substring of the response.

    The Knuth–Morris–Pratt automaton (state ``i`` = the longest suffix read so far that is a
    prefix of the pattern; state ``m`` absorbing once the pattern appeared), read at EOS and at
    truncation alike.

    Parameters
    ----------
    pattern : sequence of int
        Non-EOS token ids, non-empty.
    vocab_size : int
        ``V``, EOS included.
    reward : float, default 1.0
        The reward once the pattern appeared.

    Returns
    -------
    RewardAutomaton
        ``len(pattern) + 1`` states.
    """
    V = _vocab(vocab_size)
    pat = _tokens("pattern", pattern, V, empty_ok=False)
    m = len(pat)
    table = np.zeros((m + 1, V - 1), dtype=np.int64)
    fail = 0                                   # the state the KMP failure link of i points to
    for i in range(m):
        for a in range(V - 1):
            table[i, a] = i + 1 if a == pat[i] else table[fail, a] if i > 0 else 0
        if i > 0:
            fail = table[fail, pat[i]]
    table[m, :] = m
    return RewardAutomaton(table, {m: float(reward)})
