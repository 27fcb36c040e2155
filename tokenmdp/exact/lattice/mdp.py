"""The lattice MDP: responses of up to ``T`` tokens scored by a reward automaton.

A response is a path through ``T × K`` nodes ``(t, z)``: position ``t`` (tokens so far) and
automaton state ``z``. At ``(t, z)`` the policy draws ``a``; EOS ends the response (length
``t + 1``, reward ``eos_reward[z] + length_reward[t + 1]``), a non-EOS token moves to
``(t + 1, δ[z, a])``, and after ``T`` non-EOS tokens the response is truncated (length ``T``,
reward ``truncation_reward[z] + length_reward[T]``). This is the exact world of
:class:`~tokenmdp.exact.TokenMDP` (one prompt, ``max_len = T``) whenever the reward factors
through the automaton, and :func:`to_token_mdp` builds that enumerable twin for small ``T``.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch

from tokenmdp.exact.lattice.automaton import RewardAutomaton
from tokenmdp.exact.world.budget import check_budget
from tokenmdp.exact.world.mdp import TokenMDP

__all__ = ["LatticeMDP", "to_token_mdp", "BYTES_PER_ENTRY"]

#: Estimated bytes per lattice entry ``(t, z, a)`` that the recursions and the exact moments
#: hold at once (policy tables, coefficient tables, messages per reward class).
BYTES_PER_ENTRY = 8 * 24


class LatticeMDP:
    """A finite-state token MDP: one prompt, responses of up to ``max_len`` tokens, reward by
    automaton.

    Parameters
    ----------
    automaton : RewardAutomaton
        States, transitions over the non-EOS tokens, EOS and truncation rewards.
    max_len : int
        ``T >= 1``, the longest response.
    length_reward : float or sequence of float, optional
        Added to the automaton's reward: a float ``c`` gives ``c · |y|`` (``c < 0`` a length
        penalty); a sequence of ``T + 1`` floats gives ``length_reward[|y|]`` (entry 0 unused).
    memory_budget : int or str, optional
        Bytes the lattice may need (:func:`~tokenmdp.exact.world.budget.memory_budget`); the
        ``T · K · V`` entries times :data:`BYTES_PER_ENTRY` are checked before anything is
        allocated.

    Raises
    ------
    TypeError
        ``automaton`` not a :class:`RewardAutomaton`.
    ValueError
        ``max_len < 1``; ``length_reward`` of the wrong length or not finite; a lattice over the
        memory budget (naming ``max_len``, the number of states and the vocabulary).
    """

    def __init__(self, automaton: RewardAutomaton, max_len: int, *, length_reward=None,
                 memory_budget: int | str | None = None) -> None:
        if not isinstance(automaton, RewardAutomaton):
            raise TypeError(f"automaton: expected a RewardAutomaton, got "
                            f"{type(automaton).__name__}")
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)):
            raise TypeError(f"max_len: expected an int, got {type(max_len).__name__}")
        if max_len < 1:
            raise ValueError(f"max_len: must be >= 1, got {max_len}")
        T, K, V = int(max_len), automaton.num_states, automaton.vocab_size
        check_budget(f"max_len={T}, num_states={K} (automaton), vocab_size={V}", T * K * V,
                     "lattice entries (t, z, a)", T * K * V * BYTES_PER_ENTRY,
                     memory_budget=memory_budget)
        if length_reward is None:
            lr = np.zeros(T + 1)
        elif isinstance(length_reward, (int, float, np.floating, np.integer)) \
                and not isinstance(length_reward, bool):
            lr = float(length_reward) * np.arange(T + 1, dtype=np.float64)
        else:
            lr = np.asarray(length_reward, dtype=np.float64)
            if lr.shape != (T + 1,):
                raise ValueError(f"length_reward: expected a float or {T + 1} values (indexed by "
                                 f"the length 0..{T}), got shape {lr.shape}")
        if not np.all(np.isfinite(lr)):
            raise ValueError("length_reward: must be finite")
        self.automaton = automaton
        self.max_len = T
        self.length_reward = torch.as_tensor(lr, dtype=torch.float64)

    # ------------------------------------------------------------------ sizes
    @property
    def num_states(self) -> int:
        """``K``, the automaton's states."""
        return self.automaton.num_states

    @property
    def vocab_size(self) -> int:
        """``V``, EOS included."""
        return self.automaton.vocab_size

    @property
    def eos(self) -> int:
        """The EOS token id, ``V - 1``."""
        return self.vocab_size - 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(T, K, V)``: the shape of every per-(position, state, token) table."""
        return self.max_len, self.num_states, self.vocab_size

    # ------------------------------------------------------------------ tables
    @cached_property
    def transitions(self) -> torch.Tensor:
        """Long ``[K, V - 1]``: ``δ[z, a]``."""
        return torch.as_tensor(self.automaton.transitions, dtype=torch.long)

    @cached_property
    def eos_rewards(self) -> torch.Tensor:
        """Float64 ``[T, K]``: the reward of EOS at ``(t, z)`` (length ``t + 1``)."""
        base = torch.as_tensor(self.automaton.eos_reward, dtype=torch.float64)
        return base[None, :] + self.length_reward[1:, None]

    @cached_property
    def truncation_rewards(self) -> torch.Tensor:
        """Float64 ``[K]``: the reward of a response truncated in state ``z`` (length ``T``)."""
        base = torch.as_tensor(self.automaton.truncation_reward, dtype=torch.float64)
        return base + self.length_reward[self.max_len]

    @cached_property
    def reachable(self) -> torch.Tensor:
        """Bool ``[T + 1, K]``: which states some response visits at each position."""
        T, K = self.max_len, self.num_states
        out = torch.zeros(T + 1, K, dtype=torch.bool)
        out[0, self.automaton.start] = True
        for t in range(T):
            nxt = torch.zeros(K, dtype=torch.bool)
            nxt[self.transitions[out[t]].reshape(-1)] = True
            out[t + 1] = nxt
        return out

    @cached_property
    def reward_classes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The distinct rewards of reachable terminals and each terminal's class.

        Returns ``(values [m], eos_class [T, K], truncation_class [K])``: class ids index
        ``values`` (unreachable terminals get class 0; they have probability 0).
        """
        reach = self.reachable
        vals = torch.cat([self.eos_rewards[reach[:-1]], self.truncation_rewards[reach[-1]]])
        values = torch.unique(vals)
        eos_class = torch.searchsorted(values, self.eos_rewards.contiguous()).clamp(
            max=values.numel() - 1)
        trunc_class = torch.searchsorted(values, self.truncation_rewards.contiguous()).clamp(
            max=values.numel() - 1)
        return values, eos_class, trunc_class

    def reward(self, response) -> float:
        """``R(y)`` of one response given as token ids (EOS-terminated or ``T`` non-EOS tokens).

        Parameters
        ----------
        response : sequence of int
            The response's tokens; an EOS, if any, must be the last.

        Returns
        -------
        float
            The automaton's reward plus the length reward.
        """
        tokens = [int(a) for a in response]
        if tokens and tokens[-1] == self.eos:
            body = tokens[:-1]
            if len(tokens) > self.max_len:
                raise ValueError(f"response: longer than max_len={self.max_len}")
            z = self.automaton.run(body)
            return float(self.automaton.eos_reward[z] + self.length_reward[len(tokens)])
        if len(tokens) != self.max_len:
            raise ValueError("response: without EOS it must have exactly max_len tokens")
        z = self.automaton.run(tokens)
        return float(self.automaton.truncation_reward[z] + self.length_reward[self.max_len])

    def __repr__(self) -> str:
        return (f"LatticeMDP(max_len={self.max_len}, num_states={self.num_states}, "
                f"vocab_size={self.vocab_size})")


def to_token_mdp(mdp: LatticeMDP, *, memory_budget: int | str | None = None) -> TokenMDP:
    """The enumerable :class:`~tokenmdp.exact.TokenMDP` with the same responses and rewards.

    One prompt ``(0,)``, ``vocab_size = V``, ``max_len = T``, reward :meth:`LatticeMDP.reward`;
    only small lattices fit (``(V − 1)^T`` responses, the enumeration's memory budget).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    memory_budget : int or str, optional
        The enumeration's budget (see :class:`~tokenmdp.exact.TokenMDP`).

    Returns
    -------
    TokenMDP
        Its twin.
    """
    if not isinstance(mdp, LatticeMDP):
        raise TypeError(f"mdp: expected a LatticeMDP, got {type(mdp).__name__}")

    def automaton_reward(prompt, response):
        return mdp.reward(response)

    return TokenMDP(mdp.vocab_size, mdp.max_len, automaton_reward, memory_budget=memory_budget)
