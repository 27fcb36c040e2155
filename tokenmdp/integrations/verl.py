"""verl's actor and algorithm configuration as the :class:`~tokenmdp.estimators.Estimator` it trains.

Written against verl 0.9.1 (``verl/trainer/config/_generated_ppo_trainer.yaml``,
``verl/workers/config/actor.py``, ``verl/trainer/ppo/core_algos.py``). The mapping:

* ``actor.policy_loss.loss_mode`` — ``vanilla``: PPO's clip with the dual clip at
  ``clip_ratio_c`` (always on); ``gspo``: GSPO-token; ``sapo``: SAPO (``tau_pos``, ``tau_neg``);
  ``cispo``: CISPO; ``dppo_tv`` / ``dppo_kl``: DPPO's masks, weight capped at ``clip_ratio_c``;
  ``geo_mean``: GMPO; ``clip_cov`` / ``kl_cov``: the covariance selections. ``gpg``, ``dro``,
  ``bypass_mode`` and registered custom losses have no counterpart.
* ``clip_ratio_low`` / ``clip_ratio_high`` (None: ``clip_ratio``) — the band, thresholds or
  log-space bounds of the loss mode.
* ``loss_agg_mode`` — its name is the :class:`~tokenmdp.estimators.Aggregation` value;
  ``seq-mean-token-sum-norm`` is the constant normalizer (``sapo`` and ``geo_mean`` ignore it).
* ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type`` — a KL in the loss (k1, k2, k3, k3+, abs);
  ``algorithm.use_kl_in_reward`` with ``kl_ctrl.kl_coef`` and ``kl_penalty`` — a KL in the reward.
* ``algorithm.adv_estimator`` — ``grpo`` (``norm_adv_by_std_in_grpo``), ``rloo``,
  ``reinforce_plus_plus_baseline``, ``opo``; without an ``algorithm`` section, ``grpo``.
* ``algorithm.rollout_correction`` — ``rollout_is`` (token / sequence) at
  ``rollout_is_threshold`` (a number truncates, ``"lo_hi"`` masks), ``rollout_is_batch_normalize``
  (self-normalized), or ``rollout_rs`` at ``rollout_rs_threshold`` (rejection); one at a time.

Accepted and ignored (they do not change the loss of a step): batch and micro-batch sizes,
``ppo_epochs``, ``shuffle``, ``optim``, ``checkpoint``, ``profiler``, the engines' sections
(``fsdp_config``, ``megatron``, ...), ``use_dynamic_bsz``, ``use_remove_padding``, ``grad_clip``,
``gamma`` / ``lam`` of outcome advantages, ``filter_groups`` (it filters data), and every
section of the trainer config other than ``actor_rollout_ref.actor`` and ``algorithm``. An
unknown field of those two is an error.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenmdp.estimators import (
    CISPO,
    Aggregation,
    Estimator,
    GroupMean,
    GroupNormalized,
    GSPOToken,
    KLPenalty,
    LeaveOneOut,
    Level,
    MaskedIS,
    NoCorrection,
    PPOClip,
    TruncatedIS,
)
from tokenmdp.estimators.advantages.baselines import OPOBaseline, ReinforcePPBaseline
from tokenmdp.estimators.corrections.rejection import RejectionSampling
from tokenmdp.estimators.corrections.self_normalized import SelfNormalizedIS
from tokenmdp.estimators.kl import kl_abs, kl_k1, kl_k2, kl_k3, kl_k3_plus
from tokenmdp.estimators.surrogates.covariance import ClipCov, KLCov
from tokenmdp.estimators.surrogates.soft import GMPO, SAPO
from tokenmdp.estimators.surrogates.trust_region_masks import DPPO
from tokenmdp.integrations.common import (
    ConfiguredEstimator,
    check_fields,
    no_counterpart,
    read_config,
    registry_match,
)

__all__ = ["VERL_ACTOR_DEFAULTS", "VERL_VERSION", "estimator_from_verl"]

VERL_VERSION = "0.9.1"

#: ``actor_rollout_ref.actor``'s defaults (verl 0.9.1) of the fields that shape the loss.
VERL_ACTOR_DEFAULTS: dict[str, object] = {
    "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
    "tau_pos": 1.0, "tau_neg": 1.05, "loss_agg_mode": "token-mean", "loss_scale_factor": None,
    "entropy_coeff": 0.0, "use_kl_loss": False, "kl_loss_coef": 0.001,
    "kl_loss_type": "low_var_kl", "policy_loss": {},
}
_POLICY_LOSS_DEFAULTS = {"loss_mode": "vanilla", "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0,
                         "clip_cov_ub": 5.0, "kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1,
                         "dro_beta": None, "_target_": None}
_ACTOR_IGNORED = frozenset("""
_target_ calculate_entropy calculate_sum_pi_squared checkpoint data_loader_seed
entropy_checkpointing entropy_from_logits_chunk_size entropy_from_logits_with_chunking
freeze_vision_tower fsdp_config grad_clip megatron optim pad_to_length ppo_epochs
ppo_max_token_len_per_gpu ppo_micro_batch_size ppo_micro_batch_size_per_gpu ppo_mini_batch_size
ppo_infer_micro_batch_size_per_gpu ppo_infer_max_token_len_per_gpu profiler qat rollout_n shuffle
strategy torchtitan ulysses_sequence_parallel_size use_dynamic_bsz use_fused_kernels
use_prefix_grouper use_remove_padding use_torch_compile veomni engine model_config
global_batch_info
""".split())
_ALGORITHM_DEFAULTS = {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True,
                       "use_kl_in_reward": False, "kl_penalty": "kl", "kl_ctrl": {},
                       "use_pf_ppo": False, "rollout_correction": None}
_ALGORITHM_IGNORED = frozenset({"_target_", "gamma", "lam", "filter_groups", "pf_ppo",
                                "gdpo_reward_keys", "gdpo_reward_weights"})
_KL_CTRL = {"_target_": None, "type": "fixed", "kl_coef": 0.001, "horizon": 10000,
            "target_kl": 0.1}
_CORRECTION = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
               "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False,
               "loss_type": "ppo_clip", "_target_": None}
_KL = {"kl": kl_k1, "k1": kl_k1, "abs": kl_abs, "mse": kl_k2, "k2": kl_k2, "k2+": kl_k2,
       "mse+": kl_k2, "low_var_kl": kl_k3, "k3": kl_k3, "low_var_kl+": kl_k3_plus, "k3+": kl_k3_plus}
_AGGREGATION = {"token-mean": Aggregation.TOKEN_MEAN, "token-sum": Aggregation.TOKEN_SUM,
                "seq-mean-token-mean": Aggregation.SEQUENCE_MEAN_TOKEN_MEAN,
                "seq-mean-token-sum": Aggregation.SEQUENCE_MEAN_TOKEN_SUM,
                "seq-mean-token-sum-norm": Aggregation.CONSTANT}


def _section(data: Mapping, defaults: Mapping, ignored=frozenset(), *, where: str) -> dict:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where.rstrip('.')}: expected a mapping of fields, got {data!r}")
    check_fields(data, {*defaults, *ignored}, where=where)
    return {**defaults, **{k: v for k, v in data.items() if k in defaults}}


def _num(field: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: expected a number, got {value!r}") from None


def _split(config, algorithm) -> tuple[dict, dict | None]:
    data = read_config(config, what="verl config")
    if "actor_rollout_ref" in data:
        arr = data["actor_rollout_ref"] or {}
        actor = arr.get("actor", {}) if isinstance(arr, Mapping) else arr
        algo = data.get("algorithm")
    else:
        algo = data.pop("algorithm", None)
        actor = data.get("actor", data) if set(data) == {"actor"} else data
    return actor, algorithm if algorithm is not None else algo


def _surrogate(a: dict, loss: dict, notes: list[str]):
    low = _num("clip_ratio_low", a["clip_ratio_low"] if a["clip_ratio_low"] is not None
               else a["clip_ratio"])
    high = _num("clip_ratio_high", a["clip_ratio_high"] if a["clip_ratio_high"] is not None
                else a["clip_ratio"])
    c = _num("clip_ratio_c", a["clip_ratio_c"])
    mode = loss["loss_mode"]
    if mode == "vanilla":
        notes.append(f"verl's vanilla loss always applies the dual clip at clip_ratio_c = {c:g} "
                     "(it asserts c > 1)")
        return PPOClip(eps_low=low, eps_high=high, dual_clip=c)
    if mode == "gspo":
        notes.append("verl's gspo is GSPO-token: GSPO's value, each token its own gradient")
        return GSPOToken(eps_low=low, eps_high=high)
    if mode == "sapo":
        return SAPO(tau_pos=_num("tau_pos", a["tau_pos"]), tau_neg=_num("tau_neg", a["tau_neg"]))
    if mode == "cispo":
        return CISPO(eps_low=low, eps_high=high)
    if mode in ("dppo_tv", "dppo_kl"):
        notes.append(f"verl's DPPO weight is sg(min(r, clip_ratio_c)): capped at {c:g}")
        return DPPO(divergence=mode[5:], delta_low=low, delta_high=high, cap=c)
    if mode == "geo_mean":
        return GMPO(eps_low=low, eps_high=high)
    if mode in ("clip_cov", "kl_cov"):
        notes.append(f"verl's {mode} selects tokens per micro-batch at the current log-probs "
                     "(clip_cov by an unseeded draw); here once per step from log pi_old, seeded")
        if mode == "kl_cov":
            return KLCov(ratio=_num("kl_cov_ratio", loss["kl_cov_ratio"]),
                         coef=_num("ppo_kl_coef", loss["ppo_kl_coef"]))
        return ClipCov(eps_low=low, eps_high=high, ratio=_num("clip_cov_ratio", loss["clip_cov_ratio"]),
                       cov_low=_num("clip_cov_lb", loss["clip_cov_lb"]),
                       cov_high=_num("clip_cov_ub", loss["clip_cov_ub"]))
    raise no_counterpart("policy_loss.loss_mode", mode, "the library's parts express vanilla, "
                         "gspo, sapo, cispo, dppo_tv, dppo_kl, geo_mean, clip_cov, kl_cov")


def _advantage(algo: dict, notes: list[str]):
    name = algo["adv_estimator"]
    if name == "grpo":
        if algo["norm_adv_by_std_in_grpo"]:
            return GroupNormalized(ddof=1, eps=1e-6)
        return GroupMean()
    if name == "rloo":
        return LeaveOneOut()
    if name == "reinforce_plus_plus_baseline":
        return ReinforcePPBaseline(ddof=1, eps=1e-8)
    if name == "opo":
        return OPOBaseline()
    raise no_counterpart("algorithm.adv_estimator", name, "outcome advantages grpo, rloo, "
                         "reinforce_plus_plus_baseline and opo only (gae needs a critic)")


def _correction(rc, notes: list[str]):
    if rc is None:
        return NoCorrection()
    rc = _section(rc, _CORRECTION, where="algorithm.rollout_correction.")
    if rc["bypass_mode"]:
        if rc["loss_type"] != "ppo_clip":
            raise no_counterpart("algorithm.rollout_correction.loss_type", rc["loss_type"],
                                 "bypass mode with a loss other than ppo_clip")
        notes.append("bypass_mode: verl's pi_old is the rollout's log-probs; pass them as "
                     "old_logprob (and behavior_logprob)")
    is_level, rs = rc["rollout_is"], rc["rollout_rs"]
    if is_level is not None and rs is not None:
        raise no_counterpart("algorithm.rollout_correction.rollout_rs", rs,
                             "together with rollout_is: an estimator has one correction part")
    if rs is not None:
        notes.append("verl's rejected tokens leave response_mask: they leave the normalizers")
        return RejectionSampling.from_verl(rs, rc["rollout_rs_threshold"])
    if is_level is None:
        return NoCorrection()
    level = {"token": Level.TOKEN, "sequence": Level.SEQUENCE}.get(is_level)
    if level is None:
        raise no_counterpart("algorithm.rollout_correction.rollout_is", is_level,
                             "verl's levels are token and sequence")
    threshold = rc["rollout_is_threshold"]
    if isinstance(threshold, str) and "_" in threshold:
        lo, _, hi = threshold.partition("_")
        if rc["rollout_is_batch_normalize"]:
            raise no_counterpart("algorithm.rollout_correction.rollout_is_batch_normalize", True,
                                 "self-normalized weights after a masking band")
        notes.append("verl zeroes the weights outside the band and keeps response_mask: the "
                     "masked tokens stay in the normalizers")
        return MaskedIS(low=_num("rollout_is_threshold", lo), high=_num("rollout_is_threshold", hi),
                        level=level, masked_in_normalizer=True)
    cap = _num("algorithm.rollout_correction.rollout_is_threshold", threshold)
    if rc["rollout_is_batch_normalize"]:
        return SelfNormalizedIS(level=level, cap=cap)
    return TruncatedIS(cap=cap, level=level)


def estimator_from_verl(config, algorithm=None) -> ConfiguredEstimator:
    """The estimator a verl configuration trains (verl 0.9.1).

    Parameters
    ----------
    config : mapping, str or Path
        The whole trainer config (``actor_rollout_ref.actor`` and ``algorithm`` are read) or the
        actor's subtree (optionally with an ``algorithm`` key beside its fields), as a nested
        dict or the path of a YAML/JSON file. Fields left out take verl's defaults.
    algorithm : mapping, optional
        The ``algorithm`` section, when ``config`` is the actor's subtree alone.

    Returns
    -------
    ConfiguredEstimator
        ``.estimator`` named ``"verl:<loss_mode>"``, ``.notes`` where verl's semantics differ,
        ``.same_as`` the registry entry it equals, if one does.

    Raises
    ------
    ValueError
        An unknown field, or a field whose value no part expresses, named in one line.
    """
    actor, algo = _split(config, algorithm)
    a = _section(actor, VERL_ACTOR_DEFAULTS, _ACTOR_IGNORED, where="actor.")
    loss = _section(a["policy_loss"] or {}, _POLICY_LOSS_DEFAULTS, where="actor.policy_loss.")
    notes: list[str] = []
    if algo is None:
        notes.append("no algorithm section: the advantage is verl's grpo (adv_estimator=grpo, "
                     "norm_adv_by_std_in_grpo=True); verl's own default is gae, with a critic")
    algo = _section(algo or {}, _ALGORITHM_DEFAULTS, _ALGORITHM_IGNORED, where="algorithm.")
    if _num("entropy_coeff", a["entropy_coeff"]) != 0.0:
        raise no_counterpart("actor.entropy_coeff", a["entropy_coeff"], "verl's bonus is the "
                             "full distribution's entropy from the logits")
    if algo["use_pf_ppo"]:
        raise no_counterpart("algorithm.use_pf_ppo", True, "it reweights the data")
    surrogate = _surrogate(a, loss, notes)
    mode = a["loss_agg_mode"]
    if mode not in _AGGREGATION:
        raise no_counterpart("actor.loss_agg_mode", mode, f"verl's modes are "
                             f"{', '.join(_AGGREGATION)}")
    aggregation = _AGGREGATION[mode]
    if loss["loss_mode"] in ("sapo", "geo_mean"):
        aggregation = Aggregation.SEQUENCE_MEAN_TOKEN_MEAN
        if mode != "seq-mean-token-mean":
            notes.append(f"verl's {loss['loss_mode']} loss is a mean over sequences whatever "
                         f"loss_agg_mode={mode!r} says")
    if aggregation is Aggregation.SEQUENCE_MEAN_TOKEN_MEAN:
        notes.append("verl divides each sequence by |y| + 1e-8 (a relative 1e-8/|y| apart)")
    if aggregation is Aggregation.CONSTANT:
        scale = a["loss_scale_factor"]
        notes.append("pass max_len to prepare: verl divides by S x "
                     + (f"loss_scale_factor = {scale}" if scale is not None
                        else "the padded response width (loss_scale_factor unset)"))
    kl = None
    if a["use_kl_loss"] and algo["use_kl_in_reward"]:
        raise no_counterpart("algorithm.use_kl_in_reward", True, "together with "
                             "actor.use_kl_loss: an estimator has one KL placement")
    if a["use_kl_loss"]:
        kind = a["kl_loss_type"]
        if kind not in _KL:
            raise no_counterpart("actor.kl_loss_type", kind, f"the KL parts are {', '.join(_KL)}")
        kl = KLPenalty(coef=_num("kl_loss_coef", a["kl_loss_coef"]), in_reward=False,
                       estimator=_KL[kind])
        if kind in ("low_var_kl", "k3", "low_var_kl+", "k3+"):
            notes.append("verl clamps low_var_kl to [-10, 10]; the k3 part does not")
    elif algo["use_kl_in_reward"]:
        ctrl = _section(algo["kl_ctrl"] or {}, _KL_CTRL, where="algorithm.kl_ctrl.")
        if ctrl["type"] != "fixed":
            raise no_counterpart("algorithm.kl_ctrl.type", ctrl["type"], "an adaptive "
                                 "coefficient: a part's coefficient is fixed")
        kind = algo["kl_penalty"]
        if kind not in _KL:
            raise no_counterpart("algorithm.kl_penalty", kind, f"the KL parts are {', '.join(_KL)}")
        kl = KLPenalty(coef=_num("kl_ctrl.kl_coef", ctrl["kl_coef"]), in_reward=True,
                       estimator=_KL[kind])
        notes.append("verl subtracts the KL from each token's reward; an outcome advantage "
                     "sums them: R - beta sum_t k_t, as the part does")
    advantage = _advantage(algo, notes)
    if advantage.group_local and algo["adv_estimator"] != "opo":
        notes.append("a one-response group keeps a finite advantage in verl; the registry's "
                     "group advantages refuse it or give it 0")
    correction = _correction(algo["rollout_correction"], notes)
    est = Estimator(name=f"verl:{loss['loss_mode']}", surrogate=surrogate, advantage=advantage,
                    correction=correction, aggregation=aggregation, kl=kl)
    return ConfiguredEstimator(est, tuple(notes), f"verl {VERL_VERSION}", registry_match(est))
