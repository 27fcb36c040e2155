"""Interop with other trainers: Hugging Face padded batches, per-token log-probs from logits, HF models.

The front door: :func:`to_hf` and :func:`from_hf` (``transformers`` is needed by
:mod:`~tokenmdp.interop.hf` only, loaded when it is used).

Floors, top to bottom::

    hf
    logits, padded

* :mod:`~tokenmdp.interop.padded` — :class:`~tokenmdp.TokenBatch` to and from Hugging Face
  padded dicts;
* :mod:`~tokenmdp.interop.logits` — per-token log-probs and entropy from any logits (float32,
  chunked);
* :mod:`~tokenmdp.interop.hf` — any Hugging Face causal LM on a TokenBatch, packed or padded.

It imports the narrow waist only (batch, packing).
"""

from tokenmdp.interop.hf import (
    MASK_ATTENTION,
    PACKED_ROWS,
    CausalLMOutputs,
    causal_lm_token_logprobs,
    causal_lm_token_outputs,
    document_attention_mask,
)
from tokenmdp.interop.logits import (
    DEFAULT_CHUNK_SIZE,
    entropy_from_logits,
    token_logprobs_from_logits,
)
from tokenmdp.interop.padded import IGNORE_INDEX, from_hf, from_token_lists, to_hf

__all__ = ["IGNORE_INDEX", "from_hf", "from_token_lists", "to_hf", "DEFAULT_CHUNK_SIZE",
           "token_logprobs_from_logits", "entropy_from_logits", "CausalLMOutputs",
           "MASK_ATTENTION", "PACKED_ROWS", "causal_lm_token_logprobs", "causal_lm_token_outputs",
           "document_attention_mask"]
