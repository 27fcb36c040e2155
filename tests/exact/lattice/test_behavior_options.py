"""Issue 33, gap 2: ``inference_copy``'s options on the lattice change ``μ`` as documented:
``log μ(·|t, z) = log_softmax(round(logits + noise) / temperature)`` — the temperature divides
after the rounding, and each option moves the engine's copy away from ``π``."""

from __future__ import annotations

import pytest
import torch

from tokenmdp.exact import lattice as L
from tokenmdp.exact.world.behavior import round_logits

#: float64 log-softmax of the same numbers
EXACT = 1e-12


def _lattice_policy(seed=0):
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 4, length_reward=-0.1)
    return L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(seed), init_std=2.0)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("rounding", [None, "bf16", "fp8_e4m3"])
def test_inference_copy_divides_the_rounded_logits_by_the_temperature(temperature, rounding):
    pi = _lattice_policy()
    mu = L.inference_copy(pi, rounding=rounding, temperature=temperature)
    logits = pi.logits.detach()
    want = torch.log_softmax(round_logits(logits, rounding) / temperature, dim=-1)
    torch.testing.assert_close(mu.logprobs(), want, rtol=EXACT, atol=EXACT)
    assert not mu.logits.requires_grad
    if temperature != 1.0 or rounding is not None:
        assert float((mu.logprobs() - pi.logprobs().detach()).abs().max()) > 1e-3   # μ is not π
    if temperature != 1.0 and rounding is not None:        # the order is part of the contract
        other = torch.log_softmax(round_logits(logits / temperature, rounding), dim=-1)
        assert float((other - want).abs().max()) > 1e-6


def test_a_lower_temperature_sharpens_every_state():
    pi = _lattice_policy(1)
    entropy = {}
    for temperature in (0.5, 1.0, 2.0):
        logp = L.inference_copy(pi, temperature=temperature).logprobs()
        entropy[temperature] = -(logp.exp() * logp).sum(-1)
    assert bool((entropy[0.5] < entropy[1.0]).all()) and bool((entropy[1.0] < entropy[2.0]).all())


def test_the_noise_is_drawn_from_the_generator_once():
    pi = _lattice_policy(2)
    a = L.inference_copy(pi, noise_std=0.3, generator=torch.Generator().manual_seed(5))
    b = L.inference_copy(pi, noise_std=0.3, generator=torch.Generator().manual_seed(5))
    noise = torch.randn(pi.logits.shape, generator=torch.Generator().manual_seed(5),
                        dtype=torch.float64) * 0.3
    want = torch.log_softmax(pi.logits.detach() + noise, dim=-1)
    torch.testing.assert_close(a.logprobs(), want, rtol=EXACT, atol=EXACT)
    assert torch.equal(a.logits, b.logits)
