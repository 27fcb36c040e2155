"""The registry of published estimators, at the edge of the package: names → compositions.

This is the only place where an estimator is looked up by a string. Each entry is a factory with
a docstring giving its summary and default hyperparameters as the papers give them; the
decorator appends its formula, paper and the names other frameworks use (as of late 2025). The
``±tis`` / ``±mis`` variants are generated from the bases.

>>> from tokenmdp import estimators
>>> estimators.get("dapo").surrogate
PPOClip(eps_low=0.2, eps_high=0.28, dual_clip=None)
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable

from tokenmdp.estimators.advantages import (
    BatchNormalized,
    GroupMean,
    GroupNormalized,
    LeaveOneOut,
    RewardAsAdvantage,
)
from tokenmdp.estimators.aggregation import Aggregation
from tokenmdp.estimators.corrections import (
    ImportanceSampling,
    Level,
    MaskedIS,
    NoCorrection,
    TruncatedIS,
)
from tokenmdp.estimators.estimator import Estimator
from tokenmdp.estimators.kl import KLPenalty, kl_k3
from tokenmdp.estimators.per_decision import PerDecisionRatio
from tokenmdp.estimators.sequence_surrogates import GSPO, GSPOToken, SequenceRatio
from tokenmdp.estimators.soft_surrogates import GMPO, SAPO, EntropyBonus
from tokenmdp.estimators.surrogates import CISPO, MiniRL, PPOClip, Reinforce, TokenRatio
from tokenmdp.estimators.trust_region_masks import DPPO, OffPolicySequenceMask

__all__ = ["Entry", "describe", "format_table", "get", "names"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registry entry: how to build the estimator and where it comes from.

    Parameters
    ----------
    name : str
        The registry name (``"grpo"``).
    build : callable
        ``build() -> Estimator``: a fresh estimator with the paper's defaults.
    formula : str
        The loss as a formula in plain text.
    paper : str
        The paper (arXiv id or venue) the estimator comes from.
    aliases : str
        The names and options other frameworks use for it.
    """

    name: str
    build: Callable[[], Estimator]
    formula: str
    paper: str
    aliases: str


_ENTRIES: dict[str, Entry] = {}


def _register(name: str, *, formula: str, paper: str, aliases: str):
    def decorate(factory: Callable[[], Estimator]) -> Callable[[], Estimator]:
        factory.__doc__ = (f"{(factory.__doc__ or '').rstrip()}\n\n    Formula: {formula}\n\n"
                           f"    Paper: {paper}\n\n    Other names: {aliases}\n")
        _ENTRIES[name] = Entry(name, factory, formula, paper, aliases)
        return factory
    return decorate


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
           aliases="verl adv_estimator=rloo; TRL RLOOTrainer; OpenRLHF advantage_estimator=rloo")
def rloo() -> Estimator:
    """RLOO: leave-one-out baseline (unbiased), weighted NLL, sequence-mean of token sums."""
    return Estimator(name="rloo", surrogate=Reinforce(), advantage=LeaveOneOut(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_register("token_is", formula="-1/S Σ_i Σ_t ρ_it A_i, ρ_it = π_θ/μ = (π_old/μ)(π_θ/π_old)",
           paper="Zheng et al., arXiv 2512.01374, Eq. 3",
           aliases="Tinker loss_fn='importance_sampling'")
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
           aliases="verl policy_loss.loss_mode=vanilla (clip_ratio; clip_ratio_c = dual clip); "
                   "Tinker loss_fn='ppo'")
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
                   "kl_loss_type=low_var_kl; TRL loss_type='grpo', beta, epsilon")
def grpo() -> Estimator:
    """GRPO: group mean/std advantage (sample std, ε 1e-6), PPO clip ε = 0.2, sequence-mean of
    token means, k3 KL in the loss with β = 0.04 (paper). Needs ``ref_logprob``."""
    return Estimator(name="grpo", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN,
                     kl=KLPenalty(coef=0.04, in_reward=False, estimator=kl_k3))


@_register("dr_grpo", formula="-1/(S L_max) Σ_i Σ_t min(r Â, clip(r) Â), Â = R - mean_g",
           paper="Liu et al. (Dr. GRPO), arXiv 2503.20783",
           aliases="verl norm_adv_by_std_in_grpo=False, loss_agg_mode=seq-mean-token-sum-norm; "
                   "TRL loss_type='dr_grpo', scale_rewards=False")
def dr_grpo() -> Estimator:
    """Dr. GRPO: no std and no ``1/|y|`` (both biases removed), PPO clip ε = 0.2, constant
    normalizer ``S · L_max`` (pass ``max_len`` to ``prepare``), no KL."""
    return Estimator(name="dr_grpo", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=GroupMean(), aggregation=Aggregation.CONSTANT)


@_register("dapo", formula="-1/N Σ_i Σ_t min(r Â, clip(r, 1-0.2, 1+0.28) Â), "
                           "Â = (R - mean_g)/std_g",
           paper="Yu et al. (DAPO), arXiv 2503.14476",
           aliases="verl clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=token-mean; "
                   "TRL loss_type='dapo', epsilon_high=0.28")
def dapo() -> Estimator:
    """DAPO: clip-higher (ε_low 0.2, ε_high 0.28), token-level mean over the step, no KL.
    Dynamic sampling and overlong shaping act on the data, not the loss."""
    return Estimator(name="dapo", surrogate=PPOClip(eps_low=0.2, eps_high=0.28),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("gspo", formula="-1/S Σ_i min(s_i Â_i, clip(s_i) Â_i), s_i = exp(mean_t log r_it)",
           paper="Zheng et al. (GSPO), arXiv 2507.18071",
           aliases="verl policy_loss.loss_mode=gspo; TRL importance_sampling_level='sequence'")
def gspo() -> Estimator:
    """GSPO: geometric-mean sequence ratio clipped at ε_low 3e-4, ε_high 4e-4 (paper), group
    mean/std advantage, sequence-mean of token means, no KL."""
    return Estimator(name="gspo", surrogate=GSPO(eps_low=3e-4, eps_high=4e-4),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)


@_register("gspo_token", formula="-1/S Σ_i 1/|y_i| Σ_t min(s_it Â_it, clip(s_it) Â_it), "
                                 "s_it = sg[s_i] π_θ/sg[π_θ]",
           paper="Zheng et al. (GSPO), arXiv 2507.18071, GSPO-token",
           aliases="TRL experimental GSPO-token")
def gspo_token() -> Estimator:
    """GSPO-token: GSPO's value; token gradients allow per-token advantages (ε as GSPO)."""
    return Estimator(name="gspo_token", surrogate=GSPOToken(eps_low=3e-4, eps_high=4e-4),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)


@_register("cispo", formula="-1/N Σ_i Σ_t sg(clip(r, 1-ε_low, 1+ε_high)) Â log π",
           paper="MiniMax (MiniMax-M1), arXiv 2506.13585",
           aliases="verl policy_loss.loss_mode=cispo; Tinker loss_fn='cispo'")
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
_TIS_ALIASES = ("verl rollout correction (token TIS, threshold 2); TRL "
                "vllm_importance_sampling_correction (cap 2); ms-swift token_truncate")
_MIS_ALIASES = "IcePop; ms-swift token_mask; NeMo RL ICE-POP"


_TIS_TERM = "each token's surrogate term × sg(min(π_old/μ, 2))"
_MIS_TERM = ("each token's surrogate term × sg(π_old/μ) · 1[0.5 ≤ π_old/μ ≤ 5] (rejects stay in "
             "the normalizer)")


def _variant(base: str, suffix: str, summary: str, aliases: str, *, formula: str | None = None,
             **changes) -> None:
    """Register ``base_suffix``: ``base`` with ``changes`` and its own ``formula`` (a formula
    that starts with ";" is appended to the base's: what the change does to each term)."""
    parent = _ENTRIES[base]
    if formula is None:
        raise ValueError(f"formula: the variant {base}_{suffix} must state its formula")
    if formula.startswith(";"):
        formula = parent.formula + formula

    def factory() -> Estimator:
        return parent.build().replace(name=f"{base}_{suffix}", **changes)
    factory.__name__ = factory.__qualname__ = f"{base}_{suffix}"
    factory.__doc__ = f"{base} with {summary}."
    _register(f"{base}_{suffix}", formula=formula, paper=parent.paper,
              aliases=aliases)(factory)


for _base in ("ppo", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "cispo"):
    _variant(_base, "tis", "token-level truncated IS, C = 2 (Yao et al. 2025)", _TIS_ALIASES,
             formula=f"; {_TIS_TERM}", correction=_TIS)
    _variant(_base, "mis", "token-level masked IS, band [0.5, 5], rejects kept in the normalizer "
             "(IcePop, arXiv 2510.18855)", _MIS_ALIASES, formula=f"; {_MIS_TERM}",
             correction=_MIS)
_variant("gspo", "geo_mis", "geometric-mean masked IS, band [0.5, 5], rejects kept in the "
         "normalizer", _MIS_ALIASES,
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



# ---------------------------------------------------------------------- new surrogates (issue 15)
# SAPO, DPPO (TV, KL), GMPO, OPSM, per-decision IS (CTPO's ratio), LUSPO, an entropy bonus.
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
                 "the example sets clip_ratio_c = 10000, i.e. no cap); prime-rl")


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
                   "the divergence uses the sampling log-probs, π_old without them); slime "
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
    prefix; the continuation stays ``μ``'s (see :mod:`~tokenmdp.estimators.per_decision`)."""
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

# ---------------------------------------------------------------------- lookup
def names() -> tuple[str, ...]:
    """Every registered name, bases first.

    Returns
    -------
    tuple of str
        The names, in registration order.
    """
    return tuple(_ENTRIES)


def _entry(name: str) -> Entry:
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    if name not in _ENTRIES:
        close = difflib.get_close_matches(name, _ENTRIES, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"name: unknown estimator {name!r}{hint}; known: {', '.join(_ENTRIES)}")
    return _ENTRIES[name]


def get(name: str) -> Estimator:
    """The registered estimator ``name`` (a fresh frozen :class:`Estimator`).

    Parameters
    ----------
    name : str
        A registered name (:func:`names`); an unknown one raises ``ValueError`` with the
        closest matches.

    Returns
    -------
    Estimator
        The estimator, with the paper's hyperparameters.
    """
    return _entry(name).build()


def describe(name: str) -> str:
    """The docstring of entry ``name``: summary, defaults, formula, paper, other names.

    Parameters
    ----------
    name : str
        A registered name (:func:`names`).

    Returns
    -------
    str
        The docstring, paragraphs separated by blank lines.
    """
    return _entry(name).build.__doc__ or ""


def format_table() -> str:
    """Every registered estimator as a plain-text table (for ``tokenmdp estimators``).

    Returns
    -------
    str
        One line per estimator (name, its five parts, paper) under a header and a rule.
    """
    header = ("name", "surrogate", "advantage", "correction", "aggregation", "KL", "paper")
    rows = [header]
    for entry in _ENTRIES.values():
        est = entry.build()
        rows.append((entry.name, est.surrogate.describe(), est.advantage.describe(),
                     est.correction.describe(), est.aggregation.value,
                     est.kl.describe() if est.kl is not None else "none", entry.paper))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
