"""tokenmdp.interop.hf on tiny randomly initialized transformers models (built here: no download, no
network): packed = padded = each sequence run alone, values, entropies and gradients."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenmdp import TokenBatch, estimators  # noqa: E402
from tokenmdp.interop.hf import (  # noqa: E402
    causal_lm_token_logprobs,
    causal_lm_token_outputs,
    document_attention_mask,
)
from tokenmdp.interop.logits import token_logprobs_from_logits  # noqa: E402
from tokenmdp.packing import pack_in_order  # noqa: E402

#: float64 models: the same numbers computed on rows of other widths and with other masks.
F64_ATOL = 1e-10
V = 13


def _llama(attn: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation=attn)
    return transformers.LlamaForCausalLM(config).double().eval()


def _gpt2(attn: str):
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2,
                                     n_positions=32, bos_token_id=0, eos_token_id=0,
                                     attn_implementation=attn)
    return transformers.GPT2LMHeadModel(config).double().eval()


MODELS = {"llama-eager": lambda: _llama("eager"), "llama-sdpa": lambda: _llama("sdpa"),
          "gpt2-eager": lambda: _gpt2("eager"), "gpt2-sdpa": lambda: _gpt2("sdpa")}


def _batch() -> TokenBatch:
    return TokenBatch.from_sequences(
        [[3, 1], [2], [4, 4, 0], [7]], [[0, 5, 2], [6, 12], [1, 1], [9]],
        rewards=[1.0, 0.0, 1.0, 0.0], groups=[0, 0, 1, 1])


def _alone(model, batch: TokenBatch):
    """Each sequence run by itself, no mask: log-probs and entropies of its response tokens."""
    lps, hs = [], []
    for prompt, response in batch.sequences():
        ids = torch.tensor([prompt + response])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1)
        lp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        h = -(logp.exp() * logp).sum(-1)
        lps.append(lp[-len(response):])
        hs.append(h[-len(response):])
    return torch.cat(lps), torch.cat(hs)


def _by_sequence(values_RC, batch):
    """Response-token values in (sequence, position) order, whatever the layout."""
    mask = batch.response_mask
    order = torch.argsort(batch.sequence_id[mask] * 1000 + batch.position[mask])
    return values_RC[mask][order]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padded_and_packed_equal_each_sequence_run_alone(name):
    model = MODELS[name]()
    padded = _batch()
    packed = pack_in_order(padded, 9)
    assert packed.num_rows < padded.num_rows
    lp_ref, h_ref = _alone(model, padded)
    with torch.no_grad():
        cases = {"padded": (padded, "auto"), "packed-auto": (packed, "auto"),
                 "packed-mask": (packed, "mask"), "packed-unpack": (packed, "unpack")}
        for label, (batch, mode) in cases.items():
            out = causal_lm_token_outputs(model, batch, entropy=True, packed_rows=mode,
                                          chunk_size=3)
            assert (out.logprob_RC[~batch.response_mask] == 0).all(), label
            torch.testing.assert_close(_by_sequence(out.logprob_RC, batch), lp_ref,
                                       atol=F64_ATOL, rtol=0, msg=label)
            torch.testing.assert_close(_by_sequence(out.entropy_RC, batch), h_ref,
                                       atol=F64_ATOL, rtol=0, msg=label)


def test_without_the_document_mask_packed_sequences_would_see_each_other():
    model = _llama("eager")
    packed = pack_in_order(_batch(), 9)
    with torch.no_grad():   # positions restart, but the plain causal mask crosses sequences
        lp_ref, _ = _alone(model, _batch())
        out = model(input_ids=packed.tokens, position_ids=packed.position).logits
        leaky = _by_sequence(token_logprobs_from_logits(out, packed), packed)
    assert float((leaky - lp_ref).abs().max()) > 1e-3


def test_loss_gradient_is_the_same_packed_and_padded():
    model = _llama("sdpa")
    est = estimators.get("grpo")
    padded = _batch()
    with torch.no_grad():   # π_old, π_ref: the model's own log-probs, shifted
        old = causal_lm_token_logprobs(model, padded) + 0.1 * padded.response_mask
    padded = estimators.prepare(padded.replace(old_logprob=old, ref_logprob=old - 0.2), est)
    grads = []
    for batch in (padded, pack_in_order(padded, 9)):
        model.zero_grad()
        value, _ = estimators.loss(causal_lm_token_logprobs(model, batch), batch, est)
        value.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=F64_ATOL, rtol=0)


def test_document_mask_is_causal_within_each_sequence():
    batch = pack_in_order(_batch(), 9)
    mask = document_attention_mask(batch, torch.float32)[:, 0]
    sid = batch.sequence_id
    R, C = sid.shape
    for r in range(R):
        for q in range(C):
            for k in range(C):
                sees = (sid[r, q] >= 0 and sid[r, q] == sid[r, k] and k <= q) or q == k
                assert (mask[r, q, k] == 0) == sees


def test_bad_arguments_name_themselves():
    model = _llama("eager")
    with pytest.raises(ValueError, match="packed_rows"):
        causal_lm_token_outputs(model, pack_in_order(_batch(), 9), packed_rows="flat")
    with pytest.raises(TypeError, match="batch"):
        causal_lm_token_outputs(model, _batch().tokens)
    with pytest.raises(TypeError, match="model"):
        causal_lm_token_outputs(lambda **kw: {"loss": 0}, _batch())
