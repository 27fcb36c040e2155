"""Branching (tree) rollouts in the exact world: samplers, the exact law, moments at equal budget.

A tree rollout samples one prompt's responses so that they share prefixes: generate once, fork.
Here its sampling law is known exactly, so every estimator's mean and covariance over tree draws
are computable and comparable with an i.i.d. group at equal generated-token budget (issue 28).
A tree is data in the one batch type (:mod:`tokenmdp.trees`): the expanded batch of its leaves
with ``token_extras["tree_node"]``.

Floors, top to bottom::

    comparison
    moments
    gradients, law, sampler
    process

* the fork schedules are :mod:`tokenmdp.tree_schedules`' (the trainer's engine forks by the same
  ones): :class:`~tokenmdp.tree_schedules.FixedForks`,
  :class:`~tokenmdp.tree_schedules.RandomForks`, :class:`~tokenmdp.tree_schedules.EntropyForks`
  (TreeRL, arXiv 2506.11902);
* :mod:`~tokenmdp.exact.branching.process` — each schedule's growth process, written once for
  sampling and enumeration (every choice through one ``choose``);
* :mod:`~tokenmdp.exact.branching.sampler` — :func:`sample_trees` (with an explicit generator):
  :class:`~tokenmdp.trees.ResponseTree` s, ``log μ`` per node, probabilities, the expanded batch;
  :mod:`~tokenmdp.exact.branching.law` — :func:`tree_law`, every tree with its probability, and
  the leaves' exact marginal law; :mod:`~tokenmdp.exact.branching.gradients` — the lab's
  per-batch gradients on tree batches;
* :mod:`~tokenmdp.exact.branching.moments` — :func:`tree_moments` / :class:`TreeWorkspace`:
  exact or Monte Carlo :class:`TreeMoments` (a :class:`~tokenmdp.exact.Moments` with the cost in
  generated tokens), :func:`at_budget`;
* :mod:`~tokenmdp.exact.branching.comparison` — :func:`compare_at_budget`: trees against i.i.d.
  groups at equal generated-token budget.

It imports the exact world and lab below it, :mod:`tokenmdp.trees`,
:mod:`tokenmdp.tree_schedules` and the estimators.
"""

from tokenmdp.exact.branching.comparison import BudgetRow, compare_at_budget
from tokenmdp.exact.branching.law import TreeLaw, tree_law
from tokenmdp.exact.branching.moments import TreeMoments, TreeWorkspace, at_budget, tree_moments
from tokenmdp.exact.branching.sampler import TreeSample, sample_trees

__all__ = ["BudgetRow", "TreeLaw", "TreeMoments", "TreeSample", "TreeWorkspace", "at_budget",
           "compare_at_budget", "sample_trees", "tree_law", "tree_moments"]
