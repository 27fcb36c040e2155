"""What the estimator computes, read off the library itself: per-token coefficients and weights.

A *token-local* estimator's gradient on a group is ``ĝ = Σ_i W_i Σ_t φ(t, z_it, a_it; A_i)
∇ log π(a_it | t, z_it)``: the coefficient ``φ`` of a token depends on the node, the token and
its sequence's advantage only (the surrogate's derivative times the correction factor, plus a
KL-in-loss term), and the weight ``W_i`` on the group's lengths only. Neither is re-implemented
here:

* :func:`token_coefficients` evaluates ``φ`` on every ``(t, z, a)`` at once by calling
  :func:`tokenmdp.estimators.loss` on a probe batch (one row per position, the ``K·V`` node
  tokens as its response, loss weight 1, advantage ``A``) and differentiating by autograd:
  ``φ = −∂ loss / ∂ log π``;
* :func:`length_weights` calls :func:`tokenmdp.estimators.prepare` on probe groups of chosen
  lengths and recognises ``W_i = w_0`` (sequence-mean of token sums, constant normalizer, token
  sum) or ``W_i = w_0 / |y_i|`` (sequence-mean of token means; and the token mean when
  ``G = 1``).

:func:`exact_support` says whether an estimator is token-local in this sense (a whitelist of the
surrogate, correction and KL parts whose terms are per token) and why not otherwise.
"""

from __future__ import annotations

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import Estimator, loss, prepare
from tokenmdp.estimators.advantages.group import Advantage
from tokenmdp.estimators.corrections.factor import (
    ImportanceSampling,
    Level,
    MaskedIS,
    NoCorrection,
    TruncatedIS,
)
from tokenmdp.estimators.corrections.rejection import RejectionSampling
from tokenmdp.estimators.surrogates.clipped import CISPO, MiniRL, PPOClip
from tokenmdp.estimators.surrogates.soft import SAPO, EntropyBonus
from tokenmdp.estimators.surrogates.token import Reinforce, TokenRatio
from tokenmdp.estimators.surrogates.trust_region_masks import DPPO

__all__ = ["LOCAL_SURROGATES", "exact_support", "length_weights", "token_coefficients"]

LOCAL_SURROGATES = (Reinforce, TokenRatio, PPOClip, CISPO, MiniRL, SAPO, DPPO)
"""Surrogates whose term at a token reads only that token's log-probs and advantage."""
_LOCAL_CORRECTIONS = (NoCorrection, ImportanceSampling, TruncatedIS, MaskedIS, RejectionSampling)
#: Relative tolerance when recognising the form of the probe weights.
WEIGHT_TOL = 1e-12


def _local_surrogate(surrogate) -> bool:
    if isinstance(surrogate, EntropyBonus):
        return isinstance(surrogate.base, LOCAL_SURROGATES)
    return isinstance(surrogate, LOCAL_SURROGATES)


def exact_support(estimator: Estimator, group_size: int) -> tuple[bool, str]:
    """Whether the lattice computes ``estimator``'s moments exactly, and the reason if not.

    Exact: a token-local surrogate (:data:`LOCAL_SURROGATES`, or an entropy bonus on one), no
    correction or a token-level IS / truncated IS / masked IS / rejection mask (``reduce=
    'token'``; rejects kept in the normalizer),
    no KL or a KL penalty in the loss, an advantage part that reads only the group's rewards
    (the default ``from_batch`` and ``per_sequence``, not token-level), and an aggregation whose
    weight is constant or ``w_0 / |y_i|`` (:func:`length_weights`). Not exact: sequence-level
    ratios or corrections (GSPO's geometric mean, sequence IS, per-decision IS, sequence masks),
    self-normalized weights (their mean over the step couples the sequences), a KL penalty in
    the reward (the reward is then no longer few-valued), advantages that read lengths or
    tokens, rejects leaving the normalizer, and the token mean's normalizer
    ``Σ_j |y_j|`` coupling ``G >= 2`` responses.

    Parameters
    ----------
    estimator : Estimator
        The estimator.
    group_size : int
        ``G``.

    Returns
    -------
    exact : bool
        True when :func:`~tokenmdp.exact.lattice.moments` can be exact.
    reason : str
        Empty when exact, else what prevents it (``"undefined at G = 1: ..."`` when the
        estimator's advantage has no value for a group of that size, as leave-one-out and a
        group's standard deviation at ``G = 1``).
    """
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator: expected an Estimator, got {type(estimator).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    undefined = _undefined_at(estimator, group_size)
    if undefined:
        return False, undefined
    if not _local_surrogate(estimator.surrogate):
        return False, (f"surrogate {estimator.surrogate.describe()} is not token-local (a "
                       "sequence-level ratio, mask or clip couples the tokens of a response)")
    corr = estimator.correction
    if getattr(corr, "level", Level.TOKEN) is not Level.TOKEN:
        return False, f"correction {corr.describe()} is not token-level"
    if not isinstance(corr, _LOCAL_CORRECTIONS):
        return False, (f"correction {corr.describe()} is not a token-local factor (those are "
                       "IS, truncated IS, masked IS and token rejection masks; a self-normalized "
                       "weight's step mean couples the sequences)")
    if isinstance(corr, MaskedIS | RejectionSampling) and not corr.masked_in_normalizer:
        return False, (f"correction {corr.describe()}: its rejects leave the normalizer (the "
                       "counts become random)")
    part = estimator.advantage
    overridden = [m for m in ("from_batch", "per_sequence")
                  if getattr(type(part), m, None) is not getattr(Advantage, m, None)]
    if getattr(part, "token_level", False) or getattr(part, "couples_sequences", False) or \
            overridden:
        return False, (f"advantage {part.describe()} reads more of the batch than the group's "
                       "rewards")
    if estimator.kl is not None and estimator.kl.in_reward:
        return False, "a KL penalty in the reward makes the reward a sum over tokens"
    if length_weights(estimator, group_size) is None:
        return False, (f"aggregation {estimator.aggregation.value} with G = {group_size}: the "
                       "weight depends on the other responses' lengths")
    return True, ""


def _undefined_at(estimator: Estimator, group_size: int) -> str:
    """Why the estimator's advantage is undefined for one group of ``group_size`` (its own
    ``ValueError``, e.g. leave-one-out or a group std at ``G = 1``), or ``""``; asked of the part
    itself on a probe group of equal rewards."""
    part = estimator.advantage
    if getattr(part, "token_level", False):
        return ""
    reward_S = torch.zeros(group_size, dtype=torch.float64)
    try:
        part(reward_S, torch.zeros(group_size, dtype=torch.long))
    except ValueError as err:
        return f"undefined at G = {group_size}: advantage {part.describe()}: {err}"
    return ""


def _probe_group(lengths: list[int], fields: tuple[str, ...]) -> TokenBatch:
    G = len(lengths)
    batch = TokenBatch.from_sequences([[0]] * G, [[0] * n for n in lengths], rewards=[0.0] * G,
                                      groups=[0] * G)
    zeros = torch.zeros_like(batch.advantage)
    return batch.replace(**{f: zeros for f in fields})


def length_weights(estimator: Estimator, group_size: int, *, max_len: int = 2
                   ) -> tuple[float, bool] | None:
    """The aggregation's weight ``W_i`` as ``(w_0, per_length)``, from :func:`prepare`.

    ``per_length`` False: ``W_i = w_0`` for every response; True: ``W_i = w_0 / |y_i|``. The
    form is recognised on probe groups of lengths ``1`` and ``1, 2, 1, 2, ...`` (and ``2``
    when ``G = 1``); None when neither form fits (the token mean at ``G >= 2``).

    Parameters
    ----------
    estimator : Estimator
        The estimator (its aggregation and correction's normalizer rule).
    group_size : int
        ``G``.
    max_len : int, default 2
        ``L_max`` passed to ``prepare`` (the lattice's ``T``; the constant normalizer reads it).

    Returns
    -------
    tuple of (float, bool) or None
        ``(w_0, per_length)``, or None.
    """
    G = group_size
    fields = tuple(f for f in ("behavior_logprob", "old_logprob", "ref_logprob")
                   if f in estimator.requires("prepare"))

    def weights(lengths):
        batch = prepare(_probe_group(lengths, fields), estimator, max_len=max(max_len, 2),
                        advantage_S=torch.zeros(G, dtype=torch.float64))
        seq = batch.to_tokens(torch.arange(G))[batch.loss_mask]   # sequence of each token
        w = torch.zeros(G, dtype=torch.float64)
        w[seq] = batch.loss_weight[batch.loss_mask]             # one weight per sequence
        return w

    ones = [1] * G
    mixed = [1 + i % 2 for i in range(G)] if G > 1 else [2]
    w1, wm = weights(ones), weights(mixed)
    w0 = float(w1[0])
    n = torch.tensor(mixed, dtype=torch.float64)
    if not (w1 - w0).abs().max() <= WEIGHT_TOL * abs(w0):
        return None
    if (wm - w0).abs().max() <= WEIGHT_TOL * abs(w0):
        return w0, False
    if (wm * n - w0).abs().max() <= WEIGHT_TOL * abs(w0):
        return w0, True
    return None


def token_coefficients(estimator: Estimator, advantage: float, logprob: torch.Tensor,
                       fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """``φ(t, z, a; A) = −∂ loss / ∂ log π(a|t,z)`` at every lattice entry, by autograd.

    Parameters
    ----------
    estimator : Estimator
        A token-local estimator (:func:`exact_support`).
    advantage : float
        The sequence's advantage ``A``.
    logprob : Tensor ``[T, K, V]``
        ``log π_θ`` at every node.
    fields : dict of str to Tensor ``[T, K, V]``
        ``behavior_logprob``, ``old_logprob`` (and ``ref_logprob``) at every node.

    Returns
    -------
    Tensor ``[T, K, V]``
        The coefficient of the score ``∇ log π(a|t,z)`` of a token with loss weight 1.
    """
    T, K, V = logprob.shape
    R, W = T, K * V                      # one probe row per position: its K·V (z, a) entries
    cols = torch.arange(W + 1)
    tokens = torch.cat([torch.zeros(R, 1, dtype=torch.long),
                        torch.arange(V).repeat(K).expand(R, W)], dim=1)
    mask = (cols >= 1).expand(R, W + 1)

    def per_token(table):
        return torch.cat([table.new_zeros(R, 1), table.reshape(R, W)], dim=1)

    maskf = mask.to(torch.float64)
    batch = TokenBatch(tokens=tokens, sequence_id=torch.arange(R)[:, None].expand(R, W + 1),
                       position=cols.expand(R, W + 1), loss_mask=mask,
                       advantage=maskf * float(advantage), loss_weight=maskf,
                       reward=torch.zeros(R, dtype=torch.float64),
                       group=torch.arange(R), length=torch.full((R,), W),
                       prompt_index=torch.zeros(R, dtype=torch.long),
                       **{k: per_token(v) for k, v in fields.items()})
    lp = per_token(logprob.detach()).requires_grad_(True)
    with torch.enable_grad():
        value, _ = loss(lp, batch, estimator, metrics=False)
        (grad,) = torch.autograd.grad(value, lp)
    return -grad[:, 1:].reshape(T, K, V)
