"""Length bias, exactly: which objective each aggregation ascends, and how response length drifts.

With the advantage ``A_i`` of a response ``y_i``, the aggregation's weight decides what is
differentiated (docs: Concepts › Aggregation; Liu et al. 2025, Dr. GRPO, arXiv 2503.20783):

* token-sum, sequence-mean of token-sums, constant: ``∇J`` up to a fixed scale;
* sequence-mean of token-means (``1/|y_i|``): ``∇E[(R − b)/|y|]``, a different objective that
  favours short correct answers and long wrong ones;
* token-mean: one random normalizer ``Σ_i |y_i|`` shared by the batch — no fixed objective, close
  to ``∇J / E|y|`` only as the batch grows.

:func:`aggregation_gradients` gives each aggregation's exact expected gradient next to ``∇J`` and
``∇E[R/|y|]``; :func:`length_drift` runs exact gradient ascent with each expected gradient and
records how ``E|y|`` and ``J`` move.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tokenmdp.estimators import Aggregation, Estimator
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.world.ground_truth import flat_grad, objective, sequence_probs
from tokenmdp.exact.world.mdp import TokenMDP

__all__ = ["expected_length", "length_normalized_objective", "AggregationGradient",
           "aggregation_gradients", "length_drift"]


def expected_length(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """``E|y| = Σ_x D(x) Σ_y π(y|x) |y|`` (differentiable).

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.

    Returns
    -------
    Tensor
        The float64 scalar ``E|y|``, in tokens (EOS included).
    """
    w = mdp.prompt_probs[mdp.terminal_prompt_index]
    return (w * sequence_probs(mdp, policy) * mdp.terminal_lengths).sum()


def length_normalized_objective(mdp: TokenMDP, policy: nn.Module, *,
                                baseline: float = 0.0) -> torch.Tensor:
    """``E[(R − b)/|y|]``, the objective whose gradient ``1/|y|`` weighting follows.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.
    baseline : float, default 0.0
        ``b``, subtracted from every reward.

    Returns
    -------
    Tensor
        The float64 scalar (differentiable).
    """
    w = mdp.prompt_probs[mdp.terminal_prompt_index]
    return (w * sequence_probs(mdp, policy) * (mdp.rewards - baseline)
            / mdp.terminal_lengths).sum()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))


@dataclass(frozen=True)
class AggregationGradient:
    """One aggregation's exact expected gradient, compared with two objectives.

    Parameters
    ----------
    aggregation : Aggregation
        The aggregation swapped into the estimator.
    mean : Tensor ``[num_params]``
        ``E[ĝ]``.
    cosine_to_grad_J : float
        Cosine with ``∇J``.
    cosine_to_grad_length_normalized : float
        Cosine with ``∇E[R/|y|]``.
    length_slope : float
        ``<E[ĝ], ∇E|y|>``: the first-order change of the expected length along ``E[ĝ]``.
    """

    aggregation: Aggregation
    mean: torch.Tensor
    cosine_to_grad_J: float
    cosine_to_grad_length_normalized: float
    length_slope: float


def aggregation_gradients(mdp: TokenMDP, policy: nn.Module, estimator: Estimator, *,
                          group_size: int, aggregations=tuple(Aggregation),
                          **moment_kwargs) -> list[AggregationGradient]:
    """The exact expected gradient of ``estimator`` with each aggregation swapped in.

    Extra keyword arguments go to :func:`~tokenmdp.exact.lab.moments.moments`.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.
    estimator : Estimator
        The estimator whose aggregation is replaced.
    group_size : int
        ``G``, responses per prompt in a group.
    aggregations : iterable of Aggregation, default every member
        The aggregations to compare, in this order.
    **moment_kwargs
        Passed to :func:`~tokenmdp.exact.lab.moments.moments` (its method, behaviour policy, ...).

    Returns
    -------
    list of AggregationGradient
        One per aggregation, in the order given.
    """
    grad_J = flat_grad(objective(mdp, policy), policy)
    grad_norm = flat_grad(length_normalized_objective(mdp, policy), policy)
    grad_len = flat_grad(expected_length(mdp, policy), policy)
    out = []
    for agg in aggregations:
        m = moments(mdp, policy, estimator.replace(aggregation=agg), group_size=group_size,
                    **moment_kwargs)
        out.append(AggregationGradient(agg, m.mean, _cos(m.mean, grad_J),
                                       _cos(m.mean, grad_norm), float(m.mean @ grad_len)))
    return out


def length_drift(mdp: TokenMDP, policy: nn.Module, estimators: dict[str, Estimator], *,
                 group_size: int, steps: int, lr: float, normalize: bool = True,
                 **moment_kwargs) -> dict[str, list[tuple[float, float]]]:
    """Exact gradient ascent ``θ ← θ + lr E[ĝ]`` with each estimator; ``(J, E|y|)`` per step.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        The float64 starting policy of ``mdp`` (not modified: each run walks a copy).
    estimators : dict of name -> Estimator
    group_size : int
    steps : int
        Ascent steps (the first record is the start).
    lr : float
        Step size.
    normalize : bool
        Step along ``E[ĝ]/‖E[ĝ]‖`` so that estimators with different scales (token-sum vs
        token-mean) move the same distance per step and only their directions differ.
    **moment_kwargs
        Passed to :func:`~tokenmdp.exact.lab.moments.moments`.

    Returns
    -------
    dict of name -> list of ``(J, E|y|)``, ``steps + 1`` entries each; ``policy`` is unchanged.
    """
    out = {}
    for name, est in estimators.items():
        pi = copy.deepcopy(policy)
        track = []
        for k in range(steps + 1):
            with torch.no_grad():
                track.append((float(objective(mdp, pi)), float(expected_length(mdp, pi))))
            if k == steps:
                break
            g = moments(mdp, pi, est, group_size=group_size, **moment_kwargs).mean
            if normalize and g.norm() > 0:
                g = g / g.norm()
            theta = parameters_to_vector(pi.parameters()).detach()
            vector_to_parameters(theta + lr * g, pi.parameters())
        out[name] = track
    return out
