"""The rollout engine's numerics — the numeric engine-mismatch mode: its precisions, simulated.

:data:`PRECISIONS` names them. ``fp32``, ``bf16`` and ``fp16`` cast the weights and compute in
that dtype (bf16 and fp16 also sum in another order than the trainer's fp32). The others compute
in fp32 on rounded numbers:

* ``fp8`` — weights rounded to float8 e4m3 with one scale per tensor (:func:`simulate_fp8`);
* ``fp8_w8a8`` — those weights, and every activation that meets a weight in a matrix product
  rounded to e4m3 too, with one scale per row (per token), as fp8 inference engines run their
  GEMMs (:func:`round_rows_fp8`; the engine's model copy does it in each forward pass,
  :func:`round_activations`);
* ``fp4`` — weights rounded to the 4-bit float e2m1 grid ``{0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}``
  in blocks of :data:`FP4_BLOCK` along the rows (the reduction dimension of ``x @ W``), one float
  scale per block (``absmax -> 6``), in the spirit of the MXFP4 and NVFP4 formats
  (:func:`simulate_fp4`).

On the long-answer study's model the per-token ``KL(μ ‖ π_old)`` of these ranges from about
``1e-7`` (fp16) to ``2e-3`` (fp4); ``benchmarks/engine_mismatch.py`` measures it (docs:
*Concepts* › *The trainer world* › *Engine mismatch modes*).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from tokenmdp.model import MoETransformer

__all__ = ["FP4_BLOCK", "PRECISIONS", "engine_weight", "round_activations", "round_rows_fp8",
           "simulate_fp4", "simulate_fp8"]

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
              "fp8": torch.float32, "fp8_w8a8": torch.float32, "fp4": torch.float32}
"""Engine precision -> compute dtype (``fp8``, ``fp8_w8a8``, ``fp4``: fp32 compute on rounded
numbers; module docstring)."""

FP8_E4M3_MAX = 448.0
"""Largest finite magnitude of float8 e4m3fn."""
FP4_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative values of the 4-bit float e2m1."""
FP4_BLOCK = 32
"""Rows per scaling block of :func:`simulate_fp4` (MXFP4's block size)."""

_TINY = torch.finfo(torch.float32).tiny


def simulate_fp8(w: torch.Tensor) -> torch.Tensor:
    """Round ``w`` to float8 e4m3 with one per-tensor scale (``absmax -> 448``), back in its dtype.

    Parameters
    ----------
    w : Tensor
        A weight tensor (any floating dtype; an all-zero tensor stays zero).

    Returns
    -------
    Tensor
        ``w`` rounded to the fp8 e4m3 grid scaled by ``absmax(w) / 448``, same shape and dtype.
    """
    scale = w.abs().max().clamp(min=_TINY) / FP8_E4M3_MAX
    return (w / scale).to(torch.float8_e4m3fn).to(w.dtype) * scale


def round_rows_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to float8 e4m3 with one scale per row (``absmax`` of the last axis ``-> 448``).

    Parameters
    ----------
    x : Tensor ``[..., D]``
        Activations (any floating dtype; an all-zero row stays zero).

    Returns
    -------
    Tensor
        The rounded values, same shape and dtype.
    """
    scale = x.abs().amax(-1, keepdim=True).clamp(min=_TINY) / FP8_E4M3_MAX
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


def simulate_fp4(w: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Round ``w`` to the e2m1 grid in blocks of ``block`` rows, one scale per block and column.

    Each block of ``block`` consecutive entries along axis ``-2`` (the last block may be shorter)
    is scaled by ``absmax / 6`` and rounded to the nearest of ``FP4_E2M1_GRID`` (ties to the
    smaller magnitude), sign kept.

    Parameters
    ----------
    w : Tensor ``[..., R, C]``
        A weight tensor, at least 2-d (any floating dtype).
    block : int, default 32
        Rows per block, ``>= 1``.

    Returns
    -------
    Tensor
        The rounded weights, same shape and dtype.
    """
    if w.dim() < 2:
        raise ValueError(f"w: expected at least 2 dimensions, got shape {tuple(w.shape)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block: expected an int >= 1, got {block!r}")
    rows = w.shape[-2]
    pad = (-rows) % block
    x = torch.nn.functional.pad(w.transpose(-1, -2), (0, pad))        # [..., C, R + pad]
    x = x.reshape(*x.shape[:-1], -1, block)                            # [..., C, nb, block]
    scale = x.abs().amax(-1, keepdim=True).clamp(min=_TINY) / FP4_E2M1_GRID[-1]
    grid = torch.tensor(FP4_E2M1_GRID, dtype=w.dtype, device=w.device)
    q = grid[((x / scale).abs()[..., None] - grid).abs().argmin(-1)] * torch.sign(x)
    out = (q * scale).reshape(*x.shape[:-2], -1)[..., :rows]
    return out.transpose(-1, -2).contiguous()


def engine_weight(w: torch.Tensor, precision: str) -> torch.Tensor:
    """A weight as the engine of ``precision`` holds it (already cast to its compute dtype).

    Parameters
    ----------
    w : Tensor
        The trainer's weight, in the engine's compute dtype.
    precision : str
        A key of :data:`PRECISIONS`.

    Returns
    -------
    Tensor
        ``w`` rounded (matrices of ``fp8``, ``fp8_w8a8``, ``fp4``) or as it is.
    """
    if w.dim() < 2:
        return w
    if precision in ("fp8", "fp8_w8a8"):
        return simulate_fp8(w)
    if precision == "fp4":
        return simulate_fp4(w)
    return w


class _WeightActivations(TorchFunctionMode):
    """Rounds the left operand of every matrix product whose right operand is one of the given
    weights (by storage: an expert's slice counts) with :func:`round_rows_fp8`."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("matmul", "__matmul__") and len(args) == 2 \
                and isinstance(args[1], torch.Tensor) \
                and args[1].untyped_storage().data_ptr() in self.storages:
            args = (round_rows_fp8(args[0]), args[1])
        return func(*args, **(kwargs or {}))


class _ActivationRoundedTransformer(MoETransformer):
    """An engine's model copy whose every forward pass rounds the activations that meet a weight
    (:func:`round_activations`)."""

    def forward_tokens(self, *args, **kwargs):  # numpydoc ignore=PR01,RT01
        """:meth:`MoETransformer.forward_tokens` with the activations rounded to fp8 per row."""
        storages = {p.untyped_storage().data_ptr() for p in self.parameters()}
        with _WeightActivations(storages):
            return super().forward_tokens(*args, **kwargs)


def round_activations(model: MoETransformer) -> MoETransformer:
    """Make ``model`` (an engine's own copy) round, in every forward pass, each activation that
    meets one of its weights in a matrix product to fp8 e4m3 with one scale per token
    (:func:`round_rows_fp8`); attention's products of activations stay as they are.

    Parameters
    ----------
    model : MoETransformer
        Changed in place (its class becomes a subclass; weights and state unchanged).

    Returns
    -------
    MoETransformer
        ``model``.
    """
    if not isinstance(model, MoETransformer):
        raise TypeError(f"model: expected a MoETransformer, got {type(model).__name__}")
    model.__class__ = _ActivationRoundedTransformer
    return model
