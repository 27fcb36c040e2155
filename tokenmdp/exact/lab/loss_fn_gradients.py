"""Bring your own loss: the exact lab's per-batch gradients of any loss callable.

:func:`~tokenmdp.exact.moments` takes, in place of an :class:`~tokenmdp.estimators.Estimator`,
any ``loss_fn(logprobs_RC, batch) -> scalar tensor`` (the :data:`tokenmdp.testing.LossFn`
protocol): a loss written for another framework, or straight from a paper. Its gradient on one
batch is still ``ĝ = −∇_θ loss = Σ_t c_t ∇_θ log π(y_t|s_t)`` with ``c_t = −∂loss/∂ log π(y_t|s_t)``,
the per-token coefficients, which autograd gives on each enumerated batch; the rest of the lab
(the state-action Jacobian, the sums over batches, :class:`~tokenmdp.exact.Moments`) is shared
with the registry's estimators. :class:`LossFnGradients` is that engine.

What the callable sees: one optimizer step at a time, as a padded :class:`~tokenmdp.batch.TokenBatch`
(one sequence per row, ``group`` the group of each sequence, ``G`` consecutive sequences per
group) with ``reward``, ``behavior_logprob`` (``μ``), ``old_logprob`` (``π_old``) and, when a
reference is given, ``ref_logprob``; ``advantage`` and ``loss_weight`` are 1 on the response
tokens until a ``prepare`` fills them: ``prepare`` is a callable ``batch -> batch`` (it may not
change the layout), or an estimator (or registry name) whose
:func:`~tokenmdp.estimators.prepare` runs with ``max_len = mdp.max_len``.

Order. The registry's estimators do not depend on the order of a group's responses, so the lab
enumerates multisets of responses, each standing for all its orderings. A loss callable may
depend on it (a loss that cuts the batch into micro-batches by row does), so by default every
*ordered* draw is enumerated: ``P · n^G`` per group instead of ``P · C(n + G − 1, G)``
(:func:`ordered_draws`); ``order_invariant=True`` promises the order does not matter and takes
the multisets. Monte Carlo draws are ordered either way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.exact.lab._stacked import _stacked_batch
from tokenmdp.exact.lab.group_draws import filter_equal_rewards
from tokenmdp.exact.lab.step_gradients import PolicyTables, StepGradients
from tokenmdp.exact.world.mdp import TokenMDP

__all__ = ["LossFnGradients", "count_ordered_draws", "ordered_draws"]

#: The layout fields a ``prepare`` callable must leave as they are.
_LAYOUT = ("tokens", "sequence_id", "position", "loss_mask")


def _check_loss_fn(loss_fn: object) -> Callable:
    """``loss_fn`` itself, or ``TypeError`` when it cannot be ``loss_fn(logprobs_RC, batch)``."""
    if isinstance(loss_fn, str) or not callable(loss_fn):
        raise TypeError(f"estimator: expected an Estimator or a loss callable "
                        f"loss_fn(logprobs_RC, batch) -> scalar tensor, got "
                        f"{type(loss_fn).__name__} {loss_fn!r:.60}")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):   # a builtin without a signature: judged by its calls
        return loss_fn
    try:
        signature.bind(None, None)
    except TypeError as err:
        raise TypeError(f"estimator: a loss callable is called as loss_fn(logprobs_RC, batch); "
                        f"{getattr(loss_fn, '__name__', type(loss_fn).__name__)}"
                        f"{signature} cannot be ({err})") from None
    return loss_fn


def _resolve_prepare(prepare: object, mdp: TokenMDP) -> Callable[[TokenBatch], TokenBatch]:
    """The ``prepare`` step of a loss callable: identity, a user callable (checked) or an
    estimator's :func:`~tokenmdp.estimators.prepare` with ``max_len = mdp.max_len``."""
    if prepare is None:
        return lambda batch: batch
    if isinstance(prepare, (estimators.Estimator, str)):
        est = prepare if isinstance(prepare, estimators.Estimator) else estimators.get(prepare)
        return lambda batch: estimators.prepare(batch, est, max_len=mdp.max_len)
    if not callable(prepare):
        raise TypeError(f"prepare: expected a callable batch -> batch, an Estimator or a "
                        f"registry name, got {type(prepare).__name__}")

    def checked(batch: TokenBatch) -> TokenBatch:
        out = prepare(batch)
        if not isinstance(out, TokenBatch):
            raise TypeError(f"prepare: must return a TokenBatch, got {type(out).__name__}")
        for name in _LAYOUT:
            a, b = getattr(out, name), getattr(batch, name)
            if a.shape != b.shape or not torch.equal(a, b):
                raise ValueError(f"prepare: changed the batch's {name}; it may fill fields "
                                 "(advantage, loss_weight, ...) but not change the layout")
        return out
    return checked


def count_ordered_draws(mdp: TokenMDP, group_size: int, prompts_per_batch: int = 1) -> int:
    """Number of ordered batches :func:`ordered_draws` enumerates (zero-probability included).

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP (``P`` prompts, ``n`` responses per prompt).
    group_size : int
        ``G``, responses per group.
    prompts_per_batch : int, default 1
        ``B``, groups per batch.

    Returns
    -------
    int
        ``(P · n^G)^B``.
    """
    return (mdp.num_prompts * mdp.responses_per_prompt ** group_size) ** prompts_per_batch


def ordered_draws(mdp: TokenMDP, probs_N: torch.Tensor, group_size: int, prompts_per_batch: int,
                  filter_groups: bool):
    """Every ordered batch of nonzero probability: ``G`` i.i.d. responses per group, in order.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    probs_N : Tensor ``[N]``
        ``μ(y|x)`` per response, canonical order.
    group_size : int
        ``G``, responses per group.
    prompts_per_batch : int
        ``B``, groups per batch (the batch distribution is the product of the groups').
    filter_groups : bool
        Drop groups whose rewards are all equal first
        (:func:`~tokenmdp.exact.lab.group_draws.filter_equal_rewards`).

    Returns
    -------
    ids : LongTensor ``[D, B * G]``
        Each batch's responses, as rows of ``mdp.enumerate()``, group after group.
    prob : Tensor ``[D]``
        ``Π_groups D(x) Π_j μ(y_j|x)`` of each batch (summing to 1).
    p_keep : float
        The probability that a group is kept (1.0 without ``filter_groups``).
    """
    n = mdp.responses_per_prompt
    per_prompt = probs_N.view(mdp.num_prompts, n)
    tuples = torch.cartesian_prod(*[torch.arange(n)] * group_size).view(-1, group_size)
    ids = torch.cat([x * n + tuples for x in range(mdp.num_prompts)])
    prob = torch.cat([mdp.prompt_probs[x] * per_prompt[x][tuples].prod(1)
                      for x in range(mdp.num_prompts)])
    keep = prob > 0
    ids, prob = ids[keep], prob[keep]
    p_keep = 1.0
    if filter_groups:
        ids, prob, p_keep = filter_equal_rewards(mdp, ids, prob)
    all_ids, all_prob = ids, prob
    for _ in range(prompts_per_batch - 1):
        d1, d2 = all_ids.shape[0], ids.shape[0]
        all_ids = torch.cat([all_ids.repeat_interleave(d2, 0), ids.repeat(d1, 1)], dim=1)
        all_prob = all_prob.repeat_interleave(d2) * prob.repeat(d1)
    return all_ids, all_prob, p_keep


class LossFnGradients(StepGradients):
    """``ĝ`` of a loss callable for batches made of rows of ``mdp.enumerate()``.

    The per-token coefficients of every batch come from one backward pass over the sum of the
    batches' losses (each batch reads its own rows of one log-prob leaf); the callable runs once
    per batch.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        ``π_θ`` (float64).
    loss_fn : callable ``(logprobs_RC, batch) -> scalar tensor``
        The loss of one optimizer step.
    prepare : callable ``batch -> batch``
        Run on each batch before ``loss_fn`` (see the module docstring).
    fields : dict of str -> Tensor ``[N, C]``
        Log-prob fields of the enumeration.
    group_size : int
        ``G``.
    jacobian : Tensor, optional
        A precomputed state-action Jacobian.
    tables : PolicyTables, optional
        Estimator-independent tables shared with other calls (:class:`StepGradients`).
    """

    def __init__(self, mdp: TokenMDP, policy: nn.Module, loss_fn: Callable,
                 prepare: Callable[[TokenBatch], TokenBatch], fields: dict[str, torch.Tensor],
                 group_size: int, jacobian: torch.Tensor | None = None, *,
                 tables: PolicyTables | None = None) -> None:
        super().__init__(mdp, policy, None, fields, group_size, jacobian, tables=tables)
        self.loss_fn, self.prepare = loss_fn, prepare

    def coefficients(self, ids: torch.Tensor, *, first_only: bool = False):
        """Per-token coefficients of batches ``ids`` ``[D, width]``, as
        :meth:`StepGradients.coefficients` returns them (``first_only`` is not available: the
        exchangeability method needs an estimator's types).

        Parameters
        ----------
        ids : LongTensor ``[D, width]``
            Each batch's sequences, as rows of ``mdp.enumerate()``.
        first_only : bool, default False
            Refused (``ValueError``).

        Returns
        -------
        draw, pair, coef : Tensor ``[T]``
            Batch, state-action pair and ``c_t = −∂loss/∂ log π(y_t|s_t)`` of each response token.
        """
        if first_only:
            raise ValueError("method: exchangeability needs an Estimator, not a loss callable")
        D, width = ids.shape
        rows = ids.reshape(-1)
        with torch.enable_grad():
            lp = self.pi_logprob[rows].clone().requires_grad_(True)
            total = lp.new_zeros(())
            for d in range(D):
                batch, _ = _stacked_batch(self.enum, ids[d:d + 1], self.group_size, self.fields)
                value = self.loss_fn(lp[d * width:(d + 1) * width], self.prepare(batch))
                if not isinstance(value, torch.Tensor) or value.dim() != 0 \
                        or not value.is_floating_point():
                    hint = (" (estimators.loss returns (loss, metrics): take its [0])"
                            if isinstance(value, tuple) else "")
                    raise TypeError(f"loss_fn: must return a floating-point scalar tensor, got "
                                    f"{getattr(value, 'shape', type(value).__name__)}{hint}")
                if value.requires_grad:
                    total = total + value.to(lp.dtype)
            if total.requires_grad:
                (coef,) = torch.autograd.grad(-total, lp, allow_unused=True)
                coef = torch.zeros_like(lp) if coef is None else coef
            else:                           # no batch's loss depends on the log-probs
                coef = torch.zeros_like(lp)
        sa = self.sa_index[rows]
        on = sa >= 0
        if not bool(torch.isfinite(coef[on]).all()):
            raise ValueError("loss_fn: its gradient with respect to the log-probs is not finite "
                             "on some enumerated batch")
        step = torch.arange(D).repeat_interleave(width)
        return step[:, None].expand_as(sa)[on], sa[on], coef[on]
