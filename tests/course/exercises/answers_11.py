"""Right answers by another route, and plausible wrong ones, for the exercises of tutorial 11
(merged into the ``RIGHT`` / ``WRONG`` tables of tests/course/exercises/test_exercises.py and
``PREDICT`` of test_predictions.py).

The package computes each answer from the exact law of the trees and its own tree moments; here
every tree is written out by hand from the response probabilities: a ``fixed:1x4`` tree is a
first token and then an i.i.d. group of four continuations (every ordered 4-tuple enumerated), a
``fixed:0x2,1x2`` tree two i.i.d. branches that fork into two unless they end at once.
"""

from __future__ import annotations

import functools
import itertools

import torch

from tokenmdp.course.exercises import t11 as ex
from tokenmdp.course.setups import copy_task
from tokenmdp.exact import gradient, sequence_probs
from tokenmdp.exact.branching import TreeWorkspace
from tokenmdp.tree_schedules import FixedForks


@functools.cache
def _world():
    """The copy task: probabilities π(y|x), rewards, lengths, prompts, first tokens and the
    score ∇ log π(y|x) of every response (autograd of the log of sequence_probs)."""
    mdp, pi = copy_task()
    probs = sequence_probs(mdp, pi)
    params = list(pi.parameters())
    scores = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        probs[i].log(), params, retain_graph=True)]) for i in range(mdp.num_sequences)])
    responses = [y for _, y in mdp.responses()]
    return dict(mdp=mdp, pi=pi, p=probs.detach(), R=mdp.rewards, scores=scores.detach(),
                length=[len(y) for y in responses], first=[y[0] for y in responses],
                prompt=mdp.terminal_prompt_index.tolist(), D=mdp.prompt_probs.tolist(),
                grad=gradient(mdp, pi))


def _first_token_prob(w, x, a):
    return sum(float(w["p"][i]) for i in range(len(w["p"])) if w["prompt"][i] == x
               and w["first"][i] == a)


def _generated_tokens(per_continuation=4):
    # 1 + (continuations) × (tokens after the first), summed over responses by their prompt
    w = _world()
    return sum(w["D"][w["prompt"][i]] * float(w["p"][i]) * (1 + per_continuation * (w["length"][i] - 1))
               for i in range(len(w["p"])))


def _expanded_tokens():
    # the leaves' response tokens: an EOS first token is one leaf of length 1, else four leaves
    w, eos = _world(), _world()["mdp"].eos
    total = 0.0
    for x, d in enumerate(w["D"]):
        total += d * _first_token_prob(w, x, eos)
        total += d * sum(4 * float(w["p"][i]) * w["length"][i] for i in range(len(w["p"]))
                         if w["prompt"][i] == x and w["first"][i] != eos)
    return total


def _iid_tokens():
    w = _world()
    return 4 * sum(w["D"][w["prompt"][i]] * float(w["p"][i]) * w["length"][i]
                   for i in range(len(w["p"])))


def _inverse_leaves(p_end, n1):
    # E[1/(n_1 + n_2)] for branch 1's n_1 leaves: branch 2 has one leaf w.p. p_end, else two
    return p_end / (n1 + 1) + (1 - p_end) / (n1 + 2)


def _two_level_leaf_law():
    # two i.i.d. branches; a branch that ends at once (EOS) has n_b = 1 leaf, else 2;
    # q(y) = 2 E[count_1(y) / (n_1 + n_2)], n_2 independent of branch 1
    w, eos = _world(), _world()["mdp"].eos
    q = torch.zeros(len(w["p"]), dtype=torch.float64)
    for i in range(len(w["p"])):
        x = w["prompt"][i]
        p_end = _first_token_prob(w, x, eos)
        if w["first"][i] == eos:
            q[i] = 2 * w["D"][x] * p_end * _inverse_leaves(p_end, 1)
        else:          # first token a (prob π(a)), then two continuations, each y w.p. π(y)/π(a)
            q[i] = 2 * w["D"][x] * 2 * float(w["p"][i]) * _inverse_leaves(p_end, 2)
    return q


def _two_level_bias(weights="leaves"):
    w = _world()
    q = _two_level_leaf_law()
    if weights == "slots":   # the slot-weighted leaf law is D(x) π(y|x)
        q = torch.tensor([w["D"][w["prompt"][i]] * float(w["p"][i]) for i in range(len(q))],
                         dtype=torch.float64)
    mean = (q * w["R"]) @ w["scores"]
    return float((mean - w["grad"]).norm() / w["grad"].norm())


@functools.cache
def _rloo_one_level_mean():
    # E ĝ of RLOO (seq-mean-token-sum) on fixed:1x4: every ordered 4-tuple of continuations of
    # every non-EOS first token; a one-leaf tree (EOS first) is skipped (ĝ = 0)
    w, eos = _world(), _world()["mdp"].eos
    mean = torch.zeros_like(w["grad"])
    for x, d in enumerate(w["D"]):
        for a in {w["first"][i] for i in range(len(w["p"])) if w["prompt"][i] == x} - {eos}:
            rows = [i for i in range(len(w["p"])) if w["prompt"][i] == x and w["first"][i] == a]
            pa = _first_token_prob(w, x, a)
            for combo in itertools.product(rows, repeat=4):
                prob = d * pa
                for i in combo:
                    prob *= float(w["p"][i]) / pa
                R = [float(w["R"][i]) for i in combo]
                for k, i in enumerate(combo):
                    advantage = R[k] - (sum(R) - R[k]) / 3
                    mean += prob * advantage / 4 * w["scores"][i]
    return mean


def _cosine(u, v):
    return float(u @ v / (u.norm() * v.norm()))


def _prompt_logits():
    w = _world()
    mask = torch.zeros(w["pi"].table.shape, dtype=torch.bool)
    mask[:w["mdp"].num_prompts] = True
    return mask.reshape(-1)


def _other_bias(name, spec):
    mdp, pi = copy_task()
    return TreeWorkspace(mdp, pi).moments(name, FixedForks(*spec), method="exact").relative_bias


RIGHT_11 = {
    "tr11_generated_tokens": _generated_tokens,
    "tr11_two_level_bias": _two_level_bias,
    "tr11_stem_cosine": lambda: _cosine(_rloo_one_level_mean(), _world()["grad"]),
}
WRONG_11 = {
    "tr11_generated_tokens": lambda: {
        "an i.i.d. group's 4 E|y|": _iid_tokens(),
        "the expanded tokens of the leaves": _expanded_tokens(),
        "three continuations after the first token": _generated_tokens(per_continuation=3)},
    "tr11_two_level_bias": lambda: {
        "the slot-weighted leaves (unbiased)": _two_level_bias("slots"),
        "fixed:0x2,2x2 instead": _other_bias("reinforce", ((0, 2), (2, 2))),
        "RLOO on the same trees": _other_bias("rloo", ex.TR11_TWO_LEVEL)},
    "tr11_stem_cosine": lambda: {
        "as unbiased as on an i.i.d. group": 1.0,
        "the first token's part of ∇J only": _cosine(
            torch.where(_prompt_logits(), _world()["grad"], 0.0), _world()["grad"]),
        "the squared cosine": _cosine(_rloo_one_level_mean(), _world()["grad"]) ** 2},
}

# The true option of each prediction (tr11_predict_*), by the routes above.
PREDICT_11: dict = {
    "tr11_predict_tree_saving": lambda: (
        "exactly" if abs(_iid_tokens() - _generated_tokens() - 3) < 1e-9
        else "fewer" if _iid_tokens() - _generated_tokens() < 3 else "more"),
    "tr11_predict_two_level_bias": lambda: "biased" if _two_level_bias() > 1e-9 else "unbiased",
    "tr11_predict_stem_gradient": lambda: (
        "zero" if float(_rloo_one_level_mean()[_prompt_logits()].abs().max()) < 1e-12
        else "unchanged" if float((_rloo_one_level_mean() - _world()["grad"])[
            _prompt_logits()].abs().max()) < 1e-12 else "smaller"),
}
