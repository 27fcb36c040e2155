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

``N_tokens`` counts loss tokens, ``S`` the sequences with at least one loss token, ``|y_i|`` the
loss tokens of sequence i (a sequence never spans two micro-batches, so it is always local).
A mean of per-micro-batch means (TRL's ``bnpo``) is a different estimator that depends on the
micro-batch size; it exists only as the named counter-example
:func:`tokenmdp.estimators.per_micro_batch_token_mean_loss`.
"""  # noqa: E501

from __future__ import annotations

import enum

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import loss_token_counts

__all__ = ["Aggregation", "count_step", "loss_weights"]


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


def count_step(batch: TokenBatch, mask_RC: torch.Tensor | None = None) -> tuple[int, int]:
    """``(N_tokens, S)`` of ``batch``: tokens where ``mask_RC`` and sequences with any of them.

    Sum these over micro-batches and ranks (for example with an all-reduce) to get the step
    counts that :func:`loss_weights` and :func:`~tokenmdp.estimators.prepare` take.

    Parameters
    ----------
    batch : TokenBatch
        The batch (all or part of one optimizer step).
    mask_RC : BoolTensor ``[R, C]``, optional
        The tokens to count (default ``batch.loss_mask``).

    Returns
    -------
    num_tokens : int
        ``N_tokens``, the tokens of ``batch`` where ``mask_RC`` is set.
    num_sequences : int
        ``S``, the sequences with at least one of them.
    """
    mask = batch.loss_mask if mask_RC is None else mask_RC
    per_seq = loss_token_counts(batch, mask)
    return int(mask.sum()), int((per_seq > 0).sum())


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


def _per_step_counts(batch: TokenBatch, per_seq: torch.Tensor, step: torch.Tensor,
                     num_tokens, num_sequences) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``N_tokens`` and ``S`` of the step each token belongs to (at least 1)."""
    if num_tokens is not None or num_sequences is not None:
        raise ValueError("step: stacked independent steps use each step's own counts; do not "
                         "also pass num_tokens or num_sequences")
    if not isinstance(step, torch.Tensor) or step.dtype not in (torch.int64, torch.int32) \
            or step.shape != (batch.num_sequences,):
        raise ValueError(f"step: expected an integer tensor of shape [S] = "
                         f"({batch.num_sequences},)")
    if batch.num_sequences and int(step.min()) < 0:
        raise ValueError("step: contains negative step ids")
    num_steps = int(step.max()) + 1 if batch.num_sequences else 0
    step = step.long()
    tok = per_seq.new_zeros(num_steps).index_add_(0, step, per_seq)
    seq = per_seq.new_zeros(num_steps).index_add_(0, step, (per_seq > 0).to(per_seq.dtype))
    sid = batch.sequence_id.clamp(min=0)
    return tok.clamp(min=1)[step][sid], seq.clamp(min=1)[step][sid]


def loss_weights(
    batch: TokenBatch,
    mode: Aggregation,
    *,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    max_len: int | None = None,
    mask: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token loss weights ``[R, C]`` for aggregation ``mode``; zero off the counted tokens.

    Parameters
    ----------
    batch : TokenBatch
        The batch (all or part of one optimizer step).
    mode : Aggregation
        The rule; see the module table.
    num_tokens, num_sequences : int, optional
        ``N_tokens`` and ``S`` of the whole optimizer step (default: this batch's own, see
        :func:`count_step`). They are facts about the step, not options: each is validated
        (it cannot be below this batch's count) and used by the rules that need it.
    max_len : int, optional
        ``L_max``, the response-length budget; required by ``Aggregation.CONSTANT``; when given
        it must be at least the longest counted response.
    mask : BoolTensor ``[R, C]``, optional
        The tokens that count (default ``batch.loss_mask``); it must lie inside the loss mask.
        :func:`~tokenmdp.estimators.prepare` passes the loss mask minus masked-IS-rejected tokens
        when those leave the normalizer.
    step : LongTensor ``[S]``, optional
        Assigns each sequence to one of several independent optimizer steps stacked in this
        batch (the exact lab evaluates many batches at once this way): every count is then that
        step's own, and ``num_tokens``/``num_sequences`` must not be given.

    Returns
    -------
    Tensor ``[R, C]`` in ``batch.dtype``.
    """
    if not isinstance(mode, Aggregation):
        raise TypeError(f"mode: expected an Aggregation, got {type(mode).__name__} {mode!r} "
                        "(strings are parsed at the edge: Aggregation('token-mean'))")
    if mask is None:
        mask = batch.loss_mask
    elif mask.shape != batch.loss_mask.shape or mask.dtype != torch.bool:
        raise ValueError(f"mask: expected a bool tensor of shape {tuple(batch.loss_mask.shape)}")
    elif bool((mask & ~batch.loss_mask).any()):
        raise ValueError("mask: set on tokens outside batch.loss_mask")
    per_seq = loss_token_counts(batch, mask)  # |y_i|, float [S]
    if step is not None:
        n_tok, n_seq = _per_step_counts(batch, per_seq, step, num_tokens, num_sequences)
    else:
        local_tokens, local_seqs = int(mask.sum()), int((per_seq > 0).sum())
        n_tok = max(_check_count("num_tokens", num_tokens, local_tokens), 1)
        n_seq = max(_check_count("num_sequences", num_sequences, local_seqs), 1)
    if max_len is not None:
        longest = int(per_seq.max()) if batch.num_sequences else 0
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < max(longest, 1):
            raise ValueError(f"max_len: expected an int >= the longest counted response "
                             f"({max(longest, 1)}), got {max_len!r}")
    ones = mask.to(batch.dtype)
    if mode is Aggregation.TOKEN_MEAN:
        return ones / n_tok
    if mode is Aggregation.SEQUENCE_MEAN_TOKEN_MEAN:
        per_token_len = per_seq.clamp(min=1)[batch.sequence_id.clamp(min=0)]
        return ones / (per_token_len * n_seq)
    if mode is Aggregation.SEQUENCE_MEAN_TOKEN_SUM:
        return ones / n_seq
    if mode is Aggregation.CONSTANT:
        if max_len is None:
            raise ValueError("max_len: Aggregation.CONSTANT (Dr. GRPO) needs the response-length "
                             "budget L_max")
        return ones / (n_seq * max_len)
    return ones  # Aggregation.TOKEN_SUM
