"""What a training run is built from: its model, its engine, its estimator and its ``--init``
checkpoint.

:func:`build_model` (the MoE transformer of a :class:`~tokenmdp.rl.config.TrainConfig`, seeded
by ``cfg.seed``; :func:`model_config` its :class:`~tokenmdp.model.ModelConfig`),
:func:`build_engine` (its rollout engine: precision and engine mismatch mode),
:func:`build_estimator` (the registry estimator with ``kl_coef`` applied, or
:data:`SFT_ESTIMATOR` in SFT mode), :func:`load_init` (the ``init`` checkpoint, checked to
hold a model of the configured shape), :func:`build_optimizer` (AdamW or SGD) and
:func:`carry_optimizer_state` (the init checkpoint's optimizer moments, for
``optimizer_state="carry"``). The trainer's run state
(:mod:`tokenmdp.rl.run_state`) builds itself from these; every name here is re-exported by
:mod:`tokenmdp.rl.trainer`.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp import estimators
from tokenmdp.estimators import Aggregation, Estimator, KLPenalty, Reinforce, RewardAsAdvantage
from tokenmdp.exact.world.engine_mismatch import EngineMismatch
from tokenmdp.model import ModelConfig, MoETransformer
from tokenmdp.rl.checkpoint import check_model_config, load_checkpoint
from tokenmdp.rl.config import DTYPES, TrainConfig
from tokenmdp.rl.rollout import RolloutEngine
from tokenmdp.rl.tasks import get_task

__all__ = ["SFT_ESTIMATOR", "build_engine", "build_estimator", "build_model", "build_optimizer",
           "carry_optimizer_state", "load_init", "model_config"]

SFT_ESTIMATOR = Estimator(name="sft", surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                          aggregation=Aggregation.TOKEN_MEAN)
"""SFT as an estimator: ``A = R = 1``, weighted NLL, mean over the step's answer tokens."""


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """The :class:`~tokenmdp.model.ModelConfig` of ``cfg`` for a vocabulary of ``vocab_size``.

    Parameters
    ----------
    cfg : TrainConfig
        The run's configuration; its model fields (``d_model``, ``n_experts``, ...) are copied.
    vocab_size : int
        The task tokenizer's vocabulary size.

    Returns
    -------
    ModelConfig
    """
    # TrainConfig repeats the ModelConfig fields it exposes (flat, one command-line option each)
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)
              if hasattr(cfg, f.name)}
    return ModelConfig(vocab_size=vocab_size, **shared)


def build_engine(cfg: TrainConfig, model: MoETransformer) -> RolloutEngine:
    """The rollout engine of ``cfg``: ``rollout_precision`` (the numeric mode) and the engine
    mismatch mode (``rollout_mismatch*``, or the fresh ``rollout_logit_noise``).

    Parameters
    ----------
    cfg : TrainConfig
        The run's configuration (checked).
    model : MoETransformer
        The trainer's model (copied into the engine, on its device).

    Returns
    -------
    RolloutEngine
    """
    mismatch = EngineMismatch(cfg.rollout_mismatch, cfg.rollout_mismatch_scale,
                              cfg.rollout_mismatch_fraction, cfg.rollout_mismatch_seed)
    return RolloutEngine(model, precision=cfg.rollout_precision,
                         logit_noise=cfg.rollout_logit_noise, mismatch=mismatch)


def load_init(cfg: TrainConfig, device: torch.device | str = "cpu") -> dict:
    """The ``cfg.init`` checkpoint, checked to hold a model of ``cfg``'s shape.

    Parameters
    ----------
    cfg : TrainConfig
        The run's configuration, with ``init`` set (a trainer checkpoint's path).
    device : torch.device or str, default "cpu"
        Where the checkpoint's tensors are loaded.

    Returns
    -------
    dict
        The checkpoint's state (``"model"`` holds the model's ``state_dict``).

    Raises
    ------
    ValueError
        ``init``: unreadable, not a trainer checkpoint, or a model of another shape.
    """
    state = load_checkpoint(cfg.init, option="init", device=device)
    vocab = get_task(cfg.task).tokenizer.vocab_size
    check_model_config(state, dataclasses.asdict(model_config(cfg, vocab)), option="init",
                       path=cfg.init)
    return state


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device | str | None = None
                ) -> MoETransformer:
    """The MoE transformer of ``cfg``, initialized from ``cfg.seed`` on ``device`` (default
    ``cfg.device``).

    Parameters
    ----------
    cfg : TrainConfig
        The run's configuration (model shape, ``seed``, ``dtype``, ``device``).
    vocab_size : int
        The task tokenizer's vocabulary size.
    device : torch.device or str, optional
        Overrides ``cfg.device`` (a rank's ``cuda:LOCAL_RANK`` under ``torchrun``).

    Returns
    -------
    MoETransformer
        Freshly initialized, in ``cfg.dtype``.
    """
    mc = model_config(cfg, vocab_size)
    return MoETransformer(mc, generator=torch.Generator().manual_seed(cfg.seed),
                          device=cfg.device if device is None else device, dtype=DTYPES[cfg.dtype])


def build_estimator(cfg: TrainConfig) -> Estimator:
    """The registry estimator (rl) with ``kl_coef`` applied (k3 in the loss), or SFT's.

    Parameters
    ----------
    cfg : TrainConfig
        ``mode``, ``estimator`` (a registry name) and ``kl_coef`` (None: the registry's KL
        term; 0: none; > 0: k3 in the loss with that coefficient).

    Returns
    -------
    Estimator
        :data:`SFT_ESTIMATOR` when ``cfg.mode == "sft"``.
    """
    if cfg.mode == "sft":
        return SFT_ESTIMATOR
    est = estimators.get(cfg.estimator)
    if cfg.kl_coef is not None:
        est = est.replace(kl=KLPenalty(coef=cfg.kl_coef, in_reward=False) if cfg.kl_coef > 0
                          else None)
    return est


OPTIMIZER_STATE_KEYS = {torch.optim.AdamW: frozenset({"step", "exp_avg", "exp_avg_sq"}),
                        torch.optim.SGD: frozenset({"momentum_buffer"})}
"""The per-parameter state each optimizer of :func:`build_optimizer` keeps (what ``carry`` moves)."""


def build_optimizer(cfg: TrainConfig, parameters) -> torch.optim.Optimizer:
    """The optimizer of ``cfg.optimizer`` over ``parameters``, at the peak learning rate.

    ``adamw``: ``torch.optim.AdamW(lr, betas=(beta1, beta2), weight_decay)`` (decoupled decay;
    Loshchilov & Hutter 2019). Adam divides each coordinate by its gradient's running RMS, so an
    update is about ``lr`` per parameter whatever the loss's scale: a loss multiplied by a
    constant trains the same (up to ``eps``). ``sgd``: ``torch.optim.SGD(lr, momentum=beta1,
    weight_decay)`` (L2 decay, added to the gradient): the update is ``lr`` times the gradient
    (with momentum, its running sum), so a loss's scale is its step size; with
    ``grad_clip > 0`` a gradient above the clip is rescaled to it first.

    Parameters
    ----------
    cfg : TrainConfig
        Its ``optimizer``, ``lr``, ``beta1``, ``beta2`` and ``weight_decay``.
    parameters : iterable of torch.nn.Parameter
        What it updates.

    Returns
    -------
    torch.optim.Optimizer
        A fresh optimizer (zero moments).
    """
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=cfg.lr, momentum=cfg.beta1,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer != "adamw":
        raise ValueError(f"optimizer: expected adamw or sgd, got {cfg.optimizer!r}")
    return torch.optim.AdamW(parameters, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay)


def carry_optimizer_state(optimizer: torch.optim.Optimizer, init_state: dict, *,
                          path: str) -> None:
    """Put the per-parameter state of ``init_state``'s optimizer (AdamW's ``exp_avg``,
    ``exp_avg_sq`` and ``step``, SGD's ``momentum_buffer``; e.g. the SFT run's) into
    ``optimizer``, keeping ``optimizer``'s own hyperparameters (lr, betas, weight decay):
    ``optimizer_state="carry"``.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The run's fresh optimizer, over the parameters of the model loaded from ``init_state``.
    init_state : dict
        The ``init`` checkpoint (:func:`load_init`).
    path : str
        The checkpoint's path (named in errors).

    Raises
    ------
    ValueError
        ``optimizer_state``: the checkpoint holds no optimizer state, or one of another optimizer
        (its configuration names another, or its entries are not the ones ``optimizer`` keeps),
        or one whose parameters (count or shapes) are not this model's.
    """
    saved = init_state.get("optimizer")
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise ValueError(f"optimizer_state: carry needs the optimizer state of the init "
                         f"checkpoint; {path} holds none (use reset)")
    kind = {torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}.get(type(optimizer))
    trained = (init_state.get("config") or {}).get("optimizer", "adamw")  # older: AdamW
    if kind is not None and trained != kind:
        raise ValueError(f"optimizer_state: {path} was trained with {trained}, this run uses "
                         f"{kind}; carry needs the same optimizer (use reset)")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    keys = OPTIMIZER_STATE_KEYS.get(type(optimizer))
    for index, entry in saved["state"].items():
        if keys is not None and isinstance(entry, dict) and not set(entry) <= keys:
            raise ValueError(f"optimizer_state: {path} holds {type(optimizer).__name__}-foreign "
                             f"state {sorted(set(entry) - keys)} for parameter {index!r} (the "
                             f"init was trained with another optimizer; use reset)")
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"optimizer_state: {path}: optimizer state for parameter {index!r}, "
                             f"this model has {len(params)}")
        for key, value in entry.items():
            if (isinstance(value, torch.Tensor) and value.dim() > 0
                    and value.shape != params[index].shape):
                raise ValueError(f"optimizer_state: {path}: optimizer entry '{key}' of parameter "
                                 f"{index} has shape {tuple(value.shape)}, the parameter "
                                 f"{tuple(params[index].shape)}")
    target = optimizer.state_dict()          # this run's hyperparameters, the saved moments
    optimizer.load_state_dict({"state": saved["state"], "param_groups": target["param_groups"]})
