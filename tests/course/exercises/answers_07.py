"""Right answers by another route, and plausible wrong ones, for the exercises of tutorial 7
(merged into the ``RIGHT`` / ``WRONG`` tables of tests/course/exercises/test_exercises.py)."""

from __future__ import annotations

import functools
import itertools
import math

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.course.exercises import t07 as ex
from tokenmdp.estimators import get, loss, prepare
from tokenmdp.exact import flat_grad, sequence_kl, sequence_probs
from tokenmdp.exact.world.chi_square import chi_square


def _token_chi2_by_responses(visitation="mu"):
    # pooled Σ_y D(x) q(y|x) Σ_t (w_t² − 1) / Σ_y D(x) q(y|x) |y|, token by token in Python
    # floats (q = μ; q = π_old is the slip of weighting the states by the wrong visitation)
    mdp, old, mu = ex.tr07_engine()
    enum = mdp.enumerate()
    with torch.no_grad():
        lp_old, lp_mu = old.token_logprobs(enum), mu.token_logprobs(enum)
        q = sequence_probs(mdp, mu if visitation == "mu" else old).tolist()
    prompt = mdp.terminal_prompt_index.tolist()
    excess = tokens = 0.0
    for i in range(enum.num_sequences):
        p = float(mdp.prompt_probs[prompt[i]]) * q[i]
        for c in range(enum.tokens.shape[1]):
            if enum.loss_mask[i, c]:
                excess += p * (math.exp(2 * float(lp_old[i, c] - lp_mu[i, c])) - 1)
                tokens += p
    return excess / tokens


def _token_chi2_wrong_answers():
    mdp, old, mu = ex.tr07_engine()
    with torch.no_grad():
        kl_per_token = float(sequence_kl(mdp, mu, old)) / float(
            (mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, mu)
             * mdp.enumerate().length).sum())
    return {"per response": float(chi_square(mdp, old, mu)),
            "π_old's visitation": _token_chi2_by_responses("old"),
            "KL(μ ‖ π_old) per token": kl_per_token}


def _sequence_second_moment():
    # Σ_x D(x) Σ_y π_old(y|x)² / μ(y|x), response by response in Python floats
    mdp, old, mu = ex.tr07_engine()
    with torch.no_grad():
        p, q = sequence_probs(mdp, old).tolist(), sequence_probs(mdp, mu).tolist()
    prompt = mdp.terminal_prompt_index.tolist()
    return sum(float(mdp.prompt_probs[prompt[i]]) * p[i] ** 2 / q[i] for i in range(len(p)))


def _sequence_ess_wrong_answers():
    mdp, old, mu = ex.tr07_engine()
    chi2_tok = float(chi_square(mdp, old, mu, level="token"))
    chi2_seq = _sequence_second_moment() - 1
    chi2_group = float(chi_square(mdp, old, mu, group_size=2))
    return {"token ESS": 1 / (1 + chi2_tok), "1 − χ²": 1 - chi2_seq,
            "a group's joint weight": 1 / (1 + chi2_group)}


def _expected_gradient_by_pairs(mdp, old, sampler, estimator):
    # E[ĝ] = Σ over ordered pairs of D(x) q(y_1) q(y_2) ĝ(y_1, y_2), q = sampler; each ĝ by
    # autograd of the library's loss on a two-sequence batch (not moments / StepGradients)
    responses = mdp.responses()
    with torch.no_grad():
        q = sequence_probs(mdp, sampler).tolist()
    mean = 0.0
    for i, j in itertools.product(range(len(responses)), repeat=2):
        (xi, yi), (xj, yj) = responses[i], responses[j]
        if xi != xj:
            continue
        x = mdp.prompts.index(xi)
        batch = TokenBatch.from_sequences([list(xi), list(xj)], [list(yi), list(yj)],
                                          rewards=[float(mdp.rewards[i]), float(mdp.rewards[j])],
                                          groups=[0, 0], prompt_index=[x, x], dtype=torch.float64)
        with torch.no_grad():
            batch = batch.replace(old_logprob=old.token_logprobs(batch),
                                  behavior_logprob=sampler.token_logprobs(batch))
        batch = prepare(batch, estimator)
        g = -flat_grad(loss(old.token_logprobs(batch), batch, estimator)[0], old)
        mean = mean + float(mdp.prompt_probs[x]) * q[i] * q[j] * g
    return mean


@functools.cache             # about 15 s a name; RIGHT_07 and PREDICT_07 share it
def _shift_by_pairs(name):
    mdp, old, mu = ex.tr07_engine()
    estimator = get(name)
    on = _expected_gradient_by_pairs(mdp, old, old, estimator)
    off = _expected_gradient_by_pairs(mdp, old, mu, estimator)
    return float((off - on).norm() / on.norm())


def _minirl_bias_wrong_answers():
    mdp, old, mu = ex.tr07_engine()
    return {"the uncorrected minirl_no_is": ex.tr07_relative_deviation(mdp, old, mu,
                                                                       get("minirl_no_is")),
            "all removed": 0.0,
            "√χ² per response": math.sqrt(float(chi_square(mdp, old, mu)))}


def _nearest_share(kept):
    # "zero", "half" or "all" of minirl_no_is's shift: the nearest of 0, 1/2, 1
    return "zero" if kept < 0.25 else "half" if kept < 0.75 else "all"


RIGHT_07 = {
    "tr07_token_chi2": _token_chi2_by_responses,
    "tr07_minirl_bias": lambda: _shift_by_pairs("minirl"),
    "tr07_sequence_ess": lambda: 1 / _sequence_second_moment(),
}
WRONG_07 = {
    "tr07_token_chi2": _token_chi2_wrong_answers,
    "tr07_minirl_bias": _minirl_bias_wrong_answers,
    "tr07_sequence_ess": _sequence_ess_wrong_answers,
}

# The true option of each prediction (tr07_predict_*), by another route than the package's
# (merged into PREDICT of tests/course/exercises/test_predictions.py).
PREDICT_07 = {
    # token by token against response by response, both in Python floats
    "tr07_predict_token_chi2": lambda: (
        "larger" if _token_chi2_by_responses() > _sequence_second_moment() - 1 else "smaller"),
    # the two shifts by autograd over every pair: the share of minirl_no_is's that minirl keeps
    "tr07_predict_minirl_bias": lambda: _nearest_share(
        _shift_by_pairs("minirl") / _shift_by_pairs("minirl_no_is")),
    "tr07_predict_sequence_ess": lambda: "above" if 1 / _sequence_second_moment() > 0.9 else "below",
}
