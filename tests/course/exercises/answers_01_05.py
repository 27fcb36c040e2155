"""Right answers by another route, and plausible wrong ones, for the exercises of tutorials 1–5
(merged into the ``RIGHT`` / ``WRONG`` tables of tests/course/exercises/test_exercises.py), and
the true option of each of their predictions (``PREDICT_01_05``)."""

from __future__ import annotations

import math
import statistics

import torch

from tokenmdp.course.exercises import t01_05 as ex
from tokenmdp.course.setups import copy_task
from tokenmdp.estimators import NoCorrection, TokenRatio
from tokenmdp.exact import (
    NeuralPolicy,
    flat_grad,
    gradient,
    length_normalized_objective,
    moments,
    objective,
    sample,
    sequence_logprobs,
    sequence_probs,
    stale_copy,
    surrogate,
)


def _scores(mdp, policy):
    # [N, P]: ∇ log π(y|x) of every response, one autograd call each
    return torch.stack([flat_grad(sequence_logprobs(mdp, policy)[n], policy)
                        for n in range(mdp.num_sequences)])


def _weights(mdp, policy):
    with torch.no_grad():
        return mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, policy)


# ---------------------------------------------------------------------- tutorial 1
def _uniform_by_lengths(extra_eos=False):
    # Σ_x D(x) Σ_y V^(−|y|) R(x, y), in Python floats; extra_eos: a phantom EOS on truncated ones
    mdp, _ = copy_task()
    total = 0.0
    for (x, y), r in zip(mdp.responses(), mdp.rewards.tolist(), strict=True):
        n = len(y) + (extra_eos and y[-1] != mdp.eos)
        total += float(mdp.prompt_probs[mdp.prompts.index(x)]) * mdp.vocab_size ** (-n) * r
    return total


def _uniform_wrong():
    mdp, policy = copy_task()
    with torch.no_grad():
        seeded = float(objective(mdp, policy))
    n = mdp.responses_per_prompt
    equal = sum(float(mdp.prompt_probs[x]) * float(mdp.rewards[x * n:(x + 1) * n].mean())
                for x in range(mdp.num_prompts))
    return {"every response equally likely": equal, "the seeded policy's J": seeded,
            "a phantom EOS on truncated responses": _uniform_by_lengths(extra_eos=True)}


def _neural():
    mdp = ex.tr01_constant_mdp()
    return mdp, NeuralPolicy(mdp, generator=torch.Generator().manual_seed(ex.TR01_NEURAL_SEED),
                             hidden=ex.TR01_NEURAL_HIDDEN)


def _constant_by_enumerated_reinforce():
    # route 2 of tutorial 1: the REINFORCE loss on the full enumeration, detached weights
    mdp, neural = _neural()
    batch = mdp.enumerate()
    seq = batch.sequence_sum(neural.token_logprobs(batch))
    w = (mdp.prompt_probs[batch.prompt_index] * seq.exp()).detach()
    return float(flat_grad((w * batch.reward * seq).sum(), neural).norm())


def _constant_wrong():
    mdp, neural = _neural()
    batch = sample(mdp, neural, 2000, generator=torch.Generator().manual_seed(7))
    seq = batch.sequence_sum(neural.token_logprobs(batch))
    mc = float(flat_grad((batch.reward * seq).mean(), neural).norm())
    copy_mdp, _ = copy_task()
    copy_neural = NeuralPolicy(copy_mdp, generator=torch.Generator().manual_seed(2), hidden=4)
    return {"the constant c": ex.TR01_CONSTANT, "a Monte Carlo estimate's norm": mc,
            "‖∇J‖ of the copy reward": float(gradient(copy_mdp, copy_neural).norm())}


# ---------------------------------------------------------------------- tutorial 2
def _tr02_arrays():
    mdp = ex.tr02_mdp()
    policy = ex.tr02_policy(mdp)
    return mdp, policy, _weights(mdp, policy), _scores(mdp, policy)


def _baseline_by_scores(power=2):
    # b* = E[R ‖σ‖²] / E[‖σ‖²] (power=1: the norms not squared, a slip)
    mdp, _, w, scores = _tr02_arrays()
    norms = scores.norm(dim=1) ** power
    return float((w * norms) @ mdp.rewards / (w @ norms))


def _baseline_wrong():
    mdp, policy, w, _ = _tr02_arrays()
    return {"b = J": float(w @ mdp.rewards), "norms not squared": _baseline_by_scores(power=1),
            "b = 0": 0.0}


# ---------------------------------------------------------------------- tutorial 3
def _token_is_by_surrogate(distance=ex.TR03_STALE_DISTANCE, relative=True):
    mdp, pi = copy_task()
    stale = stale_copy(mdp, pi, distance=distance)
    grad = gradient(mdp, pi)
    error = (flat_grad(surrogate(mdp, pi, stale), pi) - grad).norm()
    return float(error / grad.norm()) if relative else float(error)


def _tis_by_responses(with_baseline=True, cap=ex.TR03_CAP):
    # Σ_x D(x) (E_μ[min(W, C) R σ] − E_μ[R] E_μ[min(W, C) σ]) − ∇J, by response (cap=None: no
    # correction, every weight 1)
    mdp, pi = copy_task()
    mu = ex.tr03_engine(pi)
    scores = _scores(mdp, pi)
    with torch.no_grad():
        mu_N = sequence_probs(mdp, mu)
        w_N = (torch.ones_like(mu_N) if cap is None else
               (sequence_logprobs(mdp, pi) - sequence_logprobs(mdp, mu)).exp().clamp(max=cap))
    n, mean = mdp.responses_per_prompt, torch.zeros(scores.shape[1], dtype=torch.float64)
    for x in range(mdp.num_prompts):
        rows = slice(x * n, (x + 1) * n)
        m, w, r = mu_N[rows], w_N[rows], mdp.rewards[rows]
        term = (m * w * r) @ scores[rows]
        if with_baseline:
            term = term - (m @ r) * ((m * w) @ scores[rows])
        mean += mdp.prompt_probs[x] * term
    return float((mean - gradient(mdp, pi)).norm())


def _tis_wrong():
    mdp, pi = copy_task()
    none = moments(mdp, pi, ex.tr03_estimator(TokenRatio(), NoCorrection()), group_size=2,
                   behavior=ex.tr03_engine(pi), old=pi, method="enumeration")
    return {"without the baseline term": _tis_by_responses(with_baseline=False),
            "sequence IS, C = ∞ (unbiased)": 0.0, "no correction": float(none.bias.norm())}


# ---------------------------------------------------------------------- tutorial 4
def _rloo_token_mean(scale=1.0, baseline=True):
    mdp, policy = ex.tr04_world()
    with torch.no_grad():
        j = float(objective(mdp, policy))
    target = length_normalized_objective(mdp, policy, baseline=j if baseline else 0.0)
    return scale * float(flat_grad(target, policy).norm())


def _rloo_token_mean_wrong():
    mdp, policy = ex.tr04_world()
    g = ex.TR04_GROUP
    return {"the group mean's (G−1)/G": _rloo_token_mean(scale=(g - 1) / g),
            "no baseline, ∇E[R/|y|]": _rloo_token_mean(baseline=False),
            "‖∇J‖": float(gradient(mdp, policy).norm())}


def _constant_scale(g=ex.TR04_CONSTANT_GROUP, length=4):
    return (g - 1) / (g * length)


# ---------------------------------------------------------------------- tutorial 5
def _old_pass(replay):
    from tokenmdp.rl.mismatch import compute_old_logprobs

    model, batch = ex.tr05_bf16_rollout()
    with torch.no_grad():
        return compute_old_logprobs(model, batch, replay)


def _mismatch_by_hand(replay="none"):
    # the pass of `replay` against the engine, sorted expert sets compared by hand (the RIGHT
    # answer for R2 uses the no-replay pass: R2's old pass routes by itself)
    from tokenmdp.rl.mismatch import ENGINE_ROUTING, OLD_ROUTING

    old = _old_pass(replay)
    a, b = old.token_extras[ENGINE_ROUTING], old.token_extras[OLD_ROUTING]
    both = (a >= 0).all(-1) & (b >= 0).all(-1)                    # [R, C, L]
    differ = (a.sort(-1).values != b.sort(-1).values).any(-1) & both
    return int(differ.sum()) / int(both.sum())


def _k1_by_hand():
    old = _old_pass("none")
    terms = (old.behavior_logprob.double() - old.old_logprob.double())[old.loss_mask]
    return float(terms.sum() / terms.numel())


def _k1_wrong():
    from tokenmdp.rl.mismatch import training_inference_kl

    k1 = _k1_by_hand()
    return {"sign flipped (log π_old − log μ)": -k1, "zero (a KL is ≥ 0)": 0.0,
            "the k3 estimate": training_inference_kl(_old_pass("none"), kind="k3")}


RIGHT_01_05 = {
    "tr01_uniform_objective": _uniform_by_lengths,
    "tr01_constant_reward_gradient_norm": _constant_by_enumerated_reinforce,
    "tr02_optimal_constant_baseline": _baseline_by_scores,
    "tr02_grpo_scale_g2": lambda: 1 / math.sqrt(2),
    "tr03_token_is_relative_bias": _token_is_by_surrogate,
    "tr03_tis_sequence_bias_norm": _tis_by_responses,
    "tr04_rloo_token_mean_norm": _rloo_token_mean,
    "tr04_constant_scale_g3": _constant_scale,
    "tr05_r2_routing_mismatch": _mismatch_by_hand,
    "tr05_k1_estimate": _k1_by_hand,
}
WRONG_01_05 = {
    "tr01_uniform_objective": _uniform_wrong,
    "tr01_constant_reward_gradient_norm": _constant_wrong,
    "tr02_optimal_constant_baseline": _baseline_wrong,
    "tr02_grpo_scale_g2": lambda: {"population std (= RLOO)": 1.0, "group mean": 0.5,
                                   "the inverse, √2": math.sqrt(2)},
    "tr03_token_is_relative_bias": lambda: {
        "sequence IS (unbiased)": 0.0,
        "not divided by ‖∇J‖": _token_is_by_surrogate(relative=False),
        "at stale distance 0.5": _token_is_by_surrogate(distance=0.5)},
    "tr03_tis_sequence_bias_norm": _tis_wrong,
    "tr04_rloo_token_mean_norm": _rloo_token_mean_wrong,
    "tr04_constant_scale_g3": lambda: {"(G−1)/G": 2 / 3, "1/L": 0.25,
                                       "G = 2's (G−1)/(G L)": _constant_scale(g=2)},
    "tr05_r2_routing_mismatch": lambda: {"R3's (the engine's experts)": 0.0,
                                         "the complement": 1 - _mismatch_by_hand()},
    "tr05_k1_estimate": _k1_wrong,
}

# ---------------------------------------------------------------------- predictions
def _uniform_above_seeded():
    mdp, policy = copy_task()
    seeded = float(_weights(mdp, policy) @ mdp.rewards)              # Σ D(x) π(y|x) R, by response
    return "above" if _uniform_by_lengths() > seeded else "below"


def _grpo_scale_side():
    c = 0.5 / statistics.stdev([1.0, 0.0])                  # the pair (1, 0): ±½ over its sample std
    return "equal" if math.isclose(c, 1.0) else "smaller" if c < 1 else "larger"


def _baseline_side():
    mdp, _, w, _ = _tr02_arrays()
    return "above" if _baseline_by_scores() > float(w @ mdp.rewards) else "below"


def _token_is_nearer():
    low, middle, high = (_token_is_by_surrogate(distance=d)
                         for d in (1.0, ex.TR03_STALE_DISTANCE, 2.0))
    return "a" if abs(middle - low) < abs(middle - high) else "b"


def _rloo_token_mean_vector():
    # E[A_1 σ_1/|y_1|] over independent pairs (y_1, y_2) of the single prompt, by response
    mdp, policy = ex.tr04_world()
    scores, w = _scores(mdp, policy), _weights(mdp, policy)
    lengths = torch.tensor([len(y) for _, y in mdp.responses()], dtype=torch.float64)
    j = float(w @ mdp.rewards)
    mean = (w * (mdp.rewards - j) / lengths) @ scores
    candidates = {"a": w * mdp.rewards @ scores, "b": _rloo_token_mean_vector_closed(j),
                  "c": (ex.TR04_GROUP - 1) / ex.TR04_GROUP * _rloo_token_mean_vector_closed(j)}
    near = [k for k, v in candidates.items() if float((mean - v).abs().max()) < 1e-10]
    assert len(near) == 1, near
    return near[0]


def _rloo_token_mean_vector_closed(j):
    mdp, policy = ex.tr04_world()
    return flat_grad(length_normalized_objective(mdp, policy, baseline=j), policy)


def _r2_reproduces():
    r2, none, r3 = (_mismatch_by_hand(replay) for replay in ("r2", "none", "r3"))
    return "a" if r2 == none else "b" if r2 == r3 else "c"


# The true option of each prediction (tr01_predict_* … tr05_predict_*), by another route than the
# package's (merged into PREDICT of tests/course/exercises/test_predictions.py).
PREDICT_01_05 = {
    "tr01_predict_uniform_objective": _uniform_above_seeded,
    "tr01_predict_constant_reward_gradient":
        lambda: "zero" if _constant_by_enumerated_reinforce() < 1e-10 else "nonzero",
    "tr02_predict_grpo_scale_g2": _grpo_scale_side,
    "tr02_predict_baseline_vs_j": _baseline_side,
    "tr03_predict_token_is_bias": _token_is_nearer,
    "tr03_predict_tis_vs_no_correction":
        lambda: "smaller" if _tis_by_responses() < _tis_by_responses(cap=None) else "larger",
    "tr04_predict_constant_scale_g3":
        lambda: "larger" if _constant_scale(g=3) > _constant_scale(g=2) else "smaller",
    "tr04_predict_rloo_token_mean_vector": _rloo_token_mean_vector,
    "tr05_predict_k1_sign": lambda: "positive" if _k1_by_hand() > 0 else "negative",
    "tr05_predict_r2_mismatch": _r2_reproduces,
}
