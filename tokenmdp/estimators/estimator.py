"""An estimator is a frozen composition of five parts: :class:`Estimator`.

What it does once per optimizer step (:func:`~tokenmdp.estimators.prepare`) is in
:mod:`~tokenmdp.estimators.step`, what it does per micro-batch
(:func:`~tokenmdp.estimators.loss`) in :mod:`~tokenmdp.estimators.token_loss`, and the published
compositions by name in :mod:`~tokenmdp.estimators.registry`: this module knows none of them.

``loss = -Σ_{loss tokens} loss_weight · term``, where
``term = c · surrogate - β k`` (``c`` the detached correction factor ``π_old/μ``, ``β k`` a
KL-in-loss penalty).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    require,
)
from tokenmdp.estimators.advantages.group import Advantage, RewardAsAdvantage
from tokenmdp.estimators.aggregation import Aggregation, SequenceCount
from tokenmdp.estimators.corrections.factor import Correction, NoCorrection
from tokenmdp.estimators.kl import KLPenalty
from tokenmdp.estimators.surrogates.token import Surrogate

__all__ = ["Estimator"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimator:
    """A policy-gradient estimator as five independent parts (docs: Concepts › Estimators).

    All parameters are keyword-only.

    Parameters
    ----------
    surrogate : Surrogate
        Per-token term and its ratio (:mod:`~tokenmdp.estimators.surrogates.token`).
    advantage : Advantage, default ``RewardAsAdvantage()``
        Rewards and groups → per-sequence advantage (:mod:`~tokenmdp.estimators.advantages.group`).
    correction : Correction, default ``NoCorrection()``
        The training–inference factor ``π_old/μ`` (:mod:`~tokenmdp.estimators.corrections.factor`).
    aggregation : Aggregation, default ``Aggregation.TOKEN_MEAN``
        The loss-weight rule (:mod:`~tokenmdp.estimators.aggregation`).
    kl : KLPenalty, optional
        KL penalty to a reference policy, or None (default; :mod:`~tokenmdp.estimators.kl`).
    sequence_count : SequenceCount, default ``SequenceCount.SAMPLED``
        What ``S`` counts in the sequence-mean aggregations: every sampled sequence (the peers'
        convention) or only those with a loss token (:class:`~tokenmdp.estimators.SequenceCount`).
    name : str, default ``"custom"``
        Registry name, used in messages and tables.
    """

    surrogate: Surrogate
    advantage: Advantage = RewardAsAdvantage()
    correction: Correction = NoCorrection()
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    kl: KLPenalty | None = None
    sequence_count: SequenceCount = SequenceCount.SAMPLED
    name: str = "custom"

    def __post_init__(self):
        for field, kind in (("surrogate", Surrogate), ("advantage", Advantage),
                            ("correction", Correction), ("aggregation", Aggregation),
                            ("sequence_count", SequenceCount)):
            value = getattr(self, field)
            if not isinstance(value, kind):
                raise TypeError(f"Estimator.{field}: expected a {kind.__name__}, got "
                                f"{type(value).__name__} {value!r}")
        if self.kl is not None and not isinstance(self.kl, KLPenalty):
            raise TypeError(f"Estimator.kl: expected a KLPenalty or None, got {self.kl!r}")

    def replace(self, **changes) -> Estimator:
        """A copy with some parts replaced.

        Parameters
        ----------
        **changes
            New values of fields, by name (``surrogate=PPOClip(eps_high=0.28)``).

        Returns
        -------
        Estimator
            The copy, validated like a new estimator.
        """
        return dataclasses.replace(self, **changes)

    def requires(self, stage: str) -> tuple[str, ...]:
        """Batch fields read by ``prepare`` (``stage='prepare'``) or ``loss`` (``'loss'``).

        Parameters
        ----------
        stage : {'prepare', 'loss'}
            The call whose needs are asked for.

        Returns
        -------
        tuple of str
            The optional :class:`~tokenmdp.TokenBatch` fields the stage reads (such as
            ``old_logprob``), each once.
        """
        needs = list(self.correction.requires)
        if stage == "loss":
            needs += self.surrogate.requires
        if self.kl is not None and self.kl.in_reward == (stage == "prepare"):
            needs += self.kl.requires
        return tuple(dict.fromkeys(needs))

    def _check(self, batch: TokenBatch, stage: str) -> None:
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
        if batch.dtype in HALF_DTYPES:
            raise TypeError(f"batch: {batch.dtype} float fields; the losses need float32 or "
                            "float64 (ratios up to e^20 and their metrics overflow in half "
                            "precision): use batch.to(dtype=torch.float32) and float32 log-probs")
        for field in self.requires(stage):
            require(batch, field, f"estimator {self.name!r} ({stage})")


HALF_DTYPES = (torch.float16, torch.bfloat16)
"""Refused by :func:`prepare` and :func:`loss`: the ratio cap ``e^MAX_LOG_RATIO`` overflows."""
