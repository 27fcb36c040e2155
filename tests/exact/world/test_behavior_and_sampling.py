"""Behaviour policies (stale, inference-like) and sampling."""

import numpy as np
import pytest
import scipy.stats
import torch
from torch.nn.utils import parameters_to_vector

from tests.exact.conftest import make_policy
from tokenmdp.exact import (
    InferencePolicy,
    TabularPolicy,
    gradient,
    inference_copy,
    objective,
    round_logits,
    sample,
    sequence_kl,
    sequence_probs,
    stale_copy,
)

EXACT_TOL = 1e-12
#: chi-square goodness of fit: reject only below this p-value (fixed seed, so deterministic).
CHI2_MIN_PVALUE = 1e-3


def test_sample_frequencies_pass_chi_square_against_exact_probabilities(mdp, policy):
    n = 20_000
    batch = sample(mdp, policy, n, generator=torch.Generator().manual_seed(7))
    resp = torch.full((n, mdp.max_len), mdp.eos)
    for i, (_, r) in enumerate(batch.sequences()):
        resp[i, :len(r)] = torch.tensor(r)
    idx = mdp.terminal_index(batch.prompt_index, resp, batch.length)
    observed = np.bincount(idx.numpy(), minlength=mdp.num_sequences)
    with torch.no_grad():
        expected = (mdp.prompt_probs[mdp.terminal_prompt_index]
                    * sequence_probs(mdp, policy)).numpy() * n
    assert observed.sum() == n
    pvalue = scipy.stats.chisquare(observed, expected).pvalue
    assert pvalue > CHI2_MIN_PVALUE


def test_sample_records_behavior_logprobs_and_rewards(mdp, policy):
    batch = sample(mdp, policy, 12, generator=torch.Generator().manual_seed(0), group_size=4)
    with torch.no_grad():
        torch.testing.assert_close(batch.behavior_logprob, policy.token_logprobs(batch),
                                   rtol=0, atol=EXACT_TOL)
    for (prompt, response), r in zip(batch.sequences(), batch.reward.tolist()):
        assert mdp.reward_fn(tuple(prompt), tuple(response), eos=mdp.eos) == r
    assert batch.group.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert all(len(set(batch.prompt_index[batch.group == g].tolist())) == 1 for g in range(3))


def test_sample_is_reproducible_from_its_generator(mdp, policy):
    a = sample(mdp, policy, 50, generator=torch.Generator().manual_seed(3))
    b = sample(mdp, policy, 50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens)


def test_stale_copy_by_distance_moves_exactly_that_far_downhill(mdp, policy):
    old = stale_copy(mdp, policy, distance=0.25)
    delta = (parameters_to_vector(policy.parameters())
             - parameters_to_vector(old.parameters())).detach()
    assert abs(float(delta.norm()) - 0.25) < EXACT_TOL
    g = gradient(mdp, policy)
    torch.testing.assert_close(delta / delta.norm(), g / g.norm(), rtol=0, atol=EXACT_TOL)
    assert float(objective(mdp, old).detach()) < float(objective(mdp, policy).detach())


def test_stale_copy_by_steps_equals_manual_descent(mdp):
    policy = make_policy(TabularPolicy, mdp, seed=1)
    old = stale_copy(mdp, policy, steps=2, lr=0.5)
    theta = parameters_to_vector(policy.parameters()).detach()
    manual = make_policy(TabularPolicy, mdp, seed=1)
    for _ in range(2):
        with torch.no_grad():
            manual.table -= 0.5 * gradient(mdp, manual).view_as(manual.table)
    torch.testing.assert_close(parameters_to_vector(old.parameters()),
                               parameters_to_vector(manual.parameters()), rtol=0, atol=EXACT_TOL)
    assert torch.equal(parameters_to_vector(policy.parameters()).detach(), theta)  # unchanged


@pytest.mark.parametrize("rounding", ["bf16", "fp16", "fp8_e4m3", 2, 5])
def test_inference_copy_rounds_the_same_logits(mdp, policy, rounding):
    mu = inference_copy(policy, rounding=rounding)
    prompt_index, prefix = mdp.level_prefixes(2)
    with torch.no_grad():
        base = policy.logits(prompt_index, prefix)
        got = mu.logits(prompt_index, prefix)
        assert torch.equal(round_logits(got, rounding), got)  # on the grid already
        assert not torch.equal(got, base)
        torch.testing.assert_close(mu.level_logits(2), got, rtol=0, atol=0)
        kl = float(sequence_kl(mdp, policy, mu))
    assert 0 < kl < 0.1


def test_round_logits_by_bits_has_bounded_relative_error():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 10
    for bits in (1, 3, 8, 20):
        rel = ((round_logits(x, bits) - x) / x).abs().max()
        assert rel <= 2.0 ** -bits  # half a unit in the b-bit mantissa on [0.5, 1), relative
    assert torch.equal(round_logits(x, "bf16"), x.to(torch.bfloat16).double())
    assert round_logits(torch.tensor([1e4], dtype=torch.float64), "fp8_e4m3").item() == 448.0


def test_inference_copy_noise_is_fixed_and_temperature_scales(mdp, policy):
    mu = inference_copy(policy, noise_std=0.5, generator=torch.Generator().manual_seed(0))
    pidx, prefix = mdp.level_prefixes(1)
    with torch.no_grad():
        assert torch.equal(mu.logits(pidx, prefix), mu.logits(pidx, prefix))
        hot = inference_copy(policy, temperature=2.0)
        torch.testing.assert_close(hot.logits(pidx, prefix), policy.logits(pidx, prefix) / 2,
                                   rtol=0, atol=0)


def test_inference_copy_is_a_snapshot(mdp):
    policy = make_policy(TabularPolicy, mdp)
    mu = inference_copy(policy)
    with torch.no_grad():
        before = sequence_probs(mdp, mu).clone()
        policy.table += 1.0 * torch.arange(mdp.vocab_size, dtype=torch.float64)
        assert torch.equal(sequence_probs(mdp, mu), before)
    assert not any(p.requires_grad for p in mu.parameters())


def test_inference_policy_rejects_bad_arguments(mdp, policy):
    with pytest.raises(ValueError, match="rounding"):
        InferencePolicy(policy, rounding="int4")
    with pytest.raises(ValueError, match="temperature"):
        InferencePolicy(policy, temperature=0.0)
    with pytest.raises(TypeError, match="generator"):
        InferencePolicy(policy, noise_std=0.1)
    with pytest.raises(ValueError, match="distance, steps"):
        stale_copy(mdp, policy)
    with pytest.raises(ValueError, match="lr"):
        stale_copy(mdp, policy, steps=1)
