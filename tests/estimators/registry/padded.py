"""Padded ``[B, T]`` views of a batch's response tokens, for transcriptions of the peers' losses
(verl and TRL take one completion a row, zero-padded, with a mask), and the small worlds they
are compared on."""

from __future__ import annotations

import torch

from tests.estimators.estimator_helpers import make_batch, response_values


def peer_world(log_r, log_w, old, ref, rewards, groups):
    """One response a row: ``log π_old`` = ``old``, ``log μ = old - log_w``, ``log π_ref`` =
    ``ref`` and ``log π_θ = old + log_r`` (a leaf that requires grad); each list one row a
    response."""
    behavior = [[o - w for o, w in zip(os_, ws, strict=True)]
                for os_, ws in zip(old, log_w, strict=True)]
    batch = make_batch([[9]] * len(log_r), [[1 + i] * len(r) for i, r in enumerate(log_r)],
                       rewards=rewards, groups=groups, old=old, behavior=behavior, ref=ref)
    lp = (batch.old_logprob + response_values(batch, log_r)).requires_grad_(True)
    return batch, lp


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
