"""The exact token MDP: a finite prompt distribution, a vocabulary with EOS, a length limit.

State ``s_t = (x, y_<t)``, action ``a_t = y_t``, deterministic transitions, terminal reward
``R(x, y)``. A response ends at EOS or is truncated after ``max_len`` tokens, so every response is
one of

* ``k`` non-EOS tokens followed by EOS, for ``k = 0 .. L-1`` (length ``k + 1``), or
* ``L`` non-EOS tokens (truncated),

and per prompt there are ``sum_{k=0}^{L} b^k`` responses with ``b = V - 1`` (the closed form of
:attr:`TokenMDP.responses_per_prompt`).

Indexing. The non-terminal states at depth ``k`` (``k`` response tokens, none of them EOS) of
prompt ``p`` are numbered by the base-``b`` code of their prefix, most significant token first,
so the children of code ``c`` are ``c * b + a``. Global state ids run level by level:
``state = level_offset[k] + p * b**k + code``. Terminals (full responses) are ordered prompt-major,
then by level (EOS after 0, 1, ..., L-1 tokens, then the truncated ones), then by code; this is
the order of :meth:`TokenMDP.enumerate` and of every per-sequence tensor in :mod:`tokenmdp.exact`.

This module holds the world, its counts and its indexing; the enumeration (the terminal
layout, the reward table) and the batch-side methods (:meth:`TokenMDP.make_batch`,
:meth:`TokenMDP.check_batch`, :meth:`TokenMDP.token_state_index`) are implemented in
``tokenmdp.exact.world._enumeration``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

import numpy as np
import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.exact.world import _enumeration
from tokenmdp.exact.world.budget import check_budget, check_countable

__all__ = ["TokenMDP"]

#: Tolerance on ``sum(prompt_probs) == 1``.
PROB_SUM_TOL = 1e-9
#: Estimated bytes per token of the enumerated batch and the per-token tensors built on it
#: (three long and two float64 fields, a mask, the policies' log-probs).
BYTES_PER_TOKEN = 64


def enumeration_bytes(num_sequences: int, max_prompt_len: int, max_len: int) -> int:
    """Estimated memory of enumerating ``num_sequences`` sequences: the terminal layout
    (``max_len + 3`` longs each) plus the padded batch (:data:`BYTES_PER_TOKEN` per token)."""
    return num_sequences * (8 * (max_len + 3) + BYTES_PER_TOKEN * (max_prompt_len + max_len))


def _token_id(t, prompt: int) -> int:
    """``t`` as a token id: an integer (or an integral float), never a truncated fraction."""
    if isinstance(t, torch.Tensor) and t.numel() == 1:
        t = t.item()
    if isinstance(t, bool) or not isinstance(t, (int, np.integer, float, np.floating)) or \
            (isinstance(t, (float, np.floating)) and not float(t).is_integer()):
        raise ValueError(f"prompts: prompt {prompt} has a token id that is not an integer: {t!r}")
    return int(t)


class TokenMDP:
    """An enumerable token-level MDP.

    Parameters
    ----------
    vocab_size : int
        Number of tokens ``V >= 2``; token ``V - 1`` is EOS.
    max_len : int
        Maximum response length ``L >= 1``; longer responses are truncated.
    reward : callable
        ``reward(prompt, response) -> float`` with token tuples. Built-in rewards in
        :mod:`tokenmdp.exact.world.rewards` also offer a vectorized form used when present.
    prompts : sequence of token sequences
        The prompts ``x`` (each at least one token). Default: one prompt ``(0,)``.
    prompt_probs : sequence of float, optional
        ``D(x)``; default uniform. Must be non-negative and sum to 1.
    memory_budget : int or str, optional
        Bytes the enumeration may need (default: :func:`~tokenmdp.exact.world.budget.memory_budget`,
        2 GiB or ``$TOKENMDP_MEMORY_BUDGET``).

    Raises
    ------
    ValueError
        On ``vocab_size < 2``, ``max_len < 1``, empty or malformed prompts, probabilities that do
        not sum to 1, a world whose enumeration would exceed the memory budget (refused from the
        closed-form count before allocating), or a reward returning a non-finite or non-numeric
        value (raised when rewards are first evaluated, which is at construction).
    """

    def __init__(self, vocab_size: int, max_len: int, reward: Callable[[tuple, tuple], float], *,
                 prompts: Sequence[Sequence[int]] = ((0,),),
                 prompt_probs: Sequence[float] | None = None,
                 memory_budget: int | str | None = None) -> None:
        if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool):
            raise TypeError(f"vocab_size: expected an int, got {type(vocab_size).__name__}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size: must be >= 2 (one token plus EOS), got {vocab_size}")
        if not isinstance(max_len, (int, np.integer)) or isinstance(max_len, bool):
            raise TypeError(f"max_len: expected an int, got {type(max_len).__name__}")
        if max_len < 1:
            raise ValueError(f"max_len: must be >= 1, got {max_len}")
        if not callable(reward):
            raise TypeError(f"reward: expected a callable (prompt, response) -> float, got "
                            f"{type(reward).__name__}")
        prompts = [tuple(_token_id(t, i) for t in p) for i, p in enumerate(prompts)]
        if not prompts:
            raise ValueError("prompts: need at least one prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts: prompt {i} is empty")
            if min(p) < 0 or max(p) >= vocab_size:
                raise ValueError(f"prompts: prompt {i} has token ids outside [0, {vocab_size})")
        if len(set(prompts)) != len(prompts):
            raise ValueError("prompts: prompts must be distinct")
        if prompt_probs is None:
            probs = np.full(len(prompts), 1.0 / len(prompts))
        else:
            probs = np.asarray(prompt_probs, dtype=np.float64)
            if probs.shape != (len(prompts),):
                raise ValueError(f"prompt_probs: expected {len(prompts)} values, got shape "
                                 f"{probs.shape}")
            if not np.all(np.isfinite(probs)) or np.any(probs < 0):
                raise ValueError("prompt_probs: must be finite and non-negative")
            if abs(probs.sum() - 1.0) > PROB_SUM_TOL:
                raise ValueError(f"prompt_probs: must sum to 1, sum is {probs.sum():.12g}")
        self.vocab_size = int(vocab_size)
        self.max_len = int(max_len)
        self.prompts: tuple[tuple[int, ...], ...] = tuple(prompts)
        check_countable(self.vocab_size, self.max_len, len(prompts))
        check_budget(f"vocab_size={self.vocab_size}, max_len={self.max_len}, "
                     f"{len(prompts)} prompt(s)", self.num_sequences, "sequences",
                     enumeration_bytes(self.num_sequences, max(map(len, prompts)), self.max_len),
                     memory_budget=memory_budget)
        self.reward_fn = reward
        self.prompt_probs = torch.as_tensor(probs, dtype=torch.float64)
        _ = self.rewards  # evaluate (and validate) the reward table now

    # ------------------------------------------------------------------ sizes
    @property
    def eos(self) -> int:
        """The EOS token id, ``V - 1``."""
        return self.vocab_size - 1

    @property
    def branching(self) -> int:
        """``b = V - 1``, the number of non-EOS tokens."""
        return self.vocab_size - 1

    @property
    def num_prompts(self) -> int:
        """Number of prompts ``P``."""
        return len(self.prompts)

    @property
    def responses_per_prompt(self) -> int:
        """``sum_{k=0}^{L} b^k`` responses per prompt (closed form)."""
        b, L = self.branching, self.max_len
        return L + 1 if b == 1 else (b ** (L + 1) - 1) // (b - 1)

    @property
    def num_sequences(self) -> int:
        """Total number of (prompt, response) pairs, ``P * sum_{k=0}^{L} b^k``."""
        return self.num_prompts * self.responses_per_prompt

    def level_size(self, k: int) -> int:
        """Number of non-terminal states at depth ``k`` per prompt, ``b^k``.

        Parameters
        ----------
        k : int
            Depth: the number of response tokens so far, ``0 .. L``.

        Returns
        -------
        int
            ``b^k`` prefixes of ``k`` non-EOS tokens.
        """
        return self.branching ** k

    @cached_property
    def level_offsets(self) -> tuple[int, ...]:
        """Global id of the first state of each depth ``0 .. L`` (the last entry is the total)."""
        offs = [0]
        for k in range(self.max_len):
            offs.append(offs[-1] + self.num_prompts * self.level_size(k))
        return tuple(offs)

    @property
    def num_states(self) -> int:
        """Number of non-terminal states (prefixes where the policy acts)."""
        return self.level_offsets[-1]

    # ------------------------------------------------------------------ prefixes
    def level_prefixes(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All states at depth ``k``: prompt index ``[N]`` and prefix tokens ``[N, k]``.

        ``N = P * b^k``, ordered by (prompt, code), i.e. by global state id.

        Parameters
        ----------
        k : int
            Depth: ``k`` response tokens so far (the policy acts at ``0 .. L - 1``).

        Returns
        -------
        prompt_index : LongTensor ``[N]``
            Prompt of each state.
        prefix : LongTensor ``[N, k]``
            Its ``k`` response tokens so far.
        """
        n = self.level_size(k)
        prompt_index = torch.arange(self.num_prompts).repeat_interleave(n)
        prefix = torch.empty(self.num_prompts, n, k, dtype=torch.long)
        _enumeration.prefix_digits(prefix, self.branching, k)
        return prompt_index, prefix.view(self.num_prompts * n, k)

    def decode(self, codes: torch.Tensor, k: int) -> torch.Tensor:
        """Base-``b`` digits (most significant first) ``[N, k]`` of prefix codes ``[N]``.

        Parameters
        ----------
        codes : LongTensor ``[N]``
            Prefix codes, each in ``[0, b^k)``.
        k : int
            Prefix length.

        Returns
        -------
        LongTensor ``[N, k]``
            The prefixes' non-EOS tokens.
        """
        powers = self.branching ** torch.arange(k - 1, -1, -1, dtype=torch.long)
        return (codes[:, None] // powers) % self.branching

    def encode(self, prefix: torch.Tensor) -> torch.Tensor:
        """Codes ``[N]`` of prefixes ``[N, k]`` of non-EOS tokens (inverse of :meth:`decode`).

        Parameters
        ----------
        prefix : LongTensor ``[N, k]``
            Prefixes of non-EOS tokens (ids below ``b``).

        Returns
        -------
        LongTensor ``[N]``
            ``Σ_j prefix[:, j] b^(k-1-j)``.
        """
        k = prefix.shape[1]
        powers = self.branching ** torch.arange(k - 1, -1, -1, dtype=torch.long)
        return (prefix.long() * powers).sum(-1)

    def state_index(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """Global state ids ``[N]`` of states given by prompt index ``[N]`` and prefix ``[N, k]``.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
            Prompt of each state.
        prefix : LongTensor ``[N, k]``
            Its response tokens so far (non-EOS; one depth ``k < L`` for all).

        Returns
        -------
        LongTensor ``[N]``
            ``level_offset[k] + prompt_index * b^k + code``, in ``[0, num_states)``.
        """
        k = prefix.shape[1]
        return self.level_offsets[k] + prompt_index * self.level_size(k) + self.encode(prefix)

    # ------------------------------------------------------------------ terminals
    @cached_property
    def _terminal_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per terminal in canonical order: prompt index ``[N]``, responses ``[N, L]`` (padded
        with EOS), response lengths ``[N]``."""
        return _enumeration.terminal_layout(self)

    @cached_property
    def rewards(self) -> torch.Tensor:
        """Float64 ``[N]``: ``R(x, y)`` of every terminal in canonical order."""
        return _enumeration.reward_table(self)

    @property
    def terminal_prompt_index(self) -> torch.Tensor:
        """Long ``[N]``: prompt index of every terminal."""
        return self._terminal_layout[0]

    @property
    def terminal_lengths(self) -> torch.Tensor:
        """Long ``[N]``: response length ``|y|`` of every terminal."""
        return self._terminal_layout[2]

    def responses(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Every (prompt, response) pair in canonical order, as token tuples.

        Returns
        -------
        list of (tuple of int, tuple of int)
            ``num_sequences`` pairs, in the order of :meth:`enumerate` and :attr:`rewards`.
        """
        pidx, resp, lengths = self._terminal_layout
        return [(self.prompts[p], tuple(r[:n])) for p, r, n in
                zip(pidx.tolist(), resp.tolist(), lengths.tolist())]

    def terminal_index(self, prompt_index: torch.Tensor, responses: torch.Tensor,
                       lengths: torch.Tensor) -> torch.Tensor:
        """Canonical terminal ids ``[N]`` of responses ``[N, >=L]`` (EOS-padded) with ``lengths``.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
            Prompt of each response.
        responses : LongTensor ``[N, >=L]``
            Response tokens, EOS-padded after ``lengths``.
        lengths : LongTensor ``[N]``
            Response lengths, EOS included (``L`` for a truncated response).

        Returns
        -------
        LongTensor ``[N]``
            Row of each (prompt, response) in :meth:`enumerate` and :attr:`rewards`.
        """
        b, L = self.branching, self.max_len
        ends_eos = responses.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0] == self.eos
        depth = torch.where(ends_eos, lengths - 1, torch.full_like(lengths, L))
        cols = torch.arange(L)
        digits = torch.where(cols[None, :] < depth[:, None], responses[:, :L], 0)
        # code of the depth-k prefix: sum_j y_j b^(k-1-j); shift the full-width code right by L-k
        full = (digits * (b ** torch.arange(L - 1, -1, -1))).sum(1)
        code = full // (b ** (L - depth))
        block = torch.tensor([sum(b ** j for j in range(k)) for k in range(L + 1)])
        return prompt_index * self.responses_per_prompt + block[depth] + code

    def make_batch(self, prompt_index: torch.Tensor, responses: torch.Tensor,
                   lengths: torch.Tensor, *, behavior_logprob: torch.Tensor | None = None,
                   group: torch.Tensor | None = None) -> TokenBatch:
        """A padded TokenBatch (one sequence per row) of responses to this MDP's prompts.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
        responses : LongTensor ``[N, L]``
            Response tokens, padded with anything after ``lengths``.
        lengths : LongTensor ``[N]``
        behavior_logprob : float64 ``[N, L]``, optional
            Log-prob of each response token under the sampling policy.
        group : LongTensor ``[N]``, optional
            Group ids (default: the prompt index).

        Returns
        -------
        TokenBatch
            ``reward`` is ``R(x, y)`` looked up in the reward table; advantage and loss weight 1
            on response tokens.
        """
        return _enumeration.make_batch(self, prompt_index, responses, lengths,
                                       behavior_logprob=behavior_logprob, group=group)

    def enumerate(self) -> TokenBatch:
        """Every (prompt, response) exactly once, one sequence per row, in canonical order.

        ``reward`` holds ``R(x, y)``, ``group`` and ``prompt_index`` the prompt index;
        ``advantage`` and ``loss_weight`` are 1 on response tokens (float64).

        Returns
        -------
        TokenBatch
            ``num_sequences`` rows, sequence ``i`` the ``i``-th terminal.
        """
        pidx, resp, lengths = self._terminal_layout
        return self.make_batch(pidx, resp, lengths)

    def token_state_index(self, batch: TokenBatch) -> torch.Tensor:
        """Long ``[R, C]``: the global id of the state each response token was drawn in, -1 elsewhere.

        Parameters
        ----------
        batch : TokenBatch
            Float64 sequences of this MDP, any layout (checked by :meth:`check_batch`).

        Returns
        -------
        LongTensor ``[R, C]``
            State id (:meth:`state_index`) of every response token, -1 on prompt and padding.
        """
        return _enumeration.token_state_index(self, batch)

    # ------------------------------------------------------------------ membership
    def check_batch(self, batch: TokenBatch, *, name: str = "batch") -> None:
        """Raise unless ``batch`` is a float64 batch of valid (prompt, response) pairs of this MDP.

        Parameters
        ----------
        batch : TokenBatch
            The batch to check, any layout.
        name : str, default "batch"
            The argument name the error messages start with.

        Raises
        ------
        TypeError
            If ``batch`` is not a TokenBatch or its float fields are not float64 (the exact code
            never casts silently).
        ValueError
            If a sequence is not a (prompt, response) of this MDP.
        """
        _enumeration.check_batch(self, batch, name=name)

    def __repr__(self) -> str:
        return (f"TokenMDP(vocab_size={self.vocab_size}, max_len={self.max_len}, "
                f"prompts={self.num_prompts}, sequences={self.num_sequences}, "
                f"reward={getattr(self.reward_fn, '__name__', type(self.reward_fn).__name__)})")

