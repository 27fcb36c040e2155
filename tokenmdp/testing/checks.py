"""Invariance checks for a loss over a :class:`~tokenmdp.batch.TokenBatch`: value and gradient.

Layout is memory, never meaning, and aggregation is decided once per optimizer step
(docs: Concepts › The TokenBatch). So a correct loss has

* the same value and the same parameter gradient in every layout of a step (padded, flat,
  packed at any row capacity, sequences renumbered): :func:`check_layout_invariance`;
* micro-batch losses that *sum* to the full-step loss, value and gradient, for any split,
  when the step is prepared once on the full batch first: :func:`check_micro_batch_invariance`.

Both run a model (a function ``batch -> logprobs_RC`` with parameters) and the user's
``loss_fn(logprobs_RC, batch) -> scalar``, differentiate with respect to the model's parameters
and return an :class:`InvarianceReport` with the largest differences
(:mod:`tokenmdp.testing.report`: the report and the default tolerances). The default model is a
:class:`TokenTable` (a free logit vector per prompt, position and previous token), or the exact
:class:`~tokenmdp.exact.TabularPolicy` when an MDP is given (:mod:`tokenmdp.testing.models`).
Both modules' names are re-exported here.

:func:`per_micro_batch_token_mean` is the named counter-example (each micro-batch normalized by
its own token count), on which the micro-batch check fails.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterable, Sequence

import torch

from tokenmdp import estimators as _est
from tokenmdp.batch import TokenBatch
from tokenmdp.exact import TokenMDP
from tokenmdp.testing.models import _resolve_model
from tokenmdp.testing.report import (
    FLOAT32_ATOL,
    FLOAT32_RTOL,
    FLOAT64_ATOL,
    FLOAT64_RTOL,
    InvarianceReport,
    _report,
    _tolerances,
)

__all__ = ["FLOAT32_ATOL", "FLOAT32_RTOL", "FLOAT64_ATOL", "FLOAT64_RTOL", "LossFn",
           "check_layout_invariance", "check_micro_batch_invariance", "estimator_loss", "estimator_prepare",
           "per_micro_batch_token_mean"]

# typing's alias, not collections.abc's: only it takes a __doc__ (read by help() and numpydoc)
LossFn = typing.Callable[[torch.Tensor, TokenBatch], torch.Tensor]
LossFn.__doc__ = """``loss_fn(logprobs_RC, batch) -> scalar tensor``, differentiable in ``logprobs_RC``.

The shape of every loss the checks take (the parameters below are those of such a function).

Parameters
----------
logprobs_RC : Tensor ``[R, C]``
    The model's log-probs of ``batch``'s tokens (0 on padding), differentiable.
batch : TokenBatch
    The step, a re-layout of it, or one micro-batch (:func:`check_micro_batch_invariance`).

Returns
-------
Tensor
    The scalar loss of ``batch``.
"""
# ... and the signature it documents is that of a conforming loss, not the alias's own call
LossFn.__signature__ = inspect.Signature(
    [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
     for name in ("logprobs_RC", "batch")])


# ------------------------------------------------------------------------------ estimators
def estimator_prepare(estimator: _est.Estimator, *, max_len: int | None = None
                      ) -> Callable[[TokenBatch], TokenBatch]:
    """``batch -> estimators.prepare(batch, estimator, max_len=max_len)`` (the step's weights).

    Parameters
    ----------
    estimator : Estimator
        A registry estimator or any composition.
    max_len : int, optional
        ``L_max`` for :func:`~tokenmdp.estimators.prepare` (needed by ``Aggregation.CONSTANT``).

    Returns
    -------
    callable ``batch -> batch``
        The ``prepare=`` argument of the checks.
    """
    _check_estimator(estimator)
    return lambda batch: _est.prepare(batch, estimator, max_len=max_len)


def estimator_loss(estimator: _est.Estimator) -> LossFn:
    """``(logprobs_RC, batch) -> estimators.loss(logprobs_RC, batch, estimator)[0]``.

    Parameters
    ----------
    estimator : Estimator
        A registry estimator or any composition.

    Returns
    -------
    LossFn
        ``estimator``'s loss as the checks' ``loss_fn``.
    """
    _check_estimator(estimator)
    return lambda logprobs_RC, batch: _est.loss(logprobs_RC, batch, estimator)[0]


def per_micro_batch_token_mean(estimator: _est.Estimator) -> LossFn:
    """COUNTER-EXAMPLE: each micro-batch normalized by its own loss tokens.

    :func:`tokenmdp.estimators.per_micro_batch_token_mean_loss` (``estimator``'s loss with
    token-mean weights recomputed from the micro-batch at hand, ignoring ``loss_weight``) as a
    ``loss_fn``. On a whole step it equals the token-mean loss. Accumulated as frameworks did,
    the mean of the micro-batch means (``check_micro_batch_invariance(...,
    average_micro_batches=True)``), it is the step's token mean only when every micro-batch
    holds the same number of loss tokens; summed, only with one micro-batch. Either way
    :func:`check_micro_batch_invariance` fails on it.

    Parameters
    ----------
    estimator : Estimator
        A registry estimator or any composition.

    Returns
    -------
    LossFn
        The counter-example loss as a ``loss_fn``.
    """
    _check_estimator(estimator)

    def loss_fn(logprobs_RC: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        return _est.per_micro_batch_token_mean_loss(logprobs_RC, batch, estimator)[0]
    return loss_fn


# ------------------------------------------------------------------------------ the checks
def check_layout_invariance(
    loss_fn: LossFn, batch: TokenBatch, layout_fns: Sequence[Callable[[TokenBatch], TokenBatch]],
    *, prepare: Callable[[TokenBatch], TokenBatch] | None = None, model: object = None,
    parameters: Iterable[torch.Tensor] | None = None, mdp: TokenMDP | None = None, seed: int = 0,
    rtol: float | None = None, atol: float | None = None, raise_on_failure: bool = False,
) -> InvarianceReport:
    """Compare loss and gradient on ``batch`` with those on every ``layout_fn(batch)``.

    Each layout holds the whole step, so ``prepare`` (if given) runs on each layout separately:
    it is checked too.

    Parameters
    ----------
    loss_fn : callable ``(logprobs_RC, batch) -> scalar tensor``
        The loss under test.
    batch : TokenBatch
        The reference step.
    layout_fns : sequence of callables ``batch -> batch``
        Re-layouts of the step (e.g. from :func:`tokenmdp.testing.layouts`).
    prepare : callable ``batch -> batch``, optional
        Step preparation (advantages, loss weights), e.g. :func:`estimator_prepare`.
    model : callable ``batch -> logprobs_RC``, or an object with ``token_logprobs(batch)``
        Default: :class:`TokenTable` for ``batch`` (seeded by ``seed``), or
        ``TabularPolicy(mdp)`` when ``mdp`` is given.
    parameters : iterable of tensors, optional
        What the gradient is taken with respect to (default: ``model.parameters()``).
    mdp : TokenMDP, optional
        Use the exact tabular policy of this MDP as the model (float64 batches of its sequences).
    seed : int
        Seed of the default model's initial parameters.
    rtol, atol : float, optional
        Tolerances (default :func:`default_tolerances` of ``batch.dtype``).
    raise_on_failure : bool
        Call :meth:`InvarianceReport.assert_ok` before returning.

    Returns
    -------
    InvarianceReport
    """
    _check_common(loss_fn, batch, prepare, raise_on_failure=raise_on_failure)
    layout_fns = _check_callables("layout_fns", layout_fns)
    rtol, atol = _tolerances(batch, rtol, atol)
    logprobs_fn, params = _resolve_model(model, parameters, mdp, batch, seed)
    prepare = prepare or (lambda b: b)

    def evaluate(step: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return _loss_and_grad([step], loss_fn, logprobs_fn, params)

    reference = evaluate(prepare(batch))
    cases = [(repr(f), evaluate(prepare(_checked_output("layout_fn", f(batch))))) for f in layout_fns]
    return _report(reference, cases, rtol, atol, raise_on_failure)


def check_micro_batch_invariance(
    loss_fn: LossFn, batch: TokenBatch, splits: Sequence[Callable[[TokenBatch], Sequence[TokenBatch]]],
    *, prepare: Callable[[TokenBatch], TokenBatch] | None = None, model: object = None,
    parameters: Iterable[torch.Tensor] | None = None, mdp: TokenMDP | None = None, seed: int = 0,
    rtol: float | None = None, atol: float | None = None, raise_on_failure: bool = False,
    average_micro_batches: bool = False,
) -> InvarianceReport:
    """Compare the full-step loss and gradient with the *sum* over micro-batches, for each split.

    The right protocol: ``prepare`` runs once, on the full ``batch`` (global counts, whole
    groups); each split cuts the prepared batch; ``loss_fn`` runs on every micro-batch and the
    micro-batch losses are summed (as gradient accumulation sums gradients).

    Parameters
    ----------
    loss_fn : callable ``(logprobs_RC, micro_batch) -> scalar tensor``
        The per-micro-batch loss under test.
    batch : TokenBatch
        The full step.
    splits : sequence of callables ``batch -> list of TokenBatch``
        Each returns micro-batches that together hold every sequence of its input once (e.g.
        from :func:`tokenmdp.testing.micro_batch_splits`).
    prepare, model, parameters, mdp, seed, rtol, atol, raise_on_failure
        As in :func:`check_layout_invariance`.
    average_micro_batches : bool
        Combine the micro-batch losses by their mean instead of their sum (gradient
        accumulation that divides by the number of micro-batches), to check a trainer that
        does so. A loss that is right for summing fails then, unless a split has one part.

    Returns
    -------
    InvarianceReport
    """
    _check_common(loss_fn, batch, prepare, raise_on_failure=raise_on_failure,
                  average_micro_batches=average_micro_batches)
    splits = _check_callables("splits", splits)
    rtol, atol = _tolerances(batch, rtol, atol)
    logprobs_fn, params = _resolve_model(model, parameters, mdp, batch, seed)
    step = prepare(batch) if prepare is not None else batch
    reference = _loss_and_grad([step], loss_fn, logprobs_fn, params)
    cases = []
    for split in splits:
        parts = split(step)
        if isinstance(parts, TokenBatch) or not isinstance(parts, Sequence) or not parts:
            raise TypeError(f"splits: {split!r} must return a non-empty list of TokenBatch")
        parts = [_checked_output("splits", p) for p in parts]
        if sum(p.num_sequences for p in parts) != step.num_sequences:
            raise ValueError(f"splits: {split!r} returned {sum(p.num_sequences for p in parts)} "
                             f"sequences for a step of {step.num_sequences}")
        value, grad = _loss_and_grad(parts, loss_fn, logprobs_fn, params)
        if average_micro_batches:
            value, grad = value / len(parts), grad / len(parts)
        cases.append((repr(split), (value, grad)))
    return _report(reference, cases, rtol, atol, raise_on_failure)


# ------------------------------------------------------------------------------ internals
def _check_estimator(estimator) -> None:
    if not isinstance(estimator, _est.Estimator):
        raise TypeError(f"estimator: expected an Estimator, got {type(estimator).__name__}")


def _check_common(loss_fn, batch, prepare, **flags: bool) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable (logprobs_RC, batch) -> loss, got "
                        f"{type(loss_fn).__name__}")
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
    if prepare is not None and not callable(prepare):
        raise TypeError(f"prepare: expected a callable batch -> batch, got {type(prepare).__name__}")


def _check_callables(name: str, fns) -> list:
    if callable(fns) or not isinstance(fns, Iterable):
        raise TypeError(f"{name}: expected a sequence of callables (wrap a single one in a list)")
    fns = list(fns)
    if not fns:
        raise ValueError(f"{name}: expected at least one")
    for f in fns:
        if not callable(f):
            raise TypeError(f"{name}: {f!r} is not callable")
    return fns


def _checked_output(name: str, value: object) -> TokenBatch:
    if not isinstance(value, TokenBatch):
        raise TypeError(f"{name}: must return TokenBatch objects, got {type(value).__name__}")
    return value


def _loss_and_grad(parts, loss_fn, logprobs_fn, params) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of ``loss_fn`` over ``parts`` and its gradient, flattened, both detached."""
    total = None
    for part in parts:
        value = loss_fn(logprobs_fn(part), part)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise TypeError(f"loss_fn: must return a scalar tensor, got "
                            f"{getattr(value, 'shape', type(value).__name__)}")
        total = value if total is None else total + value
    if total.requires_grad:
        grads = torch.autograd.grad(total, params, allow_unused=True)
    else:  # a loss that does not touch the parameters (e.g. no loss tokens)
        grads = [None] * len(params)
    flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                      for p, g in zip(params, grads)])
    return total.detach(), flat.detach()
