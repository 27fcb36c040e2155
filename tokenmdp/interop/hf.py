"""Per-token log-probabilities (and entropies) of any Hugging Face causal LM on a TokenBatch.

:func:`causal_lm_token_outputs` runs a ``transformers`` causal language model (anything called as
``model(input_ids=..., attention_mask=..., position_ids=...)`` that returns ``.logits``) on a
:class:`~tokenmdp.batch.TokenBatch` in any layout and returns the log-probs aligned with the
batch: ``log π(y_t | x, y_<t)`` on response tokens, 0 on prompt tokens and padding, exactly what
:func:`tokenmdp.estimators.loss` reads. So a user's own loop is::

    batch = estimators.prepare(batch, "grpo")
    logprobs_RC = causal_lm_token_logprobs(model, batch)
    value, metrics = estimators.loss(logprobs_RC, batch, "grpo")
    value.backward()

The log-softmax is :func:`tokenmdp.interop.logits.token_logprobs_from_logits` (float32 for
half-precision logits, chunked over positions). Nothing here imports ``transformers`` (the
optional ``hf`` extra installs it): the model is only called.

How the layout is handled (``packed_rows``):

* **one sequence per row** (padded, right or left): the rows go to the model as they are, with a
  2-D ``attention_mask`` (1 on real tokens) and ``position_ids = batch.position``; every causal
  LM supports this.
* **packed rows** (several sequences in a row): each sequence's positions must restart at 0 and
  no token may attend to another sequence. ``"mask"`` keeps the rows and passes
  ``position_ids = batch.position`` and a 4-D additive mask ``[R, 1, C, C]`` in the model's dtype
  (0 where the key is in the query's own sequence and not after it, the dtype's most negative
  number elsewhere; a padding query sees only itself, so nothing is undefined). ``transformers``
  hands a 4-D mask to the attention as it is, which the ``eager`` and ``sdpa`` attention
  implementations apply; others ignore it (FlashAttention reads sequence boundaries from
  ``position_ids`` or its own varlen arguments, a custom kernel may do anything), so there a
  4-D mask would silently let sequences see each other. ``"unpack"`` copies the sequences into
  one-sequence-per-row padded rows (:func:`tokenmdp.packing.padded_layout`), runs those, and maps
  the values back to the batch's grid by ``(sequence_id, position)``: correct for every model, at
  the price of the padding. ``"auto"`` (default) takes ``"mask"`` when the model's
  ``config._attn_implementation`` is ``"eager"`` or ``"sdpa"`` and ``"unpack"`` otherwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.interop.logits import DEFAULT_CHUNK_SIZE, entropy_from_logits, token_logprobs_from_logits
from tokenmdp.packing import padded_layout

__all__ = ["CausalLMOutputs", "MASK_ATTENTION", "PACKED_ROWS", "causal_lm_token_logprobs",
           "causal_lm_token_outputs", "document_attention_mask"]

PACKED_ROWS = ("auto", "mask", "unpack")
"""The ways of running packed rows (module docstring)."""

MASK_ATTENTION = ("eager", "sdpa")
"""``config._attn_implementation`` values whose attention applies a custom 4-D mask."""


class CausalLMOutputs(NamedTuple):
    """What :func:`causal_lm_token_outputs` returns.

    Parameters
    ----------
    logprob_RC : Tensor ``[R, C]``
        ``log π(y_t | x, y_<t)`` of each response token, 0 elsewhere (differentiable).
    entropy_RC : Tensor ``[R, C]`` or None
        The entropy of the distribution each response token was drawn from (with
        ``entropy=True``), 0 elsewhere.
    """

    logprob_RC: torch.Tensor
    entropy_RC: torch.Tensor | None


def document_attention_mask(batch: TokenBatch, dtype: torch.dtype) -> torch.Tensor:
    """The 4-D additive mask of ``batch``: causal and within each token's own sequence.

    Parameters
    ----------
    batch : TokenBatch
        Any layout.
    dtype : torch.dtype
        The model's floating-point dtype (the mask is added to its attention scores).

    Returns
    -------
    Tensor ``[R, 1, C, C]``
        0 where query ``q`` may see key ``k`` (same sequence, ``k ≤ q``; a padding query sees
        itself), ``torch.finfo(dtype).min`` elsewhere.
    """
    sid = batch.sequence_id
    C = batch.capacity
    col = torch.arange(C, device=sid.device)
    same = (sid[:, :, None] == sid[:, None, :]) & (sid[:, :, None] >= 0)
    causal = col[None, :, None] >= col[None, None, :]
    see = (same & causal) | torch.eye(C, dtype=torch.bool, device=sid.device)[None]
    zero = torch.zeros((), dtype=dtype, device=sid.device)
    return torch.where(see, zero, torch.finfo(dtype).min)[:, None]


def _one_sequence_per_row(batch: TokenBatch) -> bool:
    sid = batch.sequence_id
    big = torch.iinfo(sid.dtype).max
    low = torch.where(sid >= 0, sid, big).amin(1)
    high = sid.amax(1)
    return bool(((high < 0) | (low == high)).all())


def _model_dtype(model) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _run(model, batch: TokenBatch, attention_mask: torch.Tensor, model_kwargs) -> torch.Tensor:
    out = model(input_ids=batch.tokens, attention_mask=attention_mask,
                position_ids=batch.position, use_cache=False, **model_kwargs)
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape[:2]) != tuple(batch.tokens.shape):
        raise TypeError(f"model: expected a causal LM whose output has .logits of shape "
                        f"[R, C, V] = [{batch.num_rows}, {batch.capacity}, V], got "
                        f"{getattr(logits, 'shape', type(out).__name__)}")
    return logits


def _outputs(logits, batch, entropy, chunk_size) -> CausalLMOutputs:
    lp = token_logprobs_from_logits(logits, batch, chunk_size=chunk_size)
    h = entropy_from_logits(logits, batch, chunk_size=chunk_size) if entropy else None
    return CausalLMOutputs(lp, h)


def causal_lm_token_outputs(model: Any, batch: TokenBatch, *, entropy: bool = False,
                            packed_rows: str = "auto", chunk_size: int = DEFAULT_CHUNK_SIZE,
                            **model_kwargs: Any) -> CausalLMOutputs:
    """A causal LM's per-token log-probs (and entropies) on ``batch``, aligned with it.

    Parameters
    ----------
    model : transformers causal LM
        Called as ``model(input_ids=, attention_mask=, position_ids=, use_cache=False,
        **model_kwargs)``; its output's ``.logits`` (or first element) is ``[R, C, V]``. It must
        live on ``batch``'s device.
    batch : TokenBatch
        Any layout; every response token needs a prompt token before it, token ids ``< V``.
    entropy : bool, default False
        Also compute the entropy of each response token's distribution.
    packed_rows : {"auto", "mask", "unpack"}
        How rows holding several sequences are run (module docstring); rows of one sequence
        each always go as they are.
    chunk_size : int, default ``DEFAULT_CHUNK_SIZE``
        Positions normalized at a time (:mod:`tokenmdp.interop.logits`).
    **model_kwargs
        Passed on to the model.

    Returns
    -------
    CausalLMOutputs
        ``logprob_RC`` and (with ``entropy``) ``entropy_RC``, on ``batch``'s grid.

    Raises
    ------
    TypeError
        ``batch`` not a TokenBatch; a model whose output has no ``[R, C, V]`` logits.
    ValueError
        An unknown ``packed_rows``; the errors of :func:`~tokenmdp.interop.logits.token_logprobs_from_logits`.
    """
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
    if packed_rows not in PACKED_ROWS:
        raise ValueError(f"packed_rows: expected one of {', '.join(PACKED_ROWS)}, got "
                         f"{packed_rows!r}")
    if not callable(model):
        raise TypeError(f"model: expected a callable causal LM, got {type(model).__name__}")
    if _one_sequence_per_row(batch):
        mask = (batch.sequence_id >= 0).long()
        return _outputs(_run(model, batch, mask, model_kwargs), batch, entropy, chunk_size)
    if packed_rows == "auto":
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        packed_rows = "mask" if impl in MASK_ATTENTION else "unpack"
    if packed_rows == "mask":
        mask = document_attention_mask(batch, _model_dtype(model))
        return _outputs(_run(model, batch, mask, model_kwargs), batch, entropy, chunk_size)
    padded = padded_layout(batch)                   # sequence s in row s, from column 0
    out = _outputs(_run(model, padded, (padded.sequence_id >= 0).long(), model_kwargs), padded,
                   entropy, chunk_size)
    real = batch.sequence_id >= 0
    sid, pos = batch.sequence_id[real], batch.position[real]

    def back(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        grid = values.new_zeros(batch.tokens.shape)
        return grid.index_put((real.nonzero(as_tuple=True)), values[sid, pos])

    return CausalLMOutputs(back(out.logprob_RC), back(out.entropy_RC))


def causal_lm_token_logprobs(model: Any, batch: TokenBatch, **kwargs: Any) -> torch.Tensor:
    """``log π(y_t | x, y_<t)`` ``[R, C]`` of a causal LM on ``batch`` (0 off the responses).

    Parameters
    ----------
    model : transformers causal LM
        As for :func:`causal_lm_token_outputs`.
    batch : TokenBatch
        Any layout.
    **kwargs
        ``packed_rows``, ``chunk_size`` and model keyword arguments, as for
        :func:`causal_lm_token_outputs`.

    Returns
    -------
    Tensor ``[R, C]``
        The differentiable log-probs, ready for :func:`tokenmdp.estimators.loss`.
    """
    return causal_lm_token_outputs(model, batch, **kwargs).logprob_RC
