"""Aggregation: how the token terms of one optimizer step are averaged, as per-token weights.

The loss of a step is ``-sum_tokens loss_weight * term``. Every averaging rule in use is a choice
of ``loss_weight``, computed **once for the whole optimizer step** from counts that cover every
micro-batch and every data-parallel rank (pass them in; the defaults count the batch at hand,
which is right only when that batch is the whole step). Summing micro-batch losses then gives
the full-step loss exactly, whatever the layout, micro-batch size or rank count.

| :class:`Aggregation`           | weight of a loss token of sequence i | verl ``loss_agg_mode``   | TRL ``loss_type``   |
|--------------------------------|---------------------------------------|--------------------------|---------------------|
| ``TOKEN_MEAN``                 | ``1 / N_tokens``                      | token-mean               | dapo                |
| ``SEQUENCE_MEAN_TOKEN_MEAN``   | ``1 / (S |y_i|)``                     | seq-mean-token-mean      | grpo                |
| ``SEQUENCE_MEAN_TOKEN_SUM``    | ``1 / S``                             | seq-mean-token-sum       | --                  |
| ``CONSTANT``                   | ``1 / (S L_max)``                     | seq-mean-token-sum-norm  | dr_grpo             |
| ``TOKEN_SUM``                  | ``1``                                 | token-sum                | --                  |
| ``PROMPT_MEAN_TOKEN_MEAN``     | ``1 / (P N_g)``, i in group g         | --  (SkyRL prompt-mean)  | --                  |

``N_tokens`` counts loss tokens, ``|y_i|`` the loss tokens of sequence i (a sequence never spans
two micro-batches, so it is always local), ``N_g`` the loss tokens of group g and ``P`` the groups
of the step. ``S`` counts **every sampled sequence** of the step, a fully masked one included
(:attr:`SequenceCount.SAMPLED`, the default: verl's constant global batch size, TRL's ``.mean()``
over completions, the Dr. GRPO paper's ``1/G``), so masking a truncated completion does not change
the other sequences' weights; :attr:`SequenceCount.WITH_LOSS_TOKENS` counts only the sequences
(and ``P`` only the groups) with at least one loss token. ``L_max`` of ``CONSTANT`` is any
positive constant (verl's ``loss_scale_factor``; by default the response-length budget).
A mean of per-micro-batch means (TRL's ``bnpo``) is a different estimator that depends on the
micro-batch size; it exists only as the named counter-example
:func:`tokenmdp.estimators.per_micro_batch_token_mean_loss`.
"""  # noqa: E501

from __future__ import annotations

import enum
import math

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import loss_token_counts, take

__all__ = ["Aggregation", "SequenceCount", "count_groups", "count_step", "loss_weights"]


# PR01 would ask for the parameters of Enum's functional API (names, module, qualname, ...).
class Aggregation(enum.Enum):  # numpydoc ignore=PR01
    """The per-token loss-weight rule (values are the names verl uses, ``constant`` aside).

    Parameters
    ----------
    value : str
        A member's value: ``Aggregation("token-mean")`` is ``Aggregation.TOKEN_MEAN``.
    """

    TOKEN_MEAN = "token-mean"
    """``1/N_tokens``: every token of the step counts equally (DAPO, arXiv 2503.14476)."""
    SEQUENCE_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    """``1/(S |y_i|)``: mean over sequences of per-sequence token means (GRPO, arXiv 2402.03300);
    differentiates ``E[(R-b)/|y|]``, the length bias analysed in arXiv 2503.20783."""
    SEQUENCE_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    """``1/S``: mean over sequences of token sums; ``∇J`` up to the fixed scale (REINFORCE)."""
    CONSTANT = "constant"
    """``1/(S L_max)``: a constant normalizer (Dr. GRPO, arXiv 2503.20783); ``∇J`` up to scale."""
    TOKEN_SUM = "token-sum"
    """``1``: the plain sum (Tinker's losses)."""
    PROMPT_MEAN_TOKEN_MEAN = "prompt-mean-token-mean"
    """``1/(P N_g)``: token mean within each group (prompt), mean over the ``P`` groups (SkyRL's
    prompt-mean); each prompt weighs the same whatever its responses' lengths."""


class SequenceCount(str, enum.Enum):  # numpydoc ignore=PR01
    """What ``S`` (and the group count ``P``) counts in the sequence-mean aggregations.

    Parameters
    ----------
    value : str
        A member's value: ``SequenceCount("sampled")`` is ``SequenceCount.SAMPLED``.
    """

    SAMPLED = "sampled"
    """Every sampled sequence of the step, fully masked ones included (the default; verl, TRL
    and the Dr. GRPO paper)."""
    WITH_LOSS_TOKENS = "with-loss-tokens"
    """Only the sequences with at least one counted loss token (a fully masked completion
    leaves ``S``)."""


def _sequence_count(value) -> SequenceCount:
    if isinstance(value, SequenceCount):
        return value
    try:
        return SequenceCount(value)
    except ValueError:
        raise ValueError(f"sequences: expected one of {[m.value for m in SequenceCount]}, got "
                         f"{value!r}") from None


def _counted(batch: TokenBatch, mask_RC: torch.Tensor | None, name: str) -> torch.Tensor:
    """The tokens that count: ``batch.loss_mask``, or ``mask_RC`` checked to lie inside it (a
    mask that selects prompt or padding tokens would make every normalizer silently wrong)."""
    if mask_RC is None:
        return batch.loss_mask
    if not isinstance(mask_RC, torch.Tensor) or mask_RC.shape != batch.loss_mask.shape \
            or mask_RC.dtype != torch.bool:
        raise ValueError(f"{name}: expected a bool tensor of shape "
                         f"{tuple(batch.loss_mask.shape)}")
    if bool((mask_RC & ~batch.loss_mask).any()):
        raise ValueError(f"{name}: set on tokens outside batch.loss_mask (prompt, padding or "
                         "masked response tokens never count)")
    return mask_RC


def count_step(batch: TokenBatch, mask_RC: torch.Tensor | None = None, *,
               sequences: SequenceCount | str = SequenceCount.SAMPLED) -> tuple[int, int]:
    """``(N_tokens, S)`` of ``batch``: tokens where ``mask_RC`` and the sequences ``S`` counts.

    Sum these over micro-batches and ranks (for example with an all-reduce) to get the step
    counts that :func:`loss_weights` and :func:`~tokenmdp.estimators.prepare` take.

    Parameters
    ----------
    batch : TokenBatch
        The batch (all or part of one optimizer step).
    mask_RC : BoolTensor ``[R, C]``, optional
        The tokens to count (default ``batch.loss_mask``); it must lie inside the loss mask
        (``ValueError`` otherwise).
    sequences : SequenceCount or str, default ``SequenceCount.SAMPLED``
        What ``S`` counts: every sequence of ``batch``, or those with a token where ``mask_RC``.

    Returns
    -------
    num_tokens : int
        ``N_tokens``, the tokens of ``batch`` where ``mask_RC`` is set.
    num_sequences : int
        ``S``: the sequences of ``batch`` (``SAMPLED``), or those with at least one counted token.
    """
    sequences = _sequence_count(sequences)
    mask = _counted(batch, mask_RC, "mask_RC")
    if sequences is SequenceCount.SAMPLED:
        return int(mask.sum()), batch.num_sequences
    per_seq = loss_token_counts(batch, mask)
    return int(mask.sum()), int((per_seq > 0).sum())


def count_groups(batch: TokenBatch, mask_RC: torch.Tensor | None = None, *,
                 sequences: SequenceCount | str = SequenceCount.SAMPLED) -> int:
    """``P`` of ``batch``: its groups (prompts), or those with a token where ``mask_RC``.

    Sum it over ranks whose groups are disjoint to get the ``num_groups`` of a step that
    ``Aggregation.PROMPT_MEAN_TOKEN_MEAN`` divides by.

    Parameters
    ----------
    batch : TokenBatch
        The batch (all or part of one optimizer step).
    mask_RC : BoolTensor ``[R, C]``, optional
        The tokens that count (default ``batch.loss_mask``); it must lie inside the loss mask.
    sequences : SequenceCount or str, default ``SequenceCount.SAMPLED``
        ``SAMPLED`` counts every group; ``WITH_LOSS_TOKENS`` the groups with a counted token.

    Returns
    -------
    int
        The number of distinct ``batch.group`` ids counted.
    """
    sequences = _sequence_count(sequences)
    if batch.num_sequences == 0:
        return 0
    group = batch.group.long()
    if sequences is SequenceCount.WITH_LOSS_TOKENS:
        mask = _counted(batch, mask_RC, "mask_RC")
        group = group[loss_token_counts(batch, mask) > 0]
    return int(torch.unique(group).numel())


def _check_count(name: str, value: int | None, local: int) -> int:
    if value is None:
        return local
    if isinstance(value, torch.Tensor):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < local:
        raise ValueError(f"{name}={value} is smaller than this batch's own count ({local}); it "
                         "must count the whole optimizer step (all micro-batches and ranks)")
    return value


def _check_constant(max_len) -> float | int | None:
    """``L_max`` of ``CONSTANT``: any positive finite number (None when not given)."""
    if max_len is None:
        return None
    if isinstance(max_len, torch.Tensor) and max_len.numel() == 1:
        max_len = max_len.item()
    if isinstance(max_len, bool) or not isinstance(max_len, (int, float)) \
            or not math.isfinite(max_len) or max_len <= 0:
        raise ValueError(f"max_len: expected a positive number (L_max, or any constant "
                         f"normalizer), got {max_len!r}")
    return max_len


def _step_ids(batch: TokenBatch, step: torch.Tensor | None, num_tokens, num_sequences,
              num_groups) -> torch.Tensor | None:
    """``step`` validated (None for one step)."""
    if step is None:
        return None
    if num_tokens is not None or num_sequences is not None or num_groups is not None:
        raise ValueError("step: stacked independent steps use each step's own counts; do not "
                         "also pass num_tokens, num_sequences or num_groups")
    if not isinstance(step, torch.Tensor) or step.dtype not in (torch.int64, torch.int32) \
            or step.shape != (batch.num_sequences,):
        raise ValueError(f"step: expected an integer tensor of shape [S] = "
                         f"({batch.num_sequences},)")
    if batch.num_sequences and int(step.min()) < 0:
        raise ValueError("step: contains negative step ids")
    return step.long()


def _per_step(values_S: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Each sequence's step total of ``values_S`` (at least 1)."""
    num_steps = int(step.max()) + 1 if step.numel() else 0
    totals = values_S.new_zeros(num_steps).index_add_(0, step, values_S)
    return take(totals.clamp(min=1), step)


def _prompt_mean_weights(batch: TokenBatch, per_seq: torch.Tensor, step: torch.Tensor | None,
                         num_groups, sequences: SequenceCount) -> torch.Tensor:
    """``1 / (P N_g)`` per sequence: ``N_g`` the counted tokens of its group, ``P`` the groups
    of its step (all of them, or those with a counted token)."""
    keys = batch.group.long() if step is None else torch.stack([step, batch.group.long()], 1)
    _, group_of = torch.unique(keys, dim=0, return_inverse=True) if batch.num_sequences else \
        (None, batch.group.long())
    num_local = int(group_of.max()) + 1 if batch.num_sequences else 0
    group_tokens = per_seq.new_zeros(num_local).index_add_(0, group_of, per_seq)
    present = (group_tokens > 0) if sequences is SequenceCount.WITH_LOSS_TOKENS \
        else torch.ones_like(group_tokens, dtype=torch.bool)
    if step is None:
        local = int(present.sum())
        n_groups = per_seq.new_full((batch.num_sequences,),
                                    float(max(_check_count("num_groups", num_groups, local), 1)))
    else:
        first = torch.zeros(num_local, dtype=torch.long).scatter_(
            0, group_of, torch.arange(batch.num_sequences))  # one sequence of each group
        group_step = step[first]
        n_groups = _per_step(present.to(per_seq.dtype), group_step)[group_of] \
            if num_local else per_seq.new_ones(0)
    return 1.0 / (group_tokens.clamp(min=1)[group_of] * n_groups)


def loss_weights(
    batch: TokenBatch,
    mode: Aggregation,
    *,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    max_len: float | None = None,
    mask: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
    sequences: SequenceCount | str = SequenceCount.SAMPLED,
    num_groups: int | None = None,
) -> torch.Tensor:
    """Per-token loss weights ``[R, C]`` for aggregation ``mode``; zero off the counted tokens.

    Parameters
    ----------
    batch : TokenBatch
        The batch (all or part of one optimizer step; whole groups for
        ``PROMPT_MEAN_TOKEN_MEAN``).
    mode : Aggregation
        The rule; see the module table.
    num_tokens, num_sequences : int, optional
        ``N_tokens`` and ``S`` of the whole optimizer step (default: this batch's own, see
        :func:`count_step`). They are facts about the step, not options: each is validated
        (it cannot be below this batch's count) and used by the rules that need it.
    max_len : int or float, optional
        ``L_max`` of ``Aggregation.CONSTANT`` (required there): the response-length budget, or
        any positive constant normalizer (verl's ``loss_scale_factor``, a course's fixed
        constant); a zero, negative or non-finite value raises ``ValueError``.
    mask : BoolTensor ``[R, C]``, optional
        The tokens that count (default ``batch.loss_mask``); it must lie inside the loss mask.
        :func:`~tokenmdp.estimators.prepare` passes the loss mask minus masked-IS-rejected tokens
        when those leave the normalizer.
    step : LongTensor ``[S]``, optional
        Assigns each sequence to one of several independent optimizer steps stacked in this
        batch (the exact lab evaluates many batches at once this way): every count is then that
        step's own, and ``num_tokens``/``num_sequences``/``num_groups`` must not be given.
    sequences : SequenceCount or str, default ``SequenceCount.SAMPLED``
        What ``S`` and ``P`` count: every sampled sequence and group, or only those with a
        counted token (module docstring).
    num_groups : int, optional
        ``P``, the groups of the whole step, for ``PROMPT_MEAN_TOKEN_MEAN`` over several batches
        (default: this batch's own; validated like ``num_sequences``).

    Returns
    -------
    Tensor ``[R, C]`` in ``batch.dtype``.
    """
    if not isinstance(mode, Aggregation):
        raise TypeError(f"mode: expected an Aggregation, got {type(mode).__name__} {mode!r} "
                        "(strings are parsed at the edge: Aggregation('token-mean'))")
    sequences = _sequence_count(sequences)
    mask = _counted(batch, mask, "mask")
    max_len = _check_constant(max_len)
    step = _step_ids(batch, step, num_tokens, num_sequences, num_groups)
    per_seq = loss_token_counts(batch, mask)  # |y_i|, float [S]
    counted_S = (per_seq > 0).to(per_seq.dtype) if sequences is SequenceCount.WITH_LOSS_TOKENS \
        else torch.ones_like(per_seq)
    sid = batch.sequence_id.clamp(min=0)
    if step is not None:
        n_tok, n_seq = take(_per_step(per_seq, step), sid), take(_per_step(counted_S, step), sid)
    else:
        local_tokens, local_seqs = int(mask.sum()), int(counted_S.sum())
        n_tok = max(_check_count("num_tokens", num_tokens, local_tokens), 1)
        n_seq = max(_check_count("num_sequences", num_sequences, local_seqs), 1)
    ones = mask.to(batch.dtype)
    if mode is Aggregation.TOKEN_MEAN:
        return ones / n_tok
    if mode is Aggregation.SEQUENCE_MEAN_TOKEN_MEAN:
        per_token_len = take(per_seq.clamp(min=1), sid)
        return ones / (per_token_len * n_seq)
    if mode is Aggregation.SEQUENCE_MEAN_TOKEN_SUM:
        return ones / n_seq
    if mode is Aggregation.CONSTANT:
        if max_len is None:
            raise ValueError("max_len: Aggregation.CONSTANT (Dr. GRPO) needs the constant L_max "
                             "(the response-length budget, or any positive normalizer)")
        return ones / (n_seq * max_len)
    if mode is Aggregation.PROMPT_MEAN_TOKEN_MEAN:
        if batch.num_sequences == 0:
            return ones
        return ones * take(_prompt_mean_weights(batch, per_seq, step, num_groups, sequences), sid)
    return ones  # Aggregation.TOKEN_SUM
