"""The "Predict first" questions of tutorials 1–5 (``tr<NN>_predict_*``), registered in
:mod:`~tokenmdp.course.exercises.registry`.

Each prediction belongs to a numeric exercise of :mod:`~tokenmdp.course.exercises.t01_05` and
shares its setup; its true option is computed from that exercise's exact value (``expected``)
against a second exact quantity of the same setup (``J`` of another policy, the bias of another
correction, the scale at another group size), never written down. Tutorial 5's imports of
:mod:`tokenmdp.rl` are deferred, as in ``t01_05``.
"""

from __future__ import annotations

import torch

from tokenmdp.course.exercises.registry import EXACT_TOL, SHARE_TOL, _prediction, expected
from tokenmdp.course.exercises.t01_05 import (
    TR04_GROUP,
    _scale_along_grad_j,
    tr02_mdp,
    tr02_policy,
    tr03_engine,
    tr03_estimator,
    tr04_world,
    tr05_bf16_rollout,
)
from tokenmdp.course.setups import copy_task
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    GroupMean,
    LeaveOneOut,
    NoCorrection,
    Reinforce,
    TokenRatio,
)
from tokenmdp.exact import flat_grad, gradient, length_normalized_objective, moments, objective, stale_copy

__all__: list[str] = []


def _nearest(value, candidates: dict) -> str:
    """The option whose candidate (a float or a flat vector) is nearest to ``value``."""
    def distance(item):
        return float(torch.as_tensor(value - item[1], dtype=torch.float64).abs().max())
    return min(candidates.items(), key=distance)[0]


# ---------------------------------------------------------------------- tutorial 1
@_prediction("tr01_predict_uniform_objective",
             question="Is J of the uniform policy (every logit 0) above or below J of the "
                      "seeded copy-task policy of section 2?",
             options=("above", "below"),
             hint="J = Σ_x D(x) Σ_y π(y|x) R(x, y): compare where each policy puts its "
                  "probability — on responses that copy the prompt token, on an early EOS, on "
                  "truncated responses (−1) — with J of the seeded policy printed in section 2.")
def _tr01_predict_uniform_objective() -> str:
    mdp, seeded = copy_task()
    with torch.no_grad():
        j_seeded = float(objective(mdp, seeded))
    return "above" if expected("tr01_uniform_objective") > j_seeded else "below"


@_prediction("tr01_predict_constant_reward_gradient",
             question="When every response earns the same reward c, is ∇J zero or nonzero (for "
                      "any policy and any θ)?",
             options=("zero", "nonzero"),
             hint="Write J(θ) with R = c and use that π_θ(·|x) is a probability distribution "
                  "for every θ.")
def _tr01_predict_constant_reward_gradient() -> str:
    return "zero" if expected("tr01_constant_reward_gradient_norm") <= EXACT_TOL else "nonzero"


# ---------------------------------------------------------------------- tutorial 2
@_prediction("tr02_predict_grpo_scale_g2",
             question="GRPO with the sample std (ddof=1, ε = 0), G = 2, 0/1 rewards: in "
                      "E[ĝ] = c ∇J, is c smaller than 1, equal to 1 or larger than 1?",
             options=("smaller", "equal", "larger"),
             hint="With G = 2 the population std of the pair (1, 0) is ½, which makes GRPO "
                  "leave-one-out exactly (c = 1); compare the sample std with it.")
def _tr02_predict_grpo_scale_g2() -> str:
    c = expected("tr02_grpo_scale_g2")
    return "equal" if abs(c - 1) <= EXACT_TOL else "smaller" if c < 1 else "larger"


@_prediction("tr02_predict_baseline_vs_j",
             question="Is the variance-minimizing constant baseline b* of REINFORCE above or "
                      "below J on tutorial 2's MDP?",
             options=("above", "below"),
             hint="b* weights each response's reward by its squared score norm ‖σ‖²: ask whether "
                  "the rewarded responses (R = 1) have larger score norms than the others.")
def _tr02_predict_baseline_vs_j() -> str:
    mdp = tr02_mdp()
    with torch.no_grad():
        j = float(objective(mdp, tr02_policy(mdp)))
    return "above" if expected("tr02_optimal_constant_baseline") > j else "below"


# ---------------------------------------------------------------------- tutorial 3
#: The sweep's stale distances on either side of tutorial 3's exercise 1 (d = 1.5).
TR03_SWEEP_NEIGHBOURS = {"a": 1.0, "b": 2.0}


@_prediction("tr03_predict_token_is_bias",
             question="With data from stale_copy(π, 1.5), is the relative bias of token-level IS "
                      "closer to (a) the sweep's value at d = 1 or (b) its value at d = 2?",
             options=("a", "b"),
             hint="Read the sweep's biases at d = 0.5, 1, 2 and 4: whether the curve grows in "
                  "proportion to d, faster or slower decides which end the middle is nearer to.")
def _tr03_predict_token_is_bias() -> str:
    mdp, pi = copy_task()
    at = {option: moments(mdp, pi, tr03_estimator(TokenRatio()), group_size=2,
                          behavior=stale_copy(mdp, pi, distance=d),
                          method="enumeration").relative_bias
          for option, d in TR03_SWEEP_NEIGHBOURS.items()}
    return _nearest(expected("tr03_token_is_relative_bias"), at)


@_prediction("tr03_predict_tis_vs_no_correction",
             question="With tutorial 3's engine μ, is ‖E[ĝ] − ∇J‖ of sequence-level truncated IS "
                      "(C = 1.25) larger or smaller than that of no correction?",
             options=("larger", "smaller"),
             hint="min(W, C) is the exact weight W = π/μ wherever W ≤ C, where no correction "
                  "uses 1; ask how many responses have W > C and what the cap leaves of them.")
def _tr03_predict_tis_vs_no_correction() -> str:
    mdp, pi = copy_task()
    none = moments(mdp, pi, tr03_estimator(TokenRatio(), NoCorrection()), group_size=2,
                   behavior=tr03_engine(pi), old=pi, method="enumeration")
    tis = expected("tr03_tis_sequence_bias_norm")
    return "larger" if tis > float(none.bias.norm()) else "smaller"


# ---------------------------------------------------------------------- tutorial 4
@_prediction("tr04_predict_constant_scale_g3",
             question="Constant normalizer 1/(S L_max) with the group-mean advantage, L_max = 4: "
                      "is c in E[ĝ] = c ∇J larger or smaller at G = 3 than at G = 2?",
             options=("larger", "smaller"),
             hint="Two factors depend on G: the weight 1/(G L) of each sequence and the group "
                  "mean's shrinkage of E[A_i σ_i].")
def _tr04_predict_constant_scale_g3() -> str:
    mdp, policy = tr04_world()
    est = Estimator(surrogate=Reinforce(), advantage=GroupMean(),
                    aggregation=Aggregation.CONSTANT)
    at_two = _scale_along_grad_j(moments(mdp, policy, est, group_size=2))
    return "larger" if expected("tr04_constant_scale_g3") > at_two else "smaller"


@_prediction("tr04_predict_rloo_token_mean_vector",
             question="Leave-one-out with the per-sequence token mean, G = 2: is E[ĝ] (a) ∇J, "
                      "(b) ∇E[(R − J)/|y|] with J held fixed, or (c) (G − 1)/G ∇E[(R − J)/|y|]?",
             options=("a", "b", "c"),
             hint="Dividing by |y| changes the objective (section 4); the leave-one-out baseline "
                  "leaves out R_i: what is its mean given y_i, and does a shrinkage remain?")
def _tr04_predict_rloo_token_mean_vector() -> str:
    mdp, policy = tr04_world()
    est = Estimator(surrogate=Reinforce(), advantage=LeaveOneOut(),
                    aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
    mean = moments(mdp, policy, est, group_size=TR04_GROUP).mean
    with torch.no_grad():
        j = float(objective(mdp, policy))
    per_token = flat_grad(length_normalized_objective(mdp, policy, baseline=j), policy)
    return _nearest(mean, {"a": gradient(mdp, policy), "b": per_token,
                           "c": (TR04_GROUP - 1) / TR04_GROUP * per_token})


# ---------------------------------------------------------------------- tutorial 5
@_prediction("tr05_predict_k1_sign",
             question="Is the k1 estimate of KL(μ ‖ π_old) per token, from tutorial 5's bf16 "
                      "rollout without replay, positive or negative?",
             options=("positive", "negative"),
             hint="k1 is unbiased for a KL ≥ 0, but it averages terms log μ − log π_old of "
                  "either sign: compare the size of the KL with the noise of that average.")
def _tr05_predict_k1_sign() -> str:
    return "positive" if expected("tr05_k1_estimate") > 0 else "negative"


@_prediction("tr05_predict_r2_mismatch",
             question="Which of section 2's bf16 routing mismatches does R2's old_logprob pass "
                      "reproduce against the engine: (a) no replay's, (b) R3's, or (c) neither?",
             options=("a", "b", "c"),
             hint="R2 records the old pass's routing for the later update passes; ask which "
                  "experts the old pass itself uses.")
def _tr05_predict_r2_mismatch() -> str:
    from tokenmdp.rl.mismatch import ENGINE_ROUTING, OLD_ROUTING, compute_old_logprobs, routing_mismatch_rate

    model, batch = tr05_bf16_rollout()
    rates = {}
    for option, replay in (("a", "none"), ("b", "r3")):
        with torch.no_grad():
            old = compute_old_logprobs(model, batch, replay)
        rates[option] = float(routing_mismatch_rate(old.token_extras[ENGINE_ROUTING],
                                                    old.token_extras[OLD_ROUTING]))
    r2 = expected("tr05_r2_routing_mismatch")
    option = _nearest(r2, rates)
    return option if abs(r2 - rates[option]) <= SHARE_TOL else "c"
