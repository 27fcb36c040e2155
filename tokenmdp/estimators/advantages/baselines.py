"""More per-sequence advantages: REINFORCE++-baseline, TRL's batch-std GRPO and OPO's optimal
baseline, as the frameworks compute them.

Like :mod:`~tokenmdp.estimators.advantages.group`, pure functions of float ``[S]`` rewards and integer
``[S]`` group ids (and, where the formula needs them, the loss-token counts ``|y_i|``), one
``index_add`` per statistic, exactly zero deviation where the values averaged are all equal.
``step_S`` stacks independent optimizer steps: every batch-wide statistic is then per step.
The frozen dataclasses at the end are the composable parts; ``prepare`` gives them ``|y_i|``
counted from the loss mask (:meth:`~tokenmdp.estimators.Advantage.per_sequence`).

A group of one response: the group mean is its own reward, so its deviation is 0 here, as in
:class:`~tokenmdp.estimators.GroupMean` (verl sets the baseline of such a group to 0 instead).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.estimators._common import check_nonnegative, loss_token_counts
from tokenmdp.estimators.advantages.group import Advantage, _check, _group_deviation

__all__ = [
    "GroupMeanBatchStd", "OPOBaseline", "ReinforcePPBaseline", "group_mean_batch_std_advantage",
    "opo_advantage", "reinforce_pp_baseline_advantage", "weighted_whiten",
]


def _check_ddof(ddof: object) -> None:
    if isinstance(ddof, bool) or not isinstance(ddof, int) or ddof < 0:
        raise ValueError(f"ddof: expected an int >= 0, got {ddof!r}")


def _check_lengths(length_S: object, reward_S: torch.Tensor) -> None:
    if not isinstance(length_S, torch.Tensor) or length_S.shape != reward_S.shape:
        raise ValueError(f"length_S: expected the loss-token count of each sequence, a tensor of "
                         f"shape {tuple(reward_S.shape)}, got "
                         f"{getattr(length_S, 'shape', type(length_S).__name__)}")
    if bool((length_S < 0).any()):
        raise ValueError("length_S: token counts must be >= 0")


def _ids(ids: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense ids ``0..n-1`` of ``ids`` (all 0 when None) and ``n``."""
    if ids is None:
        return torch.zeros(like.shape, dtype=torch.long, device=like.device), int(like.numel() > 0)
    _, index = torch.unique(ids, return_inverse=True)
    return index, int(index.max()) + 1 if index.numel() else 0


def weighted_whiten(values: torch.Tensor, weight: torch.Tensor, step: torch.Tensor | None = None,
                    *, ddof: int, eps: float) -> torch.Tensor:
    """``(v - m) / sqrt(var + eps)`` with weighted statistics per step.

    ``m = Σ w v / Σ w``, ``var = Σ w (v - m)² / (Σ w - ddof)`` over the entries of each step
    (0 when ``Σ w <= ddof``). With integer weights this is the whitening of every entry repeated
    ``w`` times: verl's ``masked_whiten`` over tokens (``ddof=1``, ``eps=1e-8``) when ``v`` is a
    sequence's advantage and ``w`` its token count. Where every weighted value of a step is equal
    the deviation is exactly 0 (not rounding), so the result is 0 there.

    Parameters
    ----------
    values : Tensor ``[N]``
        The values (finite floats).
    weight : Tensor ``[N]``
        Nonnegative weights (a zero weight leaves the statistics; its entry is still whitened).
    step : LongTensor ``[N]``, optional
        Step id of each entry (default: one step).
    ddof : int
        Delta degrees of freedom of the variance (1 = Bessel's correction over the weights).
    eps : float
        Added to the variance (>= 0).

    Returns
    -------
    Tensor ``[N]``
        The whitened values.
    """
    _check_ddof(ddof)
    check_nonnegative("eps", eps)
    index, n = _ids(step, values)
    total = values.new_zeros(n).index_add(0, index, weight)
    mean = values.new_zeros(n).index_add(0, index, weight * values) / total.clamp(min=1e-300)
    counted = weight > 0
    hi = values.new_full((n,), -torch.inf).scatter_reduce(
        0, index, torch.where(counted, values, -torch.inf), "amax")
    lo = values.new_full((n,), torch.inf).scatter_reduce(
        0, index, torch.where(counted, values, torch.inf), "amin")
    constant = (hi <= lo)[index]  # one distinct counted value, or none
    deviation = torch.where(constant, torch.zeros_like(values), values - mean[index])
    sq = values.new_zeros(n).index_add(0, index, weight * deviation.square())
    var = torch.where(total > ddof, sq / (total - ddof).clamp(min=1e-300), 0.0)
    return torch.where(deviation == 0, deviation, deviation / (var[index] + eps).sqrt())


def reinforce_pp_baseline_advantage(reward_S: torch.Tensor, group_S: torch.Tensor,
                                    length_S: torch.Tensor, *, ddof: int = 1, eps: float = 1e-8,
                                    step_S: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++-baseline: ``A_i = (d_i - m) / sqrt(v + eps)``, ``d_i = R_i - mean_g``.

    The group mean is subtracted, then ``d`` is whitened over every loss token of the step
    (:func:`weighted_whiten` with weights ``|y_i|``): ``m = Σ |y_i| d_i / N``, ``v = Σ |y_i|
    (d_i - m)² / (N - ddof)``, ``N = Σ |y_i|``. This is verl's
    ``adv_estimator=reinforce_plus_plus_baseline`` (``masked_whiten`` of the broadcast scores:
    token-weighted, Bessel-corrected, ``rsqrt(var + 1e-8)``); OpenRLHF's ``reinforce_baseline``
    whitens over tokens too, with the population variance (``ddof=0``) floored at 1e-8 instead of
    incremented, after adding its per-token KL reward
    (:class:`~tokenmdp.estimators.advantages.token.RewardToGo`). Paper: Hu et al.
    (REINFORCE++), arXiv 2501.03262.

    Parameters
    ----------
    reward_S : Tensor ``[S]``
        Float rewards, one per sequence (finite).
    group_S : Tensor ``[S]``
        Integer group id of each sequence.
    length_S : Tensor ``[S]``
        ``|y_i|``, the loss tokens of each sequence (the whitening weights).
    ddof : int, default 1
        Delta degrees of freedom of the token variance (verl 1, OpenRLHF 0).
    eps : float, default 1e-8
        Added to the variance (verl's 1e-8).
    step_S : LongTensor ``[S]``, optional
        Optimizer-step id of each sequence (each step whitened on its own).

    Returns
    -------
    Tensor ``[S]``
        The advantages, exactly 0 in a step whose deviations are all equal.
    """
    _check(reward_S, group_S)
    _check_lengths(length_S, reward_S)
    deviation = _group_deviation(reward_S, group_S)[0]
    return weighted_whiten(deviation, length_S.to(reward_S.dtype), step_S, ddof=ddof, eps=eps)


def group_mean_batch_std_advantage(reward_S: torch.Tensor, group_S: torch.Tensor, *,
                                   ddof: int = 1, eps: float = 1e-4,
                                   step_S: torch.Tensor | None = None) -> torch.Tensor:
    """``A_i = (R_i - mean_g) / (std_batch(R) + eps)``: TRL's ``scale_rewards='batch'``.

    ``std_batch`` is the std of the raw rewards over every sequence of the step (TRL:
    ``rewards.std()`` of the gathered batch, ``ddof=1``, ``eps = 1e-4`` added to it; 0 for a step
    of at most ``ddof`` sequences): sequence-weighted, unlike
    :func:`reinforce_pp_baseline_advantage`, and the std of the rewards, not of the deviations.

    Parameters
    ----------
    reward_S : Tensor ``[S]``
        Float rewards, one per sequence (finite).
    group_S : Tensor ``[S]``
        Integer group id of each sequence.
    ddof : int, default 1
        Delta degrees of freedom of the batch std (TRL's ``torch.std``: 1).
    eps : float, default 1e-4
        Added to the std (TRL's 1e-4).
    step_S : LongTensor ``[S]``, optional
        Optimizer-step id of each sequence (each step's own std).

    Returns
    -------
    Tensor ``[S]``
        The advantages, exactly 0 in a group whose rewards are all equal.
    """
    _check(reward_S, group_S)
    _check_ddof(ddof)
    check_nonnegative("eps", eps)
    group_dev = _group_deviation(reward_S, group_S)[0]
    steps = torch.zeros_like(group_S) if step_S is None else step_S
    step_dev, index, size = _group_deviation(reward_S, steps)
    sq = reward_S.new_zeros(size.shape).index_add(0, index, step_dev.square())
    std = torch.where(size > ddof, sq / (size - ddof).clamp(min=1), 0.0).sqrt()[index]
    return torch.where(group_dev == 0, group_dev, group_dev / (std + eps))


def opo_advantage(reward_S: torch.Tensor, group_S: torch.Tensor,
                  length_S: torch.Tensor) -> torch.Tensor:
    """``A_i = R_i - b_g``, ``b_g = Σ_{j in g} |y_j| R_j / Σ_{j in g} |y_j|``: OPO's optimal
    baseline (Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585;
    verl ``adv_estimator=opo``).

    The length-weighted mean of the group's rewards minimizes the gradient variance when
    ``‖∇ log π(y)‖² ∝ |y|`` (the paper's assumption). A group whose responses have no loss token
    at all gets the plain mean (its advantages weigh nothing).

    Parameters
    ----------
    reward_S : Tensor ``[S]``
        Float rewards, one per sequence (finite).
    group_S : Tensor ``[S]``
        Integer group id of each sequence.
    length_S : Tensor ``[S]``
        ``|y_i|``, the loss tokens of each sequence.

    Returns
    -------
    Tensor ``[S]``
        The advantages, exactly 0 in a group whose rewards are all equal.
    """
    _check(reward_S, group_S)
    _check_lengths(length_S, reward_S)
    _, index, size = _group_deviation(reward_S, group_S)
    empty = reward_S.new_zeros(size.shape)
    hi = empty.scatter_reduce(0, index, reward_S, "amax", include_self=False)
    lo = empty.scatter_reduce(0, index, reward_S, "amin", include_self=False)
    length = length_S.to(reward_S.dtype)
    total = reward_S.new_zeros(size.shape).index_add(0, index, length)
    weighted = reward_S.new_zeros(size.shape).index_add(0, index, length * reward_S)
    plain = reward_S.new_zeros(size.shape).index_add(0, index, reward_S) / size
    baseline = torch.where(total > 0, weighted / total.clamp(min=1e-300), plain)
    return torch.where((hi == lo)[index], torch.zeros_like(reward_S), reward_S - baseline[index])


# ---------------------------------------------------------------------- composable parts
@dataclasses.dataclass(frozen=True)
class ReinforcePPBaseline(Advantage):
    """REINFORCE++-baseline (:func:`reinforce_pp_baseline_advantage`): group mean, then token-
    weighted whitening over the step. Batch-wide: a data-parallel rank needs every rank's
    rewards and lengths (:meth:`~tokenmdp.estimators.Advantage.per_sequence`).

    Parameters
    ----------
    ddof : int, default 1
        Delta degrees of freedom of the token variance (verl 1, OpenRLHF 0).
    eps : float, default 1e-8
        Added to the variance.
    """

    group_local = False
    ddof: int = 1
    eps: float = 1e-8

    def __post_init__(self):
        _check_ddof(self.ddof)
        check_nonnegative("eps", self.eps)

    def __call__(self, reward_S, group_S, step_S=None, *, length_S=None):
        return reinforce_pp_baseline_advantage(reward_S, group_S, length_S, ddof=self.ddof,
                                               eps=self.eps, step_S=step_S)

    def per_sequence(self, reward_S, group_S, length_S, step_S=None):  # numpydoc ignore=PR01,RT01
        """The advantages, weighted by the loss-token counts ``length_S``."""
        return self(reward_S, group_S, step_S, length_S=length_S)

    def from_batch(self, batch, reward_S, step_S=None):  # numpydoc ignore=PR01,RT01
        """The advantages with ``|y_i|`` counted from ``batch.loss_mask`` (overridden, so that a
        caller can tell that this part reads more of the batch than the rewards)."""
        return self.per_sequence(reward_S, batch.group, loss_token_counts(batch), step_S)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"whiten_tokens(R - group mean), ddof=1, eps=1e-08"``.
        """
        return f"whiten_tokens(R - group mean), ddof={self.ddof}, eps={self.eps:g}"


@dataclasses.dataclass(frozen=True)
class GroupMeanBatchStd(Advantage):
    """``(R - group mean) / (batch std + eps)`` (:func:`group_mean_batch_std_advantage`).
    Batch-wide: a data-parallel rank needs every rank's rewards.

    Parameters
    ----------
    ddof : int, default 1
        Delta degrees of freedom of the batch std (TRL 1).
    eps : float, default 1e-4
        Added to the std (TRL 1e-4).
    """

    group_local = False
    ddof: int = 1
    eps: float = 1e-4

    def __post_init__(self):
        _check_ddof(self.ddof)
        check_nonnegative("eps", self.eps)

    def __call__(self, reward_S, group_S, step_S=None):
        return group_mean_batch_std_advantage(reward_S, group_S, ddof=self.ddof, eps=self.eps,
                                              step_S=step_S)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"(R - group mean)/(batch std + 0.0001), ddof=1"``.
        """
        return f"(R - group mean)/(batch std + {self.eps:g}), ddof={self.ddof}"


@dataclasses.dataclass(frozen=True)
class OPOBaseline(Advantage):
    """``R - Σ|y|R / Σ|y|`` within the group (:func:`opo_advantage`); group-local."""

    def __call__(self, reward_S, group_S, step_S=None, *, length_S=None):
        return opo_advantage(reward_S, group_S, length_S)

    def per_sequence(self, reward_S, group_S, length_S, step_S=None):  # numpydoc ignore=PR01,RT01
        """The advantages, weighted by the loss-token counts ``length_S``."""
        return self(reward_S, group_S, step_S, length_S=length_S)

    def from_batch(self, batch, reward_S, step_S=None):  # numpydoc ignore=PR01,RT01
        """The advantages with ``|y_i|`` counted from ``batch.loss_mask`` (overridden, so that a
        caller can tell that this part reads more of the batch than the rewards)."""
        return self.per_sequence(reward_S, batch.group, loss_token_counts(batch), step_S)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"R - length-weighted group mean (OPO)"``.
        """
        return "R - length-weighted group mean (OPO)"
