"""Tutorial 8's worlds, moments and tables (KL regularization), and Monte Carlo error bars.

* :func:`kl_world` — the copy task at a length, with ``π``, ``π_ref`` and an older ``μ``;
* :func:`kl_placement_moments` — exact moments of the eight placements k1/k2/k3/k3+ ×
  reward/loss;
* :func:`kl_matches` and :func:`kl_gradient_table` — which KL gradient each placement delivers;
* :func:`kl_option_table` — the verl and TRL options that select each placement
  (:data:`TRAINER_OPTIONS`), beside what it delivers;
* :func:`mean_and_sd` — a sample mean and standard deviation, each with its standard error.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmdp import estimators
from tokenmdp.course.display import Rendered, table
from tokenmdp.course.setups import copy_task, step_along
from tokenmdp.exact import TabularPolicy, TokenMDP

__all__ = ["KL_ESTIMATORS", "KL_WORLD_STALE_STEP", "KL_WORLD_STEP", "TRAINER_OPTIONS",
           "kl_gradient_table", "kl_matches", "kl_option_table", "kl_placement_moments", "kl_world",
           "mean_and_sd"]

#: Tutorial 8's policy: ``π_ref`` moved by this distance along ``∇J(π_ref)`` (:func:`kl_world`).
KL_WORLD_STEP = 3.0
#: Tutorial 8's behaviour policy ``μ``: ``π_ref`` moved by this distance (half-way to ``π``).
KL_WORLD_STALE_STEP = 1.5
#: The per-token estimators of tutorial 8's tables, by the name its rows use: Schulman's k1, k2,
#: k3 and verl's straight-through k3+ (the value of k3, the gradient of k2).
KL_ESTIMATORS = {"k1": estimators.kl_k1, "k2": estimators.kl_k2, "k3": estimators.kl_k3,
                 "k3+": estimators.kl_k3_plus}

#: For each placement of :func:`kl_placement_moments`: ``(verl, TRL)``, the option values that
#: select it. verl: a penalty in the reward is ``algorithm.use_kl_in_reward=True`` with
#: ``algorithm.kl_penalty=<value>`` (coefficient ``algorithm.kl_ctrl.kl_coef``), one in the loss
#: ``actor_rollout_ref.actor.use_kl_loss=True`` with ``actor_rollout_ref.actor.kl_loss_type=
#: <value>`` (coefficient ``kl_loss_coef``); both values go through verl's
#: ``core_algos.kl_penalty`` (``kl``/``k1``, ``mse``/``k2``, ``low_var_kl``/``k3``, and a ``+``
#: suffix for the straight-through k2 gradient, verl's docs naming ``k1+`` and ``k3+``). TRL:
#: ``GRPOTrainer``'s loss adds ``beta`` times k3 per token (``GRPOConfig.beta``, default 0.0: no
#: penalty), with no choice of estimator or placement; the PPO trainer's ``PPOConfig.kl_coef``
#: and ``kl_estimator`` (``"k1"``, the default, or ``"k3"``; ``"k2"`` refused) put the penalty in
#: the reward of every token. "none": no option of that trainer selects the placement.
TRAINER_OPTIONS = {
    "k1 in reward": ("kl_penalty=k1 (kl)", "PPO kl_estimator='k1'"),
    "k1 in loss": ("kl_loss_type=k1 (kl)", "none"),
    "k2 in reward": ("kl_penalty=k2 (mse)", "none"),
    "k2 in loss": ("kl_loss_type=k2 (mse)", "none"),
    "k3 in reward": ("kl_penalty=k3 (low_var_kl)", "PPO kl_estimator='k3'"),
    "k3 in loss": ("kl_loss_type=k3 (low_var_kl)", "GRPO beta > 0"),
    "k3+ in reward": ("kl_penalty=k3+", "none"),
    "k3+ in loss": ("kl_loss_type=k3+", "none"),
}


def kl_world(max_len: int) -> tuple[TokenMDP, nn.Module, TabularPolicy, nn.Module]:
    """Tutorial 8's worlds: the copy task with responses of at most ``max_len`` tokens.

    ``max_len = 1`` is a bandit (one action per prompt), ``max_len >= 2`` a sequence task. The
    reference ``π_ref`` is the seeded tabular policy of
    :func:`~tokenmdp.course.setups.copy_task`; the trained policy is
    ``π = step_along(π_ref, ∇J(π_ref), KL_WORLD_STEP)`` and the behaviour policy of the
    off-policy section ``μ = step_along(π_ref, ∇J(π_ref), KL_WORLD_STALE_STEP)`` (an older
    iterate that sampled the data).

    Parameters
    ----------
    max_len : int
        The response-length limit ``L >= 1``.

    Returns
    -------
    (TokenMDP, nn.Module, TabularPolicy, nn.Module)
        ``(mdp, π, π_ref, μ)``, fresh on every call (float64).
    """
    from tokenmdp.exact import gradient

    mdp, reference = copy_task(max_len)
    direction = gradient(mdp, reference)
    return (mdp, step_along(reference, direction, KL_WORLD_STEP), reference,
            step_along(reference, direction, KL_WORLD_STALE_STEP))


def kl_placement_moments(mdp: TokenMDP, policy: nn.Module, reference: nn.Module, *,
                         coef: float = 1.0) -> dict[str, object]:
    """Exact moments of the eight placements k1/k2/k3/k3+ × in the reward / in the loss,
    on-policy.

    Each entry is :func:`tokenmdp.exact.analysis.kl_gradients.kl_penalty_moments` of
    ``KLPenalty(coef=coef, in_reward=..., estimator=...)`` with the estimators of
    :data:`KL_ESTIMATORS`.

    Parameters
    ----------
    mdp : TokenMDP
    policy, reference : nn.Module
        ``π_θ`` and ``π_ref``.
    coef : float
        ``β > 0``.

    Returns
    -------
    dict of str to Moments
        Keyed ``"k1 in reward"``, ``"k1 in loss"``, ..., ``"k3+ in loss"``.
    """
    from tokenmdp.exact.analysis.kl_gradients import kl_penalty_moments

    out = {}
    for short, estimator in KL_ESTIMATORS.items():
        for in_reward in (True, False):
            penalty = estimators.KLPenalty(coef=coef, in_reward=in_reward, estimator=estimator)
            out[f"{short} in {'reward' if in_reward else 'loss'}"] = kl_penalty_moments(
                mdp, policy, reference, penalty)
    return out


def kl_matches(placements: dict, targets: dict[str, torch.Tensor], *, coef: float = 1.0,
               tol: float = 1e-10) -> dict[str, tuple[str, ...]]:
    """Which targets each placement's expected penalty gradient ``−E[ĝ]/β`` equals.

    Parameters
    ----------
    placements : dict of str to Moments
        As :func:`kl_placement_moments` returns them.
    targets : dict of str to Tensor
        As :meth:`tokenmdp.exact.analysis.kl_gradients.KLGradients.targets` returns them.
    coef : float
        The ``β`` the placements were computed with.
    tol : float
        Largest ``‖−E[ĝ]/β − target‖ / ‖∇KL(π‖π_ref)‖`` counted as equal.

    Returns
    -------
    dict of str to tuple of str
        The matching target names of each placement, in ``targets`` order (empty: none).
    """
    scale = float(targets["reverse KL"].norm())
    return {name: tuple(t for t, g in targets.items()
                        if float((-m.mean / coef - g).norm()) <= tol * scale)
            for name, m in placements.items()}


def kl_gradient_table(placements: dict, targets: dict[str, torch.Tensor], *,
                      coef: float = 1.0, tol: float = 1e-10) -> Rendered:
    """The gradient table: each placement's distance to each target, its variance, its match.

    A cell is ``‖−E[ĝ]/β − target‖ / ‖∇KL(π‖π_ref)‖`` (0 where the placement delivers that
    gradient in expectation); ``Var/β²`` is the exact total variance of ``ĝ/β``.

    Parameters
    ----------
    placements, targets, coef, tol
        As for :func:`kl_matches`.

    Returns
    -------
    Rendered
        The table, one row per placement.
    """
    matches = kl_matches(placements, targets, coef=coef, tol=tol)
    scale = float(targets["reverse KL"].norm())
    rows = [(name, *[float((-m.mean / coef - g).norm()) / scale for g in targets.values()],
             m.total_variance / coef ** 2, " = ".join(matches[name]) or "none of these")
            for name, m in placements.items()]
    return table(rows, ["placement", *[f"to {t}" for t in targets], "Var/β²", "delivers"],
                 fmt=".3f")


def kl_option_table(matches: dict[str, tuple[str, ...]]) -> Rendered:
    """One row per placement: what it delivers, and the verl and TRL options that select it
    (:data:`TRAINER_OPTIONS`).

    Parameters
    ----------
    matches : dict of str to tuple of str
        :func:`kl_matches` of one world: the targets each placement equals.

    Returns
    -------
    Rendered
        The table; "none of these" where a placement delivers no target, "none" where a trainer
        has no option for it.

    Raises
    ------
    ValueError
        A placement without an entry in :data:`TRAINER_OPTIONS`.
    """
    unknown = [p for p in matches if p not in TRAINER_OPTIONS]
    if unknown:
        raise ValueError(f"matches: no trainer options for {', '.join(unknown)}")
    rows = [(p, " = ".join(m) or "none of these", *TRAINER_OPTIONS[p]) for p, m in matches.items()]
    return table(rows, ["placement", "delivers", "verl", "TRL"])


def mean_and_sd(samples: torch.Tensor) -> tuple[float, float, float, float]:
    """Sample mean and standard deviation of ``samples``, each with its standard error.

    The standard error of the standard deviation is the delta-method one,
    ``sqrt((m4 − s⁴)/n) / (2 s)`` with ``m4`` the fourth central moment (large ``n``).

    Parameters
    ----------
    samples : Tensor ``[n]``
        Independent draws (``n >= 2``).

    Returns
    -------
    (float, float, float, float)
        ``(mean, se of the mean, sd, se of the sd)``.
    """
    x = torch.as_tensor(samples, dtype=torch.float64).reshape(-1)
    if x.numel() < 2:
        raise ValueError(f"samples: need at least 2 draws, got {x.numel()}")
    n, mean = x.numel(), float(x.mean())
    centred = x - mean
    var, m4 = float(centred.square().mean()), float(centred.pow(4).mean())
    sd = var ** 0.5
    return mean, sd / n ** 0.5, sd, ((m4 - var ** 2) / n) ** 0.5 / (2 * sd) if sd > 0 else 0.0
