"""Exact mean and variance of token-level estimators on the lattice, ``O(T·K·V)`` per term.

The convention is :func:`tokenmdp.exact.moments`'s: one optimizer step is one group of ``G``
responses drawn i.i.d. from ``μ``; the estimator's gradient is ``ĝ = −∇_θ loss(prepare(group))``
in the logits of ``π_θ``; :class:`~tokenmdp.exact.Moments` holds ``E[ĝ]``, ``tr Cov[ĝ]`` (and
``Cov[ĝ]`` when the lattice has at most ``MAX_COVARIANCE_DIM`` entries) beside ``∇J``.

What is exact (``method="lattice"``), for a token-local estimator
(:func:`~tokenmdp.exact.lattice.coefficients.exact_support`):

1. The group's advantages depend only on its rewards. A response's reward takes one of ``m``
   values (its *class*; 0/1 rewards have ``m = 2``), so the group is summarised by its class
   counts ``k`` (``C(G + m − 1, G)`` of them, multinomial probabilities); the advantage of each
   member is the estimator's own advantage part evaluated on the counts' rewards.
2. Given the classes, members are independent, each drawn from ``μ`` conditioned on its class.
   With weights ``W_i = w_0 f(|y_i|)`` (``f = 1`` or ``1/|y|``, read from ``prepare``):
   ``E[ĝ | k] = w_0 Σ_i m_i`` and ``E‖ĝ‖² | k = w_0² (Σ_i (s_i − ‖m_i‖²) + ‖Σ_i m_i‖²)`` with
   ``m_i = E[f X_i | c_i]`` and ``s_i = E[f² ‖X_i‖² | c_i]``, ``X = Σ_t φ_t ∇log π_t``.
3. ``m_i`` is one pass over the lattice: ``Σ_a α_t(z) μ(a|t,z) φ(t,z,a; A_i) B^f_t(z,a,c_i)
   (e_a − π(·|t,z))`` where ``α`` is ``μ``'s forward visitation and ``B^f`` the backward
   message "ends in class ``c`` with weight ``f(|y|)``" after ``a``. Since the policy is tabular
   over ``(t, z)``, the scores of different positions are on disjoint parameters and
   ``‖X‖² = Σ_t φ_t² ‖e_{a_t} − π‖²``: ``s_i`` is one pass too. The full covariance (small
   lattices) adds the cross-position terms through ``μ``'s transition matrices.

Not exact, so estimated by Monte Carlo on the lattice with standard errors
(``method="monte_carlo"``, :mod:`~tokenmdp.exact.lattice.monte_carlo`): sequence-level ratios
and corrections (GSPO, GMPO, sequence IS, per-decision IS, sequence masks), a KL in the reward,
rejects leaving the normalizer, the token mean at ``G >= 2`` (its normalizer couples the
members' lengths), and more than ``max_configurations`` class counts.
"""

from __future__ import annotations

import itertools
import math

import torch

from tokenmdp.estimators import Estimator
from tokenmdp.exact.lab.moments_result import Moments, _exact_moments
from tokenmdp.exact.lattice.coefficients import exact_support, length_weights, token_coefficients
from tokenmdp.exact.lattice.ground_truth import _forward, gradient, transition_matrices
from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.lattice.monte_carlo import monte_carlo_moments
from tokenmdp.exact.lattice.policy import LatticePolicy, check_lattice_policy
from tokenmdp.exact.world.budget import check_budget
from tokenmdp.exact.world.mdp import BYTES_PER_TOKEN

__all__ = ["moments", "MAX_CONFIGURATIONS", "MAX_COVARIANCE_DIM"]

#: Above this many class-count configurations ``method="auto"`` uses Monte Carlo.
MAX_CONFIGURATIONS = 20_000
#: The full covariance is computed when ``T·K·V`` is at most this.
MAX_COVARIANCE_DIM = 512
METHODS = ("auto", "lattice", "monte_carlo")


def moments(mdp: LatticeMDP, policy: LatticePolicy, estimator: Estimator, *, group_size: int,
            behavior: LatticePolicy | None = None, old: LatticePolicy | None = None,
            reference: LatticePolicy | None = None, method: str = "auto",
            num_samples: int | None = None, generator: torch.Generator | None = None,
            max_configurations: int | None = None,
            memory_budget: int | str | None = None) -> Moments:
    """Mean and variance of ``estimator``'s gradient on the lattice, against the true ``∇J``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    policy : LatticePolicy
        ``π_θ``, whose gradient is estimated.
    estimator : Estimator
        Any composition (``tokenmdp.estimators.get("minirl")``).
    group_size : int
        ``G``, responses per step (one group per step).
    behavior : LatticePolicy, optional
        ``μ``, the sampler (default ``π_θ``).
    old : LatticePolicy, optional
        ``π_old`` (default ``behavior``).
    reference : LatticePolicy, optional
        ``π_ref``, required by a KL penalty.
    method : {"auto", "lattice", "monte_carlo"}
        ``"lattice"``: exact (raises ``ValueError`` with the reason where it is not);
        ``"monte_carlo"``: sampled steps; ``"auto"``: exact where it is, else Monte Carlo.
        ``Moments.method`` says which ran.
    num_samples : int, optional
        Monte Carlo steps (default 2048).
    generator : torch.Generator, optional
        Monte Carlo source (default seeded with 0).
    max_configurations : int, optional
        ``"auto"`` is exact up to this many class-count configurations
        (default :data:`MAX_CONFIGURATIONS`).
    memory_budget : int or str, optional
        The Monte Carlo path's budget for one sampled group of ``G`` responses of up to ``T``
        tokens (default ``$TOKENMDP_MEMORY_BUDGET`` or 2 GiB; see
        :func:`tokenmdp.exact.world.budget.memory_budget`).

    Returns
    -------
    Moments
        ``mean``, ``total_variance`` (``covariance`` when ``T·K·V <= MAX_COVARIANCE_DIM``),
        ``true_gradient``, ``method`` (``"lattice"`` or ``"monte_carlo"``) and ``num_draws``
        (configurations, or sampled steps).
    """
    check_lattice_policy(mdp, policy)
    behavior = policy if behavior is None else behavior
    old = behavior if old is None else old
    check_lattice_policy(mdp, behavior, name="behavior")
    check_lattice_policy(mdp, old, name="old")
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator: expected an Estimator, got {type(estimator).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    needs_ref = "ref_logprob" in estimator.requires("prepare") + estimator.requires("loss")
    if needs_ref and reference is None:
        raise ValueError(f"reference: estimator {estimator.name!r} has a KL penalty and needs a "
                         "reference policy")
    if reference is not None:
        check_lattice_policy(mdp, reference, name="reference")
    limit = MAX_CONFIGURATIONS if max_configurations is None else max_configurations
    m = mdp.reward_classes[0].numel()
    # the count comes first: exact_support probes the estimator on a group of G responses
    configs = math.comb(group_size + m - 1, group_size)
    if configs > limit:
        exact, reason = False, (f"{configs} class-count configurations (G = {group_size}, "
                                f"{m} reward values) exceed max_configurations={limit}")
    else:
        exact, reason = exact_support(estimator, group_size)
    if method == "lattice" and not exact:
        raise ValueError(f"method: not exact on the lattice for {estimator.name!r}: {reason}")
    logp = {"policy": policy.logprobs().detach(), "behavior_logprob": behavior.logprobs().detach(),
            "old_logprob": old.logprobs().detach()}
    if reference is not None:
        logp["ref_logprob"] = reference.logprobs().detach()
    if method == "monte_carlo" or not exact:
        T = mdp.max_len
        check_budget(f"method=monte_carlo, group_size={group_size}, max_len={T}",
                     group_size * (T + 1), "tokens in one sampled group",
                     group_size * (T + 1) * BYTES_PER_TOKEN, memory_budget=memory_budget)
        return monte_carlo_moments(mdp, logp, estimator, group_size, gradient(mdp, policy),
                                   num_samples=num_samples, generator=generator)
    return _lattice_moments(mdp, logp, estimator, group_size, gradient(mdp, policy))


def _continuation(mdp: LatticeMDP, mu: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``B^f[t, z, a, c] = E[f(|y|) 1{class = c} | a drawn at (t, z)]``, float64 ``[T, K, V, m]``."""
    T, K, V = mdp.shape
    values, eos_class, trunc_class = mdp.reward_classes
    m = values.numel()
    beta = f[T] * torch.nn.functional.one_hot(trunc_class, m).to(torch.float64)   # [K, m]
    out = mu.new_zeros(T, K, V, m)
    eos_part = f[1:, None, None] * torch.nn.functional.one_hot(eos_class, m).to(torch.float64)
    for t in range(T - 1, -1, -1):
        out[t, :, :V - 1] = beta[mdp.transitions]
        out[t, :, V - 1] = eos_part[t]
        beta = (mu[t][..., None] * out[t]).sum(1)
    return out


def _lattice_moments(mdp, logp, estimator, G, true_grad) -> Moments:
    T, K, V = mdp.shape
    d = T * K * V
    w0, per_length = length_weights(estimator, G, max_len=T)
    mu, pi = logp["behavior_logprob"].exp(), logp["policy"].exp()
    fields = {k: v for k, v in logp.items() if k != "policy"}
    alpha = _forward(mdp, mu)[:-1]                                          # [T, K]
    lengths = torch.arange(T + 1, dtype=torch.float64).clamp(min=1)
    f1 = lengths.reciprocal() if per_length else torch.ones(T + 1, dtype=torch.float64)
    B1 = _continuation(mdp, mu, f1)
    B2 = _continuation(mdp, mu, f1 * f1) if per_length else B1
    values = mdp.reward_classes[0]
    B_one = _continuation(mdp, mu, torch.ones(T + 1, dtype=torch.float64)) if per_length else B1
    start = mdp.automaton.start
    p_class = (mu[0, start][:, None] * B_one[0, start]).sum(0)              # P(class c)
    score_sq = 1 - 2 * pi + (pi * pi).sum(-1, keepdim=True)               # ‖e_a − π‖²
    keep_cov = d <= MAX_COVARIANCE_DIM
    phi_cache: dict[float, torch.Tensor] = {}
    member_cache: dict[tuple[int, float], tuple] = {}

    def member(c: int, a: float):
        """``(m_i, s_i, S_i)``: conditional mean, second moment (and matrix) of ``f X``."""
        key = (c, a)
        if key not in member_cache:
            if a not in phi_cache:
                phi_cache[a] = token_coefficients(estimator, a, logp["policy"], fields)
            phi = phi_cache[a]
            u = alpha[..., None] * mu * phi * B1[..., c]
            mean = (u - pi * u.sum(-1, keepdim=True)).reshape(-1) / p_class[c]
            second = float((alpha[..., None] * mu * phi * phi * B2[..., c] * score_sq).sum()
                           / p_class[c])
            matrix = (_second_matrix(mdp, alpha, mu, pi, phi, B2[..., c]) / p_class[c]
                      if keep_cov else None)
            member_cache[key] = (mean, second, matrix)
        return member_cache[key]

    mean = torch.zeros(d, dtype=torch.float64)
    second = 0.0
    outer = torch.zeros(d, d, dtype=torch.float64) if keep_cov else None
    evaluated = 0
    log_fact = math.lgamma(G + 1)
    for classes in itertools.combinations_with_replacement(range(values.numel()), G):
        counts = torch.bincount(torch.tensor(classes), minlength=values.numel())
        if any(p_class[c] <= 0 for c in classes):
            continue
        prob = math.exp(log_fact + sum(float(k) * math.log(float(p_class[c])) - math.lgamma(
            float(k) + 1) for c, k in enumerate(counts.tolist()) if k > 0))
        rewards = values[list(classes)]
        adv = estimator.advantage(rewards, torch.zeros(G, dtype=torch.long), None)
        parts = [member(c, float(a)) for c, a in zip(classes, adv.tolist())]
        total = torch.stack([p[0] for p in parts]).sum(0)
        mean += prob * w0 * total
        second += prob * w0 ** 2 * (sum(s - float(mv @ mv) for mv, s, _ in parts)
                                    + float(total @ total))
        if keep_cov:
            outer += prob * w0 ** 2 * (sum(S - torch.outer(mv, mv) for mv, _, S in parts)
                                       + torch.outer(total, total))
        evaluated += 1
    return _exact_moments(mean, torch.tensor(second, dtype=torch.float64), outer, true_grad,
                          evaluated, 1.0, "lattice")


def _second_matrix(mdp, alpha, mu, pi, phi, B2c) -> torch.Tensor:
    """``E[f² X Xᵀ 1{class}]`` ``[d, d]``: the same-position blocks, and the cross-position ones
    through ``μ``'s transition matrices (small lattices only)."""
    T, K, V = mdp.shape
    eye = torch.eye(V, dtype=torch.float64)
    s = eye[None, None] - pi[:, :, None, :]                   # [T, K, a, v]: e_a − π
    out = torch.zeros(T, K, V, T, K, V, dtype=torch.float64)
    P = transition_matrices(mdp, mu)
    end = mu * phi * B2c                                      # weight of the later token
    for t in range(T):
        w = alpha[t][:, None] * mu[t] * phi[t]                # [K, V]
        diag = torch.einsum("za,zav,zaw->zvw", w * phi[t] * B2c[t], s[t], s[t])
        out[t, torch.arange(K), :, t, torch.arange(K), :] = diag
        gamma = torch.zeros(K, V, K, dtype=torch.float64)     # [(z, a), z'] after the token
        idx = mdp.transitions
        gamma[:, :V - 1].scatter_(2, idx[..., None], w[:, :V - 1, None])
        for t2 in range(t + 1, T):
            Y = gamma[..., None] * end[t2][None, None]        # [z, a, z', a']
            block = torch.einsum("zaZA,zav,ZAw->zvZw", Y, s[t], s[t2])
            out[t, :, :, t2] = block
            out[t2, :, :, t] = block.permute(2, 3, 0, 1)
            gamma = gamma @ P[t2]
    return out.reshape(T * K * V, T * K * V)
