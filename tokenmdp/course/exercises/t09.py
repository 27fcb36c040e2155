"""The exercises of tutorial 9 (Mixture-of-Experts and routing replay), registered in
:mod:`tokenmdp.course.exercises.registry`.

The setup is :func:`tokenmdp.course.tutorials.t09.tr09_world`: the copy task, its float64 MoE policy
``π_old`` (top-2 of 4 experts) and an ``fp64`` engine that differs only in its expert selection
(router-score noise ``TR09_SELECTION_NOISE``). Each expected value is computed by the package
along a route the tutorial does not ask the student to take: the flip fraction through the
trainer's own counter (:func:`~tokenmdp.rl.mismatch.routing_mismatch_counts`), the KL of whole
responses over the expected length, R3's target through the engine's own gradient. The true
option of each prediction (``tr09_predict_*``) is computed from the same world.
"""

from __future__ import annotations

import torch

from tokenmdp.course.exercises.registry import (
    EXACT_TOL,
    SHARE_TOL,
    _exercise,
    _nearest_option,
    _prediction,
    expected,
)

#: The engine of the exercises: router-score noise of this standard deviation, selection only.
TR09_SELECTION_NOISE = 1.0
#: The threshold of the prediction on the KL per token (nats).
TR09_KL_THRESHOLD = 1e-2
#: The options of the prediction on R3's target shift, as fractions of ‖∇J(π_old)‖.
TR09_SHIFT_SIZES = {"1%": 0.01, "10%": 0.1, "30%": 0.3}


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


def _uniform_flip_share(world) -> float:
    """The share of flipped records among all enumerated responses, each counted once (every
    token but the last, prompt tokens included), through the trainer's own counter."""
    from tokenmdp.rl.mismatch import routing_mismatch_counts

    enum = world.mdp.enumerate()
    last_R = enum.sequence_lengths_total() - 1
    keep_RC = torch.arange(enum.tokens.shape[1])[None, :] < last_R[:, None]
    engine = torch.where(keep_RC[..., None, None], world.engine_routing, -1)
    differ, compared = routing_mismatch_counts(engine, world.old_routing)
    return differ / compared


@_prediction("tr09_predict_flip_weighting",
             question="For the σ = 1 engine, is the flip fraction under μ's sampling larger or "
                      "smaller than the share of flipped records among all enumerated responses, "
                      "each counted once?",
             options=("larger", "smaller"),
             hint="The two shares weigh the same records differently: ask which responses μ makes "
                  "likely, and whether their records flip more or less often than those of the "
                  "long, unlikely responses that dominate the enumeration.")
def _tr09_predict_flip_weighting() -> str:
    world = _world()
    return "larger" if world.flip_fraction() > _uniform_flip_share(world) else "smaller"


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


@_prediction("tr09_predict_kl_per_token_size",
             question="For the σ = 1 engine, most of whose routing records flip, is "
                      "KL(μ ‖ π_old) per token above or below 10⁻² nats?",
             options=("above", "below"),
             hint="A flip changes which experts compute a token, not necessarily its next-token "
                  "distribution: ask how different the outputs of two experts of the same kind "
                  "are, when both are gated by the softmax of the true scores.")
def _tr09_predict_kl_per_token_size() -> str:
    return "above" if expected("tr09_kl_per_token") > TR09_KL_THRESHOLD else "below"


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


@_prediction("tr09_predict_r3_shift_size",
             question="Relative to ‖∇J(π_old)‖, is the distance between R3's gradient at the "
                      "first mini-batch and ∇J(π_old) closer to 1%, 10% or 30% (σ = 1 engine)?",
             options=tuple(TR09_SHIFT_SIZES),
             hint="The KL compares probabilities; a gradient compares parameters: the gradient "
                  "of a token whose experts flipped flows into other experts' weights, however "
                  "alike their outputs are.")
def _tr09_predict_r3_shift_size() -> str:
    shift = expected("tr09_r3_target_shift")
    return _nearest_option(shift, TR09_SHIFT_SIZES, log=True)
