"""The exercises of tutorial 6 (trust regions and clipping), registered in
:mod:`~tokenmdp.course.exercises.registry`.

The setup is the tutorial's: the course's MDP and policy (:func:`tokenmdp.course.setups.copy_task`)
as ``π_old`` and ``π`` one step along ``∇J(π_old)``; the expected values are an exact ``J``
against the surrogate, PPO's exact clip fraction and GSPO's exact cosine; the true option of
each prediction (``tr06_predict_*``) is read off the same exact value.
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
from tokenmdp.course.setups import copy_task, ppo_clip_fraction, step_along
from tokenmdp.estimators import GSPO, Aggregation, Estimator, LeaveOneOut, Surrogate
from tokenmdp.exact import gradient, moments, objective, surrogate

__all__ = ["tr06_estimator"]

#: Tutorial 6's step: ``π = π_old + s u/‖u‖``, ``u = ∇J(π_old)``, for the first-order gap.
TR06_GAP_STEP = 2.0
#: Tutorial 6's stale step for the clip fraction and GSPO's band.
TR06_STALE_STEP = 0.5
#: PPO's clip range in tutorial 6's clip-fraction exercise.
TR06_EPS = 0.2
#: GSPO's band ``[1 − 3e-4, 1 + 4e-4]`` (arXiv 2507.18071).
TR06_GSPO_EPS_LOW, TR06_GSPO_EPS_HIGH = 3e-4, 4e-4
#: The options of the clip-share prediction and the shares they name (an order of magnitude).
TR06_CLIP_SHARES = {"0.5%": 0.005, "5%": 0.05, "50%": 0.5}


def _tr06_pair(step: float):
    mdp, old = copy_task()
    return mdp, step_along(old, gradient(mdp, old), step), old


@_exercise("tr06_first_order_gap",
           quantity="the first-order gap J(π) − L_{π_old}(π) at one step of length 2 along "
                    "∇J(π_old) (tutorial 6, exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="By the performance-difference lemma J(π) − L(π) = Σ_s (d^π(s) − d^{π_old}(s)) "
                "Σ_a π(a|s) A^{π_old}(s, a): only the state visitation differs.")
def _tr06_first_order_gap() -> float:
    mdp, pi, old = _tr06_pair(TR06_GAP_STEP)
    with torch.no_grad():
        return float(objective(mdp, pi) - surrogate(mdp, pi, old))


@_prediction("tr06_predict_gap_sign",
             question="At a step of length 2 along ∇J(π_old), is J(π) above or below the "
                      "surrogate L_{π_old}(π)?",
             options=("above", "below"),
             hint="The gap is Σ_s (d^π(s) − d^{π_old}(s)) Σ_a π(a|s) A^{π_old}(s, a): ask whether "
                  "the states π visits more often still hold advantage for π's own actions.")
def _tr06_predict_gap_sign() -> str:
    return "above" if expected("tr06_first_order_gap") > 0 else "below"


@_exercise("tr06_clip_fraction",
           quantity="the exact pooled clip fraction of PPO (ε = 0.2, G = 2, Â = R_1 − R_2) one "
                    "step of length 0.5 from π_old, data from π_old (tutorial 6, exercise 2)",
           tolerance=SHARE_TOL, tolerance_name="SHARE_TOL",
           hint="Clipped means M_t = 0: Â > 0 and r > 1 + ε, or Â < 0 and r < 1 − ε. Pool "
                "E[#clipped tokens] / E[#tokens] over every pair of responses (y_1, y_2).")
def _tr06_clip_fraction() -> float:
    mdp, pi, old = _tr06_pair(TR06_STALE_STEP)
    return ppo_clip_fraction(mdp, pi, old, eps_low=TR06_EPS, eps_high=TR06_EPS)


@_prediction("tr06_predict_clip_share",
             question="One step of length 0.5 from π_old, data from π_old: is the share of "
                      "tokens that PPO (ε = 0.2) clips closer to 0.5%, 5% or 50%?",
             options=tuple(TR06_CLIP_SHARES),
             hint="A token is clipped only when its ratio π/π_old has left [0.8, 1.2] in the "
                  "direction of its advantage: compare how much a step this small in KL moves one "
                  "token's probability with ε = 0.2.")
def _tr06_predict_clip_share() -> str:
    share = expected("tr06_clip_fraction")        # the nearest option on a log scale
    return _nearest_option(share, TR06_CLIP_SHARES, log=True)


def tr06_estimator(surrogate_part: Surrogate) -> Estimator:
    """Tutorial 6's estimator with ``surrogate_part``: leave-one-out advantage (``G = 2``:
    ``Â_1 = R_1 − R_2``), sequence-mean of token sums (loss weight ``1/S``), no correction.

    Parameters
    ----------
    surrogate_part : Surrogate
        The part under study (``PPOClip``, ``CISPO``, ``GSPO``, ...).

    Returns
    -------
    Estimator
    """
    return Estimator(surrogate=surrogate_part, advantage=LeaveOneOut(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_exercise("tr06_gspo_cosine",
           quantity="the cosine between GSPO's expected gradient (band [1 − 3e-4, 1 + 4e-4], "
                    "G = 2, Â = R_1 − R_2, loss weight 1/S) and ∇J, one step of length 0.5 from "
                    "π_old, data from π_old (tutorial 6, exercise 3)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Almost every sequence ratio s_i has left the band; the sequences whose gradient "
                "survives are those that moved against their advantage. The cosine is of the "
                "*expected* gradient over every batch drawn from π_old, not of one batch.")
def _tr06_gspo_cosine() -> float:
    mdp, pi, old = _tr06_pair(TR06_STALE_STEP)
    gspo = GSPO(eps_low=TR06_GSPO_EPS_LOW, eps_high=TR06_GSPO_EPS_HIGH)
    return moments(mdp, pi, tr06_estimator(gspo), group_size=2, behavior=old,
                   method="enumeration").cosine


@_prediction("tr06_predict_gspo_sign",
             question="One step of length 0.5 from π_old, data from π_old: is the cosine between "
                      "GSPO's expected gradient (band [1 − 3e-4, 1 + 4e-4]) and ∇J positive or "
                      "negative?",
             options=("positive", "negative"),
             hint="Ask which sequences keep a gradient once almost every sequence ratio has left "
                  "the band, and which way each of them pushes its own probability.")
def _tr06_predict_gspo_sign() -> str:
    return "positive" if expected("tr06_gspo_cosine") > 0 else "negative"
