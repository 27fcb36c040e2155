"""The exercises of tutorials 1–5, registered in :mod:`~tokenmdp.course.exercises.registry`.

Each setup repeats the one its tutorial builds (the same MDP, seeds and estimator), and each
expected value is computed by the package along a route the tutorial does not ask the student to
take: ``objective`` where the student sums responses, exact ``moments`` where the student writes a
closed form, the trainer's metric functions where the student averages tokens by hand. Tutorial 5's
exercises build the trainer-world model; their imports of :mod:`tokenmdp.rl` are deferred so that
``tokenmdp.check`` stays light for the other tutorials.
"""

from __future__ import annotations

import functools

import torch

from tokenmdp.course.exercises.registry import EXACT_TOL, SHARE_TOL, _exercise
from tokenmdp.course.setups import COPY_TASK_SEED, copy_task
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    GroupMean,
    GroupNormalized,
    LeaveOneOut,
    Level,
    Reinforce,
    TokenRatio,
    TruncatedIS,
    get,
)
from tokenmdp.exact import (
    NeuralPolicy,
    TabularPolicy,
    TokenMDP,
    gradient,
    inference_copy,
    moments,
    objective,
    stale_copy,
)

__all__: list[str] = []


def _scale_along_grad_j(m) -> float:
    """``c`` in ``E[ĝ] = c ∇J``: the projection ``<E ĝ, ∇J> / ‖∇J‖²`` (not ``Moments.scale``,
    which is the inverse rescaling)."""
    grad = m.true_gradient
    return float(m.mean @ grad / (grad @ grad))


# ---------------------------------------------------------------------- tutorial 1
#: Tutorial 1, exercise 2: the constant reward ``R(x, y) = c``.
TR01_CONSTANT = 3.0
#: Tutorial 1, exercise 2: the seed and width of the ``NeuralPolicy``.
TR01_NEURAL_SEED, TR01_NEURAL_HIDDEN = 2, 4


@_exercise("tr01_uniform_objective",
           quantity="J of the uniform policy (every logit 0) on the copy task of tutorial 1 "
                    "(tutorial 1, exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Every token has probability 1/V, so π(y|x) = V^(−|y|), for truncated responses "
                "too (L tokens, no EOS): J = Σ_x D(x) Σ_y V^(−|y|) R(x, y).")
def _tr01_uniform_objective() -> float:
    mdp, _ = copy_task()
    uniform = TabularPolicy(mdp, generator=torch.Generator().manual_seed(COPY_TASK_SEED),
                            init_std=0.0)
    with torch.no_grad():
        return float(objective(mdp, uniform))


def tr01_constant_mdp() -> TokenMDP:
    """Tutorial 1's copy-task prompts with the constant reward ``TR01_CONSTANT``.

    Returns
    -------
    TokenMDP
    """
    mdp, _ = copy_task()
    return TokenMDP(mdp.vocab_size, mdp.max_len, lambda x, y: TR01_CONSTANT, prompts=mdp.prompts,
                    prompt_probs=mdp.prompt_probs.tolist())


@_exercise("tr01_constant_reward_gradient_norm",
           quantity="‖∇J‖ of the NeuralPolicy (seed 2, hidden 4) when every response earns "
                    "R = 3 (tutorial 1, exercise 2)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="J(θ) = Σ_x D(x) Σ_y π_θ(y|x) c = c for every θ. A Monte Carlo estimate is not "
                "the gradient: it is c times the average score of the samples.")
def _tr01_constant_reward_gradient_norm() -> float:
    mdp = tr01_constant_mdp()
    neural = NeuralPolicy(mdp, generator=torch.Generator().manual_seed(TR01_NEURAL_SEED),
                          hidden=TR01_NEURAL_HIDDEN)
    return float(gradient(mdp, neural).norm())


# ---------------------------------------------------------------------- tutorial 2
#: Tutorial 2's group size for the fixed-baseline variances.
TR02_GROUP = 4


def tr02_mdp(shift: float = 0.0) -> TokenMDP:
    """Tutorial 2's MDP (``V = 3``, ``L = 2``, two prompts of probability ½, reward 1 when the
    response contains the prompt's token), with every reward lowered by ``shift`` (a baseline).

    Parameters
    ----------
    shift : float
        The constant baseline ``b``: the reward is ``R − b``.

    Returns
    -------
    TokenMDP
    """
    return TokenMDP(3, 2, lambda x, y: float(x[0] in y) - shift, prompts=[(0,), (1,)],
                    prompt_probs=[0.5, 0.5])


def tr02_policy(mdp: TokenMDP) -> TabularPolicy:
    """Tutorial 2's policy: tabular, seed 33, ``N(0, 1.5²)`` logits.

    Parameters
    ----------
    mdp : TokenMDP
        :func:`tr02_mdp` (any shift: the policy depends on the sizes only).

    Returns
    -------
    TabularPolicy
    """
    return TabularPolicy(mdp, generator=torch.Generator().manual_seed(33), init_std=1.5)


@_exercise("tr02_optimal_constant_baseline",
           quantity="the constant baseline b* that minimizes tr Cov of REINFORCE with "
                    "A = R − b on tutorial 2's MDP (tutorial 2, exercise 2)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Only (1/G) E[(R − b)² ‖σ‖²] depends on b; set its derivative to zero. The "
                "answer weights each response's reward by its squared score norm, for every G.")
def _tr02_optimal_constant_baseline() -> float:
    # the vertex of the exact variance parabola v(b), from the exact moments at b = −1, 0, 1
    policy = tr02_policy(tr02_mdp())
    v_minus, v_zero, v_plus = (moments(tr02_mdp(b), policy, get("reinforce"),
                                       group_size=TR02_GROUP, method="exact").total_variance
                               for b in (-1.0, 0.0, 1.0))
    return -(v_plus - v_minus) / (2 * (v_plus + v_minus - 2 * v_zero))


def tr02_grpo(ddof: int) -> Estimator:
    """Tutorial 2's GRPO: REINFORCE with the std-normalized group advantage (``ε = 0``).

    Parameters
    ----------
    ddof : int
        1 for the sample std (TRL, verl), 0 for the population std.

    Returns
    -------
    Estimator
    """
    return get("reinforce").replace(advantage=GroupNormalized(ddof=ddof, eps=0.0),
                                    name=f"GRPO, ddof={ddof}")


@_exercise("tr02_grpo_scale_g2",
           quantity="c in E[ĝ] = c ∇J for GRPO with the sample std (ε = 0), G = 2, on "
                    "tutorial 2's 0/1 reward (tutorial 2, exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="With G = 2 and 0/1 rewards a group is constant (advantage 0) or (1, 0): mean ½, "
                "sample std 1/√2. Compare the advantage with leave-one-out's R_1 − R_2.")
def _tr02_grpo_scale_g2() -> float:
    mdp = tr02_mdp()
    return _scale_along_grad_j(moments(mdp, tr02_policy(mdp), tr02_grpo(ddof=1), group_size=2,
                                       method="exact"))


# ---------------------------------------------------------------------- tutorial 3
#: Tutorial 3's cap of sequence-level truncated IS in the exercise.
TR03_CAP = 1.25
#: Tutorial 3's stale distance for the token-IS exercise.
TR03_STALE_DISTANCE = 1.5


def tr03_estimator(surrogate_part, correction=None) -> Estimator:
    """Tutorial 3's estimator: leave-one-out advantage (``G = 2``), loss weight ``1/S``.

    Parameters
    ----------
    surrogate_part : Surrogate
        The surrogate under study.
    correction : Correction, optional
        The training–inference correction (default: none).

    Returns
    -------
    Estimator
    """
    kw = {} if correction is None else {"correction": correction}
    return Estimator(surrogate=surrogate_part, advantage=LeaveOneOut(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM, **kw)


def tr03_engine(policy):
    """Tutorial 3's inference engine ``μ``: 3 mantissa bits, logit noise 0.5, seed 1.

    Parameters
    ----------
    policy : nn.Module
        ``π_old`` (the copy task's policy).

    Returns
    -------
    nn.Module
    """
    return inference_copy(policy, rounding=3, noise_std=0.5,
                          generator=torch.Generator().manual_seed(1))


@_exercise("tr03_token_is_relative_bias",
           quantity="‖E[ĝ_token IS] − ∇J‖ / ‖∇J‖ with data from π_old = stale_copy(π, 1.5), "
                    "G = 2, Â = R_1 − R_2 (tutorial 3, exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Token-level IS is unbiased for ∇L_{π_old}(π), the trust-region surrogate's "
                "gradient: its bias is ∇L − ∇J (surrogate and gradient, no moments).")
def _tr03_token_is_relative_bias() -> float:
    mdp, pi = copy_task()
    stale = stale_copy(mdp, pi, distance=TR03_STALE_DISTANCE)
    return moments(mdp, pi, tr03_estimator(TokenRatio()), group_size=2, behavior=stale,
                   method="enumeration").relative_bias


@_exercise("tr03_tis_sequence_bias_norm",
           quantity="‖E[ĝ] − ∇J‖ of sequence-level truncated IS (C = 1.25, G = 2, "
                    "Â = R_1 − R_2) with tutorial 3's inference engine μ (tutorial 3, exercise 2)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="E[ĝ] = Σ_x D(x) (E_μ[min(W, C) R σ] − E_μ[R] E_μ[min(W, C) σ]): the baseline "
                "term does not vanish once W is truncated.")
def _tr03_tis_sequence_bias_norm() -> float:
    mdp, pi = copy_task()
    est = tr03_estimator(TokenRatio(), TruncatedIS(cap=TR03_CAP, level=Level.SEQUENCE))
    return float(moments(mdp, pi, est, group_size=2, behavior=tr03_engine(pi), old=pi,
                         method="enumeration").bias.norm())


# ---------------------------------------------------------------------- tutorial 4
def tr04_world() -> tuple[TokenMDP, TabularPolicy]:
    """Tutorial 4's MDP and policy: the first token is the answer (0 right), the policy is
    usually wrong and rambles when it is wrong.

    Returns
    -------
    (TokenMDP, TabularPolicy)
    """
    eos, wrong = 2, 1
    mdp = TokenMDP(3, 4, lambda x, y: float(y[0] == 0), prompts=[(0,)])
    policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(4), init_std=0.5)
    prefixes = [tuple(p) for k in range(mdp.max_len) for p in mdp.level_prefixes(k)[1].tolist()]
    with torch.no_grad():
        policy.table[0] = torch.tensor([-1.0, 0.5, -2.5])
        for s, prefix in enumerate(prefixes):
            if prefix and prefix[0] == wrong:
                policy.table[s, eos] -= 2.0
    return mdp, policy


#: Tutorial 4's group size in the exercises.
TR04_GROUP = 2
#: Tutorial 4's group size in the constant-normalizer exercise.
TR04_CONSTANT_GROUP = 3


@_exercise("tr04_rloo_token_mean_norm",
           quantity="‖E[ĝ]‖ of leave-one-out with the per-sequence token mean, G = 2, on "
                    "tutorial 4's MDP (tutorial 4, exercise 2)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="The other samples are independent of y_i: E[A_i σ_i/|y_i|] = ∇E[(R − b)/|y|] "
                "with b = J held fixed. Is there still a factor (G − 1)/G?")
def _tr04_rloo_token_mean_norm() -> float:
    mdp, policy = tr04_world()
    est = Estimator(surrogate=Reinforce(), advantage=LeaveOneOut(),
                    aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
    return float(moments(mdp, policy, est, group_size=TR04_GROUP).mean.norm())


@_exercise("tr04_constant_scale_g3",
           quantity="c in E[ĝ] = c ∇J for the constant normalizer 1/(S L_max) with the "
                    "group-mean advantage, G = 3, L_max = 4 (tutorial 4, exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Each sequence's weight is 1/(G L), the same for every response; the group mean "
                "gives E[A_i σ_i] = (G − 1)/G ∇J.")
def _tr04_constant_scale_g3() -> float:
    mdp, policy = tr04_world()
    est = Estimator(surrogate=Reinforce(), advantage=GroupMean(),
                    aggregation=Aggregation.CONSTANT)
    return _scale_along_grad_j(moments(mdp, policy, est, group_size=TR04_CONSTANT_GROUP))


# ---------------------------------------------------------------------- tutorial 5
#: Tutorial 5's tiny MoE (the model of benchmarks/acceptance.py).
TR05_MODEL = dict(d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, expert_hidden=64)
#: Tutorial 5's rollouts: prompts drawn with this NumPy seed, each sampled this many times.
TR05_PROMPT_SEED, TR05_PROMPTS, TR05_SAMPLES = 6, 128, 4
#: Tutorial 5's sampling: the generator seed and the response budget.
TR05_SAMPLE_SEED, TR05_MAX_NEW_TOKENS = 7, 4


@functools.cache
def tr05_bf16_rollout():
    """Tutorial 5's bf16 rollout: the seeded initial model, 4 samples of each of 128 task
    prompts at temperature 1, packed first-fit-decreasing (cached; do not modify).

    Returns
    -------
    (nn.Module, TokenBatch)
        The float32 model and the packed batch with ``behavior_logprob`` and the engine's routing.
    """
    import numpy as np

    from tokenmdp.packing import pack_first_fit_decreasing
    from tokenmdp.rl.config import TrainConfig
    from tokenmdp.rl.rollout import RolloutEngine
    from tokenmdp.rl.run_setup import build_model
    from tokenmdp.rl.tasks import get_task

    task = get_task("addition")
    tok = task.tokenizer
    model = build_model(TrainConfig(seed=0, **TR05_MODEL), tok.vocab_size)
    prompts = [tok.encode(ex.prompt)
               for ex in task.sample(TR05_PROMPTS, np.random.default_rng(TR05_PROMPT_SEED))
               for _ in range(TR05_SAMPLES)]
    sampled = RolloutEngine(model, precision="bf16").generate(
        prompts, max_new_tokens=TR05_MAX_NEW_TOKENS, eos_id=tok.EOS,
        generator=torch.Generator().manual_seed(TR05_SAMPLE_SEED))
    return model, pack_first_fit_decreasing(sampled, task.max_prompt_len() + TR05_MAX_NEW_TOKENS)


@_exercise("tr05_r2_routing_mismatch",
           quantity="the routing mismatch between tutorial 5's bf16 engine and the old_logprob "
                    "pass with replay='r2' (tutorial 5, exercise 2)",
           tolerance=SHARE_TOL, tolerance_name="SHARE_TOL",
           hint="R2 records the old pass's routing and replays it in the update passes; which "
                "experts does the old pass itself use?")
def _tr05_r2_routing_mismatch() -> float:
    from tokenmdp.rl.mismatch import ENGINE_ROUTING, OLD_ROUTING, compute_old_logprobs, routing_mismatch_rate

    model, batch = tr05_bf16_rollout()
    with torch.no_grad():
        old = compute_old_logprobs(model, batch, "r2")
    return float(routing_mismatch_rate(old.token_extras[ENGINE_ROUTING],
                                       old.token_extras[OLD_ROUTING]))


@_exercise("tr05_k1_estimate",
           quantity="the k1 estimate of KL(μ ‖ π_old) per token from tutorial 5's bf16 rollout, "
                    "no routing replay (tutorial 5, exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="k1 averages log μ − log π_old = behavior_logprob − old_logprob over the loss "
                "tokens sampled by μ; each term can have either sign.")
def _tr05_k1_estimate() -> float:
    from tokenmdp.rl.mismatch import compute_old_logprobs, training_inference_kl

    model, batch = tr05_bf16_rollout()
    with torch.no_grad():
        old = compute_old_logprobs(model, batch, "none")
    return training_inference_kl(old, kind="k1")
