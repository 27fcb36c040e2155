"""What a training run is built from: its model, its estimator and its ``--init`` checkpoint.

:func:`build_model` (the MoE transformer of a :class:`~tokenmdp.rl.config.TrainConfig`, seeded
by ``cfg.seed``; :func:`model_config` its :class:`~tokenmdp.model.ModelConfig`),
:func:`build_estimator` (the registry estimator with ``kl_coef`` applied, or
:data:`SFT_ESTIMATOR` in SFT mode) and :func:`load_init` (the ``init`` checkpoint, checked to
hold a model of the configured shape). The trainer's run state
(:mod:`tokenmdp.rl.run_state`) builds itself from these; every name here is re-exported by
:mod:`tokenmdp.rl.trainer`.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp import estimators
from tokenmdp.estimators import Aggregation, Estimator, KLPenalty, Reinforce, RewardAsAdvantage
from tokenmdp.model import ModelConfig, MoETransformer
from tokenmdp.rl.checkpoint import check_model_config, load_checkpoint
from tokenmdp.rl.config import DTYPES, TrainConfig
from tokenmdp.rl.tasks import get_task

__all__ = ["SFT_ESTIMATOR", "build_estimator", "build_model", "load_init", "model_config"]

SFT_ESTIMATOR = Estimator(name="sft", surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                          aggregation=Aggregation.TOKEN_MEAN)
"""SFT as an estimator: ``A = R = 1``, weighted NLL, mean over the step's answer tokens."""


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """The :class:`~tokenmdp.model.ModelConfig` of ``cfg`` for a vocabulary of ``vocab_size``."""
    # TrainConfig repeats the ModelConfig fields it exposes (flat, one command-line option each)
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)
              if hasattr(cfg, f.name)}
    return ModelConfig(vocab_size=vocab_size, **shared)


def load_init(cfg: TrainConfig, device: torch.device | str = "cpu") -> dict:
    """The ``cfg.init`` checkpoint, checked to hold a model of ``cfg``'s shape.

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
    ``cfg.device``)."""
    mc = model_config(cfg, vocab_size)
    return MoETransformer(mc, generator=torch.Generator().manual_seed(cfg.seed),
                          device=cfg.device if device is None else device, dtype=DTYPES[cfg.dtype])


def build_estimator(cfg: TrainConfig) -> Estimator:
    """The registry estimator (rl) with ``kl_coef`` applied (k3 in the loss), or SFT's."""
    if cfg.mode == "sft":
        return SFT_ESTIMATOR
    est = estimators.get(cfg.estimator)
    if cfg.kl_coef is not None:
        est = est.replace(kl=KLPenalty(coef=cfg.kl_coef, in_reward=False) if cfg.kl_coef > 0
                          else None)
    return est
