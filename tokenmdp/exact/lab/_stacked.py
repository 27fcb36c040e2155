"""Stacked batches of the exact lab: rows of the enumeration as one batch of many steps.

:func:`_stacked_batch` lays draws of enumeration rows out as one batch of independent steps
(one sequence per row, as :meth:`TokenMDP.enumerate <tokenmdp.exact.TokenMDP.enumerate>` lays
them out); :func:`_select_rows` takes some rows of a prepared one as a micro-batch. Neither
validates its batch again (their rows are rows of a validated batch).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import take


def _stacked_batch(enum: TokenBatch, ids: torch.Tensor, group_size: int,
                   logprob_fields: dict[str, torch.Tensor]) -> tuple[TokenBatch, torch.Tensor]:
    """Draws ``[D, k*G]`` of enumeration rows as one batch of ``D`` independent steps.

    Built without validating it again: its rows are rows of ``enum`` (one sequence per row, as
    :meth:`TokenMDP.enumerate <tokenmdp.exact.TokenMDP.enumerate>` lays them out), renumbered
    one sequence per row, and the log-prob fields were validated on ``enum`` once
    (:class:`~tokenmdp.exact.lab.step_gradients.StepGradients`); on a block of 10^6 sequences
    validation cost a third of a step."""
    D, width = ids.shape
    rows = ids.reshape(-1)
    S = rows.numel()
    real = take(enum.sequence_id, rows) >= 0
    seq = torch.arange(S)
    fields = dict(
        tokens=take(enum.tokens, rows), sequence_id=torch.where(real, seq[:, None], -1),
        position=take(enum.position, rows), loss_mask=take(enum.loss_mask, rows),
        advantage=take(enum.advantage, rows), loss_weight=take(enum.loss_weight, rows),
        reward=take(enum.reward, rows), group=seq // group_size, length=take(enum.length, rows),
        prompt_index=take(enum.prompt_index, rows),
        **{name: take(lp, rows) for name, lp in logprob_fields.items()})
    batch = object.__new__(TokenBatch)
    for f in dataclasses.fields(TokenBatch):            # absent fields at their defaults
        value = fields[f.name] if f.name in fields else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        object.__setattr__(batch, f.name, value)
    return batch, seq // width


def _select_rows(batch: TokenBatch, rows: torch.Tensor) -> TokenBatch:
    """Rows ``rows`` of a stacked batch (one sequence per row, sequence ``i`` in row ``i``) as a
    batch of their own, sequences renumbered, every prepared field kept: a micro-batch, on which
    :func:`~tokenmdp.estimators.loss` gives each kept token the coefficient it has in the whole
    batch (it reads the step's prepared fields and recomputes no statistic). Not validated
    again, as :func:`_stacked_batch`."""
    out = object.__new__(TokenBatch)
    for f in dataclasses.fields(TokenBatch):
        value = getattr(batch, f.name)
        if f.name == "sequence_id":
            value = torch.where(take(value, rows) >= 0, torch.arange(rows.numel())[:, None], -1)
        elif f.name == "token_extras":
            value = {k: take(v, rows) for k, v in value.items()}
        elif isinstance(value, torch.Tensor):
            value = take(value, rows)
        object.__setattr__(out, f.name, value)
    return out
