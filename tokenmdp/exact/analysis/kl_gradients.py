"""KL regularization, exactly: the gradients a KL penalty could mean, and the one it delivers.

Four targets, each by autograd on exact quantities (float64), for a policy ``π`` and a reference
``π_ref`` on an exact token MDP:

* ``reverse`` — ``∇ KL(π ‖ π_ref)`` over whole responses (:func:`~tokenmdp.exact.sequence_kl`),
  the regularizer of the RLHF objective ``J − β KL(π ‖ π_ref)`` (Ouyang et al. 2022,
  arXiv 2203.02155, Eq. 2);
* ``forward`` — ``∇ KL(π_ref ‖ π)`` over whole responses;
* ``reverse_per_state`` — ``Σ_s d(s) ∇ KL(π(·|s) ‖ π_ref(·|s))`` with the visitation ``d`` held
  fixed: the *partial* gradient of the sequence KL that forgets how a token changes the states
  after it (Tang & Munos 2025, arXiv 2506.09477);
* ``forward_per_state`` — ``Σ_s d(s) ∇ KL(π_ref(·|s) ‖ π(·|s))``, ``d`` held fixed.

By the chain rule of KL, ``KL(π ‖ π_ref) = Σ_s d^π(s) KL(π(·|s) ‖ π_ref(·|s))``, so the partial
gradient is the full one without the derivative of ``d^π``. In a bandit (``max_len = 1``) the
visitation is the prompt distribution and each per-state target equals its sequence target.

:func:`kl_penalty_moments` gives the exact mean and variance of the gradient of a
:class:`~tokenmdp.estimators.KLPenalty` alone (zero task reward, REINFORCE, one response per
group, each response's tokens summed), so any placement can be compared with the four targets;
:func:`sampled_penalty_gradients` is its Monte Carlo twin on sampled batches.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    KLPenalty,
    Reinforce,
    RewardAsAdvantage,
    loss,
    prepare,
)
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.lab.moments_result import Moments
from tokenmdp.exact.world.ground_truth import (
    flat_grad,
    sequence_kl,
    state_logprobs,
    state_visitation,
)
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import check_policy
from tokenmdp.exact.world.sampling import sample

__all__ = ["KLGradients", "kl_gradients", "kl_penalty_moments", "sampled_penalty_gradients",
           "state_kl"]


def state_kl(mdp: TokenMDP, p: nn.Module, q: nn.Module) -> torch.Tensor:
    """``KL(p(·|s) ‖ q(·|s))`` at every state, ``[num_states]`` in state-id order.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    p, q : nn.Module
        Float64 policies of ``mdp``.

    Returns
    -------
    Tensor ``[num_states]``
        The next-token KL of each state, in nats (differentiable in both policies).
    """
    lp = torch.cat([x.reshape(-1, mdp.vocab_size) for x in state_logprobs(mdp, p)])
    lq = torch.cat([x.reshape(-1, mdp.vocab_size) for x in state_logprobs(mdp, q)])
    return (lp.exp() * (lp - lq)).sum(-1)


@dataclasses.dataclass(frozen=True)
class KLGradients:
    """The four gradients a KL penalty could mean, flat in ``policy.parameters()`` order.

    Parameters
    ----------
    reverse : Tensor ``[num_params]``
        ``∇ KL(π ‖ π_ref)`` over responses.
    forward : Tensor ``[num_params]``
        ``∇ KL(π_ref ‖ π)`` over responses.
    reverse_per_state : Tensor ``[num_params]``
        ``Σ_s d(s) ∇ KL(π(·|s) ‖ π_ref(·|s))``, ``d`` held fixed.
    forward_per_state : Tensor ``[num_params]``
        ``Σ_s d(s) ∇ KL(π_ref(·|s) ‖ π(·|s))``, ``d`` held fixed.
    """

    reverse: torch.Tensor
    forward: torch.Tensor
    reverse_per_state: torch.Tensor
    forward_per_state: torch.Tensor

    def targets(self) -> dict[str, torch.Tensor]:
        """The four gradients by name, plus ``"zero"``, in the order tables show them.

        Returns
        -------
        dict of str to Tensor
            ``"reverse KL"``, ``"forward KL"``, ``"per-state reverse"``,
            ``"per-state forward"`` and ``"zero"`` (a zero vector).
        """
        return {"reverse KL": self.reverse, "forward KL": self.forward,
                "per-state reverse": self.reverse_per_state,
                "per-state forward": self.forward_per_state,
                "zero": torch.zeros_like(self.reverse)}


def kl_gradients(mdp: TokenMDP, policy: nn.Module, reference: nn.Module, *,
                 visitation: nn.Module | None = None) -> KLGradients:
    """The exact gradients of the reverse and forward KL, whole and per state, in ``policy``.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        ``π``, the float64 policy whose parameters the gradients are taken in.
    reference : nn.Module
        ``π_ref`` (not differentiated).
    visitation : nn.Module, optional
        The policy whose state visitation ``d`` weights the per-state gradients (default
        ``policy``; a behaviour policy ``μ`` gives what per-token corrections reach off-policy).

    Returns
    -------
    KLGradients
        The four gradients (float64, detached).
    """
    check_policy(mdp, policy)
    check_policy(mdp, reference, name="reference")
    visitation = policy if visitation is None else visitation
    check_policy(mdp, visitation, name="visitation")
    with torch.no_grad():
        d = state_visitation(mdp, visitation)
    with torch.enable_grad():
        reverse = flat_grad(sequence_kl(mdp, policy, reference), policy)
        forward = flat_grad(sequence_kl(mdp, reference, policy), policy)
        reverse_s = flat_grad((d * state_kl(mdp, policy, reference)).sum(), policy)
        forward_s = flat_grad((d * state_kl(mdp, reference, policy)).sum(), policy)
    return KLGradients(reverse, forward, reverse_s, forward_s)


def _zero_reward(prompt, response) -> float:
    return 0.0


def _penalty_world(mdp: TokenMDP, penalty: KLPenalty) -> tuple[TokenMDP, Estimator]:
    """The zero-reward copy of ``mdp`` and the estimator whose gradient is the penalty's alone."""
    if not isinstance(penalty, KLPenalty):
        raise TypeError(f"penalty: expected a KLPenalty, got {type(penalty).__name__}")
    twin = TokenMDP(mdp.vocab_size, mdp.max_len, _zero_reward, prompts=mdp.prompts,
                    prompt_probs=mdp.prompt_probs.tolist())
    estimator = Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                          aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM, kl=penalty,
                          name=penalty.describe())
    return twin, estimator


def kl_penalty_moments(mdp: TokenMDP, policy: nn.Module, reference: nn.Module,
                       penalty: KLPenalty, *, behavior: nn.Module | None = None) -> Moments:
    """Exact moments of the gradient of a KL penalty alone, by enumeration.

    The estimator is REINFORCE with ``Â = R`` on a copy of ``mdp`` with zero reward, one
    response per group and each response's loss tokens summed (``seq-mean-token-sum``, weight 1
    per token), with ``penalty`` as its KL part. So a penalty in the reward gives
    ``ĝ = −β (Σ_t k_t) Σ_t ∇log π_θ(y_t|s_t)`` and a penalty in the loss
    ``ĝ = −β Σ_t w_t ∇k_t`` (``w_t = sg(π_θ/μ)`` when importance-weighted, else 1).

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP (its reward is not used).
    policy : nn.Module
        ``π_θ``.
    reference : nn.Module
        ``π_ref``.
    penalty : KLPenalty
        The estimator ``k``, its placement and ``β`` (``coef``).
    behavior : nn.Module, optional
        ``μ``, which samples the responses (default ``policy``); it is also ``π_old``, so a
        penalty in the reward is computed at ``μ``. The REINFORCE part is not reweighted:
        off-policy, only an importance-weighted penalty in the loss corrects for ``μ``.

    Returns
    -------
    Moments
        ``mean`` is the expected ascent direction ``E[ĝ]``, i.e. ``−β`` times the expected
        gradient of the penalty; ``total_variance`` its variance (its ``true_gradient`` is
        the zero ``∇J`` of the zero-reward copy).
    """
    twin, estimator = _penalty_world(mdp, penalty)
    return moments(twin, policy, estimator, group_size=1, behavior=behavior,
                   reference=reference, method="enumeration")


def sampled_penalty_gradients(mdp: TokenMDP, policy: nn.Module, reference: nn.Module,
                              penalty: KLPenalty, *, num_batches: int, batch_size: int,
                              generator: torch.Generator,
                              behavior: nn.Module | None = None) -> torch.Tensor:
    """Monte Carlo twin of :func:`kl_penalty_moments`: the penalty's gradient on sampled batches.

    Each batch is ``batch_size`` responses drawn from ``behavior`` (default ``policy``), with
    ``old_logprob`` = ``behavior_logprob`` and ``ref_logprob`` from ``reference``, prepared and
    differentiated by the library's own :func:`~tokenmdp.estimators.prepare` and
    :func:`~tokenmdp.estimators.loss` with the estimator of :func:`kl_penalty_moments` (whose
    batch gradient is the mean of the per-response ``ĝ``).

    Parameters
    ----------
    mdp, policy, reference, penalty, behavior
        As for :func:`kl_penalty_moments` (``behavior`` must be a prefix policy: it samples).
    num_batches : int
        Independent batches (``>= 2``, for a standard error).
    batch_size : int
        Responses per batch.
    generator : torch.Generator
        The only source of randomness.

    Returns
    -------
    Tensor ``[num_batches, num_params]``
        The ascent direction ``ĝ`` of each batch; their mean estimates ``kl_penalty_moments(...)
        .mean`` and their spread gives its standard error.
    """
    twin, estimator = _penalty_world(mdp, penalty)
    behavior = policy if behavior is None else behavior
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 2:
        raise ValueError(f"num_batches: expected an int >= 2, got {num_batches!r}")
    out = []
    for _ in range(num_batches):
        batch = sample(twin, behavior, batch_size, generator=generator)
        with torch.no_grad():
            batch = batch.replace(old_logprob=batch.behavior_logprob,
                                  ref_logprob=reference.token_logprobs(batch))
        batch = prepare(batch, estimator)
        out.append(-flat_grad(loss(policy.token_logprobs(batch), batch, estimator)[0], policy))
    return torch.stack(out)
