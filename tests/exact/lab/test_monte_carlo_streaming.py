"""Issue 17: streamed Monte Carlo moments (running sums, pooled calls) and ``auto``'s choice.

The streamed figures equal the dense per-batch computation they replace on the same draws; they
agree with the exact moments within their standard errors, and a deliberately biased sampler
is caught; ``auto`` takes exact where Monte Carlo would be slower, Monte Carlo where exact is
out of reach.
"""

import pytest
import torch

from tokenmdp import estimators as E
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy, moments, stale_copy
from tokenmdp.exact.lab.group_draws import sampled_draws
from tokenmdp.exact.lab.moments_result import _monte_carlo_moments
from tokenmdp.exact.lab.monte_carlo import pool
from tokenmdp.exact.lab.step_gradients import StepGradients
from tokenmdp.exact.world.ground_truth import gradient, sequence_probs
from tokenmdp.exact.world.rewards import RandomTable

#: float64 round-off of sums over a few thousand batches.
EXACT_TOL = 1e-10
#: a streamed Monte Carlo figure within this many standard errors of the exact one.
MAX_Z = 4.5
#: a biased sampler must stand out by at least this many standard errors somewhere.
BIASED_Z = 8.0

MOD = __import__("tokenmdp.exact.lab.moments", fromlist=["moments"])
CHOICE = __import__("tokenmdp.exact.lab.method_choice", fromlist=["choose"])


def world(V=4, L=2, seed=0):
    mdp = TokenMDP(V, L, RandomTable(seed=seed), prompts=[(0,), (1,)], prompt_probs=[0.4, 0.6])
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(seed))
    old = stale_copy(mdp, pi, distance=0.3)
    mu = inference_copy(old, noise_std=0.3, generator=torch.Generator().manual_seed(seed + 1))
    return mdp, pi, dict(behavior=mu, old=old, reference=old)


def fields(mdp, kw):
    enum = mdp.enumerate()
    with torch.no_grad():
        return {"behavior_logprob": kw["behavior"].token_logprobs(enum),
                "old_logprob": kw["old"].token_logprobs(enum),
                "ref_logprob": kw["reference"].token_logprobs(enum)}


@pytest.mark.parametrize("name, max_cov", [("grpo", 512), ("gspo", 512), ("dapo", 0),
                                           ("cispo_tis", 0)])
def test_streamed_sums_equal_the_dense_per_batch_moments(monkeypatch, name, max_cov):
    monkeypatch.setattr(MOD, "MAX_COVARIANCE_DIM", max_cov)
    mdp, pi, kw = world()
    est = E.get(name)
    m = moments(mdp, pi, est, group_size=3, method="monte_carlo", num_samples=3000,
                generator=torch.Generator().manual_seed(7), **kw)
    with torch.no_grad():
        probs = sequence_probs(mdp, kw["behavior"])
    ids, _, p_keep = sampled_draws(mdp, probs, 3, 1, 3000, torch.Generator().manual_seed(7),
                                   False)
    steps = StepGradients(mdp, pi, est, fields(mdp, kw), 3)
    dense = torch.cat([g for _, g in steps.blocks(ids)])
    ref = _monte_carlo_moments(dense, gradient(mdp, pi), max_cov > 0, p_keep)
    assert (m.mean - ref.mean).abs().max() <= EXACT_TOL
    assert abs(m.total_variance - ref.total_variance) <= EXACT_TOL * max(1, ref.total_variance)
    assert (m.mean_se - ref.mean_se).abs().max() <= 1e-8
    assert abs(m.mse_se - ref.mse_se) <= 1e-8 * max(1, ref.mse_se)
    # the Var(g·b) part of the total variance's error: exact with the covariance, batch means
    # without (a small part of it)
    rel = 1e-6 if max_cov else 0.05
    assert abs(m.total_variance_se - ref.total_variance_se) <= rel * ref.total_variance_se
    if max_cov:
        assert (m.covariance - ref.covariance).abs().max() <= EXACT_TOL
        assert abs(m.relative_bias_se - ref.relative_bias_se) <= 1e-8
        assert abs(m.cosine_se - ref.cosine_se) <= 1e-8
    else:   # batch means: the same standard error up to its own sampling error
        assert m.covariance is None
        assert 0.5 < m.relative_bias_se / ref.relative_bias_se < 2
        assert 0.5 < m.cosine_se / ref.cosine_se < 2


@pytest.mark.parametrize("name", ["reinforce", "grpo", "dr_grpo", "gspo"])
def test_streamed_monte_carlo_agrees_with_exact(monkeypatch, name):
    monkeypatch.setattr(MOD, "MAX_COVARIANCE_DIM", 0)   # the large-policy path
    mdp, pi, kw = world(V=5, L=2, seed=3)
    exact = moments(mdp, pi, E.get(name), group_size=3, method="exact", **kw)
    mc = moments(mdp, pi, E.get(name), group_size=3, method="monte_carlo", num_samples=6000,
                 generator=torch.Generator().manual_seed(0), **kw)
    z = (mc.mean - exact.mean) / mc.mean_se.clamp(min=1e-12)
    assert z.abs().max() < MAX_Z
    assert abs(mc.total_variance - exact.total_variance) < MAX_Z * mc.total_variance_se
    assert abs(mc.mse - exact.mse) < MAX_Z * mc.mse_se
    assert abs(mc.cosine - exact.cosine) < MAX_Z * mc.cosine_se
    assert abs(mc.relative_bias - exact.relative_bias) < MAX_Z * mc.relative_bias_se


def test_a_biased_sampler_is_caught(monkeypatch):
    mdp, pi, kw = world(V=5, L=2, seed=3)
    exact = moments(mdp, pi, E.get("grpo"), group_size=3, method="exact", **kw)

    def tilted(mdp, probs_N, *args):       # draws from μ², renormalized per prompt: wrong
        q = (probs_N ** 2).view(mdp.num_prompts, -1)
        return sampled_draws(mdp, (q / q.sum(1, keepdim=True)).view(-1), *args)
    monkeypatch.setattr(MOD, "sampled_draws", tilted)
    mc = moments(mdp, pi, E.get("grpo"), group_size=3, method="monte_carlo", num_samples=6000,
                 generator=torch.Generator().manual_seed(0), **kw)
    z = (mc.mean - exact.mean) / mc.mean_se.clamp(min=1e-12)
    assert z.abs().max() > BIASED_Z


def test_pooled_calls_are_one_larger_sample():
    mdp, pi, kw = world()
    gen = torch.Generator().manual_seed(0)
    a = moments(mdp, pi, E.get("grpo"), group_size=3, method="monte_carlo", num_samples=1000,
                generator=gen, **kw)
    b = moments(mdp, pi, E.get("grpo"), group_size=3, method="monte_carlo", num_samples=3000,
                generator=gen, **kw)     # the same generator: the stream continues
    both = pool(a, b)
    assert both.num_draws == 4000 and both.method == "monte_carlo"
    assert (both.mean - (a.mean * 1000 + b.mean * 3000) / 4000).abs().max() <= EXACT_TOL
    assert not torch.equal(a.mean, b.mean)                  # two different samples
    assert (both.mean_se < a.mean_se).float().mean() > 0.9
    with pytest.raises(ValueError, match="not a Monte Carlo result"):
        pool(a, moments(mdp, pi, E.get("grpo"), group_size=3, method="exact", **kw))
    other = world(seed=5)
    c = moments(other[0], other[1], E.get("grpo"), group_size=3, method="monte_carlo",
                num_samples=100, **other[2])
    with pytest.raises(ValueError, match="different true gradients"):
        pool(a, c)


def _choice(mdp, pi, kw, group_size, num_samples, max_exact_draws=None):
    steps = StepGradients(mdp, pi, E.get("grpo"), fields(mdp, kw), group_size)
    with torch.no_grad():
        probs = sequence_probs(mdp, kw["behavior"])
    return CHOICE.choose("auto", steps, mdp, probs, group_size, 1, False, max_exact_draws,
                       num_samples=num_samples, mc_cost=CHOICE.MC_COST_PER_BATCH)


def test_auto_chooses_by_time_and_memory(monkeypatch):
    mdp, pi, kw = world(V=6, L=2, seed=1)      # 31 responses per prompt
    small = moments(mdp, pi, E.get("grpo"), group_size=2, method="auto", **kw)
    assert small.method in ("enumeration", "exchangeability") and small.mean_se is None
    large = moments(mdp, pi, E.get("grpo"), group_size=40, method="auto", num_samples=200,
                    **kw)
    assert large.method == "monte_carlo" and large.mean_se is not None
    assert large.total_variance_se > 0 and large.num_draws == 200
    # above the always-exact size, the choice follows the estimated times
    monkeypatch.setattr(CHOICE, "ALWAYS_EXACT_DRAWS", 10)
    costs = {"enumeration": CHOICE.count_draws(mdp, 6),
             "exchangeability": CHOICE.exchangeability_cost(
        mdp, CHOICE._type_keys(StepGradients(mdp, pi, E.get("grpo"), fields(mdp, kw), 6)),
        sequence_probs(mdp, kw["behavior"]).detach(), 6)}
    best = min(costs, key=costs.get)
    cost = costs[best]
    few = int(cost / CHOICE.MC_COST_PER_BATCH) - 1          # Monte Carlo would be faster
    many = int(cost / CHOICE.MC_COST_PER_BATCH) + 1         # Monte Carlo would be slower
    assert _choice(mdp, pi, kw, 6, few) == "monte_carlo"
    assert _choice(mdp, pi, kw, 6, many) == best
    assert _choice(mdp, pi, kw, 6, many, max_exact_draws=cost - 1) == "monte_carlo"
    # exact does not fit, Monte Carlo's `many` sampled batches do (the same bytes per batch,
    # an eighth of the batches): Monte Carlo; below both, a refusal that names the sizes
    per_batch = CHOICE.BYTES_PER_DRAWN_RESPONSE * 6 + 16
    monkeypatch.setenv("TOKENMDP_MEMORY_BUDGET", str(cost * per_batch // 2))
    assert _choice(mdp, pi, kw, 6, many) == "monte_carlo"
    monkeypatch.setenv("TOKENMDP_MEMORY_BUDGET", "1K")
    with pytest.raises(ValueError, match=f"method=monte_carlo, num_samples={many}, group_size=6"):
        _choice(mdp, pi, kw, 6, many)
