"""What the MoE transformer takes and returns besides tensors: routing traces, the outputs of a
pass, the KV cache, the document-causal attention mask of a packed batch and the ancestor mask
of a packed tree.

Shape suffixes as in :mod:`tokenmdp.model.transformer`: ``R`` rows, ``C`` columns, ``T`` key
columns, ``L`` routed layers, ``K`` experts per token, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.model.config import ModelConfig

__all__ = ["RoutingTrace", "ModelOutput", "TokenOutputs", "KVCache", "sequence_attention_mask",
           "tree_attention_mask"]


SIGNED_INTS = (torch.int64, torch.int32, torch.int16, torch.int8)


@dataclasses.dataclass(frozen=True)
class RoutingTrace:
    """Expert ids used by every token in every routed layer.

    Parameters
    ----------
    experts : LongTensor ``[R, C, L, K]``
        Expert ids, aligned with the batch's tokens; ``-1`` where a token has no record (padding,
        or the last sampled token, which an inference engine never routes).
    """

    experts: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.experts, torch.Tensor) or self.experts.dim() != 4:
            raise TypeError("experts: expected a LongTensor [R, C, L, K], got "
                            f"{getattr(self.experts, 'shape', type(self.experts).__name__)}")
        if self.experts.dtype not in SIGNED_INTS:
            raise TypeError(f"experts: expected a signed integer tensor (-1 marks no record), "
                            f"got {self.experts.dtype}")

    @property
    def recorded(self) -> torch.Tensor:
        """Bool ``[R, C]``: tokens with a complete record in every layer."""
        return (self.experts >= 0).flatten(2).all(-1)


@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """``logits_RCV`` (output at each column, predicting the *next* token), the routing used
    (``experts_RCLK``) and the summed load-balancing loss of the routed layers.

    Parameters
    ----------
    logits_RCV : Tensor ``[R, C, V]``
        Unnormalized scores of the next token at every column (padding included).
    experts_RCLK : LongTensor ``[R, C, L, K]``
        The experts each token was routed to in each routed layer (``L = 0`` for a dense model;
        ``-1`` on padding once :meth:`MoETransformer.forward` returns it).
    load_balancing_loss : Tensor ``[]``
        The load-balancing loss summed over the routed layers (float32 for half-precision
        weights, else their dtype; 0 when not computed).
    """

    logits_RCV: torch.Tensor
    experts_RCLK: torch.Tensor
    load_balancing_loss: torch.Tensor


@dataclasses.dataclass(frozen=True)
class TokenOutputs:
    """Per-token outputs of one forward pass (:meth:`MoETransformer.token_outputs`).

    Parameters
    ----------
    logprob_RC : Tensor ``[R, C]``
        ``log pi(y_t | x, y_<t)`` of each response token, 0 elsewhere.
    routing : RoutingTrace
        The experts used (``-1`` on padding).
    load_balancing_loss : Tensor ``[]``
        The load-balancing loss summed over the routed layers (float32 for half-precision
        weights, else their dtype; 0 for a dense model).
    entropy_RC : Tensor ``[R, C]`` or None, default None
        The entropy of each response token's next-token distribution (when asked), 0 elsewhere.
    """

    logprob_RC: torch.Tensor
    routing: RoutingTrace
    load_balancing_loss: torch.Tensor
    entropy_RC: torch.Tensor | None = None


class KVCache:
    """Keys and values of one sequence per row, ``[R, h, T, d]`` per layer, for incremental
    decoding: the token at column ``t`` of a row is stored at cache column ``t``.

    Parameters
    ----------
    config : ModelConfig
        The model's shape (layers, heads, head size).
    rows : int
        Sequences decoded at once, ``R``.
    capacity : int
        Cache columns ``T`` per row: the longest prompt plus response it can hold.
    device : torch.device or str, optional
        Where the zero-initialized keys and values live.
    dtype : torch.dtype, default torch.float32
        Their dtype (that of the model's activations).
    """

    def __init__(self, config: ModelConfig, rows: int, capacity: int, *, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        shape = (rows, config.n_heads, capacity, config.head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]

    @property
    def capacity(self) -> int:
        """Cache columns ``T`` per row."""
        return self.k[0].shape[2]


def sequence_attention_mask(sequence_id_RC: torch.Tensor) -> torch.Tensor:
    """Bool ``[R, 1, C, C]``: query ``q`` sees key ``k`` iff both belong to the same sequence and
    ``k <= q`` (sequences are contiguous, so column order is position order). Padding queries see
    only themselves, so no row of the mask is empty.

    Parameters
    ----------
    sequence_id_RC : LongTensor ``[R, C]``
        The batch's ``sequence_id`` (``-1`` on padding).

    Returns
    -------
    BoolTensor ``[R, 1, C, C]``
        The mask, broadcast over heads (``attn_mask`` of ``scaled_dot_product_attention``).
    """
    C = sequence_id_RC.shape[1]
    col = torch.arange(C, device=sequence_id_RC.device)
    same_RCC = (sequence_id_RC[:, :, None] == sequence_id_RC[:, None, :]) & (sequence_id_RC >= 0)[:, :, None]
    mask_RCC = (same_RCC & (col[None, :] <= col[:, None])) | torch.eye(C, dtype=torch.bool,
                                                                       device=col.device)
    return mask_RCC[:, None]


def tree_attention_mask(tree_end_RC: torch.Tensor) -> torch.Tensor:
    """Bool ``[R, 1, C, C]``: query ``q`` sees key ``k`` iff ``k <= q < tree_end[k]``, i.e. ``k``
    is ``q`` or one of its ancestors in a packed tree (nodes in depth-first preorder: a node's
    subtree is the columns from its own to ``tree_end - 1``). Padding has ``tree_end = c + 1``,
    so it sees only itself and no row of the mask is empty.

    Parameters
    ----------
    tree_end_RC : LongTensor ``[R, C]``
        One past the last column of each slot's subtree
        (a :class:`~tokenmdp.tree_packing.PackedTree`'s ``tree_end_RC``).

    Returns
    -------
    BoolTensor ``[R, 1, C, C]``
        The mask, broadcast over heads (``attn_mask`` of ``scaled_dot_product_attention``).
    """
    C = tree_end_RC.shape[1]
    col = torch.arange(C, device=tree_end_RC.device)
    mask_RCC = (col[None, None, :] <= col[None, :, None]) & \
        (col[None, :, None] < tree_end_RC[:, None, :])
    return mask_RCC[:, None]
