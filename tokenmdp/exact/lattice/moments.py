"""Exact mean and variance of token-level estimators on the lattice, ``O(T·K·V)`` per term.

The convention is :func:`tokenmdp.exact.moments`'s: one optimizer step is one group of ``G``
responses drawn i.i.d. from ``μ``; the estimator's gradient is ``ĝ = −∇_θ loss(prepare(group))``
in the logits of ``π_θ``; :class:`~tokenmdp.exact.Moments` holds ``E[ĝ]``, ``tr Cov[ĝ]`` (and
``Cov[ĝ]`` when the lattice has at most ``MAX_COVARIANCE_DIM`` entries) beside ``∇J``.

What is exact (``method="lattice"``): every estimator :func:`~tokenmdp.exact.lattice.lattice_form`
recognises, computed by :func:`~tokenmdp.exact.lattice.exact_moments.form_moments` (docs:
Concepts › Long responses):

1. The group's advantages depend only on its rewards. A response's reward takes one of ``m``
   values (its *class*; 0/1 rewards have ``m = 2``), so the group is summarised by its class
   counts (``C(G + m − 1, G)`` of them, multinomial probabilities); given the classes the
   members are independent, each drawn from ``μ`` conditioned on its class.
2. A member's score sum ``X = Σ_t φ_t ∇log π_t`` and its square are lattice passes
   (:mod:`~tokenmdp.exact.lattice.sweep`): the tabular policy puts the scores of different
   positions on disjoint parameters, so ``‖X‖²`` is a per-position sum. Products of ratios
   along a response (sequence IS, per-decision IS) are multiplicative messages: passes under
   the measures ``μ·κ`` and ``μ·κ²``.
3. Random normalizers — the token mean's ``Σ_j |y_j|`` at every ``G``, kept counts when
   rejects leave the normalizer, the sum of weights of token-level self-normalized IS — by the
   Laplace identity ``1/N^p = Γ(p)^{-1} ∫ s^{p−1} e^{−sN} ds``
   (:mod:`~tokenmdp.exact.lattice.laplace`): a sum over ~60 nodes of passes under ``μ e^{−sν}``,
   exact to a proven relative error below ``1e-11``.

Not exact, so estimated by Monte Carlo on the lattice with standard errors
(``method="monte_carlo"``, :mod:`~tokenmdp.exact.lattice.monte_carlo`): GSPO's and GMPO's
geometric means, sequence-level clips, truncations and masks, covariance selections, a KL in the
reward, advantages that read lengths, a sequence ratio that reaches its ``e^20`` cap on some
response, and more than ``max_configurations`` class counts.
:func:`~tokenmdp.exact.lattice.exact_support` gives the reason.
"""

from __future__ import annotations

import math

import torch

from tokenmdp.estimators import Estimator
from tokenmdp.estimators._common import MAX_LOG_RATIO
from tokenmdp.estimators.corrections.factor import ImportanceSampling
from tokenmdp.exact.lab.moments_result import Moments
from tokenmdp.exact.lattice.exact_moments import form_moments
from tokenmdp.exact.lattice.ground_truth import gradient
from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.lattice.monte_carlo import monte_carlo_moments
from tokenmdp.exact.lattice.policy import LatticePolicy, check_lattice_policy
from tokenmdp.exact.lattice.structure import lattice_form
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
        ``π_θ``, whose gradient is estimated: tabular (in its logits) or a
        :class:`~tokenmdp.exact.lattice.SharedLatticePolicy` (in its parameter ``W``; the
        square's cross-position terms by vector messages).
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
        form, reason = lattice_form(estimator, group_size, max_len=mdp.max_len)
        exact = form is not None
    logp = {"policy": policy.logprobs().detach(), "behavior_logprob": behavior.logprobs().detach(),
            "old_logprob": old.logprobs().detach()}
    if reference is not None:
        logp["ref_logprob"] = reference.logprobs().detach()
    features = policy.features
    if exact and form.kind == "per_decision" and features is not None:
        exact, reason = False, ("per-decision IS with shared parameters: the square's cross "
                                "terms mix three measures, which the vector messages do not carry")
    if exact and form.kind != "local":
        reason = _ratio_cap(mdp, form, logp)
        exact = not reason
    if method == "lattice" and not exact:
        raise ValueError(f"method: not exact on the lattice for {estimator.name!r}: {reason}")
    if method == "monte_carlo" or not exact:
        T = mdp.max_len
        check_budget(f"method=monte_carlo, group_size={group_size}, max_len={T}",
                     group_size * (T + 1), "tokens in one sampled group",
                     group_size * (T + 1) * BYTES_PER_TOKEN, memory_budget=memory_budget)
        return monte_carlo_moments(mdp, logp, estimator, group_size, gradient(mdp, policy),
                                   num_samples=num_samples, generator=generator,
                                   features=features)
    return form_moments(mdp, logp, form, estimator, group_size, gradient(mdp, policy),
                        keep_cov=math.prod(mdp.shape) <= MAX_COVARIANCE_DIM, policy=policy)


def _max_path(mdp: LatticeMDP, table: torch.Tensor, *, prefixes: bool) -> float:
    """The largest sum of ``table`` over a response's tokens (``prefixes``: over any prefix)."""
    T, K, V = mdp.shape
    best = torch.full((K,), -math.inf, dtype=torch.float64)
    best[mdp.automaton.start] = 0.0
    top = -math.inf
    idx = mdp.transitions.reshape(-1)
    for t in range(T):
        step = best[:, None] + table[t]                                    # [K, V]
        top = max(top, float(step.max() if prefixes else step[:, V - 1].max()))
        best = torch.full((K,), -math.inf, dtype=torch.float64).scatter_reduce(
            0, idx, step[:, :V - 1].reshape(-1), reduce="amax")
    return top if prefixes else max(top, float(best.max()))


def _ratio_cap(mdp: LatticeMDP, form, logp) -> str:
    """Why a sequence kind is not exact on these policies (a ratio reaching its cap), or ``""``."""
    prefixes = form.kind == "per_decision"
    parts = [("ratio", form.log_kappa(logp) if prefixes else
              logp["policy"] - logp["old_logprob"])]
    if form.kind == "sequence" and isinstance(form.local.correction, ImportanceSampling):
        parts.append(("IS weight", logp["old_logprob"] - logp["behavior_logprob"]))
    for name, table in parts:
        top = _max_path(mdp, table, prefixes=prefixes)
        if top > MAX_LOG_RATIO:
            return (f"the {form.kind.replace('_', '-')} {name} reaches its e^{MAX_LOG_RATIO:g} "
                    f"cap on some response (log {top:.1f}): the capped product is not a product")
    return ""


