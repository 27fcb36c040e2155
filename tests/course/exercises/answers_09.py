"""Right answers by another route, and plausible wrong ones, for the exercises of tutorial 9
(merged into the ``RIGHT`` / ``WRONG`` tables of tests/course/exercises/test_exercises.py)."""

from __future__ import annotations

import math

import torch

from tokenmdp.course.exercises import t09 as ex
from tokenmdp.course.tutorials.t09 import tr09_estimator, tr09_world
from tokenmdp.exact import gradient, sequence_kl, sequence_probs, state_logprobs, state_visitation
from tokenmdp.rl.replay_bias import replay_gradient


def _flip_by_loops(weights="mu", skip_last=True):
    # Σ_y w(y) n_diff(y) / Σ_y w(y) n_rec(y), token by token and layer by layer in Python, with
    # μ(y|x) from the engine's own token log-probs (w: D μ; "old": D π_old; "uniform": 1)
    world = tr09_world(ex.TR09_SELECTION_NOISE)
    mdp, enum = world.mdp, world.mdp.enumerate()
    with torch.no_grad():
        if weights == "mu":
            w = mdp.prompt_probs[mdp.terminal_prompt_index] * world.engine.token_logprobs(enum).sum(-1).exp()
        elif weights == "old":
            w = mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, world.old)
        else:
            w = torch.ones(mdp.num_sequences, dtype=torch.float64)
    a, b = world.engine_routing.tolist(), world.old_routing.tolist()
    differ = recorded = 0.0
    for r in range(mdp.num_sequences):
        n = int((enum.sequence_id[r] >= 0).sum())
        for c in range(n - 1 if skip_last else n):
            for la, lb in zip(a[r][c], b[r][c]):
                recorded += float(w[r])
                differ += float(w[r]) * (set(la) != set(lb))
    return differ / recorded


def _kl_by_states(reverse=False):
    # Σ_s d^μ(s) KL(μ(·|s) ‖ π_old(·|s)) / Σ_s d^μ(s), state by state
    world = tr09_world(ex.TR09_SELECTION_NOISE)
    with torch.no_grad():
        d = state_visitation(world.mdp, world.mu)
        lp_mu = torch.cat([x.reshape(-1, world.mdp.vocab_size)
                           for x in state_logprobs(world.mdp, world.mu)])
        lp_old = torch.cat([x.reshape(-1, world.mdp.vocab_size)
                            for x in state_logprobs(world.mdp, world.old)])
    p, q = (lp_old, lp_mu) if reverse else (lp_mu, lp_old)
    per_state = (p.exp() * (p - q)).sum(-1)
    return float((d * per_state).sum() / d.sum())


def _kl_per_response():
    world = tr09_world(ex.TR09_SELECTION_NOISE)
    with torch.no_grad():
        return float(sequence_kl(world.mdp, world.mu, world.old))


def _r3_shift(replay="r3", relative_to="true"):
    world = tr09_world(ex.TR09_SELECTION_NOISE)
    true = gradient(world.mdp, world.old)
    replayed = gradient(world.mdp, world.policy(world.old, replay))
    scale = true if relative_to == "true" else replayed
    return float((replayed - true).norm() / scale.norm())


def _none_bias():
    world = tr09_world(ex.TR09_SELECTION_NOISE)
    return replay_gradient(world, world.old, tr09_estimator(), "none").relative_bias


RIGHT_09 = {
    "tr09_flip_fraction": _flip_by_loops,
    "tr09_kl_per_token": _kl_by_states,
    "tr09_r3_target_shift": _r3_shift,
}
WRONG_09 = {
    "tr09_flip_fraction": lambda: {
        "every enumerated record counted once": _flip_by_loops(weights="uniform"),
        "responses weighted by π_old": _flip_by_loops(weights="old"),
        "the last token counted too": _flip_by_loops(skip_last=False)},
    "tr09_kl_per_token": lambda: {
        "per response, not per token": _kl_per_response(),
        "the reverse KL(π_old ‖ μ)": _kl_by_states(reverse=True),
        "under R3 (zero here)": 0.0},
    "tr09_r3_target_shift": lambda: {
        "R2's (nothing to replay yet)": _r3_shift(replay="r2"),
        "relative to the replayed gradient": _r3_shift(relative_to="replayed"),
        "the bias of no replay instead": _none_bias()},
}

# The true option of each prediction (tr09_predict_*), by another route than the package's
# (merged into PREDICT of tests/course/exercises/test_predictions.py): the flip shares and the
# KL per token by the loops and state sums above, the shift's nearest size on a log scale.
PREDICT_09: dict = {
    "tr09_predict_flip_weighting": lambda: (
        "larger" if _flip_by_loops() > _flip_by_loops(weights="uniform") else "smaller"),
    "tr09_predict_kl_per_token_size": lambda: "above" if _kl_by_states() > 1e-2 else "below",
    "tr09_predict_r3_shift_size": lambda: min(
        (("1%", 0.01), ("10%", 0.1), ("30%", 0.3)),
        key=lambda option: abs(math.log(_r3_shift() / option[1])))[0],
}
