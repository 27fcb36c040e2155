"""The exercises of tutorial 10 (the capstone zoo), registered in :mod:`~tokenmdp.course.exercises.registry`.

The setup is the tutorial's: the course's MDP and policy (:func:`tokenmdp.course.setups.copy_task`)
as the initial policy ``π_0`` (and as ``π_old`` and ``π_ref``), groups of ``TR10_GROUP_SIZE``.
The expected values come from :func:`tokenmdp.exact.train_exact` (the loop the student writes
out by hand) and exact :func:`tokenmdp.exact.moments` with dynamic sampling; the tests take a
third route (a closed-form tabular step, a sum over reward values, every multiset of a group
stacked in one batch through the library's loss). Each exercise's *Predict* question is a
``tr10_predict_*`` prediction whose true option is computed from the same setup.
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
from tokenmdp.course.setups import copy_task, step_along
from tokenmdp.estimators import Aggregation, Estimator, GroupNormalized, KLPenalty, PPOClip, kl_k3
from tokenmdp.estimators import get as get_estimator
from tokenmdp.exact import gradient, moments, objective, train_exact

__all__ = ["tr10_prorl"]

#: Responses per prompt in tutorial 10.
TR10_GROUP_SIZE = 4
#: Groups per update of exercise 1's run.
TR10_GROUPS = 2
#: Seed of exercise 1's batch generator.
TR10_SEED = 10
#: Step size of exercise 1's plain gradient ascent.
TR10_LR = 1.0
#: ProRL's clip band (Liu et al. 2025, arXiv 2505.24864: decoupled clip, ε_high = 0.4).
TR10_EPS_LOW, TR10_EPS_HIGH = 0.2, 0.4
#: DAPO's upper clip range (arXiv 2503.14476), the band exercise 3's prediction compares with.
TR10_DAPO_EPS_HIGH = 0.28
#: The shares exercise 2's prediction chooses from.
TR10_KEEP_SHARES = {"a quarter": 0.25, "a half": 0.5, "three quarters": 0.75}
#: The KL coefficient of the composition (GRPO's 0.04, not ProRL's own setting).
TR10_BETA = 0.04
#: The stale step of exercise 3: ``π_θ = π_old + s ∇J/‖∇J‖``.
TR10_STALE_STEP = 1.0


def tr10_prorl(*, eps_high: float = TR10_EPS_HIGH, beta: float | None = TR10_BETA) -> Estimator:
    """Tutorial 10's reading of ProRL's loss, composed from the registry's parts.

    PPO's clip with the decoupled band ``[1 − 0.2, 1 + eps_high]``, GRPO's group mean/std
    advantage (sample std, ε 1e-6), DAPO's token mean over the step, and GRPO's k3 penalty to
    ``π_ref`` in the loss with coefficient ``beta`` (None: no penalty). Dynamic sampling is a
    property of the data (``filter_groups=True`` in :func:`~tokenmdp.exact.moments`).

    Parameters
    ----------
    eps_high : float, default ``TR10_EPS_HIGH``
        The upper clip range (DAPO's is 0.28).
    beta : float or None, default ``TR10_BETA``
        The KL coefficient, or None for no penalty.

    Returns
    -------
    Estimator
    """
    kl = None if beta is None else KLPenalty(coef=beta, in_reward=False, estimator=kl_k3)
    return Estimator(name="prorl", surrogate=PPOClip(eps_low=TR10_EPS_LOW, eps_high=eps_high),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.TOKEN_MEAN, kl=kl)


@_exercise("tr10_one_update_J",
           quantity="the exact J after one update of plain gradient ascent (lr 1) with RLOO on "
                    "two groups of G = 4 responses drawn with the seed 10 (tutorial 10, "
                    "exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="One step of plain gradient ascent on one sampled batch: ĝ is minus the gradient "
                "of RLOO's loss on exactly the exercise's two groups (its seed), and J is the "
                "exact objective of the updated policy, not a sampled return.")
def _tr10_one_update_J() -> float:
    mdp, pi0 = copy_task()
    run = train_exact(mdp, pi0, get_estimator("rloo"), updates=1, group_size=TR10_GROUP_SIZE,
                      groups_per_update=TR10_GROUPS, lr=TR10_LR,
                      generator=torch.Generator().manual_seed(TR10_SEED))
    return float(run.objective[1])


@_prediction("tr10_predict_sampled_step",
             question="After one update of plain gradient ascent (lr 1) with RLOO on the "
                      "exercise's two groups of four, does J rise by more or by less than after "
                      "the expected update θ + ∇J?",
             options=("more", "less"),
             hint="RLOO is unbiased, E[ĝ] = ∇J, but one batch of eight responses sees a few of the "
                  "thirty: ask how much of one sampled ĝ points along ∇J.")
def _tr10_predict_sampled_step() -> str:
    mdp, pi0 = copy_task()
    g = gradient(mdp, pi0)
    with torch.no_grad():
        expected_step = float(objective(mdp, step_along(pi0, g, TR10_LR * float(g.norm()))))
    return "more" if expected("tr10_one_update_J") > expected_step else "less"


@_exercise("tr10_keep_probability",
           quantity="the probability that dynamic sampling keeps a group of G = 4 responses "
                    "drawn from π_0 (rewards not all equal; tutorial 10, exercise 2)",
           tolerance=SHARE_TOL, tolerance_name="SHARE_TOL",
           hint="A group is dropped when all G rewards are equal: P(drop) = Σ_x D(x) Σ_r "
                "P(R = r | x)^G, with P(R = r | x) summed from the response probabilities.")
def _tr10_keep_probability() -> float:
    mdp, pi0 = copy_task()
    return moments(mdp, pi0, tr10_prorl(), group_size=TR10_GROUP_SIZE, reference=pi0,
                   filter_groups=True, method="enumeration").keep_probability


@_prediction("tr10_predict_keep_share",
             question="At π_0 with G = 4, what share of groups does dynamic sampling keep: a "
                      "quarter, a half or three quarters (the nearest)?",
             options=tuple(TR10_KEEP_SHARES),
             hint="A group is dropped only when its four rewards are equal, with probability "
                  "Σ_r P(R = r | x)^4: fourth powers of probabilities well below one are small.")
def _tr10_predict_keep_share() -> str:
    keep = expected("tr10_keep_probability")
    return _nearest_option(keep, TR10_KEEP_SHARES)


def tr10_stale_pair():
    """Exercise 3's world: ``(mdp, π_θ, π_old)``, ``π_θ`` one step of ``TR10_STALE_STEP``
    along ``∇J(π_old)`` from ``π_old = π_0`` (also the reference policy).

    Returns
    -------
    (TokenMDP, nn.Module, TabularPolicy)
        Fresh objects on every call.
    """
    mdp, old = copy_task()
    return mdp, step_along(old, gradient(mdp, old), TR10_STALE_STEP), old


@_exercise("tr10_prorl_stale_cosine",
           quantity="cos(E[ĝ], ∇J) of the ProRL composition with dynamic sampling, one step of "
                    "length 1 from π_old = π_ref = π_0, data from π_old, G = 4 (tutorial 10, "
                    "exercise 3)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Dynamic sampling conditions on the kept groups, so the expectation is over "
                "those only; the cosine compares that expected gradient with the true one at "
                "π_θ. The composition is GRPO's advantage with a clip-higher band, the token "
                "mean and a k3 penalty in the loss.")
def _tr10_prorl_stale_cosine() -> float:
    mdp, pi, old = tr10_stale_pair()
    return moments(mdp, pi, tr10_prorl(), group_size=TR10_GROUP_SIZE, behavior=old,
                   reference=old, filter_groups=True, method="enumeration").cosine


@_prediction("tr10_predict_wider_band",
             question="One step of length 1 along ∇J from π_old = π_ref = π_0, data from π_old, "
                      "dynamic sampling, G = 4: does ProRL's band (ε_high = 0.4) keep cos(E[ĝ], ∇J) "
                      "higher than the same composition with DAPO's ε_high = 0.28?",
             options=("yes", "no"),
             hint="The clip masks a token with Â > 0 once π_θ/π_old passes 1 + ε_high, and a step "
                  "along ∇J raises the tokens with positive advantage: which band masks more of "
                  "the gradient that the step still needs?")
def _tr10_predict_wider_band() -> str:
    mdp, pi, old = tr10_stale_pair()
    dapo_band = moments(mdp, pi, tr10_prorl(eps_high=TR10_DAPO_EPS_HIGH), group_size=TR10_GROUP_SIZE,
                        behavior=old, reference=old, filter_groups=True, method="enumeration")
    return "yes" if expected("tr10_prorl_stale_cosine") > dapo_band.cosine else "no"
