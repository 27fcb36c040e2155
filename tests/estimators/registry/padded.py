"""Padded ``[B, T]`` views of a batch's response tokens, for transcriptions of the peers' losses
(verl and TRL take one completion a row, zero-padded, with a mask)."""

from __future__ import annotations

import torch


def padded(batch, values_RC: torch.Tensor, lengths: list[int], width: int | None = None):
    """``values_RC`` at each sequence's response tokens, one row a sequence, and the mask.

    Parameters
    ----------
    batch : TokenBatch
        The batch (any layout); sequence ``s`` has ``lengths[s]`` response tokens.
    values_RC : Tensor ``[R, C]``
        Per-token values (gradients flow through the gather).
    lengths : list of int
        Response tokens per sequence.
    width : int, optional
        Row width ``T`` (default the longest response).

    Returns
    -------
    (Tensor ``[B, T]``, BoolTensor ``[B, T]``)
    """
    width = max(lengths) if width is None else width
    out = values_RC.new_zeros(len(lengths), width)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for s, n in enumerate(lengths):
        sel = (batch.sequence_id == s) & batch.loss_mask
        out[s, :n] = values_RC[sel][torch.argsort(batch.position[sel])]
        mask[s, :n] = True
    return out, mask
