"""Property-based invariance checks that users can point at their own loss function.

Two properties every RL loss over packed batches should have (docs: Concepts › The TokenBatch):

1. **layout invariance**: the loss and its gradient do not change when the same step is laid
   out differently (padded, flat, packed at any row capacity, sequences renumbered);
2. **micro-batch invariance**: with the step prepared once (global counts), the micro-batch
   losses of any split sum to the full-step loss, value and gradient.

:mod:`tokenmdp.testing.strategies` generates the cases with Hypothesis (``token_batches``,
``layouts``, ``micro_batch_splits``, ``estimators``, ``mdps``), :mod:`tokenmdp.testing.checks`
checks them (``check_layout_invariance``, ``check_micro_batch_invariance``) and returns an
:class:`InvarianceReport` with the largest differences. A loss function is any
``loss_fn(logprobs_RC, batch) -> scalar tensor``; the gradient is taken through a default
tabular model (:class:`TokenTable`), or through your own (``model=``, ``parameters=``).

Point it at your own loss (here a token mean over each micro-batch's own tokens, the bug these
checks exist to catch)::

    import torch
    from hypothesis import given, settings
    from tokenmdp import testing

    def my_loss(logprobs_RC, batch):
        mask = batch.loss_mask
        return -(batch.advantage * logprobs_RC)[mask].sum() / mask.sum().clamp(min=1)

    @settings(max_examples=50, deadline=None)
    @given(testing.token_batches(), testing.layouts(), testing.micro_batch_splits())
    def test_my_loss(batch, layout, split):
        testing.check_layout_invariance(my_loss, batch, [layout], raise_on_failure=True)
        testing.check_micro_batch_invariance(my_loss, batch, [split]).assert_ok()

The second check fails on ``my_loss`` (Hypothesis shrinks it to two short sequences split in
two micro-batches); the fix is to normalize with the step's count, decided before the split,
as ``batch.loss_weight`` does: ``-(batch.loss_weight * batch.advantage * logprobs_RC).sum()``
after ``prepare=`` has set it (e.g. :func:`estimator_prepare`). The registered estimators are
wrapped by :func:`estimator_loss` and :func:`estimator_prepare`;
:func:`per_micro_batch_token_mean` is the named counter-example.

Hypothesis is needed for the strategies only (``pip install hypothesis``); the checks work
without it.

A third property is for branching rollouts (:mod:`tokenmdp.trees`): **tree layout is memory,
never meaning** — the loss and gradient through a packed tree (each shared prefix once,
:mod:`tokenmdp.tree_packing`) equal those of its expanded root-to-leaf paths, over packings and
micro-batches of whole trees: :func:`check_tree_layout_invariance`
(:mod:`tokenmdp.testing.tree_checks`), with the strategies ``response_trees``,
``tree_batches``, ``tree_packings`` and ``tree_splits``
(:mod:`tokenmdp.testing.tree_strategies`)::

    @settings(max_examples=20, deadline=None)
    @given(testing.tree_batches(), testing.tree_packings(), testing.tree_splits())
    def test_grpo_on_trees(batch, packing, split):
        testing.check_tree_layout_invariance(estimators.get("grpo"), batch, [packing],
                                             [split], raise_on_failure=True)

Floors, top to bottom::

    tree_checks
    checks, tree_strategies
    lattice_strategies, models, report, strategies

It imports the narrow waist, the estimators, the exact world (for MDP strategies and the
default model), the tree packing and, for the tree check's default model, the MoE transformer;
never the trainer or the course.
"""

from tokenmdp.testing.checks import (
    FLOAT32_ATOL,
    FLOAT32_RTOL,
    FLOAT64_ATOL,
    FLOAT64_RTOL,
    LossFn,
    check_layout_invariance,
    check_micro_batch_invariance,
    estimator_loss,
    estimator_prepare,
    per_micro_batch_token_mean,
)
from tokenmdp.testing.models import TokenTable
from tokenmdp.testing.report import InvarianceReport, default_tolerances
from tokenmdp.testing.tree_checks import (
    check_tree_layout_invariance,
    estimators_accepting,
    tree_check_model,
)

_STRATEGIES = ("LAYOUT_KINDS", "Layout", "MicroBatchSplit", "estimators", "layouts", "mdps",
               "micro_batch_splits", "token_batches")
_TREE_STRATEGIES = ("TreePacking", "TreeSplit", "response_trees", "tree_batches",
                    "tree_packings", "tree_splits")

__all__ = [
    "FLOAT32_ATOL", "FLOAT32_RTOL", "FLOAT64_ATOL", "FLOAT64_RTOL", "InvarianceReport", "LossFn",
    "TokenTable", "check_layout_invariance", "check_micro_batch_invariance", "default_tolerances",
    "estimator_loss", "estimator_prepare", "per_micro_batch_token_mean",
    "check_tree_layout_invariance", "estimators_accepting", "tree_check_model", *_STRATEGIES,
    *_TREE_STRATEGIES,
]


def __getattr__(name: str):
    # The strategies import Hypothesis, a test-time dependency: load them on first use.
    if name in _STRATEGIES or name in _TREE_STRATEGIES:
        try:
            if name in _STRATEGIES:
                from tokenmdp.testing import strategies as module
            else:
                from tokenmdp.testing import tree_strategies as module
        except ModuleNotFoundError as err:
            if err.name != "hypothesis":
                raise
            raise ImportError(f"tokenmdp.testing.{name} needs Hypothesis: pip install "
                              "hypothesis") from err
        return getattr(module, name)
    raise AttributeError(f"module 'tokenmdp.testing' has no attribute {name!r}")
