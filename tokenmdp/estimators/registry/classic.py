"""Registry entries: the classic estimators (REINFORCE to MiniRL) and their variants.

Each entry is a factory whose docstring gives its summary and default hyperparameters as the
papers give them; :func:`~tokenmdp.estimators.registry.entry._register` appends its formula, paper
and the names other frameworks use (as of late 2025). The ``±tis`` / ``±mis`` variants are
generated from the bases. Looked up through :mod:`~tokenmdp.estimators.registry.lookup`.
"""

from __future__ import annotations

import dataclasses

from tokenmdp.estimators.advantages.group import (
    BatchNormalized,
    GroupMean,
    GroupNormalized,
    LeaveOneOut,
    RewardAsAdvantage,
)
from tokenmdp.estimators.aggregation import Aggregation
from tokenmdp.estimators.corrections.factor import (
    ImportanceSampling,
    Level,
    MaskedIS,
    NoCorrection,
    TruncatedIS,
)
from tokenmdp.estimators.estimator import Estimator
from tokenmdp.estimators.kl import KLPenalty, kl_k3
from tokenmdp.estimators.registry.entry import _ENTRIES, _register, _variant
from tokenmdp.estimators.surrogates.clipped import CISPO, MiniRL, PPOClip
from tokenmdp.estimators.surrogates.sequence import GSPO, GSPOToken, SequenceRatio
from tokenmdp.estimators.surrogates.token import Reinforce, TokenRatio


# ---------------------------------------------------------------------- bases
@_register("reinforce", formula="-1/S Σ_i Σ_t R_i log π(y_it)",
           paper="Williams 1992, Machine Learning 8:229 (no arXiv)",
           aliases="vanilla policy gradient (Spinning Up VPG)")
def reinforce() -> Estimator:
    """REINFORCE: ``A = R``, weighted NLL, sequence-mean of token sums (``∇J`` up to 1/S)."""
    return Estimator(name="reinforce", surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("rloo", formula="-1/S Σ_i Σ_t (R_i - mean_{j≠i} R_j) log π(y_it)",
           paper="Kool et al. 2019 (ICLR DeepRLStructPred); Ahmadian et al., arXiv 2402.14740",
           aliases="verl adv_estimator=rloo (a one-response group keeps its reward there, is "
                   "refused here); TRL RLOOTrainer with beta=0.0, on-policy (its default beta "
                   "0.05 takes a KL off the reward, and its loss clips a sequence ratio, so "
                   "off-policy it differs); OpenRLHF advantage_estimator=rloo: the same "
                   "advantage at init_kl_coef=0 (its default 0.01 adds a k1 KL reward), trained "
                   "with PPO's clip over the batch's token mean (on-policy: this gradient times "
                   "S/N_tokens)")
def rloo() -> Estimator:
    """RLOO: leave-one-out baseline (unbiased), weighted NLL, sequence-mean of token sums."""
    return Estimator(name="rloo", surrogate=Reinforce(), advantage=LeaveOneOut(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("token_is", formula="-1/S Σ_i Σ_t ρ_it A_i, ρ_it = π_θ/μ = (π_old/μ)(π_θ/π_old)",
           paper="Zheng et al., arXiv 2512.01374, Eq. 3",
           aliases="Tinker loss_fn='importance_sampling' (ρ_t = π_θ/q against the sampler's "
                   "log-probs, a plain sum over tokens of the caller's advantages; this entry "
                   "divides by S)")
def token_is() -> Estimator:
    """Token-level IS: ``ρ_t Â`` (gradient = ∇ of the trust-region surrogate ``L_μ(π_θ)``),
    group-mean advantage, sequence-mean of token sums, IS on ``π_old/μ`` at the token level."""
    return Estimator(name="token_is", surrogate=TokenRatio(), advantage=GroupMean(),
                     correction=ImportanceSampling(level=Level.TOKEN),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("sequence_is", formula="-1/S Σ_i ρ(y_i) A_i, ρ(y) = Π_t π_θ/μ (log space)",
           paper="Precup et al. 2000 (ICML); Zheng et al., arXiv 2512.01374",
           aliases="-- (the unbiased, high-variance reference)")
def sequence_is() -> Estimator:
    """Sequence-level IS: unbiased for ``∇J`` off-policy, variance ``(1+χ²)^T``; group-mean
    advantage, sequence-mean of token sums, IS on ``π_old/μ`` at the sequence level."""
    return Estimator(name="sequence_is", surrogate=SequenceRatio(), advantage=GroupMean(),
                     correction=ImportanceSampling(level=Level.SEQUENCE),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("ppo", formula="-1/N Σ min(r Â, clip(r, 1-ε, 1+ε) Â), Â batch-normalized R",
           paper="Schulman et al., arXiv 1707.06347",
           aliases="verl policy_loss.loss_mode=vanilla (clip_ratio; its dual clip at "
                   "clip_ratio_c, default 3, is always on: ppo_verl); Tinker loss_fn='ppo' has "
                   "the same clip "
                   "(clip_low_threshold 0.8, clip_high_threshold 1.2) of π_θ/q against the "
                   "sampler, summed over tokens with the caller's advantages")
def ppo() -> Estimator:
    """PPO clip, ε = 0.2 (paper), token-mean. No critic here: the advantage is the
    batch-normalized reward (PPO's advantage normalization), a documented simplification."""
    return Estimator(name="ppo", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=BatchNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("grpo", formula="-1/S Σ_i 1/|y_i| Σ_t [min(r Â, clip(r) Â) - β k3], "
                           "Â = (R - mean_g)/std_g",
           paper="Shao et al. (DeepSeekMath), arXiv 2402.03300, Eq. 3",
           aliases="verl adv_estimator=grpo, loss_agg_mode=seq-mean-token-mean, use_kl_loss, "
                   "kl_loss_type=low_var_kl (verl's kl_loss_coef defaults to 0.001; set 0.04, "
                   "the paper's β used here), plus the dual clip at clip_ratio_c = 3 its vanilla "
                   "loss always applies (differs on Â < 0 tokens with r > 3: grpo_verl); TRL "
                   "loss_type='grpo', beta, epsilon (TRL divides by the group std + 1e-4, here "
                   "+ 1e-6; TRL's default vllm_importance_sampling "
                   "correction is sequence_mask at 3: grpo_trl_mis); a one-response group has "
                   "the advantage R/(1 + 1e-6) in verl, is refused here")
def grpo() -> Estimator:
    """GRPO: group mean/std advantage (sample std, ε 1e-6), PPO clip ε = 0.2, sequence-mean of
    token means, k3 KL in the loss with β = 0.04 (paper). Needs ``ref_logprob``."""
    return Estimator(name="grpo", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN,
                     kl=KLPenalty(coef=0.04, in_reward=False, estimator=kl_k3))


@_register("dr_grpo", formula="-1/(S L_max) Σ_i Σ_t min(r Â, clip(r) Â), Â = R - mean_g",
           paper="Liu et al. (Dr. GRPO), arXiv 2503.20783",
           aliases="verl norm_adv_by_std_in_grpo=False, loss_agg_mode=seq-mean-token-sum-norm "
                   "(its vanilla loss adds a dual clip at clip_ratio_c = 3 on Â < 0, r > 3; a "
                   "one-response group keeps its reward there, its deviation is 0 here); "
                   "TRL loss_type='dr_grpo', scale_rewards=False")
def dr_grpo() -> Estimator:
    """Dr. GRPO: no std and no ``1/|y|`` (both biases removed), PPO clip ε = 0.2, constant
    normalizer ``S · L_max`` (pass ``max_len`` to ``prepare``), no KL."""
    return Estimator(name="dr_grpo", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=GroupMean(), aggregation=Aggregation.CONSTANT)


@_register("dapo", formula="-1/N Σ_i Σ_t min(r Â, clip(r, 1-0.2, 1+0.28) Â), "
                           "Â = (R - mean_g)/std_g",
           paper="Yu et al. (DAPO), arXiv 2503.14476",
           aliases="verl clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=token-mean, "
                   "plus its always-on dual clip at clip_ratio_c = 3 (dapo_verl); TRL "
                   "loss_type='dapo', epsilon_high=0.28 (TRL divides by the group std + 1e-4, "
                   "here + 1e-6; with TRL's default sequence_mask correction at 3: "
                   "dapo_trl_mis)")
def dapo() -> Estimator:
    """DAPO: clip-higher (ε_low 0.2, ε_high 0.28), token-level mean over the step, no KL.
    Dynamic sampling and overlong shaping act on the data, not the loss."""
    return Estimator(name="dapo", surrogate=PPOClip(eps_low=0.2, eps_high=0.28),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("gspo", formula="-1/S Σ_i min(s_i Â_i, clip(s_i) Â_i), s_i = exp(mean_t log r_it)",
           paper="Zheng et al. (GSPO), arXiv 2507.18071",
           aliases="TRL importance_sampling_level='sequence' (with loss_type='grpo'; TRL's "
                   "sequence-level default is loss_type='dapo' with ε 0.2); verl "
                   "policy_loss.loss_mode=gspo is gspo_token: the same value, each token its "
                   "own gradient")
def gspo() -> Estimator:
    """GSPO: geometric-mean sequence ratio clipped at ε_low 3e-4, ε_high 4e-4 (paper), group
    mean/std advantage, sequence-mean of token means, no KL."""
    return Estimator(name="gspo", surrogate=GSPO(eps_low=3e-4, eps_high=4e-4),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)


@_register("gspo_token", formula="-1/S Σ_i 1/|y_i| Σ_t min(s_it Â_it, clip(s_it) Â_it), "
                                 "s_it = sg[s_i] π_θ/sg[π_θ]",
           paper="Zheng et al. (GSPO), arXiv 2507.18071, GSPO-token",
           aliases="verl policy_loss.loss_mode=gspo (loss_agg_mode='seq-mean-token-mean'; its "
                   "clip_ratio defaults to 0.2 / 0.2: set clip_ratio_low 3e-4, clip_ratio_high "
                   "4e-4 for the paper's band); TRL experimental GSPO-token")
def gspo_token() -> Estimator:
    """GSPO-token: GSPO's value; token gradients allow per-token advantages (ε as GSPO)."""
    return Estimator(name="gspo_token", surrogate=GSPOToken(eps_low=3e-4, eps_high=4e-4),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)


@_register("cispo", formula="-1/N Σ_i Σ_t sg(clip(r, 1-ε_low, 1+ε_high)) Â log π",
           paper="MiniMax (MiniMax-M1), arXiv 2506.13585",
           aliases="verl policy_loss.loss_mode=cispo (its clip_ratio_low defaults to 0.2, which "
                   "floors the weight at 0.8; the paper has no lower bound: clip_ratio_low=1); "
                   "Tinker loss_fn='cispo' clips to "
                   "[0, 4] (clip_low_threshold 0, clip_high_threshold 4), not [0, 1.2], and sums "
                   "over tokens: cispo_tinker")
def cispo() -> Estimator:
    """CISPO: clip the IS weight, not the update (no lower bound; ε_high 0.2), group mean/std
    advantage, token-mean, no KL."""
    return Estimator(name="cispo", surrogate=CISPO(eps_low=1.0, eps_high=0.2),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("minirl", formula="-1/S Σ_i Σ_t M_t sg(min(π_old/μ, 5) r_t) (R_i - mean_g) log π",
           paper="Zheng et al. (MiniRL), arXiv 2512.01374",
           aliases="-- (Qwen's minimal baseline)")
def minirl() -> Estimator:
    """MiniRL: PPO mask on ``r`` with ε_low 0.2, ε_high 0.27, group-mean advantage (no std),
    sequence-mean of token sums (no ``1/|y|``), truncated IS at 5 on ``π_old/μ``."""
    return Estimator(name="minirl", surrogate=MiniRL(eps_low=0.2, eps_high=0.27),
                     advantage=GroupMean(), correction=TruncatedIS(cap=5.0, level=Level.TOKEN),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


# ---------------------------------------------------------------------- variants
_TIS = TruncatedIS(cap=2.0, level=Level.TOKEN)
_MIS = MaskedIS(low=0.5, high=5.0, level=Level.TOKEN, masked_in_normalizer=True)
_TIS_ALIASES = ("verl algorithm.rollout_correction.rollout_is=token, rollout_is_threshold=2; TRL "
                "vllm_importance_sampling_mode='token_truncate', clip_max=2 (TRL's defaults are "
                "'sequence_mask' and 3: the *_trl_mis entries); ms-swift token_truncate")
_MIS_ALIASES = ("IcePop; verl algorithm.rollout_correction.rollout_is=token, "
                "rollout_is_threshold='0.5_5.0' (its decoupled_token_icepop preset: weights "
                "zeroed, response_mask kept); ms-swift token_mask; NeMo RL ICE-POP")


_TIS_TERM = "each token's surrogate term × sg(min(π_old/μ, 2))"
_MIS_TERM = ("each token's surrogate term × sg(π_old/μ) · 1[0.5 ≤ π_old/μ ≤ 5] (rejects stay in "
             "the normalizer)")


# which peer the GSPO variants equal (tests/estimators/registry/test_gspo_peers.py checks it
# against transcriptions of both): TRL's sequence level weights every token by its sequence's
# mean weight, verl's loss_mode=gspo (GSPO-token) each token by its own
_GSPO_ALIASES = {
    ("gspo", "tis"): "TRL importance_sampling_level='sequence' with "
                     "vllm_importance_sampling_mode='token_truncate', clip_max=2 (each token's "
                     "term gets its sequence's mean weight); verl loss_mode=gspo with "
                     "rollout_is=token is gspo_token_tis",
    ("gspo", "mis"): "no peer's option: TRL importance_sampling_level='sequence' has no band "
                     "(its vllm_importance_sampling_mode='token_mask' masks above the cap "
                     "only); verl loss_mode=gspo with rollout_is=token and the IcePop band is "
                     "gspo_token_mis",
    ("gspo_token", "tis"): "verl policy_loss.loss_mode=gspo with "
                           "algorithm.rollout_correction.rollout_is=token, rollout_is_threshold=2",
    ("gspo_token", "mis"): "verl policy_loss.loss_mode=gspo with "
                           "algorithm.rollout_correction.rollout_is=token, rollout_is_threshold="
                           "'0.5_5.0' (its decoupled_token_icepop preset); IcePop",
}
for _base in ("ppo", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "cispo"):
    _variant(_base, "tis", "token-level truncated IS, C = 2 (Yao et al. 2025)",
             _GSPO_ALIASES.get((_base, "tis"), _TIS_ALIASES), formula=f"; {_TIS_TERM}",
             correction=_TIS)
    _variant(_base, "mis", "token-level masked IS, band [0.5, 5], rejects kept in the normalizer "
             "(IcePop, arXiv 2510.18855)", _GSPO_ALIASES.get((_base, "mis"), _MIS_ALIASES),
             formula=f"; {_MIS_TERM}", correction=_MIS)
_variant("gspo", "geo_mis", "geometric-mean masked IS, band [0.5, 5], rejects kept in the "
         "normalizer", "no peer's option: verl's rollout_is has token and sequence levels only "
         "(no geometric level), TRL's and ms-swift's corrections are per token or per sequence",
         formula="; each sequence's surrogate terms × sg(w_i) · 1[0.5 ≤ w_i ≤ 5], w_i = "
                 "exp(mean_t log π_old/μ) (rejects stay in the normalizer)",
         correction=MaskedIS(low=0.5, high=5.0, level=Level.GEOMETRIC, masked_in_normalizer=True))
_variant("minirl", "no_is", "no training–inference correction (the paper's 'w/o train-infer IS' "
         "ablation, which collapses)", "--",
         formula="-1/S Σ_i Σ_t M_t sg(r_t) (R_i - mean_g) log π", correction=NoCorrection())
_variant("minirl", "mis", "masked instead of truncated IS, band [0.5, 5]", _MIS_ALIASES,
         formula="-1/S Σ_i Σ_t M_t sg(π_old/μ · 1[0.5 ≤ π_old/μ ≤ 5] r_t) (R_i - mean_g) log π",
         correction=_MIS)
_variant("minirl", "len_norm", "length normalization (the paper's '+length normalization' "
         "ablation: sequence-mean of token means)", "--",
         formula="-1/S Σ_i 1/|y_i| Σ_t M_t sg(min(π_old/μ, 5) r_t) (R_i - mean_g) log π",
         aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
# C = 5 is MiniRL's own cap of the token weight, so the entry differs from minirl only in where
# the weight is formed; docs/concepts/long_responses.md has the exact world's case for it
_variant("minirl", "seq_tis", "sequence-level truncated IS, C = 5: every token of a response "
         "weighted by min(Π_t π_old/μ_t, 5) instead of its own min(π_old/μ, 5) (TIS, Yao et al. "
         "2025, at the sequence level; the cap is MiniRL's)",
         "its correction is verl algorithm.rollout_correction.rollout_is=sequence, "
         "rollout_is_threshold=5 and TRL vllm_importance_sampling_mode='sequence_truncate', "
         "vllm_importance_sampling_clip_max=5, each on that framework's own surrogate (no peer "
         "has MiniRL's); ctpo weights its tokens the same way",
         formula="-1/S Σ_i Σ_t M_t sg(min(W_i, 5) r_t) (R_i - mean_g) log π, W_i = Π_s "
                 "π_old/μ (y_is) (log space)",
         correction=TruncatedIS(cap=5.0, level=Level.SEQUENCE))


# ---------------------------------------------------------------------- the peers' defaults
_DUAL = "verl's vanilla policy loss, whose dual clip at clip_ratio_c = 3 is always on"
for _base in ("ppo", "grpo", "dapo"):
    _surrogate = _ENTRIES[_base].build().surrogate
    _variant(_base, "verl", f"the dual clip c = 3 of {_DUAL}",
             f"verl policy_loss.loss_mode=vanilla, clip_ratio_c=3.0 (its default; verl asserts "
             f"c > 1, so the dual clip cannot be switched off); otherwise as {_base}",
             formula="; each token's term with Â < 0 is max(min(r Â, clip(r) Â), 3 Â) (no "
                     "gradient where r > 3)",
             surrogate=dataclasses.replace(_surrogate, dual_clip=3.0))
_variant("cispo", "tinker", "Tinker's band [0, 4] of the ratio and its sum over tokens",
         "Tinker loss_fn='cispo' with its defaults clip_low_threshold 0.0, clip_high_threshold "
         "4.0; Tinker's ratio is π_θ/q against the sampler's log-probs (pass them as "
         "old_logprob) and its loss a plain sum; its advantages are the caller's",
         formula="-Σ_i Σ_t sg(clip(r, 0, 4)) Â log π",
         surrogate=CISPO(eps_low=1.0, eps_high=3.0), aggregation=Aggregation.TOKEN_SUM)
_TRL_MIS = MaskedIS(high=3.0, level=Level.SEQUENCE, masked_in_normalizer=True)
for _base in ("grpo", "dapo"):
    _variant(_base, "trl_mis", "TRL's default training-inference correction: the sequence weight "
             "Π_t π_old/μ, zeroed above 3", "TRL GRPOConfig vllm_importance_sampling_correction="
             "True, vllm_importance_sampling_mode='sequence_mask', "
             "vllm_importance_sampling_clip_max 3.0 (its defaults; vllm_importance_sampling_cap "
             "in earlier releases; the masked sequences stay in the normalizer)",
             formula="; each sequence's terms × sg(W_i) 1[W_i ≤ 3], W_i = Π_t π_old/μ (rejects "
                     "stay in the normalizer)", correction=_TRL_MIS)
