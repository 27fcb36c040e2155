"""TRL's ``GRPOConfig`` as the :class:`~tokenmdp.estimators.Estimator` its ``GRPOTrainer`` computes.

Written against trl 1.16.0 (``trl/trainer/grpo_config.py`` and ``GRPOTrainer._compute_loss``).
The mapping, field by field:

* ``loss_type`` — ``grpo`` / ``sapo``: sequence-mean of token means; ``dapo``, ``bnpo``,
  ``cispo``: token mean; ``dr_grpo``: the constant ``S · max_completion_length``; ``luspo``:
  sequence-mean of token sums (GSPO's surrogate, needs ``importance_sampling_level='sequence'``).
  ``vespo`` has no counterpart.
* ``epsilon``, ``epsilon_high`` (None: ``epsilon``) — PPO's band; for ``cispo`` ``epsilon_high``
  is TRL's cap ``C`` of ``min(r, C)`` itself; ``delta`` — PPO's dual clip at ``delta``.
* ``importance_sampling_level='sequence'`` — GSPO's geometric-mean ratio under the loss type's
  aggregation.
* ``sapo_temperature_pos`` / ``_neg`` — SAPO's temperatures.
* ``scale_rewards`` — ``group`` (or True): the group std ``+ 1e-4``; ``batch``: the step's std
  ``+ 1e-4``; ``none`` (or False): the group mean only.
* ``beta`` — a k3 KL in the loss (with ``use_bias_correction_kl=False``: TRL's default True
  multiplies it by the differentiable ratio, which no part does).
* ``use_vllm`` with ``vllm_importance_sampling_correction`` — the correction
  ``vllm_importance_sampling_mode`` names: truncated or masked IS per token or per sequence, at
  ``vllm_importance_sampling_clip_max`` (``_cap`` in earlier releases) and ``_clip_min``.
* ``off_policy_mask_threshold`` — DeepSeek-V3.2's off-policy sequence mask (against the sampling
  log-probs with ``use_vllm``, ``π_old`` without).
* ``max_completion_length``, ``mask_truncated_completions`` — the data's (notes say how).

Refused with the field named: ``vespo``, ``top_entropy_quantile < 1`` (an entropy mask no part
has), ``entropy_coef != 0`` or ``use_adaptive_entropy`` (the full-distribution entropy from the
logits), ``multi_objective_aggregation='normalize_then_sum'`` (per-function normalization).
Accepted and ignored, for they do not change the loss of a step: every ``TrainingArguments`` field
(learning rate, batch sizes, logging, saving, precision, ...), generation and vLLM settings
(``temperature``, ``top_p``, ``vllm_mode``, ...), ``num_generations``, ``num_iterations``,
``steps_per_generation``, the reference model's sync, ``reward_weights``, the VESPO
hyperparameters, logging of completions. An unknown field is an error.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenmdp.estimators import (
    CISPO,
    GSPO,
    Aggregation,
    Estimator,
    GroupMean,
    GroupNormalized,
    KLPenalty,
    Level,
    MaskedIS,
    NoCorrection,
    PPOClip,
    TruncatedIS,
)
from tokenmdp.estimators.advantages.baselines import GroupMeanBatchStd
from tokenmdp.estimators.kl import kl_k3
from tokenmdp.estimators.surrogates.soft import SAPO
from tokenmdp.estimators.surrogates.trust_region_masks import OffPolicySequenceMask
from tokenmdp.integrations.common import (
    ConfiguredEstimator,
    check_fields,
    no_counterpart,
    read_config,
    registry_match,
)

__all__ = ["TRL_DEFAULTS", "TRL_VERSION", "estimator_from_trl"]

TRL_VERSION = "1.16.0"

#: ``GRPOConfig``'s defaults (trl 1.16.0) of the fields that shape the loss.
TRL_DEFAULTS: dict[str, object] = {
    "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": None, "delta": None, "beta": 0.0,
    "importance_sampling_level": "token", "scale_rewards": "group",
    "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "use_bias_correction_kl": True,
    "use_vllm": False, "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_cap": None,
    "off_policy_mask_threshold": None, "top_entropy_quantile": 1.0, "entropy_coef": 0.0,
    "use_adaptive_entropy": False, "mask_truncated_completions": False,
    "max_completion_length": 256, "multi_objective_aggregation": "sum_then_normalize",
}

# GRPOConfig's other fields (trl 1.16.0) and TrainingArguments' (transformers 5.x): accepted,
# ignored, for they do not change the loss of a step
_IGNORED = frozenset("""
cache_implementation cast_lm_head_to_fp32 chat_template_kwargs disable_dropout
ds3_gather_for_generation entropy_coef_delta entropy_coef_max entropy_coef_min entropy_target
generation_batch_size generation_kwargs learning_rate log_completions log_completions_hub_repo
log_multimodal log_unique_prompts max_tool_calling_iterations min_p model_init_kwargs
num_completions_to_print num_generations num_generations_eval num_iterations pad_to_multiple_of
ref_model_mixup_alpha ref_model_sync_steps remove_unused_columns repetition_penalty reward_weights
router_aux_loss_coef shuffle_dataset steps_per_generation sync_ref_model temperature top_k top_p
transformers_continuous_batching_config trust_remote_code use_transformers_continuous_batching
use_transformers_paged vespo_k_neg vespo_k_pos vespo_lambda_neg vespo_lambda_pos
vllm_enable_sleep_mode vllm_gpu_memory_utilization vllm_group_port vllm_max_model_length vllm_mode
vllm_model_impl vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout
vllm_structured_outputs_regex vllm_tensor_parallel_size
accelerator_config activation_checkpointing activation_checkpointing_kwargs adam_beta1 adam_beta2
adam_epsilon auto_find_batch_size average_tokens_across_devices batch_eval_metrics bf16
bf16_full_eval data_seed dataloader_drop_last dataloader_in_order
dataloader_multiprocessing_context dataloader_num_workers dataloader_persistent_workers
dataloader_pin_memory dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers
ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph ddp_timeout debug deepspeed
disable_tqdm do_eval do_predict do_train enable_jit_checkpoint eval_accumulation_steps eval_delay
eval_do_concat_batches eval_on_start eval_steps eval_strategy eval_use_gather_object fp16
fp16_full_eval fsdp fsdp_config full_determinism gradient_accumulation_steps
gradient_checkpointing gradient_checkpointing_kwargs greater_is_better hub_always_push
hub_model_id hub_private_repo hub_revision hub_strategy hub_token ignore_data_skip
include_for_metrics include_num_input_tokens_seen label_names label_smoothing_factor
length_column_name liger_kernel_config load_best_model_at_end local_rank log_level
log_level_replica log_on_each_node logging_first_step logging_nan_inf_filter logging_steps
logging_strategy lr_scheduler_kwargs lr_scheduler_type max_grad_norm max_steps
metric_for_best_model neftune_noise_alpha num_train_epochs optim optim_args optim_target_modules
output_dir parallelism_config per_device_eval_batch_size per_device_train_batch_size
prediction_loss_only project push_to_hub report_to restore_callback_states_from_checkpoint
resume_from_checkpoint run_name save_on_each_node save_only_model save_steps save_strategy
save_total_limit seed skip_memory_metrics tf32 torch_compile torch_compile_backend
torch_compile_mode torch_empty_cache_steps trackio_bucket_id trackio_space_id
trackio_static_space_id train_sampling_strategy use_cache use_cpu use_liger_kernel warmup_steps
weight_decay
""".split())

_AGGREGATION = {"grpo": Aggregation.SEQUENCE_MEAN_TOKEN_MEAN, "sapo": Aggregation.SEQUENCE_MEAN_TOKEN_MEAN,
                "dapo": Aggregation.TOKEN_MEAN, "bnpo": Aggregation.TOKEN_MEAN,
                "cispo": Aggregation.TOKEN_MEAN, "dr_grpo": Aggregation.CONSTANT,
                "luspo": Aggregation.SEQUENCE_MEAN_TOKEN_SUM}
_SCALE = {"group": "group", True: "group", "true": "group", "batch": "batch", "none": "none",
          False: "none", "false": "none"}
_NOTE_STD = ("TRL divides by the std + 1e-4 (the registry's group-normalized entries add 1e-6); "
             "this estimator adds 1e-4, as TRL")


def _settings(config) -> dict:
    """The loss fields of ``config`` over TRL's defaults; unknown fields refused (a mapping)."""
    if isinstance(config, Mapping) or isinstance(config, (str, bytes)) or hasattr(config,
                                                                                 "__fspath__"):
        data = read_config(config, what="TRL config")
        check_fields(data, {*TRL_DEFAULTS, *_IGNORED}, where="")
        return {**TRL_DEFAULTS, **{k: v for k, v in data.items() if k in TRL_DEFAULTS}}
    # an object with TRL's attributes (a GRPOConfig): read what shapes the loss
    return {k: getattr(config, k, default) for k, default in TRL_DEFAULTS.items()}


def _correction(s: dict, notes: list[str]):
    if not (s["use_vllm"] and s["vllm_importance_sampling_correction"]):
        if s["vllm_importance_sampling_correction"] and not s["use_vllm"]:
            notes.append("vllm_importance_sampling_correction applies with use_vllm=True only "
                         "(TRL's default use_vllm=False: no training-inference correction)")
        return NoCorrection()
    mode = s["vllm_importance_sampling_mode"]
    cap = s["vllm_importance_sampling_cap"]
    high = cap if cap is not None else s["vllm_importance_sampling_clip_max"]
    low = s["vllm_importance_sampling_clip_min"]
    granularity, _, kind = str(mode).partition("_")
    level = {"token": Level.TOKEN, "sequence": Level.SEQUENCE}.get(granularity)
    if level is None or kind not in ("truncate", "mask"):
        raise no_counterpart("vllm_importance_sampling_mode", mode, "TRL's modes are "
                             "token_truncate, token_mask, sequence_truncate, sequence_mask")
    if high is None:
        raise no_counterpart("vllm_importance_sampling_clip_max", None,
                             "every correction part has an upper bound")
    notes.append("the sampling engine's log-probs are behavior_logprob; TRL's ratio is "
                 "exp(old - sampling) on the sampler's float32 log-probs")
    if s["loss_type"] == "luspo":
        notes.append("TRL multiplies LUSPO's sequence loss by the correction after the length "
                     "weight; the parts weight each token's term: the same product")
    if kind == "truncate":
        return TruncatedIS(cap=float(high), level=level, floor=None if low is None else float(low))
    notes.append("a masked weight is zeroed but its tokens stay in TRL's normalizer")
    return MaskedIS(high=float(high), low=0.0 if low is None else float(low), level=level,
                    masked_in_normalizer=True)


def _surrogate(s: dict, loss_type: str, notes: list[str]):
    eps = float(s["epsilon"])
    eps_high = float(s["epsilon_high"]) if s["epsilon_high"] is not None else eps
    sequence = s["importance_sampling_level"] == "sequence"
    if s["importance_sampling_level"] not in ("token", "sequence"):
        raise no_counterpart("importance_sampling_level", s["importance_sampling_level"],
                             "TRL's levels are 'token' and 'sequence'")
    delta = s["delta"]
    if delta is not None and loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
        raise no_counterpart("delta", delta, f"a dual clip of loss_type={loss_type!r}")
    if loss_type == "luspo" and not sequence:
        raise no_counterpart("importance_sampling_level", "token",
                             "loss_type='luspo' is GSPO's sequence ratio: TRL requires 'sequence'")
    if sequence and loss_type in ("cispo", "sapo"):
        raise no_counterpart("importance_sampling_level", "sequence",
                             f"loss_type={loss_type!r} on the sequence ratio")
    if loss_type == "sapo":
        return SAPO(tau_pos=float(s["sapo_temperature_pos"]),
                    tau_neg=float(s["sapo_temperature_neg"]))
    if loss_type == "cispo":
        if eps_high < 1:
            raise no_counterpart("epsilon_high", s["epsilon_high"], f"for cispo it is the cap C "
                                 f"of min(r, C) itself (unset: epsilon), here {eps_high:g}; CISPO's "
                                 "cap is >= 1 (TRL recommends 5.0)")
        notes.append(f"for cispo TRL's epsilon_high is the cap C of sg(min(r, C)) itself "
                     f"(here {eps_high:g}, i.e. CISPO's eps_high {eps_high - 1:g}); left "
                     "unset it is epsilon")
        return CISPO(eps_low=1.0, eps_high=round(eps_high - 1.0, 12))
    if sequence:
        if delta is not None:
            raise no_counterpart("delta", delta, "a dual clip of the sequence ratio")
        notes.append("importance_sampling_level='sequence': each token's term carries its "
                     "sequence's ratio exp(mean_t log r), clipped as a whole (GSPO)")
        return GSPO(eps_low=eps, eps_high=eps_high)
    if delta is not None:
        if float(delta) <= 1 + eps_high:
            raise no_counterpart("delta", delta, f"TRL's two-sided clip equals a dual clip only "
                                 f"above 1 + epsilon_high = {1 + eps_high:g}")
        notes.append(f"TRL's delta caps r at {delta:g} inside min(.): on Â < 0 it is the dual "
                     "clip (the same value and gradient), on Â > 0 it never binds")
        return PPOClip(eps_low=eps, eps_high=eps_high, dual_clip=float(delta))
    return PPOClip(eps_low=eps, eps_high=eps_high)


def estimator_from_trl(config) -> ConfiguredEstimator:
    """The estimator a TRL ``GRPOConfig`` computes (trl 1.16.0).

    Parameters
    ----------
    config : mapping, str, Path or object
        A dict of ``GRPOConfig`` fields, the path of a YAML/JSON file holding one, or an object
        with TRL's attributes (a real ``GRPOConfig``; trl is not imported here). Fields left out
        take TRL's defaults (:data:`TRL_DEFAULTS`); the module docstring lists the mapping and
        the fields ignored.

    Returns
    -------
    ConfiguredEstimator
        ``.estimator`` named ``"trl:<loss_type>"``, ``.notes`` where TRL's semantics differ,
        ``.same_as`` the registry entry it equals, if one does.

    Raises
    ------
    ValueError
        An unknown field, or a field whose value no part expresses, named in one line.
    """
    s = _settings(config)
    notes: list[str] = []
    loss_type = s["loss_type"]
    if loss_type == "vespo":
        raise no_counterpart("loss_type", loss_type, "VESPO's Gamma weighting is not a part")
    if loss_type not in _AGGREGATION:
        raise no_counterpart("loss_type", loss_type, f"TRL's loss types are "
                             f"{', '.join(sorted([*_AGGREGATION, 'vespo']))}")
    if float(s["top_entropy_quantile"]) < 1.0:
        raise no_counterpart("top_entropy_quantile", s["top_entropy_quantile"],
                             "an entropy mask of the policy loss; 1.0 keeps every token")
    if float(s["entropy_coef"]) != 0.0 or s["use_adaptive_entropy"]:
        field = "use_adaptive_entropy" if s["use_adaptive_entropy"] else "entropy_coef"
        raise no_counterpart(field, s[field], "TRL's bonus is the full distribution's entropy "
                             "from the logits; the parts see log-probs only")
    if s["multi_objective_aggregation"] != "sum_then_normalize":
        raise no_counterpart("multi_objective_aggregation", s["multi_objective_aggregation"],
                             "tokenmdp reads one reward per sequence, normalized after the sum")
    scale = _SCALE.get(s["scale_rewards"] if isinstance(s["scale_rewards"], bool)
                       else str(s["scale_rewards"]).lower())
    if scale is None:
        raise no_counterpart("scale_rewards", s["scale_rewards"],
                             "TRL's values are 'group', 'batch' and 'none'")
    advantage = {"group": GroupNormalized(ddof=1, eps=1e-4), "batch": GroupMeanBatchStd(ddof=1, eps=1e-4),
                 "none": GroupMean()}[scale]
    if scale == "group":
        notes.append(_NOTE_STD)
    surrogate = _surrogate(s, loss_type, notes)
    if s["off_policy_mask_threshold"] is not None:
        against = "behavior" if s["use_vllm"] else "old"
        surrogate = OffPolicySequenceMask(surrogate, delta=float(s["off_policy_mask_threshold"]),
                                          against=against)
    kl = None
    if float(s["beta"]) != 0.0:
        if s["use_bias_correction_kl"]:
            raise no_counterpart("use_bias_correction_kl", True, f"with beta={s['beta']} TRL "
                                 "multiplies the KL term by the differentiable ratio pi/pi_old; "
                                 "set use_bias_correction_kl=False for a k3 KL in the loss")
        kl = KLPenalty(coef=float(s["beta"]), in_reward=False, estimator=kl_k3)
    correction = _correction(s, notes)
    aggregation = _AGGREGATION[loss_type]
    if loss_type == "dr_grpo":
        notes.append(f"pass max_len=max_completion_length ({s['max_completion_length']}) to "
                     "prepare: TRL divides by B x max_completion_length")
    if loss_type in ("dapo", "cispo"):
        notes.append("TRL's token count is num_items_in_batch over the generation batch: the "
                     "step's token mean when one optimizer step takes the generation batch")
    if loss_type == "bnpo":
        notes.append("bnpo normalizes by the local batch's tokens: the step's token mean only "
                     "when one micro-batch on one process is the step")
    if s["mask_truncated_completions"]:
        notes.append("mask_truncated_completions: set loss_mask False on truncated completions "
                     "before prepare; they still count in S, as TRL's mean over completions")
    est = Estimator(name=f"trl:{loss_type}", surrogate=surrogate, advantage=advantage,
                    correction=correction, aggregation=aggregation, kl=kl)
    same = registry_match(est)
    if same is None and scale == "group":
        near = registry_match(est.replace(advantage=GroupNormalized(ddof=1, eps=1e-6)))
        if near is not None:
            notes[notes.index(_NOTE_STD)] = (f"the registry's {near} but for the std epsilon: "
                                             "TRL's and this estimator's 1e-4, there 1e-6")
    return ConfiguredEstimator(est, tuple(notes), f"trl {TRL_VERSION}", same)
