"""Tutorial 3 (off-policy and the first-order approximation): its estimators, tables and figures.

* :func:`rloo` and :func:`one_sample` — the two estimators the notebook varies a part of;
* :func:`response_scores` and :func:`fixed_length_pair` — the fixed-length experiment of section 1;
* :func:`path_kls` and :func:`monte_carlo_clip_fraction` — repeated measurements of sections 2–3;
* :class:`Table` and the ``*_table`` functions — the printed tables, as rows plus their layout;
* the ``plot_*`` functions — the figures, returned for the notebook to show.

Every function formats or measures what the notebook has computed and shown; the identities the
notebook asserts stay in the notebook.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tokenmdp.course.table import Table
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

__all__ = ["composition_table", "cap_table", "fixed_length_pair", "length_identity_table",
           "length_ratio_table", "monte_carlo_clip_fraction", "mse", "mse_table", "one_sample",
           "path_kls", "path_table", "ppo_table", "response_scores", "rloo", "sweep_table"]


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


# ---------------------------------------------------------------------------------------------
# Tables: rows plus a fixed-width layout, printed as the notebook's stdout

def composition_table(pairs: dict) -> Table:
    """The two compositions of one estimator side by side (section 1).

    Parameters
    ----------
    pairs : dict
        ``name -> (by_surrogate, by_correction)``, two exact moments of the same estimator.

    Returns
    -------
    Table
        Rows ``(name, ‖E ĝ‖ by surrogate, ‖E ĝ‖ by correction, max |Δ E ĝ|, Δ variance)``.
    """
    rows = [(name, float(s.mean.norm()), float(c.mean.norm()), float((s.mean - c.mean).abs().max()),
             s.total_variance - c.total_variance) for name, (s, c) in pairs.items()]
    return Table(columns=[("estimator", 12, "s"), ("surrogate: ||E ĝ||", 19, ".6f"),
                        ("correction: ||E ĝ||", 20, ".6f"), ("max |Δ E ĝ|", 12, ".1e"),
                        ("Δ variance", 11, ".1e")], rows=rows)


def sweep_table(sweep: list[dict]) -> Table:
    """The staleness sweep of section 1: divergences and the two IS estimators' moments.

    Parameters
    ----------
    sweep : list of dict
        Per stale distance: ``distance``, ``kl``, ``chi2``, ``seq`` and ``tok`` (moments).

    Returns
    -------
    Table
        Rows ``(d, KL, exp KL, 1 + χ², ‖seq bias‖, seq variance, token relative bias,
        token variance)``.
    """
    rows = [(r["distance"], r["kl"], math.exp(r["kl"]), 1 + r["chi2"], float(r["seq"].bias.norm()),
             r["seq"].total_variance, r["tok"].relative_bias, r["tok"].total_variance)
            for r in sweep]
    return Table(columns=[("d", 5, ".2f"), ("KL(π‖μ)", 8, ".4f"), ("exp KL", 7, ".3f"),
                        ("1+χ²", 8, ".3f"), "|", ("seq IS ||bias||", 15, ".1e"),
                        ("seq IS var", 10, ".4f"), "|", ("token IS ||bias||/||∇J||", 24, ".4f"),
                        ("token IS var", 12, ".4f")], rows=rows)


def length_identity_table(entries: Sequence[tuple]) -> Table:
    """The two identities of the fixed-length experiment against ``T``.

    Parameters
    ----------
    entries : sequence of tuple
        ``(T, 1 + χ²_seq, (1 + χ²_tok)^T, E‖ĝ‖², (1 + χ²) E_q[R²‖σ‖²])``.

    Returns
    -------
    Table
        Each identity's two sides and their difference.
    """
    rows = [(T, a, b, a - b, s, p, s - p) for T, a, b, s, p in entries]
    return Table(columns=[("T", 2, ""), ("1+χ²_seq", 9, ".5f"), ("(1+χ²_tok)^T", 12, ".5f"),
                        ("diff", 8, ".1e"), "|", ("E||ĝ||² (moments)", 17, ".6f"),
                        ("(1+χ²) E_q[R²||σ||²]", 20, ".6f"), ("diff", 8, ".1e")], rows=rows)


def _excess(by_length: list[dict]) -> list[float]:
    # sequence-IS variance over on-policy variance, per length
    return [r["seq"].total_variance / r["on"].total_variance for r in by_length]


def length_ratio_table(by_length: list[dict], chi2_tok: float) -> Table:
    """Successive ratios of the sequence-IS excess variance against ``1 + χ²_tok``.

    Parameters
    ----------
    by_length : list of dict
        Per length: ``T`` and the moments ``seq`` (sequence IS), ``tok`` (token IS), ``on``
        (on-policy REINFORCE).
    chi2_tok : float
        The per-token ``χ²``.

    Returns
    -------
    Table
        From the second length on: ``(T, excess(T)/excess(T−1), 1 + χ²_tok, difference,
        token-IS relative bias, sequence-IS relative bias)``.
    """
    excess = _excess(by_length)
    rows = [(r["T"], e / e_prev, 1 + chi2_tok, e / e_prev - 1 - chi2_tok, r["tok"].relative_bias,
             r["seq"].relative_bias) for r, e_prev, e in zip(by_length[1:], excess, excess[1:])]
    return Table(columns=[("T", 2, ""), ("var(T)/var(T-1), sequence IS / on-policy", 42, ".4f"),
                        ("1+χ²_tok", 9, ".4f"), ("difference", 11, "+.4f"), "|",
                        ("token IS rel. bias", 18, ".4f"), ("sequence IS rel. bias", 21, ".1e")], rows=rows)


def path_table(path: Sequence, path_kl: Sequence[float]) -> Table:
    """The first-order path: improvements, gap, bound, gradient error and KL per step.

    Parameters
    ----------
    path : sequence of FirstOrderPoint
        What ``first_order_path`` returns.
    path_kl : sequence of float
        ``KL(π_θ ‖ π_old)`` at each step (:func:`path_kls`).

    Returns
    -------
    Table
        Rows ``(s, J − J_old, L − J_old, seqIS − J_old, gap, bound, ‖∇L − ∇J‖, KL, gap/KL)``.
    """
    rows = [(p.step, p.true_improvement, p.token_surrogate_improvement, p.sequence_is_improvement,
             p.gap, p.bound, p.gradient_error, kl, p.gap / kl) for p, kl in zip(path, path_kl)]
    return Table(columns=[("s", 7, ".3g"), ("J - J_old", 10, ".3e"), ("L - J_old", 10, ".3e"),
                        ("seqIS - J_old", 13, ".3e"), ("gap J-L", 10, ".2e"), ("bound", 9, ".2e"),
                        ("||∇L-∇J||", 10, ".2e"), ("KL", 9, ".2e"), ("gap/KL", 7, ".4f")], rows=rows)


def ppo_table(ppo: dict, grad_L: dict, grad_J: torch.Tensor) -> Table:
    """PPO's exact moments per stale distance and clip range (section 3).

    Parameters
    ----------
    ppo : dict
        ``(d, ε) -> {"m": moments, "clip": exact clip fraction}``, in row order.
    grad_L : dict
        ``d -> ∇L_μ(π)`` at that stale distance.
    grad_J : Tensor
        ``∇J(π)``.

    Returns
    -------
    Table
        Rows ``(d, ε, clip fraction, cos(E ĝ, ∇J), ‖E ĝ − ∇L‖/‖∇J‖, ‖E ĝ‖/‖∇J‖, variance)``.
    """
    scale = grad_J.norm()
    rows = [(d, eps, v["clip"], v["m"].cosine, float((v["m"].mean - grad_L[d]).norm() / scale),
             float(v["m"].mean.norm() / scale), v["m"].total_variance) for (d, eps), v in ppo.items()]
    return Table(columns=[("d", 5, ".2f"), ("ε", 5, ""), ("clip frac", 9, ".4f"),
                        ("cos(E ĝ, ∇J)", 13, ".4f"), ("||E ĝ - ∇L||/||∇J||", 20, ".2e"),
                        ("||E ĝ||/||∇J||", 15, ".4f"), ("variance", 9, ".4f")], rows=rows)


def cap_table(same: dict) -> Table:
    """Corrections with a cap above every ratio beside the IS estimator they must equal.

    Parameters
    ----------
    same : dict
        ``name -> (moments, reference moments)``.

    Returns
    -------
    Table
        Rows ``(name, relative bias, IS relative bias, max |Δ E ĝ|, variance, IS variance)``.
    """
    rows = [(name, m.relative_bias, ref.relative_bias, float((m.mean - ref.mean).abs().max()),
             m.total_variance, ref.total_variance) for name, (m, ref) in same.items()]
    return Table(columns=[("correction", 22, "s"), ("rel. bias", 10, ".5f"), ("IS rel. bias", 13, ".5f"),
                        ("max |Δ E ĝ|", 12, ".1e"), ("variance", 9, ".5f"),
                        ("IS variance", 12, ".5f")], rows=rows)


def mse_table(references: dict, curves: dict, caps: Sequence[float], groups: int) -> Table:
    """Squared bias, variance and MSE of the references and of every cap of every family.

    Parameters
    ----------
    references : dict
        ``name -> moments`` (no cap; ``C`` shows ``-``).
    curves : dict
        ``family -> [moments per cap]``.
    caps : sequence of float
        The caps ``C`` of the curves.
    groups : int
        ``B`` of the last column.

    Returns
    -------
    Table
        Rows ``(name, C, ‖bias‖², variance, MSE_1, MSE_B)``.
    """
    entries = [(name, "-", m) for name, m in references.items()]
    entries += [(name, c, m) for name, ms in curves.items() for c, m in zip(caps, ms)]
    rows = [(name, c, float(m.bias @ m.bias), m.total_variance, mse(m, 1), mse(m, groups))
            for name, c, m in entries]
    return Table(columns=[("estimator", 14, "s"), ("C", 5, ""), ("||bias||²", 10, ".2e"),
                        ("variance", 9, ".4f"), ("MSE_1", 8, ".4f"), (f"MSE_{groups}", 9, ".5f")], rows=rows)


# ---------------------------------------------------------------------------------------------
# Figures (returned; the notebook shows them)


