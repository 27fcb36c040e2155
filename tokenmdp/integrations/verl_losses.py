"""Every registry estimator as a verl policy loss: :func:`register_with_verl`.

Install the extra (``pip install "tokenmdp[verl]"``); tested with verl 0.9.1 only, and another
release line than 0.9.x is refused at import. verl's actor loss
(``verl.workers.utils.losses.ppo_loss``) looks ``actor.policy_loss.loss_mode`` up with
``get_policy_loss_fn`` and calls it on each micro-batch as ``fn(old_log_prob, log_prob,
advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``, which returns
``(pg_loss, metrics)``; verl then adds its entropy bonus and its KL loss itself.
:func:`register_with_verl` registers one such function per estimator, with verl's
``register_policy_loss``, under ``"tokenmdp_<name>"`` (verl's own ``cispo``, ``gspo``, ``sapo``,
... keep their names). The function maps verl's padded ``[B, L]`` tensors into a
:class:`~tokenmdp.TokenBatch`, column for column, and returns :func:`~tokenmdp.estimators.loss`:

* ``response_mask`` → ``loss_mask``; ``log_prob`` → ``logprobs_RC``; ``old_log_prob`` →
  ``old_logprob`` (half precision is computed in float32);
* ``advantages`` → ``advantage``, token for token: verl's advantages
  (``algorithm.adv_estimator``, with a KL in the reward if verl put one there) replace the
  estimator's advantage part, which never runs;
* ``config.global_batch_info``, the counts verl's ``agg_loss`` reads: ``batch_num_tokens`` →
  ``N_tokens``, ``global_batch_size`` → ``S``, ``loss_scale_factor`` (else the padded width) →
  ``L_max``, and the loss times ``dp_size``; without them this micro-batch's own, ``S`` then
  counting the responses with a loss token, as ``agg_loss`` does;
* ``rollout_is_weights`` (verl's training–inference factor, from
  ``algorithm.rollout_correction``) multiply each token's loss weight, as in verl's own losses.

Which side wins:

* the estimator's hyperparameters: ``clip_ratio*``, ``clip_ratio_c``, ``tau_pos``/``tau_neg``
  and ``policy_loss.*`` are not read;
* the estimator's aggregation: ``loss_agg_mode`` must name it (``seq-mean-token-sum-norm`` for
  ``constant``), else ``ValueError`` saying what to set; verl aggregates its entropy and KL terms
  with ``loss_agg_mode`` too, so a step never mixes two rules;
* the estimator's KL in the loss: verl passes a policy loss no reference log-probs and adds its
  KL loss itself, so ``use_kl_loss``, ``kl_loss_coef`` and ``kl_loss_type`` must give the
  estimator's KL (none: ``use_kl_loss=False``), else ``ValueError``; ``entropy_coeff`` must be 0.

Registered all the same, but refused when called (``ValueError`` naming the field verl does not
pass): a correction part and OPSM's or per-decision IS's ratio to ``μ`` (``behavior_logprob``:
verl passes ``rollout_is_weights`` instead; the message names the ``rollout_correction`` that
computes the factor, and the entry without it), a KL in the reward (``ref_logprob`` and the
rewards), the prompt-mean aggregation (``group``). :func:`verl_settings` says the same up front.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import NamedTuple

import torch

try:
    import verl
    from verl.trainer.ppo import core_algos
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError('tokenmdp.integrations.verl_losses needs verl: pip install "tokenmdp[verl]"'
                      ) from err

from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    Level,
    NoCorrection,
    RejectionSampling,
    SequenceCount,
    loss,
    loss_weights,
)
from tokenmdp.estimators import get as get_estimator
from tokenmdp.estimators import names as registry_names
from tokenmdp.integrations.common import batch_from_padded, registry_match
from tokenmdp.integrations.verl import estimator_from_verl

TESTED_VERL = "0.9"
"""The verl release line this module was written and tested against (0.9.1: the policy-loss
signature and ``global_batch_info``)."""

if ".".join(verl.__version__.split(".")[:2]) != TESTED_VERL:
    raise ImportError(f"tokenmdp.integrations.verl_losses was tested with verl {TESTED_VERL}.x; "
                      f"verl {verl.__version__} is installed (pip install \"tokenmdp[verl]\")")

__all__ = ["PREFIX", "TESTED_VERL", "policy_loss", "register_with_verl", "verl_settings"]

PREFIX = "tokenmdp_"
"""What :func:`register_with_verl` puts before a registry name by default."""

_KL_TYPES = ("low_var_kl", "kl", "mse", "abs", "low_var_kl+")   # one verl name per KL part
_VERL_RS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
            "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
_HALF = (torch.float16, torch.bfloat16)


class _Plan(NamedTuple):
    """An estimator in verl: its policy part (no KL), the actor settings, or why it cannot run."""

    policy: Estimator
    settings: dict
    problem: str | None


def _rollout_corrections(correction):
    """Candidate ``algorithm.rollout_correction`` settings for ``correction``."""
    if isinstance(correction, RejectionSampling):
        low, high = correction.low, correction.high
        for option in _VERL_RS:
            yield {"rollout_rs": option,
                   "rollout_rs_threshold": high if low is None else f"{low}_{high}"}
        return
    level = getattr(correction, "level", None)
    if level not in (Level.TOKEN, Level.SEQUENCE):
        return
    for threshold in (getattr(correction, "cap", None),
                      f"{getattr(correction, 'low', 0.0)}_{getattr(correction, 'high', None)}"):
        for normalize in (False, True):
            yield {"rollout_is": level.value, "rollout_is_threshold": threshold,
                   "rollout_is_batch_normalize": normalize}


def _verl_correction(correction) -> dict | None:
    """The ``algorithm.rollout_correction`` whose factor is ``correction``, if one is (each
    candidate checked through :func:`~tokenmdp.integrations.estimator_from_verl`)."""
    for rc in _rollout_corrections(correction):
        try:
            got = estimator_from_verl({}, algorithm={"rollout_correction": rc}).estimator
        except ValueError:
            continue
        if got.correction == correction:
            return {k: v for k, v in rc.items() if v is not False}
    return None


def _plan(est: Estimator) -> _Plan:
    agg = est.aggregation
    mode = "seq-mean-token-sum-norm" if agg is Aggregation.CONSTANT else agg.value
    settings = {"loss_agg_mode": mode, "use_kl_loss": False, "entropy_coeff": 0.0}
    policy = est.replace(kl=None) if est.kl is not None and not est.kl.in_reward else est
    who = f"estimator {est.name!r}"
    if agg is Aggregation.PROMPT_MEAN_TOKEN_MEAN:
        return _Plan(policy, settings, f"{who}: its prompt-mean aggregation needs group (each "
                     "response's prompt, verl's uid), which verl does not pass to a policy loss, "
                     "and no loss_agg_mode of verl's computes it")
    if est.kl is not None and est.kl.in_reward:
        return _Plan(policy, settings, f"{who}: its KL penalty in the reward needs ref_logprob "
                     "and the rewards, which verl does not pass to a policy loss; verl applies "
                     "it before the advantage: register est.replace(kl=None) and set "
                     "algorithm.use_kl_in_reward=True with the matching kl_penalty and "
                     "kl_ctrl.kl_coef")
    if not isinstance(est.correction, NoCorrection):
        rc = _verl_correction(est.correction)
        base = registry_match(est.replace(correction=NoCorrection()))
        how = ("masks response_mask" if "rollout_rs" in (rc or {})
               else "passes rollout_is_weights, which the loss applies")
        fix = (f"set algorithm.rollout_correction={rc} (verl then {how}) with " if rc
               else "no rollout_correction of verl's computes it; register ")
        fix += (f"the registry's {base!r}" if base else "est.replace(correction=NoCorrection())")
        return _Plan(policy, settings, f"{who}: its correction {est.correction.describe()} "
                     "needs behavior_logprob (the sampler's log-probs), which verl does not pass "
                     f"to a policy loss; {fix}")
    missing = [f for f in policy.requires("loss") if f != "old_logprob"]
    if missing:
        return _Plan(policy, settings, f"{who}: its surrogate {est.surrogate.describe()} needs "
                     f"{', '.join(missing)}, which verl does not pass to a policy loss")
    if policy is not est:
        coef = est.kl.coef
        kind = next((t for t in _KL_TYPES if estimator_from_verl(
            {"use_kl_loss": True, "kl_loss_coef": coef, "kl_loss_type": t}).estimator.kl == est.kl),
            None)
        if kind is None:
            return _Plan(policy, settings, f"{who}: its KL in the loss ({est.kl.describe()}) needs "
                         "ref_logprob, which verl does not pass to a policy loss, and verl's own "
                         "KL loss (kl_loss_type) cannot compute it")
        settings.update(use_kl_loss=True, kl_loss_coef=coef, kl_loss_type=kind)
    return _Plan(policy, settings, None)


def verl_settings(estimator: str | Estimator) -> dict:
    """The ``actor_rollout_ref.actor`` fields the estimator's verl policy loss requires.

    Parameters
    ----------
    estimator : str or Estimator
        A registry name or an :class:`~tokenmdp.estimators.Estimator`.

    Returns
    -------
    dict
        ``loss_agg_mode``, ``use_kl_loss`` (with ``kl_loss_coef`` and ``kl_loss_type`` when
        true) and ``entropy_coeff``; set ``policy_loss.loss_mode`` to the registered name.

    Raises
    ------
    ValueError
        The estimator needs a field verl does not pass to a policy loss (module docstring).
    """
    plan = _plan(_resolve(estimator))
    if plan.problem:
        raise ValueError(plan.problem)
    return dict(plan.settings)


def _resolve(estimator) -> Estimator:
    est = get_estimator(estimator) if isinstance(estimator, str) else estimator
    if not isinstance(est, Estimator):
        raise TypeError(f"estimator: expected a registry name or an Estimator, got {estimator!r}")
    return est


def _field(config, name: str, default):
    value = getattr(config, name, default) if config is not None else default
    return default if value is None else value


@functools.lru_cache(maxsize=64)
def _verl_side(mode, use_kl, coef, kind, entropy):
    """(aggregation, KL part) of verl's actor settings: the mapping of ``estimator_from_verl``."""
    est = estimator_from_verl({"loss_agg_mode": mode, "use_kl_loss": use_kl,
                               "kl_loss_coef": coef, "kl_loss_type": kind,
                               "entropy_coeff": entropy}).estimator
    return est.aggregation, est.kl


def _check_config(plan: _Plan, est: Estimator, loss_agg_mode, config) -> None:
    if plan.problem:
        raise ValueError(plan.problem)
    want = plan.settings
    use_kl = bool(_field(config, "use_kl_loss", False))
    side = (loss_agg_mode, use_kl, _field(config, "kl_loss_coef", 0.001),
            _field(config, "kl_loss_type", "low_var_kl"), _field(config, "entropy_coeff", 0.0))
    try:
        aggregation, kl = _verl_side(*side)
    except ValueError as err:
        raise ValueError(f"estimator {est.name!r} in verl: {err}") from None
    if aggregation is not est.aggregation:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r}: estimator {est.name!r} aggregates "
                         f"{want['loss_agg_mode']!r}; set actor.loss_agg_mode="
                         f"{want['loss_agg_mode']} (verl aggregates its KL and entropy terms "
                         "with it too)")
    if kl != (est.kl if want["use_kl_loss"] else None):
        fix = ", ".join(f"actor.{k}={want[k]}" for k in ("use_kl_loss", "kl_loss_coef",
                                                         "kl_loss_type") if k in want)
        raise ValueError(f"use_kl_loss={use_kl}: verl adds the KL loss of the actor config and "
                         f"estimator {est.name!r} needs "
                         f"{'its KL, ' + est.kl.describe() if want['use_kl_loss'] else 'none'}; "
                         f"set {fix}")


def _tensor(name: str, value, shape=None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(value).__name__}")
    if value.dim() != 2 or (shape is not None and value.shape != shape):
        want = "[B, L]" if shape is None else f"{tuple(shape)} (log_prob's)"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(value.shape)}")
    return value


def policy_loss(estimator: str | Estimator):
    """The estimator as a verl policy-loss function (the module docstring says how it maps).

    Parameters
    ----------
    estimator : str or Estimator
        A registry name or an :class:`~tokenmdp.estimators.Estimator`.

    Returns
    -------
    callable
        ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
        config=None, rollout_is_weights=None)`` → ``(pg_loss, metrics)``, verl 0.9's
        ``PolicyLossFn``; ``metrics`` holds floats: ``actor/pg_clipfrac``, ``actor/ppo_kl``
        and each metric of :func:`~tokenmdp.estimators.loss` as ``tokenmdp/<name>``. An estimator
        verl cannot feed raises its ``ValueError`` when called; ``fn.tokenmdp_estimator`` is the
        estimator.
    """
    est = _resolve(estimator)
    plan = _plan(est)

    def fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
           config=None, rollout_is_weights=None):
        _check_config(plan, est, loss_agg_mode, config)
        shape = _tensor("log_prob", log_prob).shape
        if not log_prob.is_floating_point():
            raise TypeError(f"log_prob: expected a float tensor, got {log_prob.dtype}")
        old = _tensor("old_log_prob", old_log_prob, shape)
        adv = _tensor("advantages", advantages, shape)
        mask = _tensor("response_mask", response_mask, shape).bool()
        dtype = torch.float32 if log_prob.dtype in _HALF else log_prob.dtype
        batch = batch_from_padded(mask, old.detach(), dtype=dtype, advantage_BT=adv.detach())
        info = _field(config, "global_batch_info", None) or {}
        seqs = info.get("global_batch_size")
        counted = (plan.policy.sequence_count if seqs is not None
                   else SequenceCount.WITH_LOSS_TOKENS)             # agg_loss's local count
        scale = info.get("loss_scale_factor") or shape[1]
        weights = loss_weights(batch, est.aggregation, num_tokens=info.get("batch_num_tokens"),
                               num_sequences=seqs, sequences=counted,
                               max_len=scale if est.aggregation is Aggregation.CONSTANT else None)
        if rollout_is_weights is not None:
            factor = _tensor("rollout_is_weights", rollout_is_weights, shape)
            weights = weights * factor.detach().to(dtype)
        step = batch.replace(loss_weight=weights)
        for part in (plan.policy.surrogate, plan.policy.correction):   # prepare's last step
            step = part.prepare_step(step, None)
        lp = log_prob.to(dtype)
        value, metrics = loss(lp, step, plan.policy)
        dp_size = info.get("dp_size") or 1
        with torch.no_grad():
            kl = torch.where(mask, old.to(dtype) - lp, 0.0).sum() / mask.sum().clamp(min=1)
            keys = ["actor/pg_clipfrac", "actor/ppo_kl", *(f"tokenmdp/{k}" for k in metrics)]
            values = torch.stack([metrics["clip_fraction"], kl, *metrics.values()]).tolist()
        # a new tensor, never loss()'s own output: verl's ppo_loss adds its KL and entropy
        # terms to it in place, which autograd forbids on a custom Function's output
        return value * dp_size, dict(zip(keys, values))

    fn.tokenmdp_estimator = est
    fn.__name__ = fn.__qualname__ = f"tokenmdp_policy_loss_{est.name}"
    fn.__doc__ = f"tokenmdp's estimator {est.name!r} as a verl policy loss."
    return fn


def register_with_verl(estimators: Iterable[str | Estimator] | str | Estimator | None = None,
                       *, prefix: str = PREFIX, replace: bool = False) -> dict[str, Estimator]:
    """Register estimators as verl policy losses (``actor.policy_loss.loss_mode``).

    Call it in every process that computes verl's actor loss: verl's workers are Ray processes,
    so import :mod:`tokenmdp.integrations.verl_plugin` there (``actor_rollout_ref.model
    .external_lib=tokenmdp.integrations.verl_plugin``), which calls it. Calling it again is
    harmless.

    Parameters
    ----------
    estimators : str, Estimator or iterable of them, optional
        Registry names or estimators (default: every registry entry,
        :func:`~tokenmdp.estimators.names`).
    prefix : str, default ``"tokenmdp_"``
        Put before each estimator's name: the loss mode is ``prefix + estimator.name``.
    replace : bool, default False
        Replace a policy loss of that name that is not tokenmdp's (verl's own ``cispo``, say,
        with ``prefix=""``); without it that is a ``ValueError``.

    Returns
    -------
    dict of str to Estimator
        The registered loss modes and their estimators. An estimator verl cannot feed is
        registered too; its loss raises the ``ValueError`` of :func:`verl_settings` when called.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    if estimators is None:
        estimators = registry_names()
    elif isinstance(estimators, (str, Estimator)):
        estimators = [estimators]
    chosen = [_resolve(item) for item in estimators]
    out: dict[str, Estimator] = {}
    for est in chosen:
        name = prefix + est.name
        if name in out:
            raise ValueError(f"estimators: two estimators named {est.name!r}")
        try:
            existing = core_algos.get_policy_loss_fn(name)
        except ValueError:
            existing = None
        if existing is not None and not hasattr(existing, "tokenmdp_estimator") and not replace:
            raise ValueError(f"{name!r}: verl already has a policy loss of that name; choose "
                             "another prefix, or pass replace=True")
        out[name] = est
    for name, est in out.items():
        core_algos.register_policy_loss(name)(policy_loss(est))
    return out

