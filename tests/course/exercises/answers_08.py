"""Right answers by another route, and plausible wrong ones, for the exercises of tutorial 8
(merged into the ``RIGHT`` / ``WRONG`` tables of tests/course/exercises/test_exercises.py)."""

from __future__ import annotations

import math

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.course.exercises import t08 as ex
from tokenmdp.course.tutorials.t08 import kl_world
from tokenmdp.estimators import KLPenalty, kl_k2, kl_k3, loss, prepare
from tokenmdp.exact import flat_grad, sequence_logprobs, sequence_probs
from tokenmdp.exact.analysis.kl_gradients import _penalty_world, kl_penalty_moments


def _bisect(f, lo, hi):
    while hi - lo > 1e-13:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


def _closed_form_sds(mu):
    # log r ~ N(−μ²/2, μ²), KL = μ²/2: sd(k1) = μ, sd(k2) = μ²√(2+μ²)/2, sd(k3)² = e^{μ²} − 1 − μ²
    kl = mu * mu / 2
    return mu / kl, math.sqrt(2 + mu * mu), math.sqrt(math.expm1(mu * mu) - mu * mu) / kl


def _crossover(other=1):
    return _bisect(lambda m: _closed_form_sds(m)[2] - _closed_form_sds(m)[other], *ex.TR08_BRACKET)


def _one_response_gradients(mdp, pi, ref, penalty):
    # ĝ of every response alone (a one-sequence batch through the library's prepare and loss)
    _, estimator = _penalty_world(mdp, penalty)
    for (x, y), x_index in zip(mdp.responses(), mdp.terminal_prompt_index.tolist()):
        batch = TokenBatch.from_sequences([list(x)], [list(y)], rewards=[0.0], groups=[0],
                                          prompt_index=[x_index], dtype=torch.float64)
        with torch.no_grad():
            batch = batch.replace(ref_logprob=ref.token_logprobs(batch))
        yield batch, estimator


def _expected_by_responses(mdp, pi, ref, penalty, sampler):
    # Σ_y D(x) μ(y|x) ĝ(y), with μ = sampler and the IS weight from behavior_logprob = log μ
    weights = (mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, sampler)).detach()
    total = 0.0
    for w, (batch, estimator) in zip(weights, _one_response_gradients(mdp, pi, ref, penalty)):
        with torch.no_grad():
            mu_lp = sampler.token_logprobs(batch)
            batch = batch.replace(behavior_logprob=mu_lp, old_logprob=mu_lp)
        batch = prepare(batch, estimator)
        total = total + float(w) * -flat_grad(loss(pi.token_logprobs(batch), batch, estimator)[0],
                                              pi)
    return total


def _reverse_by_scores(mdp, pi, ref):
    # ∇KL(π‖π_ref) = Σ_y D π(y) log(π/π_ref)(y) ∇log π(y), one autograd call per response
    lp = sequence_logprobs(mdp, pi)
    with torch.no_grad():
        w = mdp.prompt_probs[mdp.terminal_prompt_index] * lp.exp() * (lp - sequence_logprobs(mdp, ref))
    params = list(pi.parameters())
    return sum(float(w[i]) * torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        lp[i], params, retain_graph=True)]) for i in range(mdp.num_sequences))


def _k3_loss_bias(max_len=ex.TR08_SEQUENCE_LEN, estimator=kl_k3):
    mdp, pi, ref, _ = kl_world(max_len)
    g = -_expected_by_responses(mdp, pi, ref, KLPenalty(coef=1.0, in_reward=False,
                                                        estimator=estimator), pi)
    reverse = _reverse_by_scores(mdp, pi, ref)
    return float((g - reverse).norm() / reverse.norm())


def _off_policy_gap(weighted=True):
    mdp, pi, ref, mu = kl_world(ex.TR08_SEQUENCE_LEN)
    penalty = KLPenalty(coef=1.0, in_reward=False, importance_weighted=weighted)
    off = _expected_by_responses(mdp, pi, ref, penalty, mu)
    on = _expected_by_responses(mdp, pi, ref, KLPenalty(coef=1.0, in_reward=False), pi)
    return float((off - on).norm() / on.norm())


def _off_policy_gap_relative_to_reverse():
    mdp, pi, ref, mu = kl_world(ex.TR08_SEQUENCE_LEN)
    weighted = KLPenalty(coef=1.0, in_reward=False, importance_weighted=True)
    off = kl_penalty_moments(mdp, pi, ref, weighted, behavior=mu).mean
    on = kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=1.0, in_reward=False)).mean
    return float((off - on).norm() / _reverse_by_scores(mdp, pi, ref).norm())


RIGHT_08 = {
    "tr08_k3_k2_crossover": _crossover,
    "tr08_k3_loss_relative_bias": _k3_loss_bias,
    "tr08_is_k3_off_policy_gap": _off_policy_gap,
}
WRONG_08 = {
    "tr08_k3_k2_crossover": lambda: {"Schulman's second setting, μ = 1": 1.0,
                                     "where k3 meets k1 instead": _crossover(other=0)},
    "tr08_k3_loss_relative_bias": lambda: {
        "unbiased (true in no world)": 0.0,
        "the bandit's value": _k3_loss_bias(max_len=1),
        "k2 in the loss instead": _k3_loss_bias(estimator=kl_k2)},
    "tr08_is_k3_off_policy_gap": lambda: {
        "the weight fixes everything (true in a bandit)": 0.0,
        "without the importance weight": _off_policy_gap(weighted=False),
        "relative to ‖∇KL(π‖π_ref)‖": _off_policy_gap_relative_to_reverse()},
}



def _k3_spread_stays_below():
    # the closed forms (not the quadrature) on a fine grid across the bracket
    lo, hi = ex.TR08_BRACKET
    grid = [lo + (hi - lo) * i / 200 for i in range(201)]
    return "yes" if all(_closed_form_sds(m)[2] < _closed_form_sds(m)[1] for m in grid) else "no"


def _nearest_bias_size():
    bias = _k3_loss_bias()
    return min(("0", "0.3", "1"), key=lambda option: abs(float(option) - bias))


def _where_the_weight_repairs():
    # the weighted stale gradient against the on-policy one, response by response in each world
    exact = []
    for max_len in (1, ex.TR08_SEQUENCE_LEN):
        mdp, pi, ref, mu = kl_world(max_len)
        off = _expected_by_responses(mdp, pi, ref, KLPenalty(coef=1.0, in_reward=False,
                                                             importance_weighted=True), mu)
        on = _expected_by_responses(mdp, pi, ref, KLPenalty(coef=1.0, in_reward=False), pi)
        exact.append(float((off - on).norm() / on.norm()) < 1e-9)
    return {(True, True): "both", (True, False): "bandit", (False, False): "neither"}[tuple(exact)]


# The true option of each prediction (tr08_predict_*), by another route than the package's
# (merged into PREDICT of tests/course/exercises/test_predictions.py).
PREDICT_08: dict = {
    "tr08_predict_k3_spread_stays_below_k2": _k3_spread_stays_below,
    "tr08_predict_k3_loss_bias_size": _nearest_bias_size,
    "tr08_predict_weight_repairs": _where_the_weight_repairs,
}
