"""Issue 33, gap 3: the Monte Carlo standard errors are calibrated, not only wide enough.

A test that checks ``|mc - exact| < 4.5 SE`` passes just as well when the SE is 60 times too
wide. Here many independent Monte Carlo runs (seeds) of the same world are compared with the
exact answer: the z-scores ``(mc - exact) / SE`` of the mean's coordinates, of the total
variance and of the relative bias must spread like ``N(0, 1)`` (their root mean square within
a band around 1), and the reported SE of the mean must match the spread of the means over the
seeds (their ratio within a band). An SE off by a factor of 1.6 either way fails; so does a
sampler whose mean is off by a fraction of an SE in every run.

The bands hold for ``SEEDS`` runs: the root mean square of ``n`` independent z-scores has a
relative spread of about ``1/sqrt(2n)`` (0.11 for 40 z-scores).
"""

from __future__ import annotations

import math

import torch

from tokenmdp import estimators as E
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy, moments, stale_copy
from tokenmdp.exact import lattice as L
from tokenmdp.exact.world.rewards import RandomTable

SEEDS = 40
SAMPLES = 300
#: the root mean square of the z-scores, and the reported SE over the spread over seeds
BAND = (0.7, 1.4)


def _world():
    mdp = TokenMDP(4, 2, RandomTable(seed=3), prompts=[(0,), (1,)], prompt_probs=[0.4, 0.6])
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(3))
    old = stale_copy(mdp, pi, distance=0.3)
    mu = inference_copy(old, noise_std=0.3, generator=torch.Generator().manual_seed(4))
    return mdp, pi, dict(behavior=mu, old=old, reference=old)


def _rms(z):
    z = torch.as_tensor(z, dtype=torch.float64).flatten()
    return float(z.pow(2).mean().sqrt())


def _median_rms(z_RD):
    """The median over coordinates of each coordinate's root mean square z over the runs.

    The median, because a coordinate driven by a rare response (seen a handful of times in
    ``SAMPLES`` draws) has a noisy, often too small, sample SE: its z-scores spread wider
    (root mean square 2 to 9 here), as any sample standard error does when ``n p`` is small.
    A wrong SE formula moves every coordinate and the median with them."""
    return float(z_RD.pow(2).mean(0).sqrt().median())


def test_monte_carlo_standard_errors_match_the_spread_over_seeds():
    mdp, pi, kw = _world()
    est = E.get("grpo_tis")
    exact = moments(mdp, pi, est, group_size=3, method="exact", **kw)
    runs = [moments(mdp, pi, est, group_size=3, method="monte_carlo", num_samples=SAMPLES,
                    generator=torch.Generator().manual_seed(s), **kw) for s in range(SEEDS)]
    means = torch.stack([m.mean for m in runs])
    ses = torch.stack([m.mean_se for m in runs])
    live = exact.covariance.diagonal() > 1e-6 * exact.covariance.diagonal().max()
    z_mean = ((means - exact.mean) / ses)[:, live]
    z_var = [(m.total_variance - exact.total_variance) / m.total_variance_se for m in runs]
    z_bias = [(m.relative_bias - exact.relative_bias) / m.relative_bias_se for m in runs]
    spread = means[:, live].std(0)
    ratio = float((ses[:, live].mean(0) / spread).median())
    figures = dict(rms_mean=_median_rms(z_mean), rms_var=_rms(z_var), rms_bias=_rms(z_bias),
                   se_over_spread=ratio, mean_z=float(z_mean.mean()))
    for key in ("rms_mean", "rms_var", "rms_bias", "se_over_spread"):
        assert BAND[0] < figures[key] < BAND[1], figures
    assert abs(figures["mean_z"]) < 4 / math.sqrt(SEEDS), figures     # centred on the truth


def test_lattice_monte_carlo_standard_errors_match_the_spread_over_seeds():
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 3, length_reward=-0.1)
    g = torch.Generator().manual_seed(0)
    pi = L.LatticePolicy(mdp, generator=g)
    mu = L.inference_copy(pi, noise_std=0.3, generator=g)
    est = E.get("grpo_mis")
    exact = L.moments(mdp, pi, est, group_size=2, behavior=mu, old=mu, reference=mu)
    runs = [L.moments(mdp, pi, est, group_size=2, behavior=mu, old=mu, reference=mu,
                      method="monte_carlo",
                      num_samples=SAMPLES, generator=torch.Generator().manual_seed(s))
            for s in range(SEEDS)]
    means = torch.stack([m.mean for m in runs])
    ses = torch.stack([m.mean_se for m in runs])
    live = means.std(0) > 1e-6 * float(means.std(0).max())
    z = ((means - exact.mean) / ses)[:, live]
    ratio = float((ses[:, live].mean(0) / means[:, live].std(0)).median())
    rms = _median_rms(z)
    assert BAND[0] < rms < BAND[1] and BAND[0] < ratio < BAND[1], (rms, ratio)
