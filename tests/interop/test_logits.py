"""tokenmdp.interop.logits against a direct log_softmax, chunked against unchunked, half against fp32,
its custom backward against finite differences, its alignment against the MoE transformer's."""

from __future__ import annotations

import pytest
import torch

from tests.model.models import make_model
from tokenmdp import TokenBatch
from tokenmdp.interop.logits import entropy_from_logits, token_logprobs_from_logits
from tokenmdp.packing import pack_in_order

#: float64 results of the same computation in another order (chunking) or another formula.
F64_ATOL = 1e-12
#: A half-precision path normalized in float32 equals float32 on the upcast logits up to
#: float32 summation order.
F32_ATOL = 1e-5


def _batch() -> TokenBatch:
    return TokenBatch.from_sequences([[3, 1], [2], [4, 4, 0]], [[0, 5, 2], [6], [1, 1]],
                                     rewards=[1.0, 0.0, 1.0])


def _logits(batch: TokenBatch, V: int = 7, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*batch.tokens.shape, V, generator=g, dtype=torch.float64)).to(dtype)


def _direct_logprobs(logits_RCV, batch):
    """The textbook shift: log_softmax over the whole grid, outputs [:, :-1] for tokens [:, 1:]."""
    lp = torch.log_softmax(logits_RCV.double(), dim=-1)[:, :-1]
    picked = lp.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    return out * batch.response_mask


def _direct_entropy(logits_RCV, batch):
    p = torch.softmax(logits_RCV.double(), dim=-1)[:, :-1]
    h = -(torch.special.xlogy(p, p)).sum(-1)
    return torch.cat([torch.zeros_like(h[:, :1]), h], dim=1) * batch.response_mask


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_logprobs_and_entropy_equal_a_direct_log_softmax(layout):
    batch = _batch() if layout == "padded" else pack_in_order(_batch(), 7)
    logits = _logits(batch)
    torch.testing.assert_close(token_logprobs_from_logits(logits, batch),
                               _direct_logprobs(logits, batch), atol=F64_ATOL, rtol=0)
    torch.testing.assert_close(entropy_from_logits(logits, batch),
                               _direct_entropy(logits, batch), atol=F64_ATOL, rtol=0)


def test_padded_and_packed_give_the_same_token_values():
    padded = _batch()
    packed = pack_in_order(padded, 7)
    assert packed.num_rows < padded.num_rows              # sequences really share a row
    # the same outputs per (sequence, position) in both layouts
    table = torch.randn(3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def logits_of(b):
        real = b.sequence_id >= 0
        out = torch.zeros(*b.tokens.shape, 7, dtype=torch.float64)
        out[real] = table[b.sequence_id[real], b.position[real]]
        return out

    for fn in (token_logprobs_from_logits, entropy_from_logits):
        by_padded = padded.sequence_sum(fn(logits_of(padded), padded))
        by_packed = packed.sequence_sum(fn(logits_of(packed), packed))
        torch.testing.assert_close(by_packed, by_padded, atol=F64_ATOL, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 10_000])
def test_chunked_equals_unchunked_values_and_gradients(chunk_size):
    batch = pack_in_order(_batch(), 7)
    results = []
    for size in (chunk_size, 10**9):
        logits = _logits(batch).requires_grad_(True)
        lp = token_logprobs_from_logits(logits, batch, chunk_size=size)
        h = entropy_from_logits(logits, batch, chunk_size=size)
        w = torch.linspace(-1, 2, lp.numel(), dtype=torch.float64).view_as(lp)
        (grad,) = torch.autograd.grad((w * lp).sum() + (w.flip(0) * h).sum(), logits)
        results.append((lp.detach(), h.detach(), grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=F64_ATOL, rtol=0)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_logits_are_normalized_in_float32(half):
    batch = _batch()
    logits32 = _logits(batch, dtype=torch.float32)
    rounded = logits32.to(half)
    lp = token_logprobs_from_logits(rounded, batch)
    h = entropy_from_logits(rounded, batch)
    assert lp.dtype == h.dtype == torch.float32
    # the same numbers as float32 on the upcast logits ...
    torch.testing.assert_close(lp, token_logprobs_from_logits(rounded.float(), batch),
                               atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(h, entropy_from_logits(rounded.float(), batch), atol=F32_ATOL,
                               rtol=0)
    # ... and within the rounding of the logits of the float32 result: log-softmax is
    # 2-Lipschitz in the max norm of the logits, entropy (2 log V)-Lipschitz at most here
    dz = float((rounded.float() - logits32).abs().max())
    assert float((lp - token_logprobs_from_logits(logits32, batch)).abs().max()) <= 2 * dz + 1e-5
    bound = 2 * torch.log(torch.tensor(7.0)).item() * dz + 1e-5
    assert float((h - entropy_from_logits(logits32, batch)).abs().max()) <= bound


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_gradient_is_in_the_logits_dtype_and_close_to_float32(half):
    batch = _batch()
    z = _logits(batch, dtype=torch.float32).to(half)
    grads = []
    for logits in (z.clone().requires_grad_(True), z.float().requires_grad_(True)):
        total = token_logprobs_from_logits(logits, batch).sum() + entropy_from_logits(
            logits, batch).sum()
        grads.append(torch.autograd.grad(total, logits)[0])
    assert grads[0].dtype == half
    # the float32 gradient rounded once to half precision: |g| <= 1 + log V here
    eps = torch.finfo(half).eps
    torch.testing.assert_close(grads[0].float(), grads[1], atol=4 * eps * (1 + 2.0), rtol=0)


def test_custom_backward_passes_gradcheck():
    batch = pack_in_order(_batch(), 7)
    logits = _logits(batch).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda z: token_logprobs_from_logits(z, batch, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, batch, chunk_size=3),
                                    (logits,))


def test_gradient_equals_autograd_through_the_direct_formula():
    batch = _batch()
    a = _logits(batch).requires_grad_(True)
    b = a.detach().clone().requires_grad_(True)
    w = torch.randn(batch.tokens.shape, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(3))
    (ga,) = torch.autograd.grad((w * token_logprobs_from_logits(a, batch)).sum()
                                + (w * entropy_from_logits(a, batch)).sum(), a)
    (gb,) = torch.autograd.grad((w * _direct_logprobs(b, batch)).sum()
                                + (w * _direct_entropy(b, batch)).sum(), b)
    torch.testing.assert_close(ga, gb, atol=F64_ATOL, rtol=0)


def test_zero_probability_vocabulary_entries_stay_finite():
    batch = _batch()
    logits = _logits(batch).requires_grad_(False)
    logits[..., 4] = -torch.inf                          # a banned token, never sampled here
    logits.requires_grad_(True)
    h = entropy_from_logits(logits, batch)
    lp = token_logprobs_from_logits(logits, batch)
    (g,) = torch.autograd.grad(h.sum() + lp.sum(), logits)
    assert torch.isfinite(h).all() and torch.isfinite(lp).all() and torch.isfinite(g).all()
    torch.testing.assert_close(h, _direct_entropy(logits.detach(), batch), atol=F64_ATOL, rtol=0)


def test_aligned_with_the_moe_transformers_own_log_probs():
    model = make_model(dtype=torch.float64)
    batch = pack_in_order(TokenBatch.from_sequences([[3, 1], [2], [4]], [[0, 5, 2], [6], [1, 1]]),
                          7)
    own = model.token_outputs(batch, entropy=True, aux=False)
    logits = model(batch, aux=False).logits_RCV
    torch.testing.assert_close(token_logprobs_from_logits(logits, batch), own.logprob_RC,
                               atol=F64_ATOL, rtol=0)
    torch.testing.assert_close(entropy_from_logits(logits, batch), own.entropy_RC, atol=F64_ATOL,
                               rtol=0)


def test_token_ids_and_a_mask_instead_of_a_batch():
    batch = _batch()
    logits = _logits(batch)
    every = token_logprobs_from_logits(logits, batch.tokens)
    assert (every[:, 0] == 0).all() and (every[:, 1:] != 0).all()
    masked = token_logprobs_from_logits(logits, batch.tokens, mask_RC=batch.response_mask)
    torch.testing.assert_close(masked, token_logprobs_from_logits(logits, batch), atol=0, rtol=0)
    torch.testing.assert_close(entropy_from_logits(logits, mask_RC=batch.response_mask),
                               entropy_from_logits(logits, batch), atol=0, rtol=0)


def test_bad_inputs_name_the_argument():
    batch = _batch()
    logits = _logits(batch)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_from_logits(logits, batch, chunk_size=0)
    with pytest.raises(TypeError, match="logits_RCV"):
        token_logprobs_from_logits(logits[0], batch)
    with pytest.raises(TypeError, match="tokens"):
        token_logprobs_from_logits(logits, batch.tokens[:, :-1])
    with pytest.raises(TypeError, match="tokens"):
        token_logprobs_from_logits(logits, None)
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs_from_logits(logits[..., :5], batch)            # token 6 >= V = 5
    with pytest.raises(ValueError, match="mask_RC"):
        entropy_from_logits(logits, mask_RC=torch.ones(batch.tokens.shape, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask_RC"):
        token_logprobs_from_logits(logits, batch, mask_RC=batch.response_mask)
    no_prompt = TokenBatch.from_sequences([[]], [[1, 2]])
    with pytest.raises(ValueError, match="prompt token"):
        token_logprobs_from_logits(_logits(no_prompt), no_prompt)
