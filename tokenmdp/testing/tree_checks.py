"""Tree layout is memory, never meaning: the packed tree's loss and gradient are the expanded
paths'.

:func:`check_tree_layout_invariance` runs a model over an expanded tree batch (every
root-to-leaf path one sequence: the reference) and over packed trees
(:func:`~tokenmdp.tree_packing.pack_tree`, each node once, gathered back by
:func:`~tokenmdp.tree_training.packed_tree_logprobs`), in any expanded layout, any packing and
any split into micro-batches of whole trees (prepared once for the step, losses summed), and
compares loss and parameter gradient. :func:`estimators_accepting` lists the registry
estimators a batch can run (their fields are set), the ones to check on it.

The model needs ``token_logprobs(batch)`` (the expanded pass) and ``tree_token_outputs``
(the packed pass, :meth:`tokenmdp.model.MoETransformer.tree_token_outputs`): by default a
small float64 :class:`~tokenmdp.model.MoETransformer` (:func:`tree_check_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from tokenmdp import estimators as _est
from tokenmdp.batch import TokenBatch
from tokenmdp.model import ModelConfig, MoETransformer
from tokenmdp.testing.checks import (
    LossFn,
    _check_callables,
    _check_common,
    estimator_loss,
    estimator_prepare,
)
from tokenmdp.testing.report import InvarianceReport, _report, _tolerances
from tokenmdp.tree_packing import PackedTree
from tokenmdp.tree_training import packed_tree_logprobs
from tokenmdp.trees import TREE_NODE

__all__ = ["check_tree_layout_invariance", "estimators_accepting", "tree_check_model"]


def tree_check_model(batch: TokenBatch, *, seed: int = 0) -> MoETransformer:
    """A small MoE transformer for ``batch`` (its vocabulary), in the batch's dtype.

    Two layers, four experts, top-2 routing, width 16, initial scale 0.3 (log-probs far from
    uniform, so clipped and masked estimators have gradients).

    Parameters
    ----------
    batch : TokenBatch
        Its largest token id sizes the vocabulary.
    seed : int, default 0
        Seed of the weights.

    Returns
    -------
    MoETransformer
    """
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
    vocab = max(int(batch.tokens.max()) + 1 if batch.tokens.numel() else 2, 2)
    config = ModelConfig(vocab_size=vocab, d_model=16, n_layers=2, n_heads=2, n_experts=4,
                         top_k=2, expert_hidden=16, init_std=0.3, attention="sdpa")
    return MoETransformer(config, generator=torch.Generator().manual_seed(seed),
                          device=batch.device, dtype=batch.dtype)


def estimators_accepting(batch: TokenBatch) -> tuple[str, ...]:
    """Registry names whose ``prepare`` and ``loss`` find every field they read in ``batch``
    (the entries that need trees only for a batch with ``token_extras[TREE_NODE]``).

    Parameters
    ----------
    batch : TokenBatch
        A (tree) batch.

    Returns
    -------
    tuple of str
        In :func:`tokenmdp.estimators.names` order.
    """
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
    out = []
    tree_only = set(_est.names(trees=True))
    for name in _est.names(trees=None):
        if name in tree_only and TREE_NODE not in batch.token_extras:
            continue
        est = _est.get(name)
        fields = est.requires("prepare") + est.requires("loss")
        if all(getattr(batch, f, None) is not None or f in batch.token_extras for f in fields):
            out.append(name)
    return tuple(out)


def check_tree_layout_invariance(
    loss: LossFn | _est.Estimator, batch: TokenBatch,
    packings: Sequence[Callable[[TokenBatch], tuple[TokenBatch, PackedTree]]] = (),
    splits: Sequence[Callable[[TokenBatch], Sequence[tuple[TokenBatch, PackedTree]]]] = (), *,
    prepare: Callable[[TokenBatch], TokenBatch] | None = None, max_len: int | None = None,
    model: object = None, parameters: Iterable[torch.Tensor] | None = None, seed: int = 0,
    rtol: float | None = None, atol: float | None = None, raise_on_failure: bool = False,
) -> InvarianceReport:
    """Compare the expanded batch's loss and gradient with those through packed trees.

    Reference: ``prepare(batch)``, the model's expanded pass, ``loss``. Each packing
    ``f(batch) -> (batch', packed)`` is a whole step: ``prepare(batch')`` with the log-probs of
    the packed pass gathered to ``batch'``. Each split ``g(prepare(batch)) -> [(part, packed),
    ...]`` cuts the prepared step into micro-batches of whole trees whose losses are summed.

    Parameters
    ----------
    loss : callable ``(logprobs_RC, batch) -> scalar`` or Estimator
        The loss under test; an estimator stands for :func:`estimator_loss` and (unless
        ``prepare`` is given) :func:`estimator_prepare` with ``max_len``.
    batch : TokenBatch
        The reference step: an expanded tree batch (``token_extras[TREE_NODE]``).
    packings : sequence of callables ``batch -> (batch, PackedTree)``
        E.g. :class:`~tokenmdp.testing.tree_strategies.TreePacking`.
    splits : sequence of callables ``batch -> list of (batch, PackedTree)``
        E.g. :class:`~tokenmdp.testing.tree_strategies.TreeSplit`; together the parts hold every
        sequence once.
    prepare : callable ``batch -> batch``, optional
        Step preparation (advantages, loss weights).
    max_len : int, optional
        ``L_max`` of an estimator's ``prepare``.
    model : object, optional
        With ``tree_token_outputs(...)`` (the packed pass) and ``token_logprobs(batch)`` or a
        call ``model(batch)`` (the expanded pass); default :func:`tree_check_model`, seeded by
        ``seed``.
    parameters : iterable of tensors, optional
        What the gradient is taken with respect to (default: ``model.parameters()``).
    seed : int
        Seed of the default model.
    rtol, atol : float, optional
        Tolerances (default :func:`~tokenmdp.testing.default_tolerances` of ``batch.dtype``).
    raise_on_failure : bool
        Call :meth:`InvarianceReport.assert_ok` before returning.

    Returns
    -------
    InvarianceReport
    """
    if isinstance(loss, _est.Estimator):
        prepare = prepare or estimator_prepare(loss, max_len=max_len)
        loss = estimator_loss(loss)
    _check_common(loss, batch, prepare, raise_on_failure=raise_on_failure)
    packings = _check_callables("packings", packings) if packings else []
    splits = _check_callables("splits", splits) if splits else []
    if not packings and not splits:
        raise ValueError("packings, splits: give at least one packing or split")
    rtol, atol = _tolerances(batch, rtol, atol)
    model = tree_check_model(batch, seed=seed) if model is None else model
    if not callable(getattr(model, "tree_token_outputs", None)):
        raise TypeError(f"model: needs a tree_token_outputs method (the packed pass), "
                        f"{type(model).__name__} has none")
    expanded_fn = getattr(model, "token_logprobs", None) or model
    if not callable(expanded_fn):
        raise TypeError(f"model: needs token_logprobs(batch) or to be callable (the expanded "
                        f"pass), {type(model).__name__} is neither")
    if parameters is None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError("parameters: required when model is not a torch.nn.Module")
        parameters = model.parameters()
    params = [p for p in parameters]
    if not params or not all(isinstance(p, torch.Tensor) and p.requires_grad for p in params):
        raise ValueError("parameters: expected at least one tensor, each with requires_grad=True")
    prepare = prepare or (lambda b: b)

    def value_and_grad(parts) -> tuple[torch.Tensor, torch.Tensor]:
        total = sum(loss(lp_fn(part), part) for part, lp_fn in parts)
        if not isinstance(total, torch.Tensor) or total.dim() != 0:
            raise TypeError(f"loss: must return a scalar tensor, got "
                            f"{getattr(total, 'shape', type(total).__name__)}")
        grads = (torch.autograd.grad(total, params, allow_unused=True) if total.requires_grad
                 else [None] * len(params))
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                          for p, g in zip(params, grads)])
        return total.detach(), flat.detach()

    def through(packed: PackedTree):
        return lambda part: packed_tree_logprobs(model, part, packed)

    step = prepare(batch)
    reference = value_and_grad([(step, expanded_fn)])
    cases = []
    for f in packings:
        laid, packed = _pair(f"packings: {f!r}", f(batch))
        cases.append((repr(f), value_and_grad([(prepare(laid), through(packed))])))
    for g in splits:
        parts = g(step)
        if isinstance(parts, tuple) or not isinstance(parts, Sequence) or not parts:
            raise TypeError(f"splits: {g!r} must return a non-empty list of (batch, PackedTree)")
        parts = [_pair(f"splits: {g!r}", p) for p in parts]
        if sum(p.num_sequences for p, _ in parts) != step.num_sequences:
            raise ValueError(f"splits: {g!r} returned {sum(p.num_sequences for p, _ in parts)} "
                             f"sequences for a step of {step.num_sequences}")
        cases.append((repr(g), value_and_grad([(p, through(k)) for p, k in parts])))
    return _report(reference, cases, rtol, atol, raise_on_failure)


def _pair(name: str, value: object) -> tuple[TokenBatch, PackedTree]:
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], TokenBatch)
            and isinstance(value[1], PackedTree)):
        raise TypeError(f"{name} must return (TokenBatch, PackedTree) pairs, got "
                        f"{type(value).__name__}")
    return value
