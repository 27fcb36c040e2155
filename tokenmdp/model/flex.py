"""Document-masked attention with FlexAttention: the fast path for packed rows on CUDA.

Imported only when the model's ``attention`` option selects it (never at package import), so the
CPU path needs nothing from here. The block mask says the same thing as
:func:`tokenmdp.model.sequence_attention_mask`: a query sees the keys of its own
sequence at or before it, and a padding query sees only itself.

On CUDA ``flex_attention`` runs compiled (``torch.compile`` with automatic dynamic shapes: one
compilation per dtype and grad mode, one more when the packed shape first changes) and skips
fully masked blocks; on the CPU it runs PyTorch's eager reference implementation (slow,
forward only; for tests of equality). The CUDA path is not exercised by the CPU test suite
(``benchmarks/gpu_checks.py`` checks it on a GPU).

:func:`tree_block_mask` is the packed tree's ancestor mask
(:func:`tokenmdp.model.tree_attention_mask`) as a block mask: its ``mask_mod``
(:func:`tree_mask_mod`) reads one integer per key, the end of the key's subtree.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["document_block_mask", "flex_attention", "tree_block_mask", "tree_mask_mod"]


def document_block_mask(sequence_id_RC: torch.Tensor):
    """A ``BlockMask`` for rows of packed sequences (same sequence, causal; padding sees itself)."""
    from torch.nn.attention.flex_attention import create_block_mask

    sid = sequence_id_RC

    def mask_mod(b, h, q, k):
        same = (sid[b, q] == sid[b, k]) & (sid[b, q] >= 0) & (k <= q)
        return same | (q == k)

    R, C = sid.shape
    return create_block_mask(mask_mod, R, None, C, C, device=sid.device)


def tree_mask_mod(tree_end_RC: torch.Tensor):
    """``mask_mod(b, h, q, k) = (k <= q) & (q < tree_end[b, k])``: ``k`` is ``q`` or an ancestor
    of ``q`` in a packed tree (the nodes in depth-first preorder; padding sees itself).

    Parameters
    ----------
    tree_end_RC : LongTensor ``[R, C]``
        One past the last column of each slot's subtree (``c + 1`` on padding).

    Returns
    -------
    callable ``(b, h, q, k) -> BoolTensor``
        FlexAttention's ``mask_mod``; on broadcast index tensors it gives the dense mask of
        :func:`tokenmdp.model.tree_attention_mask`.
    """
    end = tree_end_RC

    def mask_mod(b, h, q, k):
        return (k <= q) & (q < end[b, k])

    return mask_mod


def tree_block_mask(tree_end_RC: torch.Tensor):
    """A ``BlockMask`` for rows of packed trees: each token sees its ancestors and itself.

    Parameters
    ----------
    tree_end_RC : LongTensor ``[R, C]``
        As in :func:`tree_mask_mod`.

    Returns
    -------
    BlockMask
        Over ``R`` rows, all heads, ``C`` queries and keys, on ``tree_end_RC``'s device.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    R, C = tree_end_RC.shape
    return create_block_mask(tree_mask_mod(tree_end_RC), R, None, C, C,
                             device=tree_end_RC.device)


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention as fa

    # default (automatic) dynamic shapes: packed steps change their row count, and a static
    # compile per shape would hit the recompile limit and fall back to the eager kernel
    return torch.compile(fa)


def flex_attention(q_RhCd: torch.Tensor, k_RhCd: torch.Tensor, v_RhCd: torch.Tensor,
                   block_mask) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + mask) v`` under ``block_mask``; compiled on CUDA only."""
    if q_RhCd.is_cuda:
        return _compiled()(q_RhCd, k_RhCd, v_RhCd, block_mask=block_mask)
    from torch.nn.attention.flex_attention import flex_attention as fa

    return fa(q_RhCd, k_RhCd, v_RhCd, block_mask=block_mask)
