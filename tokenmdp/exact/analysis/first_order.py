"""The first-order (trust-region) approximation, exactly: how far the token-level surrogate can be
trusted as ``θ`` moves away from ``θ_old``.

Along a path ``θ(s) = θ_old + s u`` (``u`` a direction in parameter space) this module computes

* the true improvement ``J(θ) − J(θ_old)``;
* the token-level surrogate's improvement ``L_{π_old}(π_θ) − J(θ_old)`` — the objective whose
  gradient the token-level IS estimator follows (:func:`~tokenmdp.exact.surrogate`);
* the sequence-IS objective's improvement ``E_{y~μ}[π_θ(y)/μ(y) R] − J(θ_old)`` (it equals the
  true improvement: sequence-level IS is unbiased, the price is its variance);
* the gap ``J − L`` and the finite-horizon trust-region bound on it, and
* the error ``‖∇L_{π_old}(π_θ) − ∇J(θ)‖`` of the token-level gradient.

The bound. With ``α = max_s TV(π_θ(·|s), π_old(·|s))`` and ``ε = max_{s,a} |A^{π_old}(s, a)|``,
writing ``J(π) − L(π) = Σ_t (E_{s_t ~ d_t^π} − E_{s_t ~ d_t^{π_old}}) [Σ_a π(a|s_t) A^{π_old}(s_t, a)]``
and using ``TV(d_t^π, d_t^{π_old}) ≤ t α`` and ``|Σ_a π(a|s) A^{π_old}(s, a)| ≤ 2 α ε`` gives

``|J(π) − L_{π_old}(π)| ≤ Σ_{t=0}^{L−1} 2 (t α)(2 α ε) = 2 ε α² L (L − 1)``,

the finite-horizon, undiscounted form of Kakade & Langford (2002, Thm 4.1) and Schulman et al.
(2015, TRPO, arXiv 1502.05477, Thm 1): the gap is second order in the policy change.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tokenmdp.exact.world.ground_truth import (
    flat_grad,
    objective,
    sequence_logprobs,
    state_logprobs,
    surrogate,
    values,
)
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import check_policy

__all__ = ["PathPoint", "trust_region_bound", "max_state_tv", "first_order_path"]


@dataclass(frozen=True)
class PathPoint:
    """One point ``θ_old + s u`` of a path (all floats).

    Parameters
    ----------
    step : float
        ``s``: the distance along the (unit) direction.
    true_improvement : float
        ``J(θ) − J(θ_old)``.
    token_surrogate_improvement : float
        ``L_{π_old}(π_θ) − J(θ_old)``.
    sequence_is_improvement : float
        ``E_{y~μ}[π_θ(y)/μ(y) R] − J(θ_old)`` (``μ`` the behaviour policy).
    gap : float
        ``J(θ) − L_{π_old}(π_θ)``.
    bound : float
        ``2 ε α² L (L−1)``, the trust-region bound on ``|gap|``.
    max_tv : float
        ``α = max_s TV(π_θ(·|s), π_old(·|s))``.
    gradient_error : float
        ``‖∇L_{π_old}(π_θ) − ∇J(θ)‖``.
    gradient_norm : float
        ``‖∇J(θ)‖``.
    """

    step: float
    true_improvement: float
    token_surrogate_improvement: float
    sequence_is_improvement: float
    gap: float
    bound: float
    max_tv: float
    gradient_error: float
    gradient_norm: float


def max_state_tv(mdp: TokenMDP, p: nn.Module, q: nn.Module) -> torch.Tensor:
    """``max_s TV(p(·|s), q(·|s))`` over every state of the MDP.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    p, q : nn.Module
        Float64 policies of ``mdp``.

    Returns
    -------
    Tensor
        The float64 scalar, in ``[0, 1]`` (no gradient).
    """
    with torch.no_grad():
        tv = [0.5 * (a.exp() - b.exp()).abs().sum(-1).max()
              for a, b in zip(state_logprobs(mdp, p), state_logprobs(mdp, q))]
    return torch.stack(tv).max()


def trust_region_bound(mdp: TokenMDP, policy: nn.Module, old: nn.Module) -> torch.Tensor:
    """``2 ε α² L (L − 1)`` with ``α = max_s TV(π, π_old)``, ``ε = max |A^{π_old}|``.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP (``L`` its maximum response length).
    policy : nn.Module
        ``π``, a float64 policy of ``mdp``.
    old : nn.Module
        ``π_old``, whose advantages ``A^{π_old}`` enter ``ε``.

    Returns
    -------
    Tensor
        The float64 scalar bound on ``|J(π) − L_{π_old}(π)|`` (no gradient).
    """
    with torch.no_grad():
        alpha = max_state_tv(mdp, policy, old)
        eps = values(mdp, old).A.abs().max()
    L = mdp.max_len
    return 2 * eps * alpha ** 2 * L * (L - 1)


def first_order_path(mdp: TokenMDP, old: nn.Module, direction: torch.Tensor, steps,
                     *, behavior: nn.Module | None = None) -> list[PathPoint]:
    """Exact first-order diagnostics along ``θ_old + s u / ‖u‖`` for each ``s`` in ``steps``.

    Parameters
    ----------
    mdp : TokenMDP
    old : policy module
        ``π_old`` at ``θ_old`` (not modified: the path is walked on a copy).
    direction : Tensor ``[num_params]``
        ``u``, in ``old.parameters()`` order (normalized here).
    steps : iterable of float
        Distances ``s`` along the unit direction.
    behavior : policy module, optional
        ``μ`` for the sequence-IS objective (default ``π_old``).

    Returns
    -------
    list of PathPoint
    """
    check_policy(mdp, old, name="old")
    behavior = old if behavior is None else behavior
    check_policy(mdp, behavior, name="behavior")
    theta_old = parameters_to_vector(old.parameters()).detach().clone()
    direction = torch.as_tensor(direction, dtype=torch.float64)
    if direction.shape != theta_old.shape:
        raise ValueError(f"direction: expected shape {tuple(theta_old.shape)}, got "
                         f"{tuple(direction.shape)}")
    if not direction.norm() > 0:
        raise ValueError("direction: has zero norm")
    unit = direction / direction.norm()
    policy = copy.deepcopy(old)
    with torch.no_grad():
        j_old = float(objective(mdp, old))
        mu_logp = sequence_logprobs(mdp, behavior)
        w = mdp.prompt_probs[mdp.terminal_prompt_index]
    points = []
    for s in steps:
        vector_to_parameters(theta_old + float(s) * unit, policy.parameters())
        J = objective(mdp, policy)
        L = surrogate(mdp, policy, old)
        grad_J = flat_grad(J, policy)
        grad_L = flat_grad(L, policy)
        with torch.no_grad():
            ratio = (sequence_logprobs(mdp, policy) - mu_logp).exp()
            seq_is = float((w * mu_logp.exp() * ratio * mdp.rewards).sum())
            alpha = float(max_state_tv(mdp, policy, old))
            points.append(PathPoint(
                step=float(s), true_improvement=float(J) - j_old,
                token_surrogate_improvement=float(L) - j_old,
                sequence_is_improvement=seq_is - j_old, gap=float(J - L),
                bound=float(trust_region_bound(mdp, policy, old)), max_tv=alpha,
                gradient_error=float((grad_L - grad_J).norm()),
                gradient_norm=float(grad_J.norm())))
    return points

