"""Tutorial 3 (off-policy and the first-order approximation): its estimators and experiments.

* :func:`rloo` and :func:`one_sample` — the two estimators the notebook varies a part of;
* :func:`response_scores` and :func:`fixed_length_pair` — the fixed-length experiment of section 1;
* :func:`path_kls` and :func:`monte_carlo_clip_fraction` — repeated measurements of sections 2–3;
* the printed tables, as rows plus their layout, are in
  :mod:`~tokenmdp.course.tutorials.t03_tables`;
* the figures are in :mod:`~tokenmdp.course.tutorials.t03_figures`.

Every function formats or measures what the notebook has computed and shown; the identities the
notebook asserts stay in the notebook.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    LeaveOneOut,
    NoCorrection,
    RewardAsAdvantage,
    loss,
    prepare,
)
from tokenmdp.exact import TabularPolicy, TokenMDP, sample, sequence_kl, state_logprobs

__all__ = ["fixed_length_pair", "monte_carlo_clip_fraction", "mse", "one_sample", "path_kls",
           "response_scores", "rloo"]


# ---------------------------------------------------------------------------------------------
# The notebook's estimators and experiments

def rloo(surrogate_part, correction=None) -> Estimator:
    """The estimator of tutorial 3 with the surrogate (and correction) under study.

    Leave-one-out advantage (``Â_1 = R_1 − R_2`` for ``G = 2``) and the sequence-mean of token
    sums (loss weight ``1/S`` per token), so that the expected gradient compares with ``∇J``.

    Parameters
    ----------
    surrogate_part : Surrogate
        E.g. ``Reinforce()``, ``SequenceRatio()``, ``TokenRatio()``, ``PPOClip(...)``.
    correction : Correction, optional
        The training–inference correction; ``NoCorrection()`` when None.

    Returns
    -------
    Estimator
    """
    correction = NoCorrection() if correction is None else correction
    return Estimator(surrogate=surrogate_part, advantage=LeaveOneOut(), correction=correction,
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


def one_sample(surrogate_part) -> Estimator:
    """The single-response estimator of the fixed-length experiment: ``Â = R``, weight ``1/S``.

    Parameters
    ----------
    surrogate_part : Surrogate
        The surrogate under study.

    Returns
    -------
    Estimator
    """
    return Estimator(surrogate=surrogate_part, advantage=RewardAsAdvantage(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


def response_scores(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """The score ``∇ log π(y|x)`` of every response, by batched autograd.

    Parameters
    ----------
    mdp : TokenMDP
        The exact MDP whose responses are enumerated (canonical order).
    policy : nn.Module
        ``π``, a policy of ``mdp``.

    Returns
    -------
    Tensor ``[N, num_params]``
        Row ``i`` is the gradient of response ``i``'s log-probability, in
        ``policy.parameters()`` order.
    """
    batch = mdp.enumerate()
    seq_logprobs_S = batch.sequence_sum(policy.token_logprobs(batch))
    n = seq_logprobs_S.numel()
    # one vector-Jacobian product per response, batched: row i of the identity selects response i
    grads = torch.autograd.grad(seq_logprobs_S, list(policy.parameters()),
                                grad_outputs=torch.eye(n, dtype=torch.float64),
                                is_grads_batched=True)
    return torch.cat([g.reshape(n, -1) for g in grads], dim=1)


def fixed_length_pair(T: int, *, delta: float, no_eos: float,
                      vocab_size: int = 3) -> tuple[TokenMDP, TabularPolicy, TabularPolicy]:
    """An MDP where every response has ``T`` tokens, with a target ``π`` and a sampler ``μ``.

    ``μ`` is uniform over the non-EOS tokens, ``π`` gives token 0 the logit ``delta`` in every
    state; both give EOS (the last token) the logit ``no_eos``. The reward is the fraction of zeros.

    Parameters
    ----------
    T : int
        The response length (``max_len`` of the MDP).
    delta : float
        ``π``'s logit of token 0 (the other logits are 0).
    no_eos : float
        The logit of EOS in both policies (very negative: responses run to ``T`` tokens).
    vocab_size : int, default 3
        Tokens, EOS included.

    Returns
    -------
    (TokenMDP, TabularPolicy, TabularPolicy)
        ``(mdp, π, μ)``, float64.
    """
    eos = vocab_size - 1
    mdp_T = TokenMDP(vocab_size, T, lambda x, y: sum(t == 0 for t in y) / len(y))
    mu_T = TabularPolicy(mdp_T, generator=torch.Generator().manual_seed(0), init_std=0.0)
    pi_T = TabularPolicy(mdp_T, generator=torch.Generator().manual_seed(0), init_std=0.0)
    with torch.no_grad():
        mu_T.table[:, eos] = no_eos
        pi_T.table[:, eos] = no_eos
        pi_T.table[:, 0] = delta
    return mdp_T, pi_T, mu_T


def path_kls(mdp: TokenMDP, policy: nn.Module, direction: torch.Tensor,
             steps: Sequence[float]) -> tuple[list[float], list[float]]:
    """KL divergences along ``θ(s) = θ_old + s u/‖u‖``, the path of ``first_order_path``.

    Parameters
    ----------
    mdp : TokenMDP
        The exact MDP.
    policy : nn.Module
        ``π_old`` (not modified).
    direction : Tensor ``[num_params]``
        ``u``, in ``policy.parameters()`` order.
    steps : sequence of float
        The step lengths ``s``.

    Returns
    -------
    (list of float, list of float)
        At each step, ``KL(π_θ ‖ π_old)`` of whole responses and the largest per-state
        ``KL(π_old(·|s) ‖ π_θ(·|s))``.
    """
    theta_old = parameters_to_vector(policy.parameters()).detach()
    probe = copy.deepcopy(policy)
    sequence, max_state = [], []
    for s in steps:
        vector_to_parameters(theta_old + s * direction / direction.norm(), probe.parameters())
        with torch.no_grad():
            sequence.append(float(sequence_kl(mdp, probe, policy)))
            max_state.append(max(float((lp_old.exp() * (lp_old - lp_new)).sum(-1).max())
                                 for lp_old, lp_new in zip(state_logprobs(mdp, policy),
                                                           state_logprobs(mdp, probe))))
    return sequence, max_state


def monte_carlo_clip_fraction(mdp: TokenMDP, policy: nn.Module, old: nn.Module,
                              estimator: Estimator, *, batches: int, size: int, group_size: int,
                              generator: torch.Generator) -> torch.Tensor:
    """The trainer's ``clip_fraction`` metric on independent batches sampled from ``old``.

    Each batch: ``sample`` ``size`` responses in groups of ``group_size`` from ``old``, take
    ``old`` as ``π_old`` too (``μ = π_old``), ``prepare`` and ``loss`` with ``estimator`` at
    ``policy``'s log-probs, and read ``metrics["clip_fraction"]``.

    Parameters
    ----------
    mdp : TokenMDP
        The exact MDP.
    policy : nn.Module
        ``π_θ``.
    old : nn.Module
        ``π_old``, the sampler.
    estimator : Estimator
        An estimator whose loss reports ``clip_fraction`` (PPO's clip).
    batches, size, group_size : int
        Number of batches, responses per batch, responses per prompt.
    generator : torch.Generator
        The sampling generator (advanced in place).

    Returns
    -------
    Tensor ``[batches]``
        Float64, one clip fraction per batch.
    """
    fractions = []
    for _ in range(batches):
        batch = sample(mdp, old, size, generator=generator, group_size=group_size)
        batch = prepare(batch.replace(old_logprob=batch.behavior_logprob), estimator)
        with torch.no_grad():
            _, metrics = loss(policy.token_logprobs(batch), batch, estimator)
        fractions.append(float(metrics["clip_fraction"]))
    return torch.tensor(fractions, dtype=torch.float64)


def mse(m, groups: int) -> float:
    """``MSE_B = ‖E ĝ − ∇J‖² + tr Cov[ĝ] / B`` of a step averaging ``B`` independent groups.

    Parameters
    ----------
    m : Moments
        Exact moments of one group (``bias``, ``total_variance``).
    groups : int
        ``B``.

    Returns
    -------
    float
    """
    return float(m.bias @ m.bias) + m.total_variance / groups


def _excess(by_length: list[dict]) -> list[float]:
    # sequence-IS variance over on-policy variance, per length
    return [r["seq"].total_variance / r["on"].total_variance for r in by_length]
