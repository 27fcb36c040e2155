"""Reward functions ``R(x, y)`` for the exact token MDP.

A reward is any callable ``reward(prompt, response) -> float`` on token tuples. The built-in ones
below also offer ``vectorized(prompts, prompt_index, responses, lengths, *, eos)`` over every
terminal at once (``responses`` is ``[N, L]`` padded with EOS), which :class:`~tokenmdp.exact.TokenMDP`
uses when present; their ``__call__`` runs the same vectorized code on one row, so the two forms
cannot disagree. A reward may also offer ``on_prefix_tree(prompts, vocab_size, max_len)``, its
values over a whole enumeration in canonical order (:class:`RandomTable` does, walking its hash
once per prefix): the MDP then never builds the ``[N, L]`` responses to evaluate it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from tokenmdp.exact.world import _hashing

__all__ = ["Reward", "ExactMatch", "ContainsPattern", "TokenCount", "Parity", "LengthReward",
           "RandomTable", "OverlongPenalty"]


def _np(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class Reward:
    """Base class: a subclass implements ``_rewards`` (its rule on NumPy arrays, which
    :meth:`~Reward.vectorized` calls after converting its inputs once) or overrides
    :meth:`~Reward.vectorized` itself; ``__call__`` evaluates one sequence."""

    def vectorized(self, prompts: Sequence[tuple[int, ...]], prompt_index, responses, lengths, *,
                   eos: int) -> np.ndarray:
        """Rewards ``[N]`` of responses ``[N, L]`` (EOS-padded) with ``lengths`` ``[N]``.

        Parameters
        ----------
        prompts : sequence of tuple of int
            The MDP's prompts, as token tuples.
        prompt_index : array ``[N]``
            The prompt of each response (index into ``prompts``).
        responses : array ``[N, L]``
            Integer response tokens, padded with ``eos`` after the response's end.
        lengths : array ``[N]``
            Response lengths ``|y|`` (EOS included when the response has one).
        eos : int
            The EOS token id.

        Returns
        -------
        ndarray ``[N]``
            Float64 rewards.
        """
        return self._rewards(prompts, _np(prompt_index), _np(responses), _np(lengths), eos)

    def _rewards(self, prompts, prompt_index, responses, lengths, eos) -> np.ndarray:
        """The rule itself, on NumPy arrays (what a subclass implements)."""
        raise NotImplementedError

    def __call__(self, prompt: Sequence[int], response: Sequence[int], *, eos: int | None = None
                 ) -> float:
        """``R(prompt, response)``; ``eos`` defaults to the last token if it looks like EOS."""
        response = tuple(int(t) for t in response)
        if eos is None:
            eos = getattr(self, "eos", None)
        if eos is None:
            raise ValueError(f"{type(self).__name__}: pass eos= (or construct with eos=) to "
                             "evaluate a single sequence outside an MDP")
        row = np.full((1, max(len(response), 1)), eos, dtype=np.int64)
        row[0, :len(response)] = response
        out = self.vectorized((tuple(prompt),), np.zeros(1, dtype=np.int64), row,
                              np.array([len(response)]), eos=eos)
        return float(out[0])

    @property
    def __name__(self) -> str:  # used in reprs
        return type(self).__name__


def _content_mask(responses: np.ndarray, lengths: np.ndarray, eos: int) -> np.ndarray:
    """True on response tokens that are not EOS (the content)."""
    cols = np.arange(responses.shape[1])[None, :]
    return (cols < lengths[:, None]) & (responses != eos)


class ExactMatch(Reward):
    """1 when the response equals the target (including its EOS, if the target has one), else 0.

    Parameters
    ----------
    target : tuple of int, or mapping prompt -> tuple
        The target response, the same for every prompt or one per prompt (keyed by prompt tuple).
    eos : int, optional
        EOS id, needed only to call the reward on a single sequence outside an MDP.
    """

    def __init__(self, target: Sequence[int] | Mapping[tuple[int, ...], Sequence[int]], *,
                 eos: int | None = None) -> None:
        if isinstance(target, Mapping):
            self.targets = {tuple(k): tuple(int(t) for t in v) for k, v in target.items()}
        else:
            self.targets = {None: tuple(int(t) for t in target)}
        self.eos = eos

    def _rewards(self, prompts, prompt_index, responses, lengths, eos):
        # 1.0 where the response equals its prompt's target, else 0.0.
        out = np.zeros(len(lengths))
        for p, prompt in enumerate(prompts):
            target = self.targets.get(prompt, self.targets.get(None))
            if target is None:
                raise ValueError(f"reward: ExactMatch has no target for prompt {prompt}")
            rows = prompt_index == p
            if len(target) > responses.shape[1]:
                continue
            padded = np.full(responses.shape[1], eos)
            padded[:len(target)] = target
            out[rows] = ((responses[rows] == padded).all(1) & (lengths[rows] == len(target)))
        return out


class ContainsPattern(Reward):
    """1 when the pattern occurs as a contiguous run of the response's tokens, else 0.

    Parameters
    ----------
    pattern : sequence of int
        The tokens to look for, non-empty (EOS may be part of it).
    eos : int, optional
        EOS id, needed only to call the reward on a single sequence outside an MDP.
    """

    def __init__(self, pattern: Sequence[int], *, eos: int | None = None) -> None:
        self.pattern = tuple(int(t) for t in pattern)
        if not self.pattern:
            raise ValueError("pattern: must be non-empty")
        self.eos = eos

    def _rewards(self, prompts, prompt_index, responses, lengths, eos):
        # 1.0 where the pattern occurs within the response's length, else 0.0.
        n, width = responses.shape
        m = len(self.pattern)
        found = np.zeros(n, dtype=bool)
        for start in range(0, width - m + 1):
            window = responses[:, start:start + m] == np.array(self.pattern)
            found |= window.all(1) & (start + m <= lengths)
        return found.astype(np.float64)


class TokenCount(Reward):
    """``scale`` x the number of occurrences of ``token`` in the response.

    Parameters
    ----------
    token : int
        The token counted (EOS never counts).
    scale : float, default 1.0
        The reward per occurrence.
    eos : int, optional
        EOS id, needed only to call the reward on a single sequence outside an MDP.
    """

    def __init__(self, token: int, *, scale: float = 1.0, eos: int | None = None) -> None:
        self.token, self.scale, self.eos = int(token), float(scale), eos

    def _rewards(self, prompts, prompt_index, responses, lengths, eos):
        # scale times the count of the token among each response's non-EOS tokens
        mask = _content_mask(responses, lengths, eos)
        return self.scale * ((responses == self.token) & mask).sum(1).astype(np.float64)


class Parity(Reward):
    """1 when the sum of the response's non-EOS token ids has the given parity (0 even, 1 odd).

    Parameters
    ----------
    parity : {0, 1}, default 0
        The rewarded parity of the sum.
    eos : int, optional
        EOS id, needed only to call the reward on a single sequence outside an MDP.
    """

    def __init__(self, parity: int = 0, *, eos: int | None = None) -> None:
        if parity not in (0, 1):
            raise ValueError(f"parity: must be 0 or 1, got {parity}")
        self.parity, self.eos = parity, eos

    def _rewards(self, prompts, prompt_index, responses, lengths, eos):
        # 1.0 where the sum of the non-EOS tokens has the parity, else 0.0.
        total = np.where(_content_mask(responses, lengths, eos), responses, 0).sum(1)
        return (total % 2 == self.parity).astype(np.float64)


class LengthReward(Reward):
    """A reward correlated with length: ``base + per_token * |y| + content(x, y)``.

    With ``per_token < 0`` long responses are worse (wrong answers ramble), with ``per_token > 0``
    better; ``content`` adds any other reward. Used for the length-bias studies.

    Parameters
    ----------
    per_token : float
        The reward per response token ``|y|`` (EOS included).
    base : float, default 0.0
        A constant added to every reward.
    content : Reward, optional
        A reward added on top (its ``vectorized`` is used).
    eos : int, optional
        EOS id, needed only to call the reward on a single sequence outside an MDP.
    """

    def __init__(self, per_token: float, *, base: float = 0.0, content: Reward | None = None,
                 eos: int | None = None) -> None:
        self.per_token, self.base, self.content, self.eos = float(per_token), float(base), content, eos

    def _rewards(self, prompts, prompt_index, responses, lengths, eos):
        # base + per_token |y|, plus the content reward when given
        out = self.base + self.per_token * lengths.astype(np.float64)
        if self.content is not None:
            out = out + self.content.vectorized(prompts, prompt_index, responses, lengths, eos=eos)
        return out


class RandomTable(Reward):
    """A seeded random reward per (prompt, response): uniform in ``[low, high)`` or Bernoulli.

    The value is a hash of (seed, prompt tokens, response tokens), so it does not depend on the
    enumeration order, and the same seed always gives the same table.

    Parameters
    ----------
    seed : int
        Seed of the table.
    low, high : float
        Range of the uniform values.
    binary_p : float, optional
        If given, rewards are 1 with probability ``binary_p`` and 0 otherwise.
    eos : int, optional
        EOS id, needed only to call the reward on a single sequence outside an MDP.
    """

    def __init__(self, seed: int, *, low: float = 0.0, high: float = 1.0,
                 binary_p: float | None = None, eos: int | None = None) -> None:
        if binary_p is not None and not 0.0 <= binary_p <= 1.0:
            raise ValueError(f"binary_p: must be in [0, 1], got {binary_p}")
        self.seed, self.low, self.high, self.binary_p, self.eos = (int(seed), float(low),
                                                                    float(high), binary_p, eos)

    def _rewards(self, prompts, prompt_index, responses, lengths, eos):
        # the table's value of each (prompt, response), from the hash
        u = _hashing.table_hash(self.seed, prompts, prompt_index, responses, lengths)
        return self._scale(u)

    def on_prefix_tree(self, prompts, vocab_size: int, max_len: int) -> np.ndarray:
        """The table's value of every (prompt, response) of an MDP, in canonical order.

        The same values as :meth:`~Reward.vectorized` over the MDP's enumeration, bit for bit, walking
        the hash chain once per prefix instead of once per response token
        (:class:`~tokenmdp.exact.TokenMDP` uses this form when a reward offers it).

        Parameters
        ----------
        prompts : sequence of tuple of int
            The MDP's prompts.
        vocab_size : int
            ``V``; token ``V - 1`` is EOS.
        max_len : int
            The MDP's response length limit ``L``.

        Returns
        -------
        ndarray ``[P * Σ_{k<=L} (V-1)^k]``
            Float64 rewards, prompt-major, in the order of :meth:`TokenMDP.enumerate
            <tokenmdp.exact.TokenMDP.enumerate>`.
        """
        return self._scale(_hashing.tree_hash(self.seed, prompts, vocab_size - 1, max_len,
                                              vocab_size - 1))

    def _scale(self, u: np.ndarray) -> np.ndarray:
        if self.binary_p is not None:
            return (u < self.binary_p).astype(np.float64)
        u *= self.high - self.low
        u += self.low
        return u


class OverlongPenalty(Reward):
    """DAPO's soft overlong punishment added to a base reward (Yu et al. 2025, arXiv 2503.14476, Eq. 13).

    ``R_len(y) = 0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``L_max - L_cache < |y| <= L_max``; ``-1`` beyond; ``penalty`` scales the term. A response
    cut at the limit without EOS exceeded the budget, so with ``truncated_is_overlong`` (default)
    it gets ``-1`` too.

    Parameters
    ----------
    base : callable
        The base reward: a :class:`Reward` (its ``vectorized`` is used) or any
        ``base(prompt, response) -> float``.
    max_len : int
        ``L_max``, the length budget.
    cache_len : int
        ``L_cache``, the soft-punishment interval, ``1 <= cache_len <= max_len``.
    penalty : float, default 1.0
        The scale of the length term.
    truncated_is_overlong : bool, default True
        A response that reaches ``max_len`` without EOS gets the full ``-penalty``.
    eos : int, optional
        EOS id, needed only to call the reward on a single sequence outside an MDP.
    """

    def __init__(self, base: Callable[..., float], *, max_len: int, cache_len: int,
                 penalty: float = 1.0, truncated_is_overlong: bool = True,
                 eos: int | None = None) -> None:
        if cache_len < 1 or cache_len > max_len:
            raise ValueError(f"cache_len: must be in [1, max_len={max_len}], got {cache_len}")
        self.base, self.max_len, self.cache_len, self.penalty = base, max_len, cache_len, penalty
        self.truncated_is_overlong, self.eos = truncated_is_overlong, eos

    def length_term(self, responses, lengths, *, eos) -> np.ndarray:
        """The penalty term alone, ``[N]``.

        Parameters
        ----------
        responses : array ``[N, L]``
            Integer response tokens, EOS-padded.
        lengths : array ``[N]``
            Response lengths ``|y|``.
        eos : int
            The EOS token id.

        Returns
        -------
        ndarray ``[N]``
            Float64 ``penalty · R_len(y)``, in ``[-penalty, 0]`` for ``penalty >= 0``.
        """
        responses, lengths = _np(responses), _np(lengths).astype(np.float64)
        start = self.max_len - self.cache_len
        term = np.where(lengths <= start, 0.0, (start - lengths) / self.cache_len)
        term = np.where(lengths > self.max_len, -1.0, term)
        if self.truncated_is_overlong:
            last = responses[np.arange(len(lengths)), np.maximum(lengths.astype(int) - 1, 0)]
            truncated = (lengths >= self.max_len) & (last != eos)
            term = np.where(truncated, -1.0, term)
        return self.penalty * term

    def _rewards(self, prompts, prompt_index, responses, lengths, eos):
        # the base reward plus the length term
        vec = getattr(self.base, "vectorized", None)
        if vec is not None:
            base = vec(prompts, prompt_index, responses, lengths, eos=eos)
        else:
            base = np.array([float(self.base(prompts[int(i)], tuple(int(t) for t in row[:k])))
                             for i, row, k in zip(prompt_index, responses, lengths)])
        return base + self.length_term(responses, lengths, eos=eos)
