"""The exercises of tutorial 7, registered in :mod:`~tokenmdp.course.exercises.registry`.

The setup is the tutorial's: the course's MDP and policy (:func:`tokenmdp.course.setups.copy_task`) as
``π_old``, and an inference engine ``μ`` that sees the same logits plus a fixed Gaussian
perturbation of standard deviation ``TR07_NOISE_STD`` (seed ``TR07_NOISE_SEED``). The expected
values come from :func:`tokenmdp.exact.world.chi_square.chi_square` and exact ``moments``; the student
sums over states or calls ``moments`` in the tutorial, the tests take a third route. The true
option of each prediction (``tr07_predict_*``) is read off the same exact values.
"""

from __future__ import annotations

import torch

from tokenmdp.course.exercises.registry import (
    EXACT_TOL,
    SHARE_TOL,
    _exercise,
    _nearest_option,
    _prediction,
    expected,
)
from tokenmdp.course.setups import copy_task
from tokenmdp.estimators import get
from tokenmdp.exact import inference_copy, moments
from tokenmdp.exact.world.chi_square import chi_square

__all__: list[str] = []

#: Standard deviation of the engine's fixed logit perturbation in tutorial 7's exercises.
TR07_NOISE_STD = 0.4
#: Seed of that perturbation.
TR07_NOISE_SEED = 1
#: Responses per prompt in tutorial 7.
TR07_GROUP_SIZE = 2
#: The options of the MiniRL prediction: the share of ``minirl_no_is``'s shift that ``minirl`` keeps.
TR07_KEPT_SHARES = {"zero": 0.0, "half": 0.5, "all": 1.0}
#: The threshold of the sequence-ESS prediction.
TR07_ESS_THRESHOLD = 0.9


def tr07_engine(noise_std: float = TR07_NOISE_STD):
    """Tutorial 7's world: ``(mdp, π_old, μ)`` with ``μ`` a noisy copy of ``π_old``.

    Parameters
    ----------
    noise_std : float, default ``TR07_NOISE_STD``
        Standard deviation of ``μ``'s fixed logit perturbation (seed ``TR07_NOISE_SEED``).

    Returns
    -------
    (TokenMDP, TabularPolicy, InferencePolicy)
        Fresh objects on every call.
    """
    mdp, old = copy_task()
    mu = inference_copy(old, noise_std=noise_std,
                        generator=torch.Generator().manual_seed(TR07_NOISE_SEED))
    return mdp, old, mu


def tr07_relative_deviation(mdp, old, mu, estimator) -> float:
    """``‖E_μ[ĝ] − E_{π_old}[ĝ]‖ / ‖E_{π_old}[ĝ]‖``: how far sampling from ``μ`` moves the
    expected gradient of ``estimator`` at ``π_θ = π_old`` from the one it has on ``π_old``'s
    own samples (exact moments, groups of ``TR07_GROUP_SIZE``).

    Parameters
    ----------
    mdp : TokenMDP
    old : policy module
        ``π_old = π_θ``.
    mu : policy module
        The sampler.
    estimator : Estimator

    Returns
    -------
    float
    """
    kw = dict(group_size=TR07_GROUP_SIZE, method="enumeration")
    on = moments(mdp, old, estimator, behavior=old, **kw).mean
    off = moments(mdp, old, estimator, behavior=mu, old=old, **kw).mean
    return float((off - on).norm() / on.norm())


@_exercise("tr07_token_chi2",
           quantity="the per-token χ²(π_old ‖ μ) averaged over μ's state visitation, "
                    "μ = π_old's logits + N(0, 0.4²) noise (tutorial 7, exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="At each state χ²_s = Σ_a π_old(a|s)²/μ(a|s) − 1; weight the states by "
                "d^μ(s) (state_visitation of μ, not of π_old) and divide by Σ_s d^μ(s) = E_μ|y|.")
def _tr07_token_chi2() -> float:
    mdp, old, mu = tr07_engine()
    return float(chi_square(mdp, old, mu, level="token"))


@_prediction("tr07_predict_token_chi2",
             question="For the engine σ = 0.4, is the per-token χ²(π_old ‖ μ) larger or smaller "
                      "than the per-response one?",
             options=("larger", "smaller"),
             hint="A response's weight is the product of its tokens' weights, so its second moment "
                  "compounds over the tokens of the response.")
def _tr07_predict_token_chi2() -> str:
    mdp, old, mu = tr07_engine()
    per_response = float(chi_square(mdp, old, mu, level="sequence"))
    return "larger" if expected("tr07_token_chi2") > per_response else "smaller"


@_exercise("tr07_minirl_bias",
           quantity="the relative deviation ‖E_μ ĝ − E_π_old ĝ‖/‖E_π_old ĝ‖ of the minirl "
                    "estimator (token TIS at 5), G = 2, μ = π_old + N(0, 0.4²) logit noise "
                    "(tutorial 7, exercise 2)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="The bias is what sampling from μ instead of π_old does to the expected "
                "gradient at π_θ = π_old: compare the estimator's mean under the engine with "
                "its mean under the trainer's own policy, relative to the latter's length.")
def _tr07_minirl_bias() -> float:
    mdp, old, mu = tr07_engine()
    return tr07_relative_deviation(mdp, old, mu, get("minirl"))


@_prediction("tr07_predict_minirl_bias",
             question="For the engine σ = 0.4 at π_θ = π_old, is minirl's relative shift closer to "
                      "zero, to half of minirl_no_is's or to all of minirl_no_is's?",
             options=tuple(TR07_KEPT_SHARES),
             hint="A token-level weight corrects the action probabilities at each state μ visits, "
                  "not which states μ visits (tutorial 3, section 2).")
def _tr07_predict_minirl_bias() -> str:
    mdp, old, mu = tr07_engine()
    kept = expected("tr07_minirl_bias") / tr07_relative_deviation(mdp, old, mu, get("minirl_no_is"))
    return _nearest_option(kept, TR07_KEPT_SHARES)


@_exercise("tr07_sequence_ess",
           quantity="the large-batch normalized ESS of the sequence weights W = π_old(y|x)/μ(y|x), "
                    "μ = π_old + N(0, 0.4²) logit noise (tutorial 7, exercise 3)",
           tolerance=SHARE_TOL, tolerance_name="SHARE_TOL",
           hint="As n grows, (Σ W)²/(n Σ W²) → E_μ[W]²/E_μ[W²] = 1/(1 + χ²) with the χ² of "
                "whole responses, Σ_x D(x) Σ_y π_old(y|x)²/μ(y|x) − 1.")
def _tr07_sequence_ess() -> float:
    mdp, old, mu = tr07_engine()
    return float(1 / (1 + chi_square(mdp, old, mu, level="sequence")))


@_prediction("tr07_predict_sequence_ess",
             question="For the engine σ = 0.4, is the large-batch ESS/n of the sequence weights "
                      "above or below 0.9?",
             options=("above", "below"),
             hint="ESS/n tends to 1/(1 + χ²) with the χ² of whole responses: read that χ² from "
                  "section 1's table.")
def _tr07_predict_sequence_ess() -> str:
    return "above" if expected("tr07_sequence_ess") > TR07_ESS_THRESHOLD else "below"
