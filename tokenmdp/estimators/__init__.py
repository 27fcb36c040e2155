"""The estimator library: every estimator tokenmdp teaches, written once for both worlds.

An :class:`Estimator` composes five independent parts, each a set of pure functions of tensors
over a :class:`~tokenmdp.batch.TokenBatch`. This package is their front door: every public name
of its rooms is importable from ``tokenmdp.estimators``.

Floors, top to bottom::

    step, token_loss
    registry
    estimator, fused
    surrogates
    advantages, aggregation, corrections, kl
    _common

* the parts, by role — :mod:`~tokenmdp.estimators.advantages` (rewards and groups →
  advantages: group baselines, REINFORCE++/OPO baselines, per-token advantages, tree
  advantages from node values),
  :mod:`~tokenmdp.estimators.surrogates` (the per-token term: REINFORCE, ratios, PPO clip,
  CISPO, MiniRL, sequence IS, GSPO, SAPO, GMPO, DPPO's and OPSM's masks, per-decision IS, CTPO,
  Clip-Cov and KL-Cov), :mod:`~tokenmdp.estimators.corrections` (the detached
  training–inference factor ``π_old/μ``: IS, TIS, MIS, rejection masks, self-normalized IS and
  the weights' diagnostics), :mod:`~tokenmdp.estimators.aggregation` (the per-token loss weights
  of the step) and :mod:`~tokenmdp.estimators.kl` (KL to a reference, in the reward or the
  loss);
* :mod:`~tokenmdp.estimators.estimator` — :class:`Estimator`, the frozen composition;
  :mod:`~tokenmdp.estimators.fused` — each part's kernel of value and gradient coefficient;
* :mod:`~tokenmdp.estimators.registry` — the published algorithms by name (a new estimator is an
  entry there, built from the parts);
* :mod:`~tokenmdp.estimators.step` (:func:`prepare`, once per optimizer step) and
  :mod:`~tokenmdp.estimators.token_loss` (:func:`loss`, per micro-batch)::

    est = estimators.get("grpo")
    batch = estimators.prepare(batch, est)             # whole step: advantages, loss weights
    value, metrics = estimators.loss(logprobs_RC, batch, est)   # any micro-batch

It imports the narrow waist's :mod:`tokenmdp.batch` only; it never imports the exact world, the
model, the trainer or any front end.
"""

from tokenmdp.estimators._common import MAX_LOG_RATIO
from tokenmdp.estimators.advantages.baselines import (
    GroupMeanBatchStd,
    OPOBaseline,
    ReinforcePPBaseline,
    group_mean_batch_std_advantage,
    opo_advantage,
    reinforce_pp_baseline_advantage,
    weighted_whiten,
)
from tokenmdp.estimators.advantages.group import (
    Advantage,
    BatchNormalized,
    GroupMean,
    GroupNormalized,
    LeaveOneOut,
    RewardAsAdvantage,
    batch_normalized_advantage,
    group_mean_advantage,
    group_normalized_advantage,
    leave_one_out_advantage,
    reward_advantage,
)
from tokenmdp.estimators.advantages.token import RewardToGo, TokenAdvantage, reward_to_go
from tokenmdp.estimators.advantages.tree import (
    NodeValueDifference,
    ReturnMinusNodeValue,
    TreeAdvantage,
    TreeLeaves,
    TreeValues,
    tree_values,
)
from tokenmdp.estimators.advantages.tree_credit import TreeRLAdvantage, VinePPOTree, segment_parent
from tokenmdp.estimators.aggregation import (
    Aggregation,
    SequenceCount,
    count_groups,
    count_step,
    loss_weights,
)
from tokenmdp.estimators.corrections.factor import (
    Correction,
    CorrectionFactor,
    ImportanceSampling,
    Level,
    MaskedIS,
    NoCorrection,
    TruncatedIS,
    importance_weight,
    level_log_weight,
    masked_importance_weight,
    training_inference_log_weight,
    truncated_importance_weight,
)
from tokenmdp.estimators.corrections.rejection import (
    RejectionSampling,
    rejection_keep_mask,
    rejection_statistic,
)
from tokenmdp.estimators.corrections.self_normalized import (
    SNIS_FACTOR,
    SelfNormalizedIS,
    self_normalized_weight,
)
from tokenmdp.estimators.estimator import Estimator
from tokenmdp.estimators.kl import KLPenalty, kl_abs, kl_k1, kl_k2, kl_k3, kl_k3_plus
from tokenmdp.estimators.registry.lookup import describe, format_table, get, names
from tokenmdp.estimators.step import (
    advantage_rewards,
    counted_mask,
    prepare,
    step_counts,
    token_reward_penalty,
)
from tokenmdp.estimators.surrogates.clipped import (
    CISPO,
    MiniRL,
    PPOClip,
    cispo_term,
    minirl_term,
    ppo_clip_term,
    ppo_keep_mask,
)
from tokenmdp.estimators.surrogates.covariance import ClipCov, KLCov, token_covariance
from tokenmdp.estimators.surrogates.ctpo import CTPOClip, ctpo_bounds, ctpo_term
from tokenmdp.estimators.surrogates.per_decision import (
    PerDecisionRatio,
    cumulative_log_ratio,
    per_decision_term,
)
from tokenmdp.estimators.surrogates.sequence import (
    GSPO,
    GSPOToken,
    SequenceRatio,
    gspo_term,
    gspo_token_term,
    sequence_log_ratio,
    sequence_ratio_term,
)
from tokenmdp.estimators.surrogates.soft import (
    GMPO,
    SAPO,
    EntropyBonus,
    entropy_bonus_term,
    gmpo_term,
    sapo_term,
)
from tokenmdp.estimators.surrogates.token import (
    Reinforce,
    Surrogate,
    SurrogateTerms,
    TokenRatio,
    reinforce_term,
    token_ratio_term,
)
from tokenmdp.estimators.surrogates.trust_region_masks import (
    DPPO,
    OffPolicySequenceMask,
    dppo_keep_mask,
    dppo_term,
    off_policy_sequence_keep_mask,
)
from tokenmdp.estimators.token_loss import loss, per_micro_batch_token_mean_loss

__all__ = [
    "CISPO", "GSPO", "MAX_LOG_RATIO", "Advantage", "Aggregation", "BatchNormalized", "Correction",
    "CorrectionFactor", "Estimator", "GSPOToken", "GroupMean", "GroupNormalized",
    "ImportanceSampling", "KLPenalty", "LeaveOneOut", "Level", "MaskedIS", "MiniRL",
    "NoCorrection", "PPOClip", "Reinforce", "RewardAsAdvantage", "SequenceRatio", "Surrogate",
    "SurrogateTerms", "TokenRatio", "TruncatedIS", "advantage_rewards",
    "batch_normalized_advantage", "cispo_term",
    "SequenceCount", "count_groups", "count_step", "counted_mask", "describe", "format_table",
    "get", "group_mean_advantage",
    "group_normalized_advantage", "gspo_term", "gspo_token_term", "importance_weight", "kl_k1",
    "kl_k2", "kl_k3", "leave_one_out_advantage", "level_log_weight", "loss", "loss_weights",
    "masked_importance_weight", "minirl_term", "names", "per_micro_batch_token_mean_loss",
    "ppo_clip_term", "ppo_keep_mask", "prepare", "reinforce_term", "reward_advantage",
    "sequence_log_ratio", "sequence_ratio_term", "step_counts", "token_ratio_term",
    "training_inference_log_weight", "truncated_importance_weight",
    # issue 15 surrogates
    "DPPO", "GMPO", "SAPO", "EntropyBonus", "OffPolicySequenceMask", "PerDecisionRatio",
    "cumulative_log_ratio", "dppo_keep_mask", "dppo_term", "entropy_bonus_term", "gmpo_term",
    "off_policy_sequence_keep_mask", "per_decision_term", "sapo_term",
    # issue 15 KL estimators
    "kl_abs", "kl_k3_plus",
    # issue 15 corrections and CTPO
    "CTPOClip", "RejectionSampling", "SNIS_FACTOR", "SelfNormalizedIS", "ctpo_bounds",
    "ctpo_term", "rejection_keep_mask", "rejection_statistic", "self_normalized_weight",
    # issue 15 advantages (per-sequence and per-token) and covariance-selected surrogates
    "ClipCov", "GroupMeanBatchStd", "KLCov", "OPOBaseline", "ReinforcePPBaseline", "RewardToGo",
    "TokenAdvantage", "group_mean_batch_std_advantage", "opo_advantage",
    "reinforce_pp_baseline_advantage", "reward_to_go", "token_covariance",
    "token_reward_penalty", "weighted_whiten",
    # issue 28 tree advantages
    "NodeValueDifference", "ReturnMinusNodeValue", "TreeAdvantage", "TreeLeaves",
    "TreeRLAdvantage", "TreeValues", "VinePPOTree", "segment_parent", "tree_values",
]
