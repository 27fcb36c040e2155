"""The long-answer study's exact world (``benchmarks/_long_study_exact.py``).

The fresh-noise Monte Carlo sampler, run with the marginal weights ``π/μ̄``, must reproduce the
exact lattice moments of the same engine (``tokenmdp.exact.lattice.moments``: an independent
computation, forward/backward messages instead of samples) within its jackknife standard errors;
the margin must give the asked entropy (closed form); with fresh weights MiniRL's signal-to-noise
ratio must fall below the marginal one (the weight's extra variance given the token).
"""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _long_study_exact as E  # noqa: E402

#: Monte Carlo against exact: this many jackknife standard errors.
SE_MULTIPLE = 4.0
#: the bisection of the margin.
ENTROPY_TOL = 1e-9


def test_margin_gives_the_entropy():
    m = E.margin_for_entropy(0.08)
    V = E.VOCAB
    p = math.exp(m) / (math.exp(m) + V - 1)
    q = (1 - p) / (V - 1)
    assert abs(-(p * math.log(p) + (V - 1) * q * math.log(q)) - 0.08) < ENTROPY_TOL


@pytest.mark.parametrize("estimator", ["minirl", "minirl_no_is"])
def test_marginal_sampler_matches_the_exact_lattice(estimator):
    torch.manual_seed(0)
    exact = E.exact_row(6, 1.0, entropy=0.3, group_size=4)[estimator]
    mc = E.fresh_noise_moments(6, 1.0, estimator, weights="marginal", entropy=0.3,
                               group_size=4, groups=3000, seed=1)
    for key in ("progress", "snr"):
        assert abs(mc[key] - exact[key]) <= SE_MULTIPLE * mc[f"{key}_se"], (key, mc, exact)
    assert mc["snr_se"] < 0.1 * exact["snr"]                     # the check can fail


def test_fresh_weights_cost_minirl_signal_to_noise():
    kw = dict(entropy=0.3, group_size=4, groups=3000, seed=2)
    fresh = E.fresh_noise_moments(6, 1.0, "minirl", weights="fresh", **kw)
    marginal = E.fresh_noise_moments(6, 1.0, "minirl", weights="marginal", **kw)
    gap = marginal["snr"] - fresh["snr"]
    assert gap > SE_MULTIPLE * math.hypot(fresh["snr_se"], marginal["snr_se"])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="estimator"):
        E.fresh_noise_moments(4, 1.0, "grpo")
    with pytest.raises(ValueError, match="noise"):
        E.trainer_world(4, 3.0, 1.0, noise="sticky")
