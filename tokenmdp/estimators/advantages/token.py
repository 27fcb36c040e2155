"""Token-level advantages: ``A_{i,t}`` that differ from token to token within a sequence.

A per-sequence advantage cannot express a penalty earned *during* the response: REINFORCE++ and
OpenRLHF put the KL to the reference policy into the reward of every token, ``r_t = -β k_t``
(plus the outcome ``R`` at the last token), so the return from token t on is
``R - β Σ_{s>=t} k_s``: a token is charged only for the KL of itself and what follows it, the
causal (reward-to-go) form of the penalty. A :class:`TokenAdvantage` part gets the environment
reward and that per-token penalty from :func:`~tokenmdp.estimators.prepare` (the estimator's
``KLPenalty(in_reward=True)``, evaluated at ``π_old``) and returns ``[R, C]`` advantages.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import check_nonnegative, sequence_sum, to_tokens
from tokenmdp.estimators.advantages.baselines import _check_ddof, weighted_whiten
from tokenmdp.estimators.advantages.group import Advantage, _check, _group_deviation

__all__ = ["RewardToGo", "TokenAdvantage", "reward_to_go"]


def reward_to_go(values_RC: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """``out_t = Σ_{s >= t, s in the sequence of t} values_s``: the suffix sum within each
    sequence, in any layout (packed rows included).

    Parameters
    ----------
    values_RC : Tensor ``[R, C]``
        Per-token values, 0 wherever they should not count (padding included).
    batch : TokenBatch
        The layout (``sequence_id``, ``position``).

    Returns
    -------
    Tensor ``[R, C]``
        The suffix sums (on padding: a value of no meaning; mask it).
    """
    if values_RC.shape != batch.tokens.shape:
        raise ValueError(f"values_RC: shape {tuple(values_RC.shape)} differs from the batch's "
                         f"{tuple(batch.tokens.shape)}")
    if batch.num_sequences == 0:
        return torch.zeros_like(values_RC)
    sid = batch.sequence_id.clamp(min=0)
    inclusive = values_RC.cumsum(dim=1)  # each sequence is one contiguous span of one row
    first = (batch.position == 0) & (batch.sequence_id >= 0)
    before = values_RC.new_zeros(batch.num_sequences)
    before[batch.sequence_id[first]] = (inclusive - values_RC)[first]
    within = inclusive - before[sid]              # Σ_{s <= t} within the sequence
    return to_tokens(sequence_sum(values_RC, batch), batch) - within + values_RC


class TokenAdvantage(Advantage):
    """Base of the token-level advantage parts: ``token_advantages(batch, reward_S, penalty_RC,
    step_S) -> [R, C]``, called by :func:`~tokenmdp.estimators.prepare`.

    They have no per-sequence form: calling the part on rewards alone raises ``TypeError``, and
    ``prepare(..., advantage_S=...)`` refuses them.
    """

    token_level = True
    couples_sequences = True  # the group mean of the environment reward, the token whitening

    def __call__(self, reward_S, group_S, step_S=None):
        raise TypeError(f"{type(self).__name__} is a token-level advantage: it has no "
                        "per-sequence form; estimators.prepare computes it from the batch")

    def per_sequence(self, reward_S, group_S, length_S, step_S=None):  # numpydoc ignore=PR01,RT01
        """Refused: a token-level part has no per-sequence advantages (see ``prepare``)."""
        return self(reward_S, group_S, step_S)

    def token_advantages(self, batch: TokenBatch, reward_S: torch.Tensor,
                         penalty_RC: torch.Tensor, step_S: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """The advantage of every token of ``batch``.

        Parameters
        ----------
        batch : TokenBatch
            Whole groups of the step(s).
        reward_S : Tensor ``[S]``
            The environment reward of each sequence.
        penalty_RC : Tensor ``[R, C]``
            The per-token reward penalty ``β k_t`` (0 off the loss tokens; all 0 without a
            KL-in-reward penalty).
        step_S : LongTensor ``[S]``, optional
            Optimizer-step id of each sequence when several steps are stacked.

        Returns
        -------
        Tensor ``[R, C]``
            ``A_{i,t}`` on the loss tokens (``prepare`` zeroes the rest).
        """
        raise NotImplementedError


_BASELINES = ("group_mean", "none")


@dataclasses.dataclass(frozen=True)
class RewardToGo(TokenAdvantage):
    """``A_{i,t} = (R_i - b_i) - Σ_{s >= t} β k_{i,s}``, then optionally whitened over the step.

    ``b_i`` is the group mean of the environment rewards (``baseline='group_mean'``, OpenRLHF's
    ``reinforce_baseline``) or 0 (``'none'``, REINFORCE++ and verl's ``reinforce_plus_plus``);
    ``β k`` is the estimator's KL-in-reward penalty at ``π_old`` (OpenRLHF: k1, β = 0.01);
    ``whiten`` standardizes over every loss token of the step, ``(A - m)/sqrt(var + eps)`` with
    ``var = Σ (A - m)² / (N - ddof)`` (OpenRLHF: ``ddof = 0``, the variance floored at 1e-8
    rather than incremented; verl: ``ddof = 1``, ``+ 1e-8``). Without a penalty and without
    whitening it is the per-sequence group mean broadcast to the tokens. Paper: Hu et al.
    (REINFORCE++), arXiv 2501.03262 (token-level KL penalty, global advantage normalization).

    Parameters
    ----------
    baseline : {'group_mean', 'none'}, default 'group_mean'
        What is subtracted from the environment reward before the penalty is added.
    whiten : bool, default True
        Standardize the token advantages over each step (batch-wide when True).
    ddof : int, default 0
        Delta degrees of freedom of the token variance.
    eps : float, default 1e-8
        Added to the variance.
    """

    baseline: str = "group_mean"
    whiten: bool = True
    ddof: int = 0
    eps: float = 1e-8

    def __post_init__(self):
        if self.baseline not in _BASELINES:
            raise ValueError(f"baseline: expected one of {_BASELINES}, got {self.baseline!r}")
        if not isinstance(self.whiten, bool):
            raise TypeError(f"whiten: expected a bool, got {type(self.whiten).__name__}")
        _check_ddof(self.ddof)
        check_nonnegative("eps", self.eps)

    @property
    def group_local(self) -> bool:  # numpydoc ignore=RT01
        """False when whitening (a batch-wide statistic), True otherwise."""
        return not self.whiten

    def token_advantages(self, batch, reward_S, penalty_RC, step_S=None):  # numpydoc ignore=PR01,RT01
        """``A_{i,t}`` of every token (see the class docstring; ``[R, C]``)."""
        _check(reward_S, batch.group)
        if penalty_RC.shape != batch.tokens.shape or penalty_RC.dtype != reward_S.dtype:
            raise ValueError(f"penalty_RC: expected a {reward_S.dtype} tensor of shape "
                             f"{tuple(batch.tokens.shape)}")
        if self.baseline == "group_mean":
            reward_S = _group_deviation(reward_S, batch.group)[0]
        penalty = torch.where(batch.loss_mask, penalty_RC, 0.0)
        advantage = to_tokens(reward_S, batch) - reward_to_go(penalty, batch)
        if not self.whiten:
            return advantage
        mask = batch.loss_mask.reshape(-1)
        step = None
        if step_S is not None:
            step = to_tokens(step_S, batch).reshape(-1)
        flat = weighted_whiten(advantage.reshape(-1), mask.to(advantage.dtype), step,
                               ddof=self.ddof, eps=self.eps)
        return flat.reshape(advantage.shape)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"whiten_tokens(R - group mean - beta sum_{s>=t} k_s), ddof=0"``.
        """
        base = "R - group mean" if self.baseline == "group_mean" else "R"
        core = f"{base} - beta sum_(s>=t) k_s"
        return f"whiten_tokens({core}), ddof={self.ddof}" if self.whiten else core
