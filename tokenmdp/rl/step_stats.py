"""A rollout step's statistics, summed on each rank and divided once over all of them.

Both rollout paths of the trainer (independent groups in :mod:`tokenmdp.rl.run_state`, trees
in :mod:`tokenmdp.rl.tree_step`) log the same figures: :func:`rollout_sums` adds up this rank's
share (rewards, accuracy, lengths, entropy, training-inference KL, routing mismatch, groups of
equal rewards, the correction's ESS and χ² sums), :func:`rollout_stats` all-reduces the sums
over the ranks and divides, so every ratio is step-wide, whatever the number of ranks.
"""

from __future__ import annotations

import math

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.distributed import all_reduce_floats
from tokenmdp.estimators.corrections.diagnostics import batch_weight_sums, diagnostics_from_sums
from tokenmdp.rl.mismatch import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    routing_mismatch_counts,
    training_inference_kl,
)

__all__ = ["rollout_stats", "rollout_sums"]


def rollout_sums(batch: TokenBatch, reward_S: torch.Tensor, correct: list[bool],
                 entropy_RC: torch.Tensor, *, groups: int, zero_std: float, all_zero: float,
                 sequence: bool, length_S: torch.Tensor | None = None,
                 extra: dict[str, float] | None = None) -> dict[str, float]:
    """This rank's sums of a rollout step.

    Parameters
    ----------
    batch : TokenBatch
        The step's batch after the old-logprob pass (engine and old routing in
        ``token_extras``).
    reward_S : Tensor ``[S']``
        The rewards of every sampled response (``S'`` may exceed the batch's sequences when
        some were left out of the updates).
    correct : list of bool
        Whether each sampled response is right.
    entropy_RC : Tensor ``[R, C]``
        ``π_old``'s entropy at each token.
    groups : int
        Groups (prompts) of this rank.
    zero_std, all_zero : float
        Groups whose rewards are all equal, and all zero.
    sequence : bool
        Whether the correction acts per sequence (its ESS and χ² per sequence too).
    length_S : Tensor ``[S']``, optional
        The response lengths of the same responses as ``reward_S`` (default: the batch's, when
        every sampled response is in it).
    extra : dict of str to float, optional
        Further sums to reduce with these (e.g. the tree rollout's token counts).

    Returns
    -------
    dict of str to float
    """
    mask = batch.loss_mask
    tokens = float(mask.sum())
    mismatch, routed = routing_mismatch_counts(batch.token_extras[ENGINE_ROUTING],
                                               batch.token_extras[OLD_ROUTING])
    reward = reward_S.double()
    return dict(seqs=int(reward.numel()), reward=float(reward.sum()),
                reward_sq=float((reward ** 2).sum()), correct=float(sum(correct)),
                length=float((batch.length if length_S is None else length_S).double().sum()),
                tokens=tokens,
                entropy=float(entropy_RC[mask].double().sum()),
                kl_k1=training_inference_kl(batch, kind="k1") * tokens,
                kl_k3=training_inference_kl(batch, kind="k3") * tokens,
                mismatch=mismatch, routed=routed, groups=groups, zero_std=zero_std,
                all_zero=all_zero, **(extra or {}),
                # ESS and χ² of π_old/μ; per sequence too when the correction acts per sequence
                **batch_weight_sums(batch, sequence=sequence))


def rollout_stats(sums: dict[str, float], device) -> tuple[dict[str, float], dict[str, float]]:
    """The sums of :func:`rollout_sums` reduced over the ranks, and the step's statistics.

    Parameters
    ----------
    sums : dict of str to float
        This rank's sums.
    device : torch.device or str
        Where the all-reduce runs.

    Returns
    -------
    (dict, dict)
        The reduced sums, and the statistics: mean reward and its std, train accuracy, response
        length, per-token entropy and training-inference KL (k1, k3), routing mismatch, the
        fractions of groups of equal and of all-zero rewards (TRL's ``frac_reward_zero_std``),
        and the correction's diagnostics.
    """
    g = dict(zip(sums, all_reduce_floats(list(sums.values()), device=device)))
    n, t = g["seqs"], max(g["tokens"], 1.0)
    mean_reward = g["reward"] / n
    stats = {"reward": mean_reward,
             "reward_std": math.sqrt(max(g["reward_sq"] / n - mean_reward ** 2, 0.0)),
             "train_accuracy": g["correct"] / n, "response_length": g["length"] / n,
             "entropy": g["entropy"] / t, "train_infer_kl_k1": g["kl_k1"] / t,
             "train_infer_kl_k3": g["kl_k3"] / t,
             "routing_mismatch": g["mismatch"] / g["routed"] if g["routed"] else 0.0,
             # groups of equal rewards (zero advantage under a group baseline); TRL's name
             "frac_reward_zero_std": g["zero_std"] / g["groups"],
             "frac_reward_all_zero": g["all_zero"] / g["groups"],
             **diagnostics_from_sums(g)}
    return g, stats
