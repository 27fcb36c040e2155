"""The exercises of tutorial 8 (KL regularization), registered in :mod:`~tokenmdp.course.exercises.registry`.

Each expected value is computed by the package along a route the tutorial does not ask the
student to take: Gauss–Hermite quadrature where the student uses the closed forms, exact
``kl_penalty_moments`` and ``kl_gradients`` on :func:`tokenmdp.course.tutorials.t08.kl_world` where the
student reads the gradient table. The true option of each prediction (``tr08_predict_*``) is
computed from the same setups.
"""

from __future__ import annotations

import math

import numpy as np

from tokenmdp.course.exercises.registry import EXACT_TOL, _exercise, _nearest_option, _prediction, expected
from tokenmdp.course.tutorials.t08 import kl_world
from tokenmdp.estimators import KLPenalty, kl_k3

#: The crossing is bracketed in this range of mean shifts ``μ`` (q = N(μ, 1), p = N(0, 1)).
TR08_BRACKET = (0.5, 3.0)
#: A root found to this absolute accuracy in ``μ``.
ROOT_TOL = 1e-8
#: Nodes of the Gauss–Hermite rule (exact for polynomials of degree < 2 · nodes; the integrands
#: are smooth and grow like ``exp(2μ|x|)``, integrated to about 1e-13 for ``μ <= 3``).
QUADRATURE_NODES = 120
#: The sequence world of the gradient exercises (responses of at most 3 tokens).
TR08_SEQUENCE_LEN = 3
#: The bandit world of the off-policy prediction (responses of one token).
TR08_BANDIT_LEN = 1
#: Mean shifts at which the prediction on k3's spread compares it with k2's (across the bracket).
TR08_SPREAD_GRID = 51
#: The options of the prediction on the size of k3's loss bias, as numbers.
TR08_BIAS_SIZES = {"0": 0.0, "0.3": 0.3, "1": 1.0}


def _gaussian_relative_sds(mu: float) -> tuple[float, float]:
    """``(sd(k2), sd(k3)) / KL(q‖p)`` for ``x ~ q = N(μ, 1)``, ``p = N(0, 1)``, by quadrature."""
    z, w = np.polynomial.hermite_e.hermegauss(QUADRATURE_NODES)
    w = w / math.sqrt(2 * math.pi)                         # E[f(z)], z ~ N(0, 1)
    x = mu + z
    log_r = -0.5 * x ** 2 + 0.5 * (x - mu) ** 2            # log p(x) − log q(x)
    kl = float(w @ -log_r)
    sds = []
    for k in (0.5 * log_r ** 2, np.expm1(log_r) - log_r):
        mean = float(w @ k)
        sds.append(math.sqrt(float(w @ (k - mean) ** 2)) / kl)
    return sds[0], sds[1]


@_exercise("tr08_k3_k2_crossover",
           quantity="the mean shift μ (q = N(μ, 1), p = N(0, 1)) above which k3's standard "
                    "deviation exceeds k2's",
           tolerance=ROOT_TOL, tolerance_name="ROOT_TOL",
           hint="With log r ~ N(−μ²/2, μ²): sd(k2)/KL = √(2 + μ²) and sd(k3)/KL = "
                "√(e^{μ²} − 1 − μ²)/(μ²/2); find where they are equal (bisection on [0.5, 3]).")
def _tr08_k3_k2_crossover() -> float:
    lo, hi = TR08_BRACKET

    def k3_minus_k2(mu):
        sd2, sd3 = _gaussian_relative_sds(mu)
        return sd3 - sd2

    if not (k3_minus_k2(lo) < 0 < k3_minus_k2(hi)):
        raise RuntimeError("tr08_k3_k2_crossover: the crossing is not bracketed")
    while hi - lo > ROOT_TOL * 1e-5:          # far below the tolerance: 40 halvings
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if k3_minus_k2(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


@_prediction("tr08_predict_k3_spread_stays_below_k2",
             question="As q = N(μ, 1) moves away from p = N(0, 1) (μ from 0.5 to 3), does k3 keep "
                      "a smaller standard deviation than k2?",
             options=("yes", "no"),
             hint="Compare how the two spreads grow with μ: k2 = ½(log r)² is a polynomial in a "
                  "Gaussian, while k3 contains r − 1 itself, a lognormal variable.")
def _tr08_predict_k3_spread_stays_below_k2() -> str:
    below = [sd3 < sd2 for sd2, sd3 in map(_gaussian_relative_sds,
                                           np.linspace(*TR08_BRACKET, TR08_SPREAD_GRID))]
    return "yes" if all(below) else "no"


def _relative_distance(a, b) -> float:
    return float((a - b).norm() / b.norm())


@_exercise("tr08_k3_loss_relative_bias",
           quantity="‖E[∇ of β·k3 in the loss]/β − ∇KL(π‖π_ref)‖ / ‖∇KL(π‖π_ref)‖ on "
                    "kl_world(3)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="The penalty alone has an exact expected gradient, β E[∇k3]; the target is the "
                "gradient of the reverse KL(π ‖ π_ref) over whole responses. Mind the sign: the "
                "lab reports ascent directions.")
def _tr08_k3_loss_relative_bias() -> float:
    from tokenmdp.exact.analysis.kl_gradients import kl_gradients, kl_penalty_moments

    mdp, pi, ref, _ = kl_world(TR08_SEQUENCE_LEN)
    delivered = -kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=1.0, in_reward=False,
                                                            estimator=kl_k3)).mean
    return _relative_distance(delivered, kl_gradients(mdp, pi, ref).reverse)


@_prediction("tr08_predict_k3_loss_bias_size",
             question="On the sequence task, is ‖E[∇k3 in the loss] − ∇KL(π‖π_ref)‖ / "
                      "‖∇KL(π‖π_ref)‖ closer to 0, 0.3 or 1?",
             options=tuple(TR08_BIAS_SIZES),
             hint="Per state, E[∇k3] is −Σ_a π_ref(a|s) ∇log π(a|s), a forward-KL gradient, and "
                  "it ignores the later tokens: it agrees with the reverse-KL gradient only to "
                  "first order in the distance between π and π_ref, and π has moved by a step "
                  "of 3.")
def _tr08_predict_k3_loss_bias_size() -> str:
    bias = expected("tr08_k3_loss_relative_bias")
    return _nearest_option(bias, TR08_BIAS_SIZES)


@_prediction("tr08_predict_weight_repairs",
             question="Where does the per-token weight sg(π_θ/μ) make the stale k3-in-the-loss "
                      "gradient exactly the on-policy one: in both worlds, in the bandit only, or "
                      "in neither?",
             options=("both", "bandit", "neither"),
             hint="The weight changes which action is counted at a state, not how often μ "
                  "reaches the state: ask in which world the states reached do not depend on "
                  "the policy.")
def _tr08_predict_weight_repairs() -> str:
    from tokenmdp.exact.analysis.kl_gradients import kl_penalty_moments

    exact = []
    for max_len in (TR08_BANDIT_LEN, TR08_SEQUENCE_LEN):
        mdp, pi, ref, mu = kl_world(max_len)
        weighted = KLPenalty(coef=1.0, in_reward=False, importance_weighted=True)
        off = kl_penalty_moments(mdp, pi, ref, weighted, behavior=mu).mean
        on = kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=1.0, in_reward=False)).mean
        exact.append(_relative_distance(off, on) <= EXACT_TOL)
    return {(True, True): "both", (True, False): "bandit", (False, False): "neither"}.get(
        tuple(exact), "sequence only")


@_exercise("tr08_is_k3_off_policy_gap",
           quantity="‖E_μ[ĝ] of importance-weighted k3 in the loss − E_π[ĝ] of k3 in the loss‖ "
                    "/ ‖E_π[ĝ]‖ on kl_world(3)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Off-policy, the per-token weight π/μ repairs which action is taken at a state, "
                "not how often μ visits the state: compare the weighted penalty's expected "
                "gradient under μ with the unweighted one on-policy.")
def _tr08_is_k3_off_policy_gap() -> float:
    from tokenmdp.exact.analysis.kl_gradients import kl_penalty_moments

    mdp, pi, ref, mu = kl_world(TR08_SEQUENCE_LEN)
    weighted = KLPenalty(coef=1.0, in_reward=False, importance_weighted=True)
    off = kl_penalty_moments(mdp, pi, ref, weighted, behavior=mu).mean
    on = kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=1.0, in_reward=False)).mean
    return _relative_distance(off, on)
