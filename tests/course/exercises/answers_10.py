"""Right answers by another route, and plausible wrong ones, for the exercises of tutorial 10
(merged into the ``RIGHT`` / ``WRONG`` tables of tests/course/exercises/test_exercises.py)."""

from __future__ import annotations

import itertools
import math

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tests.exact.analysis.test_training import _rloo_step_by_hand
from tokenmdp.batch import TokenBatch
from tokenmdp.course.exercises import t10 as ex
from tokenmdp.course.setups import copy_task
from tokenmdp.estimators import loss, prepare
from tokenmdp.exact import flat_grad, gradient, objective, sample, sequence_probs


def _one_update_J(direction="sampled", sign=1.0):
    # θ_1 = θ_0 + lr ĝ with ĝ RLOO's step in closed form (or ∇J: the expected step)
    mdp, pi0 = copy_task()
    n = ex.TR10_GROUP_SIZE * ex.TR10_GROUPS
    batch = sample(mdp, pi0, n, generator=torch.Generator().manual_seed(ex.TR10_SEED),
                   group_size=ex.TR10_GROUP_SIZE)
    g = _rloo_step_by_hand(mdp, pi0, batch) if direction == "sampled" else gradient(mdp, pi0)
    theta = parameters_to_vector(pi0.parameters()).detach()
    vector_to_parameters(theta + sign * ex.TR10_LR * g, pi0.parameters())
    with torch.no_grad():
        return float(objective(mdp, pi0))


def _initial_J():
    mdp, pi0 = copy_task()
    with torch.no_grad():
        return float(objective(mdp, pi0))


def _reward_distributions():
    # P(R = r | x) for each prompt, from the exact response probabilities
    mdp, pi0 = copy_task()
    with torch.no_grad():
        q = sequence_probs(mdp, pi0).tolist()
    out = [{} for _ in range(mdp.num_prompts)]
    for i, (x, r) in enumerate(zip(mdp.terminal_prompt_index.tolist(), mdp.rewards.tolist())):
        out[x][r] = out[x].get(r, 0.0) + q[i]
    return mdp.prompt_probs.tolist(), out


def _keep_probability(group_size=ex.TR10_GROUP_SIZE, prompt_weights=None):
    weights, dists = _reward_distributions()
    weights = weights if prompt_weights is None else prompt_weights
    return 1.0 - sum(w * sum(p ** group_size for p in d.values())
                     for w, d in zip(weights, dists))


def _stacked_multisets_cosine(estimator, filter_groups=True):
    # E[ĝ] = −∇ Σ_b P(b | kept) loss_b: every multiset b of G responses of each prompt, stacked in
    # one batch with its step id, prepared per step, each step's loss weighted by its probability
    mdp, pi, old = ex.tr10_stale_pair()
    G, responses = ex.TR10_GROUP_SIZE, mdp.responses()
    with torch.no_grad():
        q = sequence_probs(mdp, old).tolist()
    prompts, resp, rewards, weights = [], [], [], []
    for x in range(mdp.num_prompts):
        ids = [i for i, xi in enumerate(mdp.terminal_prompt_index.tolist()) if xi == x]
        for combo in itertools.combinations_with_replacement(ids, G):
            rs = [float(mdp.rewards[i]) for i in combo]
            if filter_groups and len(set(rs)) == 1:
                continue
            counts = [combo.count(i) for i in set(combo)]
            p = float(mdp.prompt_probs[x]) * math.factorial(G) / math.prod(
                math.factorial(c) for c in counts) * math.prod(q[i] for i in combo)
            prompts += [list(responses[i][0]) for i in combo]
            resp += [list(responses[i][1]) for i in combo]
            rewards += rs
            weights.append(p)
    steps = len(weights)
    step = torch.arange(steps).repeat_interleave(G)
    batch = TokenBatch.from_sequences(prompts, resp, rewards=rewards, groups=step.tolist(),
                                      prompt_index=[mdp.prompts.index(tuple(p)) for p in prompts])
    with torch.no_grad():
        lp_old = old.token_logprobs(batch)
        batch = batch.replace(old_logprob=lp_old, behavior_logprob=lp_old, ref_logprob=lp_old)
    batch = prepare(batch, estimator, max_len=mdp.max_len, step=step)
    w = torch.tensor(weights, dtype=torch.float64)
    w = (w / w.sum())[step]                                      # P(b | kept) per sequence
    batch = batch.replace(loss_weight=batch.loss_weight * w[:, None])
    mean = -flat_grad(loss(pi.token_logprobs(batch), batch, estimator)[0], pi)
    true = gradient(mdp, pi)
    return float(mean @ true / (mean.norm() * true.norm()))


RIGHT_10 = {
    "tr10_one_update_J": _one_update_J,
    "tr10_keep_probability": _keep_probability,
    "tr10_prorl_stale_cosine": lambda: _stacked_multisets_cosine(ex.tr10_prorl()),
}
WRONG_10 = {
    "tr10_one_update_J": lambda: {"J before the update": _initial_J(),
                                  "a descent step (θ − lr ĝ)": _one_update_J(sign=-1.0),
                                  "the expected step (θ + lr ∇J)": _one_update_J("expected")},
    "tr10_keep_probability": lambda: {
        "groups of two": _keep_probability(group_size=2),
        "prompts weighted equally": _keep_probability(prompt_weights=[0.5, 0.5]),
        "the drop probability": 1.0 - _keep_probability()},
    "tr10_prorl_stale_cosine": lambda: {
        "without dynamic sampling": _stacked_multisets_cosine(ex.tr10_prorl(), False),
        "DAPO's band and no KL": _stacked_multisets_cosine(ex.tr10_prorl(eps_high=0.28,
                                                                          beta=None)),
        "on-policy (cosine 1)": 1.0},
}

# The true option of each prediction (tr10_predict_*), by another route than the package's
# (merged into PREDICT of tests/course/exercises/test_predictions.py).
PREDICT_10 = {
    "tr10_predict_sampled_step": lambda: "more" if _one_update_J() > _one_update_J("expected")
    else "less",
    "tr10_predict_keep_share": lambda: min(ex.TR10_KEEP_SHARES, key=lambda share: abs(
        ex.TR10_KEEP_SHARES[share] - _keep_probability())),
    "tr10_predict_wider_band": lambda: "yes" if _stacked_multisets_cosine(ex.tr10_prorl()) >
    _stacked_multisets_cosine(ex.tr10_prorl(eps_high=ex.TR10_DAPO_EPS_HIGH)) else "no",
}
