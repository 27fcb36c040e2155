"""The exercises of tutorial 11 (branching rollouts), registered in
:mod:`~tokenmdp.course.exercises.registry`.

The setup is the tutorial's: the course's MDP and policy (:func:`tokenmdp.course.setups.copy_task`)
as the sampler (on-policy), one tree of ``G = 4`` nominal leaves per step. The expected values come
from the exact law of the trees (:func:`tokenmdp.exact.branching.tree_law`) and the library's
exact tree moments (:class:`tokenmdp.exact.branching.TreeWorkspace`), routes the tutorial asks
the student not to take (the student writes each from ``E|y|``, a leaf law or ``∇J``); the tests
take a third (sums over the trees written out by hand). The true option of each prediction
(``tr11_predict_*``) is computed from the same setup.
"""

from __future__ import annotations

import functools

import torch

from tokenmdp.course.exercises.registry import EXACT_TOL, _exercise, _prediction, expected
from tokenmdp.course.setups import copy_task
from tokenmdp.exact import expected_length

#: The fork schedules of the exercises, in their text form: one level, two levels.
TR11_ONE_LEVEL = ((1,), (4,))
TR11_TWO_LEVEL = ((0, 1), (2, 2))
#: The saving that exercise 1's prediction compares with (tokens of an i.i.d. group of 4 minus
#: those of a ``fixed:1x4`` tree).
TR11_SAVING = 3.0


@functools.cache
def _workspace():
    from tokenmdp.exact.branching import TreeWorkspace

    mdp, pi = copy_task()
    return TreeWorkspace(mdp, pi)


def _schedule(spec):
    from tokenmdp.tree_schedules import FixedForks

    return FixedForks(*spec)


@_exercise("tr11_generated_tokens",
           quantity="the expected generated tokens of one fixed:1x4 tree on the copy task "
                    "(tutorial 11, exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Count the nodes: the first token once, then four continuations of it; after an "
                "EOS first token the continuations are empty. Write it with E|y|.")
def _tr11_generated_tokens() -> float:
    return _workspace().law(_schedule(TR11_ONE_LEVEL)).expected("generated_tokens")


@_prediction("tr11_predict_tree_saving",
             question="Does a fixed:1x4 tree generate fewer, exactly or more than 3 tokens less "
                      "than an i.i.d. group of 4, on average?",
             options=("fewer", "exactly", "more"),
             hint="Compare the two counts for a given first token, EOS included: how many copies "
                  "of the first token does the group generate that the tree does not?")
def _tr11_predict_tree_saving() -> str:
    mdp, pi = copy_task()
    with torch.no_grad():
        group = 4 * float(expected_length(mdp, pi))
    saving = group - expected("tr11_generated_tokens")
    if abs(saving - TR11_SAVING) < 1e-9:
        return "exactly"
    return "fewer" if saving < TR11_SAVING else "more"


@_exercise("tr11_two_level_bias",
           quantity="the relative bias ‖E ĝ − ∇J‖/‖∇J‖ of leaf-level REINFORCE (leaves averaged "
                    "1/n) on fixed:0x2,1x2 trees (tutorial 11, exercise 2)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="The mean of a leaf-level estimator depends only on how often each response is a "
                "leaf: E ĝ = Σ_y q(y) R(y) σ(y) with q the law of a leaf picked uniformly among "
                "the tree's leaves, not μ.")
def _tr11_two_level_bias() -> float:
    return _workspace().moments("reinforce", _schedule(TR11_TWO_LEVEL),
                                method="exact").relative_bias


@_prediction("tr11_predict_two_level_bias",
             question="On fixed:0x2,1x2 trees, is leaf-level REINFORCE (leaves averaged 1/n) "
                      "unbiased or biased?",
             options=("unbiased", "biased"),
             hint="A branch that ends before the second fork leaves one leaf where the others "
                  "leave two: is it weighted as the two slots it stands for?")
def _tr11_predict_two_level_bias() -> str:
    return "biased" if expected("tr11_two_level_bias") > 1e-9 else "unbiased"


@_exercise("tr11_stem_cosine",
           quantity="the cosine between RLOO's expected gradient on fixed:1x4 trees and ∇J "
                    "(tutorial 11, exercise 3)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="The leaf advantages of a tree sum to zero, so the shared first token gets no "
                "weight; below it the four continuations are an i.i.d. group, for which RLOO is "
                "unbiased. Which components of ∇J survive?")
def _tr11_stem_cosine() -> float:
    return _workspace().moments("rloo", _schedule(TR11_ONE_LEVEL), method="exact").cosine


@_prediction("tr11_predict_stem_gradient",
             question="On fixed:1x4 trees, is RLOO's expected gradient on the prompt states' "
                      "logits zero, smaller than ∇J's there, or unchanged?",
             options=("zero", "smaller", "unchanged"),
             hint="Every leaf of a tree that forked shares the first token; what is the sum of "
                  "the leaves' leave-one-out advantages?")
def _tr11_predict_stem_gradient() -> str:
    ws = _workspace()
    m = ws.moments("rloo", _schedule(TR11_ONE_LEVEL), method="exact")
    mdp = ws.mdp
    first = torch.zeros(ws.policy.table.shape, dtype=torch.bool)
    first[:mdp.num_prompts] = True
    first = first.reshape(-1)
    got, true = m.mean[first], ws.tables.true_grad[first]
    if float(got.abs().max()) < 1e-12:
        return "zero"
    if float((got - true).abs().max()) < 1e-12:
        return "unchanged"
    return "smaller"
