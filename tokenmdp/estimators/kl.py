"""KL regularization to a reference policy: the estimators k1, k2, k3 (and k3+, abs) and where
they are placed.

Per token, with ``log r = log π_ref - log π_θ`` (Schulman 2020, "Approximating KL divergence",
http://joschu.net/blog/kl-approx.html): ``k1 = -log r``, ``k2 = ½ (log r)²``,
``k3 = (r - 1) - log r``. Each is an unbiased (k1) or low-variance (k2, k3) estimate of
``KL(π_θ ‖ π_ref)`` at a token sampled from ``π_θ``, but **placement changes the gradient**:

* k1 in the (detached) reward: ``R - β Σ_t k1_t`` gives ``∇(J - β KL(π_θ‖π_ref))`` over
  sequences, the reverse KL (the classic RLHF penalty, Ouyang et al., arXiv 2203.02155);
* k1 in the loss: ``E_π[∇ log π] = 0``, zero gradient in expectation;
* k2 in the loss: ``E_π[log(π/π_ref) ∇log π]``, the reverse-KL gradient per state;
* k3 in the loss (GRPO's default, arXiv 2402.03300 Eq. 4): ``-E_π[(π_ref/π) ∇log π] =
  ∇ KL(π_ref ‖ π)``, the *forward*-KL gradient per state.

Two more from verl's ``kl_penalty`` modes: ``k3+`` (the value of k3, the gradient of k2: in
the loss, the reverse-KL gradient of k2 with k3's nonnegative, low-variance value) and ``abs``
(``|log r|``).

Off-policy samples need the detached weight ``π_θ/μ`` on loss-placed terms
(``importance_weighted=True``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    MAX_LOG_RATIO,
    capped_exp,
    check_nonnegative,
    require,
    sequence_sum,
    with_derivative,
)

__all__ = ["KLPenalty", "kl_abs", "kl_k1", "kl_k2", "kl_k3", "kl_k3_plus"]


def kl_k1(logprobs_RC: torch.Tensor, ref_logprobs_RC: torch.Tensor) -> torch.Tensor:
    """``k1 = -log r = log π_θ - log π_ref`` (Schulman 2020).

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    ref_logprobs_RC : Tensor ``[R, C]``
        ``log π_ref`` of each token.

    Returns
    -------
    Tensor ``[R, C]``
        ``k1`` of each token (of either sign; unbiased for the KL).
    """
    return logprobs_RC - ref_logprobs_RC


def kl_k2(logprobs_RC: torch.Tensor, ref_logprobs_RC: torch.Tensor) -> torch.Tensor:
    """``k2 = ½ (log r)²``, ``log r = log π_ref - log π_θ`` (Schulman 2020).

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    ref_logprobs_RC : Tensor ``[R, C]``
        ``log π_ref`` of each token.

    Returns
    -------
    Tensor ``[R, C]``
        ``k2 >= 0`` of each token.
    """
    return 0.5 * (ref_logprobs_RC - logprobs_RC).square()


def kl_k3(logprobs_RC: torch.Tensor, ref_logprobs_RC: torch.Tensor) -> torch.Tensor:
    """``k3 = (r - 1) - log r``, ``r = π_ref/π_θ`` (Schulman 2020; verl ``low_var_kl``).

    ``r - 1`` is computed as ``expm1(log r)``: near ``r = 1`` the difference ``exp(u) - 1`` of
    two rounded numbers loses every digit of ``u`` and ``(exp(u) - 1) - u`` comes out negative
    (about 10% of float32 inputs with ``|log r| ≤ 1e-3``), while ``expm1(u) ≥ u`` holds after
    rounding, so ``k3 ≥ 0`` term by term. ``r`` is held at ``e^20`` (beyond it only the
    ``-log r`` part carries gradient). The derivative ``∂k/∂log π_θ = 1 - r`` is attached by
    ``with_derivative`` (a one-product backward pass; the reference log-probs are data and get
    no gradient).

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    ref_logprobs_RC : Tensor ``[R, C]``
        ``log π_ref`` of each token.

    Returns
    -------
    Tensor ``[R, C]``
        ``k3 >= 0`` of each token.
    """
    with torch.no_grad():  # in place where possible: these passes are bound by memory
        log_r = ref_logprobs_RC - logprobs_RC
        r_minus_1 = torch.expm1(log_r.clamp(max=MAX_LOG_RATIO))
        derivative = torch.neg(r_minus_1).masked_fill_(log_r > MAX_LOG_RATIO, 1.0)
        value = r_minus_1.sub_(log_r)
    return with_derivative(logprobs_RC, value, derivative)


def kl_k3_plus(logprobs_RC: torch.Tensor, ref_logprobs_RC: torch.Tensor) -> torch.Tensor:
    """Straight-through ``k3+``: the value of k3, the gradient of k2 (verl ``kl_penalty="k3+"``).

    Value ``k3 = (r - 1) - log r`` exactly as :func:`kl_k3` (``r = π_ref/π_θ``, held at
    ``e^20``); derivative that of ``k2 = ½ (log r)²``, ``∂k/∂log π_θ = -log r =
    log π_θ - log π_ref``. In the loss the gradient is therefore k2's, ``E_π[log(π/π_ref)
    ∇log π]``, the reverse-KL gradient per state (Schulman 2020,
    http://joschu.net/blog/kl-approx.html, for k2 and k3; verl's ``kl_penalty`` modes
    ``low_var_kl``/``k3`` and their straight-through ``+`` suffix, with k2 behind it). The
    derivative is attached by ``with_derivative``.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    ref_logprobs_RC : Tensor ``[R, C]``
        ``log π_ref`` of each token.

    Returns
    -------
    Tensor ``[R, C]``
        ``k3 >= 0`` of each token, carrying k2's gradient.
    """
    with torch.no_grad():
        value = kl_k3(logprobs_RC.detach(), ref_logprobs_RC)
        derivative = logprobs_RC.detach() - ref_logprobs_RC
    return with_derivative(logprobs_RC, value, derivative)


def kl_abs(logprobs_RC: torch.Tensor, ref_logprobs_RC: torch.Tensor) -> torch.Tensor:
    """``|log r| = |log π_θ - log π_ref|`` (verl ``kl_penalty="abs"``).

    A symmetric penalty, not an unbiased KL estimate (``E_π|log r| >= KL(π_θ ‖ π_ref)``).
    Derivative ``∂k/∂log π_θ = sign(log π_θ - log π_ref)``, ``0`` where the two are equal,
    attached by ``with_derivative``.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    ref_logprobs_RC : Tensor ``[R, C]``
        ``log π_ref`` of each token.

    Returns
    -------
    Tensor ``[R, C]``
        ``|log r| >= 0`` of each token.
    """
    with torch.no_grad():
        minus_log_r = logprobs_RC.detach() - ref_logprobs_RC
        derivative = torch.sign(minus_log_r)
        value = minus_log_r.abs()
    return with_derivative(logprobs_RC, value, derivative)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLPenalty:
    """A KL penalty ``β · k`` to a reference policy, placed in the reward or in the loss.

    All parameters are keyword-only.

    Parameters
    ----------
    coef : float
        ``β >= 0`` (GRPO 0.04).
    in_reward : bool
        True: ``R_i ← R_i - β Σ_t k_t`` before advantages, with ``k`` at ``π_old`` (detached
        data); False: ``β k_t`` is subtracted from each token's term in the loss.
    estimator : callable, default :func:`kl_k3`
        ``k(logprobs_RC, ref_logprobs_RC) -> [R, C]``: :func:`kl_k1`, :func:`kl_k2`,
        :func:`kl_k3`, :func:`kl_k3_plus` or :func:`kl_abs`.
    importance_weighted : bool, default False
        Loss placement only: multiply each ``k_t`` by ``sg(π_θ/μ)`` (needs
        ``behavior_logprob``).
    """

    coef: float
    in_reward: bool
    estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = kl_k3
    # The default is a function: autodoc would list the field as a method carrying kl_k3's
    # docstring. Private to autodoc; the field is documented in the class's Parameters.
    """:meta private:"""
    importance_weighted: bool = False

    def __post_init__(self):
        check_nonnegative("coef", self.coef)
        if not callable(self.estimator):
            raise TypeError(f"estimator: expected a callable such as kl_k3, got {self.estimator!r}")
        if self.in_reward and self.importance_weighted:
            raise ValueError("importance_weighted: applies to the loss placement only "
                             "(in_reward=True samples the penalty from the data as it is)")

    @property
    def requires(self) -> tuple[str, ...]:
        """Batch fields the penalty reads."""
        if self.in_reward:
            return ("old_logprob", "ref_logprob")
        return ("ref_logprob", "behavior_logprob") if self.importance_weighted else ("ref_logprob",)

    def reward_penalty(self, batch: TokenBatch) -> torch.Tensor:
        """Float ``[S]``: ``β Σ_t k(log π_old, log π_ref)`` over each sequence's loss tokens.

        Parameters
        ----------
        batch : TokenBatch
            The batch, with ``old_logprob`` and ``ref_logprob``.

        Returns
        -------
        Tensor ``[S]``
            The penalty of each sequence, to subtract from its reward.
        """
        who = "a KL penalty in the reward"
        k = self.estimator(require(batch, "old_logprob", who), require(batch, "ref_logprob", who))
        return self.coef * sequence_sum(torch.where(batch.loss_mask, k, 0.0), batch)

    def loss_penalty(self, logprobs_RC: torch.Tensor, batch: TokenBatch
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(k, w)`` per token ``[R, C]``: ``k = k(log π_θ, log π_ref)`` (differentiable) and the
        detached importance weight ``w = sg(π_θ/μ)`` (None unless ``importance_weighted``); the
        penalty is ``β · w · k``. The loss folds ``β`` and ``w`` into its detached weights, so
        neither is on the autograd graph.

        Parameters
        ----------
        logprobs_RC : Tensor ``[R, C]``
            ``log π_θ`` of each token (differentiable).
        batch : TokenBatch
            The batch, with ``ref_logprob`` (and ``behavior_logprob`` when importance-weighted).

        Returns
        -------
        k : Tensor ``[R, C]``
            The estimator's ``k_t`` of each token.
        w : Tensor ``[R, C]`` or None
            The detached weight ``sg(π_θ/μ)``, capped at ``e^20``; None unless
            ``importance_weighted``.
        """
        who = "a KL penalty in the loss"
        k = self.estimator(logprobs_RC, require(batch, "ref_logprob", who))
        weight = None
        if self.importance_weighted:
            # sg(π_θ/μ): an importance weight on the sample, not a path for the gradient, so the
            # estimate is E_μ[(π_θ/μ) ∇k] = E_π[∇k] off-policy.
            weight = capped_exp(logprobs_RC.detach() - require(batch, "behavior_logprob", who))
        return k, weight

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"k3 in loss, coef=0.04"`` (``"k3+"`` for :func:`kl_k3_plus`).
        """
        name = getattr(self.estimator, "__name__", repr(self.estimator)).removeprefix("kl_")
        name = name.removesuffix("_plus") + "+" if name.endswith("_plus") else name
        place = "reward" if self.in_reward else "loss"
        weighted = ", IS-weighted" if self.importance_weighted else ""
        return f"{name} in {place}, coef={self.coef:g}{weighted}"
