"""Hypothesis strategies for batches, layouts, micro-batch splits, estimators and exact MDPs.

All are built with ``@st.composite``, so they shrink: a failing case shrinks towards few groups,
short sequences, one micro-batch, the padded layout. Layouts and splits are small frozen
dataclasses with readable reprs (they appear in Hypothesis' falsifying examples); they draw
their own randomness from a seed they carry, never from a global generator.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from tokenmdp import estimators as _est
from tokenmdp import packing as _pk
from tokenmdp.batch import TokenBatch
from tokenmdp.exact import TokenMDP
from tokenmdp.exact.world import rewards as _rewards

__all__ = ["Layout", "MicroBatchSplit", "estimators", "layouts", "mdps", "micro_batch_splits",
           "token_batches"]

LAYOUT_KINDS = ("as_is", "padded", "flat", "first_fit_decreasing", "in_order")
"""Placements a :class:`Layout` can apply after its optional permutation."""

_LOGPROB_FIELDS = ("behavior_logprob", "old_logprob", "ref_logprob")


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value}: must be at least {minimum}")
    return value


# ------------------------------------------------------------------------------ batches
@st.composite
def token_batches(draw, *, dtype: torch.dtype = torch.float64, max_groups: int = 3,
                  min_group_size: int = 2, max_group_size: int = 3, num_prompts: int = 3,
                  max_prompt_len: int = 3, max_response_len: int = 4, vocab_size: int = 5,
                  with_logprobs: bool | None = None, partial_loss_mask: bool = True,
                  edge_masks: bool = False) -> TokenBatch:
    """Random valid TokenBatches: groups of responses to shared prompts, one sequence per row.

    Parameters
    ----------
    dtype : torch.dtype
        ``torch.float64`` or ``torch.float32``, the dtype of every float field.
    max_groups, min_group_size, max_group_size : int
        1 to ``max_groups`` groups of ``min_group_size`` to ``max_group_size`` sequences. Keep
        ``min_group_size >= 2`` for estimators with a group std or a leave-one-out baseline.
    num_prompts, max_prompt_len : int
        Each group answers one of ``num_prompts`` prompts of 1 to ``max_prompt_len`` tokens
        (two groups may share a prompt, as repeated draws do).
    max_response_len : int
        Responses have 0 to ``max_response_len`` tokens.
    vocab_size : int
        Token ids lie in ``[0, vocab_size)``.
    with_logprobs : bool, optional
        True: ``behavior_logprob``, ``old_logprob`` and ``ref_logprob`` are all set (every
        registered estimator can run); False: none is; None (default): each one is drawn.
    partial_loss_mask : bool
        Sometimes clear ``loss_mask`` on some response tokens (tool outputs, masked spans).
    edge_masks : bool, default False
        Always hold both edge cases of the loss mask, which the random draw reaches only
        rarely: the first sequence has a response (1 token or more) with *no* loss token, and
        the second one (2 tokens or more) has loss tokens and response tokens outside the loss
        mask. The first group then has at least two sequences; needs ``max_group_size >= 2``
        and ``max_response_len >= 2``.

    Returns
    -------
    TokenBatch
        Padded layout; ``reward`` 0/1 (ties likely) or Gaussian, ``advantage`` random on
        loss tokens, ``loss_weight`` 1 on loss tokens; the log-prob fields are random, ``<= 0``
        on loss tokens and 0 elsewhere.
    """
    if dtype not in (torch.float64, torch.float32):
        raise TypeError(f"dtype: expected torch.float64 or torch.float32, got {dtype}")
    _check_int("max_groups", max_groups, 1)
    _check_int("min_group_size", min_group_size, 1)
    _check_int("max_group_size", max_group_size, min_group_size)
    _check_int("num_prompts", num_prompts, 1)
    _check_int("max_prompt_len", max_prompt_len, 1)
    _check_int("max_response_len", max_response_len, 0)
    _check_int("vocab_size", vocab_size, 1)
    if edge_masks and (max_group_size < 2 or max_response_len < 2):
        raise ValueError(f"edge_masks: needs max_group_size >= 2 and max_response_len >= 2 (a "
                         f"masked and a partly masked response), got {max_group_size} and "
                         f"{max_response_len}")
    token = st.integers(0, vocab_size - 1)
    prompt_table = draw(st.lists(st.lists(token, min_size=1, max_size=max_prompt_len),
                                 min_size=num_prompts, max_size=num_prompts))
    sizes = draw(st.lists(st.integers(min_group_size, max_group_size), min_size=1,
                          max_size=max_groups))
    if edge_masks:
        sizes[0] = max(sizes[0], 2)
    prompts, responses, groups, prompt_index = [], [], [], []
    for g, size in enumerate(sizes):
        p = draw(st.integers(0, num_prompts - 1))
        for _ in range(size):
            prompts.append(prompt_table[p])
            shortest = (1, 2)[len(responses)] if edge_masks and len(responses) < 2 else 0
            n = draw(st.integers(shortest, max_response_len))   # uniform, unlike a list's length
            responses.append(draw(st.lists(token, min_size=n, max_size=n)))
            groups.append(g)
            prompt_index.append(p)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    binary = draw(st.booleans())   # 0/1 rewards (verifiable tasks, ties in a group) or Gaussian
    rewards = (rng.integers(0, 2, len(prompts)) if binary else rng.normal(size=len(prompts)))
    batch = TokenBatch.from_sequences(prompts, responses, rewards=rewards.astype(np.float64),
                                      groups=groups, prompt_index=prompt_index, dtype=dtype)
    shape = batch.tokens.shape

    def random_field(values: np.ndarray, where: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(values, dtype=torch.float64).to(dtype)
        return torch.where(where, t, torch.zeros_like(t))

    mask = batch.loss_mask
    if partial_loss_mask and draw(st.booleans()):
        mask = mask & torch.as_tensor(rng.random(shape) < 0.7)
    if edge_masks:
        mask = _edge_masks(batch, mask, rng)
    response = batch.response_mask
    changes = {"loss_mask": mask, "advantage": random_field(rng.normal(size=shape), mask),
               "loss_weight": mask.to(dtype)}
    old = -rng.exponential(1.0, size=shape)
    for name in _LOGPROB_FIELDS:
        present = draw(st.booleans()) if with_logprobs is None else with_logprobs
        if present:
            shift = 0.0 if name == "old_logprob" else rng.normal(scale=0.3, size=shape)
            changes[name] = random_field(np.minimum(old + shift, 0.0), response)
    return batch.replace(**changes)


def _edge_masks(batch: TokenBatch, mask: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """``mask`` with sequence 0's response cleared and, of sequence 1's response, one random
    token cleared and another one kept (the rest as drawn)."""
    response = batch.response_mask
    mask = mask & ~(response & (batch.sequence_id == 0))
    places = torch.nonzero(response & (batch.sequence_id == 1))
    cleared, kept = rng.choice(len(places), size=2, replace=False)
    mask[tuple(places[cleared])] = False
    mask[tuple(places[kept])] = True
    return mask


# ------------------------------------------------------------------------------ layouts
@dataclasses.dataclass(frozen=True)
class Layout:
    """A re-layout ``batch -> batch``: an optional sequence permutation, then a placement.

    Call it on a :class:`~tokenmdp.TokenBatch` to get the same sequences in the new layout.

    Parameters
    ----------
    kind : str
        One of :data:`LAYOUT_KINDS`: keep the places (``as_is``), one sequence per row
        (``padded``), one row (``flat``), or packed rows (``first_fit_decreasing``,
        ``in_order``).
    extra_capacity : int, default 0
        Row capacity beyond the minimum (the longest sequence; for ``flat`` all tokens).
    permutation_seed : int or None, default None
        If set, sequences are renumbered by a random permutation first (so packing sees them in
        another order).
    """

    kind: str
    extra_capacity: int = 0
    permutation_seed: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"kind: expected one of {LAYOUT_KINDS}, got {self.kind!r}")
        _check_int("extra_capacity", self.extra_capacity, 0)

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
        if self.permutation_seed is not None:
            gen = torch.Generator().manual_seed(self.permutation_seed)
            batch = _pk.select_sequences(batch, torch.randperm(batch.num_sequences, generator=gen))
        totals = batch.sequence_lengths_total()
        longest = max(int(totals.max()) if batch.num_sequences else 0, 1)
        capacity = longest + self.extra_capacity
        if self.kind == "padded":
            return _pk.padded_layout(batch, capacity)
        if self.kind == "flat":
            return _pk.flat_layout(batch, max(int(totals.sum()), 1) + self.extra_capacity)
        if self.kind == "first_fit_decreasing":
            return _pk.pack_first_fit_decreasing(batch, capacity)
        if self.kind == "in_order":
            return _pk.pack_in_order(batch, capacity)
        return batch


@st.composite
def layouts(draw, *, kinds: tuple[str, ...] = LAYOUT_KINDS, max_extra_capacity: int = 6,
            permute: bool | None = None) -> Layout:
    """Random :class:`Layout` functions: padded, flat, FFD or in-order packed at a random row
    capacity, or kept in place, after a random sequence permutation (``permute=None``: drawn)."""
    if not kinds or any(k not in LAYOUT_KINDS for k in kinds):
        raise ValueError(f"kinds: expected a non-empty subset of {LAYOUT_KINDS}, got {kinds!r}")
    _check_int("max_extra_capacity", max_extra_capacity, 0)
    kind = draw(st.sampled_from(kinds))
    extra = draw(st.integers(0, max_extra_capacity))
    permuted = draw(st.booleans()) if permute is None else permute
    return Layout(kind, extra, draw(st.integers(0, 2**31 - 1)) if permuted else None)


# ------------------------------------------------------------------------------ micro-batches
@dataclasses.dataclass(frozen=True)
class MicroBatchSplit:
    """A split ``batch -> list of micro-batches`` holding every sequence exactly once.

    Call it on a :class:`~tokenmdp.TokenBatch` to get the list of micro-batches.

    Parameters
    ----------
    num_micro_batches : int
        Requested count; capped at the number of rows (``by_rows``) or of sequences.
    by_rows : bool, default True
        True: re-lay the batch out with ``layout`` and cut its rows in order
        (:func:`tokenmdp.packing.split_micro_batches`, the trainer's way). False: cut a random
        permutation of the sequences into contiguous chunks of random sizes, then re-lay each
        chunk out with ``layout``.
    layout : Layout or None, default None
        The re-layout applied (None: the places are kept).
    seed : int, default 0
        Seed of the permutation and chunk sizes (``by_rows=False``).
    """

    num_micro_batches: int
    by_rows: bool = True
    layout: Layout | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("num_micro_batches", self.num_micro_batches, 1)
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise TypeError(f"layout: expected a Layout or None, got {type(self.layout).__name__}")

    def __call__(self, batch: TokenBatch) -> list[TokenBatch]:
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
        if self.by_rows:
            laid = self.layout(batch) if self.layout is not None else batch
            k = min(self.num_micro_batches, max(laid.num_rows, 1))
            return [mb.batch for mb in _pk.split_micro_batches(laid, k)] if laid.num_rows else [laid]
        num = batch.num_sequences
        k = min(self.num_micro_batches, max(num, 1))
        gen = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(num, generator=gen)
        cuts = (torch.randperm(max(num - 1, 0), generator=gen)[: k - 1] + 1).sort().values
        bounds = [0, *cuts.tolist(), num]
        parts = [_pk.select_sequences(batch, order[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        return [self.layout(p) if self.layout is not None else p for p in parts]


@st.composite
def micro_batch_splits(draw, *, max_micro_batches: int = 4, by_rows: bool | None = None
                       ) -> MicroBatchSplit:
    """Random :class:`MicroBatchSplit` into 1 to ``max_micro_batches`` micro-batches, cut by
    rows of a random layout or by random groups of sequences (``by_rows=None``: drawn)."""
    _check_int("max_micro_batches", max_micro_batches, 1)
    rows = draw(st.booleans()) if by_rows is None else by_rows
    layout = draw(st.none() | layouts())
    return MicroBatchSplit(draw(st.integers(1, max_micro_batches)), rows, layout,
                           draw(st.integers(0, 2**31 - 1)))


# ------------------------------------------------------------------------------ estimators
@st.composite
def estimators(draw, *, names: tuple[str, ...] | None = None,
               aggregations: tuple[_est.Aggregation, ...] | None = None) -> _est.Estimator:
    """Registry entries sampled by name (default: all of :func:`tokenmdp.estimators.names`),
    with the aggregation replaced by one of ``aggregations`` when given."""
    known = _est.names()
    names = known if names is None else tuple(names)
    if not names or any(n not in known for n in names):
        raise ValueError(f"names: expected a non-empty subset of the registry, got {names!r}")
    if aggregations is not None and (not aggregations or not all(
            isinstance(a, _est.Aggregation) for a in aggregations)):
        raise ValueError(f"aggregations: expected a non-empty tuple of Aggregation, "
                         f"got {aggregations!r}")
    est = _est.get(draw(st.sampled_from(names)))
    if aggregations is not None:
        est = est.replace(aggregation=draw(st.sampled_from(aggregations)))
    return est


# ------------------------------------------------------------------------------ exact MDPs
@st.composite
def mdps(draw, *, max_vocab_size: int = 4, max_len: int = 3, max_prompts: int = 3,
         max_prompt_len: int = 2) -> TokenMDP:
    """Small exact :class:`~tokenmdp.exact.TokenMDP` with a built-in reward.

    Vocabulary 2 to ``max_vocab_size`` (EOS last), response length limit 1 to ``max_len``,
    1 to ``max_prompts`` distinct prompts of 1 to ``max_prompt_len`` tokens with random
    probabilities, and one of the rewards of :mod:`tokenmdp.exact.world.rewards` (a seeded random
    table, with or without a length term, a token count, a parity).
    """
    _check_int("max_vocab_size", max_vocab_size, 2)
    _check_int("max_len", max_len, 1)
    _check_int("max_prompts", max_prompts, 1)
    _check_int("max_prompt_len", max_prompt_len, 1)
    vocab = draw(st.integers(2, max_vocab_size))
    length = draw(st.integers(1, max_len))
    prompt = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_prompt_len).map(tuple)
    prompts = draw(st.lists(prompt, min_size=1, max_size=max_prompts, unique=True))
    weights = np.asarray(draw(st.lists(st.integers(1, 4), min_size=len(prompts),
                                       max_size=len(prompts))), dtype=np.float64)
    seed = draw(st.integers(0, 2**31 - 1))
    reward = draw(st.sampled_from((
        _rewards.RandomTable(seed),
        _rewards.LengthReward(-0.2, content=_rewards.RandomTable(seed)),
        _rewards.TokenCount(0),
        _rewards.Parity(1),
    )))
    return TokenMDP(vocab, length, reward, prompts=prompts,
                    prompt_probs=(weights / weights.sum()).tolist())
