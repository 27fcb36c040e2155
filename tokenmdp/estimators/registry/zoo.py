"""Registry entries: the newer surrogates (SAPO, DPPO, GMPO, OPSM, per-decision IS, LUSPO,
an entropy bonus, CTPO) and verl's rejection masks, registered
like the classic ones and looked up through :mod:`~tokenmdp.estimators.registry.lookup`.
"""

from __future__ import annotations

from tokenmdp.estimators.advantages.group import (
    GroupMean,
    GroupNormalized,
)
from tokenmdp.estimators.aggregation import Aggregation
from tokenmdp.estimators.corrections.factor import Level, TruncatedIS
from tokenmdp.estimators.corrections.rejection import RejectionSampling
from tokenmdp.estimators.corrections.self_normalized import SelfNormalizedIS
from tokenmdp.estimators.estimator import Estimator
from tokenmdp.estimators.registry.classic import grpo, ppo
from tokenmdp.estimators.registry.entry import _register, _variant
from tokenmdp.estimators.surrogates.ctpo import CTPOClip
from tokenmdp.estimators.surrogates.per_decision import PerDecisionRatio
from tokenmdp.estimators.surrogates.sequence import GSPO, SequenceRatio
from tokenmdp.estimators.surrogates.soft import GMPO, SAPO, EntropyBonus
from tokenmdp.estimators.surrogates.token import TokenRatio
from tokenmdp.estimators.surrogates.trust_region_masks import DPPO, OffPolicySequenceMask


@_register("sapo", formula="-1/S Σ_i 1/|y_i| Σ_t (4/τ) σ(τ (r_t - 1)) Â_i, τ = τ_pos if Â > 0 "
                           "else τ_neg",
           paper="Gao et al. (SAPO), arXiv 2511.20347",
           aliases="verl policy_loss.loss_mode=sapo (tau_pos 1.0, tau_neg 1.05; the loss "
                   "always aggregates seq-mean-token-mean); TRL loss_type='sapo' "
                   "(sapo_temperature_pos 1.0, sapo_temperature_neg 1.05)")
def sapo() -> Estimator:
    """SAPO: temperature-gated soft clip, τ_pos 1.0, τ_neg 1.05 (paper), group mean/std
    advantage, sequence-mean of token means, no KL."""
    return Estimator(name="sapo", surrogate=SAPO(tau_pos=1.0, tau_neg=1.05),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)


_DPPO_ALIASES = ("verl policy_loss.loss_mode=dppo_{kind} (clip_ratio_low / clip_ratio_high are "
                 "the {name} thresholds; its example script: {delta}, Dr. GRPO advantage, "
                 "seq-mean-token-sum-norm, bypass_mode; verl's weight is sg(min(r, clip_ratio_c)), "
                 "the example sets clip_ratio_c = 10000, i.e. no cap; left unset, its "
                 "ActorConfig's clip_ratio_c = 3.0 caps the weight at 3: DPPO(cap=3.0)); "
                 "prime-rl")


@_register("dppo_tv", formula="-1/(S L_max) Σ_i Σ_t M_t sg(r_t) Â log π, M_t = 0 iff "
                              "Â > 0, p - p_old > δ or Â <= 0, p - p_old < -δ (p = π_θ(y_t))",
           paper="Qi et al. (DPPO, 'Rethinking the trust region in LLM RL'), arXiv 2602.04879",
           aliases=_DPPO_ALIASES.format(kind="tv", name="TV", delta="0.15"))
def dppo_tv() -> Estimator:
    """DPPO-Binary-TV: a total-variation trust-region mask on the sampled token's probability,
    δ = 0.15 both ways, group-mean advantage, constant normalizer ``S · L_max``, no KL."""
    return Estimator(name="dppo_tv",
                     surrogate=DPPO(divergence="tv", delta_low=0.15, delta_high=0.15),
                     advantage=GroupMean(), aggregation=Aggregation.CONSTANT)


@_register("dppo_kl", formula="-1/(S L_max) Σ_i Σ_t M_t sg(r_t) Â log π, M_t = 0 iff "
                              "KL(Ber(p_old) ‖ Ber(p)) > δ moving p the way Â pushes",
           paper="Qi et al. (DPPO, 'Rethinking the trust region in LLM RL'), arXiv 2602.04879",
           aliases=_DPPO_ALIASES.format(kind="kl", name="binary-KL", delta="0.05"))
def dppo_kl() -> Estimator:
    """DPPO-Binary-KL: the binary-KL trust-region mask, δ = 0.05 both ways, group-mean
    advantage, constant normalizer ``S · L_max``, no KL penalty."""
    return Estimator(name="dppo_kl",
                     surrogate=DPPO(divergence="kl", delta_low=0.05, delta_high=0.05),
                     advantage=GroupMean(), aggregation=Aggregation.CONSTANT)


@_register("gmpo", formula="-1/S Σ_i Â_i exp(mean_t ℓ_it), ℓ = log r capped at ε (Â > 0) or "
                           "floored at -ε (Â < 0)",
           paper="Zhao et al. (GMPO), arXiv 2507.20673",
           aliases="verl policy_loss.loss_mode=geo_mean (clip_ratio_low / clip_ratio_high are "
                   "the log-space bounds: set 0.4 for the paper, verl's clip_ratio default is "
                   "0.2; the loss is a mean over sequences whatever loss_agg_mode says)")
def gmpo() -> Estimator:
    """GMPO: geometric mean of the token ratios clipped in log space at ±0.4 (paper), group
    mean/std advantage, sequence-mean of token means (the paper's ``1/G Σ_i``), no KL."""
    return Estimator(name="gmpo", surrogate=GMPO(eps_low=0.4, eps_high=0.4),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)


@_register("grpo_opsm", formula="grpo's loss with each token's clipped term times M_i, M_i = 0 "
                                "iff Â_i < 0 and mean_t log(μ/π_θ) > δ",
           paper="DeepSeek-AI (DeepSeek-V3.2), arXiv 2512.02556, off-policy sequence masking",
           aliases="TRL off_policy_mask_threshold=δ (default None: off; its docs suggest 0.5; "
                   "the divergence uses the sampling log-probs, π_old without them) with "
                   "vllm_importance_sampling_correction=False (the sampling log-probs come with "
                   "use_vllm, whose default sequence_mask correction at 3 also multiplies every "
                   "term by the sequence's ratio); slime "
                   "off-policy sequence mask")
def grpo_opsm() -> Estimator:
    """GRPO with off-policy sequence masking, δ = 0.5 against ``μ``: negative-advantage
    responses that ``π_θ`` has moved away from by more than 0.5 nats per token are dropped.
    Otherwise as ``grpo`` (k3 KL in the loss, β = 0.04; needs ``ref_logprob``)."""
    base = grpo()
    return base.replace(name="grpo_opsm",
                        surrogate=OffPolicySequenceMask(base.surrogate, delta=0.5,
                                                        against="behavior"))


@_register("per_decision_is", formula="-1/S Σ_i Σ_t ρ_{i,1:t} A_i log π (gradient), "
                                      "ρ_{i,1:t} = Π_{s<=t} π_θ/μ",
           paper="Precup et al. 2000 (ICML); Zhang et al. (CTPO), arXiv 2605.07331",
           aliases="CTPO's cumulative token ratio without its position-adaptive clip")
def per_decision_is() -> Estimator:
    """Per-decision IS: token t's score weighted by the cumulative ratio ``π_θ/μ`` of its
    prefix and itself (no separate correction: the ratio is against ``μ``), group-mean
    advantage, sequence-mean of token sums (as ``sequence_is``). Exact for each decision's
    prefix; the continuation stays ``μ``'s (see :mod:`~tokenmdp.estimators.surrogates.per_decision`)."""
    return Estimator(name="per_decision_is", surrogate=PerDecisionRatio(against="behavior"),
                     advantage=GroupMean(), aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("luspo", formula="-1/S Σ_i |y_i| min(s_i Â_i, clip(s_i) Â_i), "
                            "s_i = exp(mean_t log r_it)",
           paper="Liu et al. (LUSPO), arXiv 2602.05261",
           aliases="TRL loss_type='luspo', importance_sampling_level='sequence', epsilon 2e-3, "
                   "epsilon_high 2.5e-3")
def luspo() -> Estimator:
    """LUSPO: GSPO with each sequence's loss scaled by its length, i.e. GSPO's surrogate under
    sequence-mean of token sums; ε_low 2e-3, ε_high 2.5e-3 (paper Sec. 5.1), group mean/std
    advantage, no KL."""
    return Estimator(name="luspo", surrogate=GSPO(eps_low=2e-3, eps_high=2.5e-3),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("ppo_entropy", formula="ppo's loss - c/N Σ_t ĥ_t, ĥ_t = -r_t log π(y_t) "
                                  "(sampled-token entropy)",
           paper="Schulman et al., arXiv 1707.06347, Eq. 9 (entropy bonus, c_2 = 0.01)",
           aliases="verl actor.entropy_coeff and TRL entropy_coef (default 0.0) differentiate "
                   "the full distribution's entropy from the logits: the same gradient in "
                   "expectation, not per batch")
def ppo_entropy() -> Estimator:
    """PPO with an entropy bonus, c = 0.01 (the paper's Atari setting), on the sampled token's
    entropy estimate; otherwise as ``ppo``."""
    base = ppo()
    return base.replace(name="ppo_entropy", surrogate=EntropyBonus(base.surrogate, coef=0.01))


# ---------------------------------------------------------------------- issue 15: corrections
@_register("ctpo", formula="-1/N Σ_t sg(min(W_i, 5)) max(min(e^L Â, e^{clamp(L, lo_t, hi_t)} Â), "
                           "e^{c_t} Â [Â<0]), L = Σ_{s<=t} log π_θ/π_old, lo_t = -0.025 √t, "
                           "hi_t = c_t = 0.05 √t, W_i = Π_t π_old/μ",
           paper="Zhang et al. (CTPO), arXiv 2605.07331; the authors' verl loss "
                 "cum-token-cumprod-la (github.com/horizon-llm/CTPO)",
           aliases="horizon-llm/CTPO policy_loss.loss_mode=cum-token-cumprod-la, la_clip_low "
                   "0.025, la_clip_high 0.05, la_clip_c 0.05, clip_ratio_la_power 0.5, with its "
                   "ctpo.sh rollout correction rollout_is=sequence, rollout_is_threshold 5.0; "
                   "adv_estimator=grpo; verl's default loss_agg_mode token-mean")
def ctpo() -> Estimator:
    """CTPO-LA: the cumulative token ratio ``ρ_{1:t}`` against ``π_old`` clipped in log space
    with bounds growing like ``√t`` and an always-on dual clip (the authors' defaults), group
    mean/std advantage, token-mean, sequence-level TIS at 5 on ``π_old/μ`` (their script's
    rollout correction), no KL. Unclipped, the cumulative ratio is ``per_decision_is``."""
    return Estimator(name="ctpo", surrogate=CTPOClip(), advantage=GroupNormalized(ddof=1, eps=1e-6),
                     correction=TruncatedIS(cap=5.0, level=Level.SEQUENCE),
                     aggregation=Aggregation.TOKEN_MEAN)


_RS_ALIASES = ("verl algorithm.rollout_correction.rollout_rs={option}, rollout_rs_threshold="
               "'0.5_2.0' (the band of its decoupled_seq_is_rs preset and of its multi-criteria "
               "example, here without IS weights; rejected tokens leave response_mask, so they "
               "leave the normalizers and the KL term{note}); RejectionSampling.from_verl "
               "reads any other option")
_variant("grpo", "rs_token", "verl's token rejection mask: tokens whose μ/π_old leaves [0.5, 2] "
         "are dropped, the others keep factor 1 (no IS weight)",
         _RS_ALIASES.format(option="token_k1", note=""),
         formula="; each token's terms × 1[0.5 ≤ μ/π_old ≤ 2] (rejects leave the normalizer "
                 "and the loss)",
         correction=RejectionSampling.from_verl("token_k1", "0.5_2.0"))
_variant("grpo", "rs_seq", "verl's sequence rejection mask: sequences whose product of μ/π_old "
         "leaves [0.5, 2] are dropped, the others keep factor 1 (no IS weight)",
         _RS_ALIASES.format(
             option="seq_sum_k1", note="; the sequence count S is the whole mini-batch, as "
             "verl's newer engine passes it; agg_loss's own default counts only the sequences "
             "that keep a token"),
         formula="; each sequence's terms × 1[0.5 ≤ Π_t μ/π_old ≤ 2] (rejects leave the "
                 "normalizer and the loss)",
         correction=RejectionSampling.from_verl("seq_sum_k1", "0.5_2.0"))


_SNIS_ALIASES = ("verl algorithm.rollout_correction.rollout_is={level} with "
                 "rollout_is_batch_normalize=True (there with rollout_is_threshold 2.0 truncating "
                 "first: SelfNormalizedIS(cap=2.0)); the weights over their step mean, computed "
                 "once in prepare")


@_register("token_snis", formula="-1/S Σ_i Σ_t (w_it / w̄) ρ_t A_i, w = π_old/μ, w̄ the mean of w "
                                 "over the step's loss tokens, ρ_t = π_θ/π_old",
           paper="Owen 2013, Monte Carlo theory, methods and examples, §9.2 (self-normalized "
                 "importance sampling; no arXiv)",
           aliases=_SNIS_ALIASES.format(level="token"))
def token_snis() -> Estimator:
    """Token-level self-normalized IS: ``token_is`` with the training–inference weights divided
    by their mean over the step (biased, consistent: the bias falls like 1/G), group-mean
    advantage, sequence-mean of token sums."""
    return Estimator(name="token_snis", surrogate=TokenRatio(), advantage=GroupMean(),
                     correction=SelfNormalizedIS(level=Level.TOKEN),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("sequence_snis", formula="-1/S Σ_i (W_i / W̄) ρ(y_i) A_i, W_i = Π_t π_old/μ, W̄ the "
                                    "mean of W over the step's sequences, ρ(y) = Π_t π_θ/π_old",
           paper="Owen 2013, Monte Carlo theory, methods and examples, §9.2 (self-normalized "
                 "importance sampling; no arXiv)",
           aliases=_SNIS_ALIASES.format(level="sequence"))
def sequence_snis() -> Estimator:
    """Sequence-level self-normalized IS: ``sequence_is`` with the sequence weights divided by
    their mean over the step (biased, consistent; no ``(1+χ²)^T`` blow-up of the weights' scale),
    group-mean advantage, sequence-mean of token sums."""
    return Estimator(name="sequence_snis", surrogate=SequenceRatio(), advantage=GroupMean(),
                     correction=SelfNormalizedIS(level=Level.SEQUENCE),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)
