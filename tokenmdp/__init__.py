"""tokenmdp: the estimator theory of RL for language models, exact and runnable.

The package is a house: each floor imports only the floors below it, never sideways or up.

Floors, top to bottom::

    cli
    course
    integrations
    reports, rl, testing, interop
    exact, model
    estimators, tree_training
    tree_packing
    packing, distributed, trees
    batch
    _batch_validation, placement, tree_schedules

* the narrow waist, at the bottom — :mod:`tokenmdp.batch` (:class:`TokenBatch`, the one batch
  type both worlds share; its checks in ``_batch_validation``), :mod:`tokenmdp.placement` (where
  each sequence goes), :mod:`tokenmdp.packing` (layouts and micro-batches),
  :mod:`tokenmdp.trees` (branching rollouts: which tokens of a batch are one tree node),
  :mod:`tokenmdp.tree_schedules` (where a tree forks, the same schedules in both worlds) and
  :mod:`tokenmdp.distributed` (step counts over data-parallel ranks); above them
  :mod:`tokenmdp.tree_packing` (a tree's nodes packed once, gathered back to the expanded
  paths) and :mod:`tokenmdp.tree_training` (the model's pass over a packed tree, micro-batches
  of whole trees);
* :mod:`tokenmdp.estimators` — every estimator as a composition of pure functions of tensors,
  the published ones by name in its registry;
* the two worlds — :mod:`tokenmdp.exact` (an enumerable token MDP and the lattice: the true
  objective, gradient and the exact bias and variance of any estimator) and
  :mod:`tokenmdp.model` (the tiny MoE transformer with routing record and replay);
* the front ends — :mod:`tokenmdp.rl` (the rollout engine, routing replay R2/R3 and the
  trainer), :mod:`tokenmdp.testing` (hypothesis strategies and invariance checks),
  :mod:`tokenmdp.interop` (Hugging Face batches, logits and models), :mod:`tokenmdp.reports`
  (the compare table, its hints, the estimator cards, plots);
* :mod:`tokenmdp.integrations` — a peer's configuration (TRL's ``GRPOConfig``, verl's actor
  config) as the estimator it computes, with its card and ``compare`` row; over the front ends;
* :mod:`tokenmdp.course` — the tutorials' setups, printouts, exercises (``tokenmdp.check``,
  loaded on first use) and student editions; :mod:`tokenmdp.cli`, the command line, on top.

So the estimators know no model, the exact world knows no trainer, the model knows no trainer,
and nothing below the course knows it exists.

Shape-suffix legend used in tensor names where a shape is not obvious:

* ``_RC``  rows x row capacity of a :class:`TokenBatch` (every per-token tensor);
* ``_S``   one entry per sequence (indexed by ``sequence_id``);
* ``_N``   a flat list of items (states, sequences of an enumeration, ...);
* ``_V``   one entry per vocabulary token;
* ``_P``   one entry per prompt.
"""

from tokenmdp.batch import TokenBatch

__version__ = "0.1.0"
__all__ = ["TokenBatch", "__version__", "check"]


def __getattr__(name: str):
    # ``tokenmdp.check`` (the tutorials' exercise checker) is loaded on first use, so that
    # ``import tokenmdp`` stays light and the lower layers never import the upper ones.
    if name == "check":
        from tokenmdp.course.exercises import check

        return check
    raise AttributeError(f"module 'tokenmdp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"check"})
