"""Advantages: per-sequence ``A_i`` from the rewards of each group (one prompt's G responses).

Pure functions of ``reward_S`` (float ``[S]``) and ``group_S`` (integer ``[S]``, any ids), each
returning float ``[S]``; group statistics are one ``index_add`` over groups, no Python loop. A
group whose rewards are all equal gets exactly zero advantage (the deviation is set to 0 there,
not left to rounding), hence exactly zero gradient. The small frozen dataclasses at the end hold
the hyperparameters and are the parts an :class:`~tokenmdp.estimators.Estimator` composes.

``prepare`` broadcasts ``A_i`` to the loss tokens of sequence i.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.estimators._common import check_nonnegative, loss_token_counts, take

__all__ = [
    "Advantage", "BatchNormalized", "GroupMean", "GroupNormalized", "LeaveOneOut",
    "RewardAsAdvantage", "batch_normalized_advantage", "group_mean_advantage",
    "group_normalized_advantage", "leave_one_out_advantage", "reward_advantage",
]


def _check(reward_S: torch.Tensor, group_S: torch.Tensor | None = None) -> None:
    if not isinstance(reward_S, torch.Tensor) or reward_S.dim() != 1:
        raise ValueError(f"reward_S: expected a 1-d tensor [S], got "
                         f"{getattr(reward_S, 'shape', type(reward_S).__name__)}")
    if not reward_S.dtype.is_floating_point:
        raise TypeError(f"reward_S: expected a floating-point tensor, got {reward_S.dtype}")
    if not bool(torch.isfinite(reward_S).all()):
        bad = int((~torch.isfinite(reward_S)).nonzero()[0])
        raise ValueError(f"reward_S: reward {bad} is {float(reward_S[bad])}; rewards must be "
                         "finite")
    if group_S is not None and (not isinstance(group_S, torch.Tensor)
                                or group_S.shape != reward_S.shape
                                or group_S.dtype.is_floating_point):
        raise ValueError(f"group_S: expected an integer tensor of shape {tuple(reward_S.shape)}")


def _group_index(group_S: torch.Tensor) -> torch.Tensor:
    """Each sequence's group as ``0 .. num_groups-1`` in increasing id order: that of
    ``torch.unique(group_S, return_inverse=True)``, by runs when the ids are sorted (stacked
    steps, a trainer's batch: one pass instead of a sort)."""
    if group_S.numel() > 1 and bool((group_S[1:] >= group_S[:-1]).all()):
        return torch.unique_consecutive(group_S, return_inverse=True)[1]
    return torch.unique(group_S, return_inverse=True)[1]


def _group_deviation(reward_S: torch.Tensor, group_S: torch.Tensor):
    """``(R - group mean, group index of each sequence, group sizes)``; deviation exactly 0 in a
    constant group."""
    index = _group_index(group_S)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    size = reward_S.new_zeros(num_groups).index_add(0, index, torch.ones_like(reward_S))
    mean = reward_S.new_zeros(num_groups).index_add(0, index, reward_S) / size
    empty = reward_S.new_zeros(num_groups)
    hi = empty.scatter_reduce(0, index, reward_S, "amax", include_self=False)
    lo = empty.scatter_reduce(0, index, reward_S, "amin", include_self=False)
    deviation = torch.where(take(hi == lo, index), torch.zeros_like(reward_S),
                            reward_S - take(mean, index))
    return deviation, index, size


def _std(deviation_S: torch.Tensor, index: torch.Tensor, size: torch.Tensor, ddof: int,
         who: str) -> torch.Tensor:
    """Per-group std with ``ddof`` (``sqrt(sum dev^2 / (n - ddof))``), at each sequence."""
    if bool((size <= ddof).any()):
        raise ValueError(f"{who}: a group of {int(size.min())} sequence(s) has no std with "
                         f"ddof={ddof}")
    sq = deviation_S.new_zeros(size.shape).index_add(0, index, deviation_S.square())
    return take((sq / (size - ddof)).sqrt(), index)


def reward_advantage(reward_S: torch.Tensor) -> torch.Tensor:
    """``A_i = R_i``: no baseline (REINFORCE; Williams 1992, Machine Learning 8:229).

    Parameters
    ----------
    reward_S : Tensor ``[S]``
        Float rewards, one per sequence (finite).

    Returns
    -------
    Tensor ``[S]``
        A copy of ``reward_S``.
    """
    _check(reward_S)
    return reward_S.clone()


def group_mean_advantage(reward_S: torch.Tensor, group_S: torch.Tensor) -> torch.Tensor:
    """``A_i = R_i - mean_{j in g(i)} R_j`` (Dr. GRPO, arXiv 2503.20783; MiniRL, arXiv 2512.01374).

    Equals ``(G-1)/G`` times the leave-one-out advantage, sample by sample.

    Parameters
    ----------
    reward_S : Tensor ``[S]``
        Float rewards, one per sequence (finite).
    group_S : Tensor ``[S]``
        Integer group id of each sequence (any ids; a group is one prompt's responses).

    Returns
    -------
    Tensor ``[S]``
        The advantages, exactly 0 in a group whose rewards are all equal.
    """
    _check(reward_S, group_S)
    return _group_deviation(reward_S, group_S)[0]


def group_normalized_advantage(reward_S: torch.Tensor, group_S: torch.Tensor, *, ddof: int,
                               eps: float) -> torch.Tensor:
    """``A_i = (R_i - mean_g) / (std_g + eps)`` (GRPO, arXiv 2402.03300, Sec. 4.1.2).

    ``std_g = sqrt(sum_j (R_j - mean_g)^2 / (G - ddof))``: ``ddof=1`` is the sample std that
    TRL and verl use (``torch.std``), ``ddof=0`` the population std. ``eps`` is added to the std
    (verl 1e-6, TRL 1e-4). A group needs more than ``ddof`` sequences (``ValueError`` otherwise).

    Parameters
    ----------
    reward_S : Tensor ``[S]``
        Float rewards, one per sequence (finite).
    group_S : Tensor ``[S]``
        Integer group id of each sequence.
    ddof : int
        Delta degrees of freedom of the std (1 = sample std, 0 = population std).
    eps : float
        Added to the std (>= 0).

    Returns
    -------
    Tensor ``[S]``
        The advantages, exactly 0 in a group whose rewards are all equal.
    """
    _check(reward_S, group_S)
    return _normalized(reward_S, group_S, ddof=ddof, eps=eps, who="group_S")


def _normalized(reward_S, group_S, *, ddof: int, eps: float, who: str) -> torch.Tensor:
    check_nonnegative("eps", eps)
    deviation, index, size = _group_deviation(reward_S, group_S)
    std = _std(deviation, index, size, ddof, who)
    # A constant group has deviation 0 and std 0: 0 / (0 + eps) = 0, and 0 / 0 is avoided for eps=0.
    return torch.where(deviation == 0, deviation, deviation / (std + eps))


def leave_one_out_advantage(reward_S: torch.Tensor, group_S: torch.Tensor) -> torch.Tensor:
    """``A_i = R_i - mean_{j != i, j in g(i)} R_j`` (RLOO: Kool et al. 2019; Ahmadian et al.,
    arXiv 2402.14740). Unbiased: the baseline does not depend on sample i. Groups of size >= 2.

    Computed as ``G/(G-1) (R_i - mean_g)``, the same number without a second pass.

    Parameters
    ----------
    reward_S : Tensor ``[S]``
        Float rewards, one per sequence (finite).
    group_S : Tensor ``[S]``
        Integer group id of each sequence; every group has at least 2 sequences.

    Returns
    -------
    Tensor ``[S]``
        The advantages, exactly 0 in a group whose rewards are all equal.
    """
    _check(reward_S, group_S)
    deviation, index, size = _group_deviation(reward_S, group_S)
    if bool((size < 2).any()):
        raise ValueError("group_S: leave-one-out needs every group to have at least 2 sequences")
    return deviation * take(size / (size - 1), index)


def batch_normalized_advantage(reward_S: torch.Tensor, *, ddof: int, eps: float,
                               step_S: torch.Tensor | None = None) -> torch.Tensor:
    """``A_i = (R_i - mean_batch) / (std_batch + eps)`` over every sequence of the step
    (REINFORCE++-style global normalization, arXiv 2501.03262; PPO's advantage normalization).

    ``step_S`` (optional) splits the batch into independent optimizer steps, each normalized
    over its own sequences (used to stack many steps into one batch, as the exact lab does).

    Parameters
    ----------
    reward_S : Tensor ``[S]``
        Float rewards, one per sequence (finite).
    ddof : int
        Delta degrees of freedom of the std (1 = sample std, 0 = population std).
    eps : float
        Added to the std (>= 0).
    step_S : Tensor ``[S]``, optional
        Integer optimizer-step id of each sequence (default: all one step).

    Returns
    -------
    Tensor ``[S]``
        The advantages, exactly 0 where every reward of a step is equal.
    """
    _check(reward_S)
    steps = torch.zeros_like(reward_S, dtype=torch.long) if step_S is None else step_S
    return _normalized(reward_S, steps, ddof=ddof, eps=eps, who="reward_S")


# ---------------------------------------------------------------------- composable parts
class Advantage:
    """Base of the advantage parts: ``part(reward_S, group_S, step_S=None) -> advantage_S``.

    ``step_S`` assigns sequences to independent optimizer steps stacked in one batch; only parts
    with batch-wide statistics read it (groups never span steps).
    :func:`~tokenmdp.estimators.prepare` calls :meth:`from_batch`, which passes the loss-token
    counts to :meth:`per_sequence`; parts that weigh by length override :meth:`per_sequence`.
    """

    group_local: bool = True
    """True when a sequence's advantage depends only on its own group: then any holder of whole
    groups (a micro-batch, a data-parallel rank) computes it exactly. False for batch-wide
    statistics, which need every sequence of the step."""

    couples_sequences: bool = False
    """True when a sequence's advantage depends on the other sequences through more than their
    rewards (after a KL-in-reward penalty) and loss-token counts, e.g. through their per-token
    penalties: the exact lab's exchangeability method, which reduces the other samples to those
    types, does not apply then."""

    token_level: bool = False
    """True for parts whose advantages differ from token to token
    (:class:`~tokenmdp.estimators.advantages.token.TokenAdvantage`); ``prepare`` then calls
    their ``token_advantages`` instead of
    :meth:`~tokenmdp.estimators.Advantage.from_batch`."""

    def __call__(self, reward_S: torch.Tensor, group_S: torch.Tensor,
                 step_S: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def from_batch(self, batch, reward_S: torch.Tensor,
                   step_S: torch.Tensor | None = None) -> torch.Tensor:
        """The advantage of each sequence of ``batch`` (what :func:`~tokenmdp.estimators.prepare`
        calls): :meth:`per_sequence` with the loss-token counts of ``batch``.

        Parameters
        ----------
        batch : TokenBatch
            Whole groups of the step(s).
        reward_S : Tensor ``[S]``
            The rewards the part sees (:func:`~tokenmdp.estimators.advantage_rewards`).
        step_S : LongTensor ``[S]``, optional
            Optimizer-step id of each sequence when several steps are stacked.

        Returns
        -------
        Tensor ``[S]``
            One advantage per sequence.
        """
        if type(self).per_sequence is Advantage.per_sequence:    # the counts unused: not counted
            return self(reward_S, batch.group, step_S)
        return self.per_sequence(reward_S, batch.group, loss_token_counts(batch), step_S)

    def per_sequence(self, reward_S: torch.Tensor, group_S: torch.Tensor,
                     length_S: torch.Tensor, step_S: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The advantages from per-sequence data alone: what a data-parallel trainer computes
        over every rank's gathered rewards, groups and loss-token counts before
        ``prepare(..., advantage_S=...)`` of its share. By default ``self(reward_S, group_S,
        step_S)`` (the counts unused); parts that weigh by length use ``length_S``.

        Parameters
        ----------
        reward_S : Tensor ``[S]``
            The rewards the part sees (:func:`~tokenmdp.estimators.advantage_rewards`).
        group_S : Tensor ``[S]``
            Integer group id of each sequence.
        length_S : Tensor ``[S]``
            ``|y_i|``, the loss tokens of each sequence.
        step_S : LongTensor ``[S]``, optional
            Optimizer-step id of each sequence when several steps are stacked.

        Returns
        -------
        Tensor ``[S]``
            One advantage per sequence.
        """
        return self(reward_S, group_S, step_S)

    def describe(self) -> str:
        """Short label for tables."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class RewardAsAdvantage(Advantage):
    """``A_i = R_i`` (:func:`reward_advantage`); groups are not used."""

    def __call__(self, reward_S, group_S, step_S=None):
        return reward_advantage(reward_S)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"R (no baseline)"``.
        """
        return "R (no baseline)"


@dataclasses.dataclass(frozen=True)
class GroupMean(Advantage):
    """``A_i = R_i - mean_g`` (:func:`group_mean_advantage`)."""

    def __call__(self, reward_S, group_S, step_S=None):
        return group_mean_advantage(reward_S, group_S)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"R - group mean"``.
        """
        return "R - group mean"


@dataclasses.dataclass(frozen=True)
class GroupNormalized(Advantage):
    """``A_i = (R_i - mean_g)/(std_g + eps)`` (:func:`group_normalized_advantage`).

    Parameters
    ----------
    ddof : int, default 1
        Delta degrees of freedom of the std: 1 = sample std (TRL, verl), 0 = population std.
    eps : float, default 1e-6
        Added to the std (verl's 1e-6; TRL uses 1e-4).
    """

    ddof: int = 1
    eps: float = 1e-6

    def __post_init__(self):
        check_nonnegative("eps", self.eps)
        if not isinstance(self.ddof, int) or self.ddof < 0:
            raise ValueError(f"ddof: expected an int >= 0, got {self.ddof!r}")

    def __call__(self, reward_S, group_S, step_S=None):
        return group_normalized_advantage(reward_S, group_S, ddof=self.ddof, eps=self.eps)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"(R - group mean)/(std + 1e-06), ddof=1"``.
        """
        return f"(R - group mean)/(std + {self.eps:g}), ddof={self.ddof}"


@dataclasses.dataclass(frozen=True)
class LeaveOneOut(Advantage):
    """``A_i = R_i - mean_{j != i} R_j`` (:func:`leave_one_out_advantage`)."""

    def __call__(self, reward_S, group_S, step_S=None):
        return leave_one_out_advantage(reward_S, group_S)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"R - leave-one-out mean"``.
        """
        return "R - leave-one-out mean"


@dataclasses.dataclass(frozen=True)
class BatchNormalized(Advantage):
    """``A_i = (R_i - mean)/(std + eps)`` over the step (:func:`batch_normalized_advantage`);
    groups are not used. Batch-wide: a data-parallel rank must see every rank's rewards.

    Parameters
    ----------
    ddof : int, default 1
        Delta degrees of freedom of the std: 1 = sample std, 0 = population std.
    eps : float, default 1e-6
        Added to the std.
    """

    group_local = False
    ddof: int = 1
    eps: float = 1e-6

    def __post_init__(self):
        check_nonnegative("eps", self.eps)
        if not isinstance(self.ddof, int) or self.ddof < 0:
            raise ValueError(f"ddof: expected an int >= 0, got {self.ddof!r}")

    def __call__(self, reward_S, group_S, step_S=None):
        return batch_normalized_advantage(reward_S, ddof=self.ddof, eps=self.eps, step_S=step_S)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"(R - batch mean)/(std + 1e-06), ddof=1"``.
        """
        return f"(R - batch mean)/(std + {self.eps:g}), ddof={self.ddof}"
