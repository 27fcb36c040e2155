"""The exercises of tutorial 9 (Mixture-of-Experts and routing replay), registered in
:mod:`tokenmdp.course.exercises.registry`.

The setup is :func:`tokenmdp.course.tutorials.t09.tr09_world`: the copy task, its float64 MoE policy
``π_old`` (top-2 of 4 experts) and an ``fp64`` engine that differs only in its expert selection
(router-score noise ``TR09_SELECTION_NOISE``). Each expected value is computed by the package
along a route the tutorial does not ask the student to take: the flip fraction through the
trainer's own counter (:func:`~tokenmdp.rl.mismatch.routing_mismatch_counts`), the KL of whole
responses over the expected length, R3's target through the engine's own gradient.
"""

from __future__ import annotations

import torch

from tokenmdp.course.exercises.registry import EXACT_TOL, SHARE_TOL, _exercise

#: The engine of the exercises: router-score noise of this standard deviation, selection only.
TR09_SELECTION_NOISE = 1.0


def _world():
    from tokenmdp.course.tutorials.t09 import tr09_world

    return tr09_world(TR09_SELECTION_NOISE)


@_exercise("tr09_flip_fraction",
           quantity="the expected share of (token, layer) routing records where the engine and "
                    "π_old pick different experts, in responses sampled by μ",
           tolerance=SHARE_TOL, tolerance_name="SHARE_TOL",
           hint="Weight each enumerated response by D(x) μ(y|x); count the records of every token "
                "but the last (the engine never routes it), prompt tokens included, in each "
                "layer; divide the weighted number of differing expert sets by the weighted "
                "number of records.")
def _tr09_flip_fraction() -> float:
    return _world().flip_fraction()


@_exercise("tr09_kl_per_token",
           quantity="KL(μ ‖ π_old) per token, without routing replay",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Average the per-state KL(μ(·|s) ‖ π_old(·|s)) over the states μ visits, with "
                "the weights d^μ(s) / Σ_s d^μ(s) (state_logprobs and state_visitation of μ).")
def _tr09_kl_per_token() -> float:
    from tokenmdp.exact import expected_length, sequence_kl

    world = _world()
    with torch.no_grad():
        kl = sequence_kl(world.mdp, world.mu, world.old_policy("none"))
        return float(kl / expected_length(world.mdp, world.mu))


@_exercise("tr09_r3_target_shift",
           quantity="‖∇J(π_old under R3) − ∇J(π_old)‖ / ‖∇J(π_old)‖ at the first mini-batch",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="R3 replaces the policy whose gradient is followed by the one routed as the "
                "engine routed: the shift is between the true gradients of the replayed and the "
                "freely routed policies, relative to the latter.")
def _tr09_r3_target_shift() -> float:
    from tokenmdp.exact import gradient

    world = _world()
    true = gradient(world.mdp, world.old)
    engine = gradient(world.mdp, world.engine_at(world.old))   # = the R3 policy's, exactly
    return float((engine - true).norm() / true.norm())
