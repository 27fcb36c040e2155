"""Clip-Cov and KL-Cov: surrogates that restrain the tokens of largest covariance between
``log π`` and ``Â`` (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617; verl ``policy_loss.loss_mode=clip_cov`` / ``kl_cov``).

Under policy gradient the entropy falls by about the covariance of ``log π(y_t)`` and ``Â_t``
over the batch, so the paper restrains the tokens that carry the most of it. The per-token
covariance term is ``cov_t = (Â_t - mean Â)(log π_old(y_t) - mean log π_old)``, means over the
loss tokens of the step, and ``N`` counts those tokens:

* **Clip-Cov** detaches ``max(⌊r N⌋, 1)`` tokens drawn among those with ``ω_low < cov_t <
  ω_high``: their PPO-clip term is multiplied by 0 (no gradient), the normalizer unchanged;
* **KL-Cov** adds ``-β |log π_θ - log π_old|`` to the unclipped ``r_t Â`` of the ``max(⌊k N⌋,
  1)`` tokens of largest ``cov_t``; every other token keeps ``r_t Â`` (no clip).

The selection is a statistic of the whole step: ``prepare_step`` computes it once, from the
detached ``old_logprob`` and ``advantage``, per step when steps are stacked, and stores it in
``token_extras`` so that every micro-batch reads the same one (the losses are micro-batch
invariant). verl recomputes it inside the loss of every micro-batch from the current ``log π_θ``
(detached) with micro-batch means and counts: the same selection at the first mini-batch of a
step when the micro-batch is the whole step (``π_θ = π_old``), a different one otherwise; verl's
Clip-Cov also leaves out tokens PPO already clips (none at ``π_θ = π_old``).

Clip-Cov's random draw is made reproducible and layout-free: each token's priority is a hash of
``seed``, its sequence's tokens (prompt and response) and its position, and the candidates of
lowest priority are detached (identical tokens of identical sequences tie; those at the cut
share the places left, each scaled by ``1 - places / ties``, the same total and independent of
the order of the sequences). The estimator is then a fixed, deterministic function of the batch,
and its exact moments are those of that rule: over the enumeration, the mean is that of verl's
estimator to the extent the hash behaves like an independent uniform draw, and the variance
lacks the part that comes from the draw itself. ``selection='expected'`` instead scales every
candidate's term by ``1 - n_detached / n_candidates``, the probability that a uniform draw keeps
it: the expectation of verl's estimator over its draw, whose exact mean equals verl's and whose
variance is the between-batch part of verl's (law of total variance).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    check_nonnegative,
    check_positive,
    require,
    sequence_sum,
    to_tokens,
)
from tokenmdp.estimators.kl import kl_abs
from tokenmdp.estimators.surrogates.clipped import ppo_clip_term
from tokenmdp.estimators.surrogates.token import Surrogate, _check_eps, token_ratio_term

__all__ = ["CLIP_COV_SCALE", "ClipCov", "KL_COV_SELECTED", "KLCov", "token_covariance"]

CLIP_COV_SCALE = "clip_cov_scale"
"""``token_extras`` key of Clip-Cov's per-token factor (0 detached, 1 kept; the keep probability
with ``selection='expected'``)."""
KL_COV_SELECTED = "kl_cov_selected"
"""``token_extras`` key of KL-Cov's selection (1 where the KL term applies, else 0; a share for
identical tokens at the cut)."""

_PRIME = 2_147_483_647  # 2^31 - 1: products of two residues stay below 2^62
_MULT = (48_271, 69_621, 40_692)


def _token_steps(batch: TokenBatch, step: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Step id of every token (0 on padding) and the number of steps."""
    if step is None:
        return torch.zeros(batch.tokens.shape, dtype=torch.long, device=batch.device), 1
    if not isinstance(step, torch.Tensor) or step.shape != (batch.num_sequences,) \
            or step.dtype.is_floating_point:
        raise ValueError(f"step: expected an integer tensor of shape [S] = "
                         f"({batch.num_sequences},)")
    num = int(step.max()) + 1 if step.numel() else 1
    return to_tokens(step.long(), batch), num


def _per_step_mean(values_RC, mask_RC, step_RC, num):
    total = values_RC.new_zeros(num).index_add(0, step_RC[mask_RC], values_RC[mask_RC])
    count = values_RC.new_zeros(num).index_add(0, step_RC[mask_RC],
                                               torch.ones_like(values_RC[mask_RC]))
    return (total / count.clamp(min=1))[step_RC], count


def token_covariance(batch: TokenBatch, step: torch.Tensor | None = None) -> torch.Tensor:
    """``cov_t = (Â_t - mean Â)(log π_old(y_t) - mean log π_old)``, means over the loss tokens of
    each step (the per-token term of the covariance in Cui et al., arXiv 2505.22617).

    Parameters
    ----------
    batch : TokenBatch
        A prepared batch (``advantage`` filled) with ``old_logprob``.
    step : LongTensor ``[S]``, optional
        Optimizer-step id of each sequence when several steps are stacked.

    Returns
    -------
    Tensor ``[R, C]``
        ``cov_t`` on the loss tokens, 0 elsewhere.
    """
    old = require(batch, "old_logprob", "the token covariance of Clip-Cov / KL-Cov")
    mask = batch.loss_mask
    step_RC, num = _token_steps(batch, step)
    mean_a, _ = _per_step_mean(batch.advantage, mask, step_RC, num)
    mean_l, _ = _per_step_mean(old, mask, step_RC, num)
    return torch.where(mask, (batch.advantage - mean_a) * (old - mean_l), 0.0)


def _priority(batch: TokenBatch, seed: int) -> torch.Tensor:
    """A pseudo-random integer in ``[0, 2^31 - 1)`` per token: a hash of ``seed``, the tokens of
    its sequence (prompt and response, in order) and its position; the same in every layout."""
    p = _PRIME
    length = int(batch.position.max()) + 1 if batch.tokens.numel() else 1
    powers = [1]
    for _ in range(length - 1):
        powers.append(powers[-1] * _MULT[0] % p)
    power = torch.tensor(powers, dtype=torch.long, device=batch.device)[batch.position]
    term = torch.where(batch.sequence_id >= 0, (batch.tokens + 1) % p * power % p, 0)
    content = sequence_sum(term, batch) % p            # the sequence's polynomial hash
    h = to_tokens(content, batch)
    h = (h * _MULT[1] + batch.position + 1) % p
    h = (h * _MULT[2] + seed % p) % p
    for mult in _MULT:                                  # a few rounds of mixing
        h = (h * mult + (h >> 7)) % p
    return h


def _selected_fraction(step_T: torch.Tensor, budget_S: torch.Tensor,
                       *keys: torch.Tensor) -> torch.Tensor:
    """The share of each entry in the first ``budget`` of its step, ordered by ``keys`` (first
    key first): 1 or 0, except for entries equal in every key that straddle the cut, which share
    the remaining places equally (two identical tokens competing for one place get 1/2 each), so
    the result does not depend on the order of the entries."""
    n = step_T.numel()
    order = torch.arange(n, device=step_T.device)
    for key in reversed((step_T, *keys)):
        order = order[torch.argsort(key[order], stable=True)]
    columns = [key[order] for key in (step_T, *keys)]
    new = torch.zeros(n, dtype=torch.bool, device=step_T.device)
    new[:1] = True
    for column in columns:
        new[1:] |= column[1:] != column[:-1]
    tie = new.cumsum(0) - 1                                # class of equal entries
    steps = columns[0]
    counts = torch.bincount(steps, minlength=int(steps.max()) + 1)
    rank = torch.arange(n, device=step_T.device) - (counts.cumsum(0) - counts)[steps]
    size = torch.bincount(tie).to(budget_S.dtype)
    left = (budget_S[steps[new]] - rank[new].to(budget_S.dtype)).clamp(min=0)
    share = torch.minimum(left, size) / size
    out = torch.empty(n, dtype=budget_S.dtype, device=step_T.device)
    out[order] = share[tie]
    return out


def _budget(ratio: float, count: torch.Tensor) -> torch.Tensor:
    """``max(⌊ratio N⌋, 1)`` per step (verl: ``max(int(ratio * N), 1)``)."""
    return torch.floor(ratio * count).clamp(min=1)


def _check_ratio(name: str, value: float) -> None:
    check_positive(name, value)
    if value > 1:
        raise ValueError(f"{name}: a fraction of the tokens, expected 0 < {name} <= 1, got {value}")


def _extra(batch: TokenBatch, key: str, who: str) -> torch.Tensor:
    if key not in batch.token_extras:
        raise ValueError(f"batch.token_extras has no {key!r}: {who} selects its tokens in "
                         "estimators.prepare; prepare the step with this estimator first")
    return batch.token_extras[key]


# ---------------------------------------------------------------------- composable parts
@dataclasses.dataclass(frozen=True)
class ClipCov(Surrogate):
    """Clip-Cov: PPO clip, with the step's selected high-covariance tokens detached.

    ``term_t = s_t · min(r_t Â, clip(r_t, 1-ε_low, 1+ε_high) Â)``, ``s_t = 0`` on the tokens
    drawn in :meth:`~tokenmdp.estimators.ClipCov.prepare_step` (see the module docstring),
    else 1. No dual clip, as verl's ``clip_cov``.

    Parameters
    ----------
    eps_low, eps_high : float, default 0.2
        The PPO clip band (verl ``clip_ratio_low`` / ``clip_ratio_high``).
    ratio : float, default 2e-4
        ``r``: the fraction of the step's loss tokens detached, at least one (paper and verl
        ``clip_cov_ratio`` 2e-4).
    cov_low, cov_high : float, default 1.0 and 5.0
        The band ``ω_low < cov < ω_high`` of the candidates (verl ``clip_cov_lb`` 1,
        ``clip_cov_ub`` 5); ``cov_low < cov_high``.
    selection : {'random', 'expected'}, default 'random'
        Detach a seeded draw of the candidates, or scale every candidate by the probability a
        uniform draw keeps it.
    seed : int, default 0
        Seed of the draw (``selection='random'``).
    """

    couples_sequences = True
    """The term of a token depends on the other sequences' ``log π_old`` (the covariance and the
    selection), not only on their rewards and counts: the exact lab's exchangeability method
    does not apply."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    ratio: float = 2e-4
    cov_low: float = 1.0
    cov_high: float = 5.0
    selection: str = "random"
    seed: int = 0

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high)
        _check_ratio("ratio", self.ratio)
        for name in ("cov_low", "cov_high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not abs(value) < float("inf"):
                raise ValueError(f"{name}: expected a finite number, got {value!r}")
        if not self.cov_low < self.cov_high:
            raise ValueError(f"cov_low, cov_high: expected cov_low < cov_high, got "
                             f"({self.cov_low}, {self.cov_high})")
        if self.selection not in ("random", "expected"):
            raise ValueError(f"selection: expected 'random' or 'expected', got "
                             f"{self.selection!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: expected an int >= 0, got {self.seed!r}")

    def prepare_step(self, batch, step):  # numpydoc ignore=PR01,RT01
        """Draw the detached tokens of each step; store ``s_t`` in ``token_extras``."""
        with torch.no_grad():
            cov = token_covariance(batch, step).to(torch.float32)  # rounding-proof ordering
            mask = batch.loss_mask
            step_RC, num = _token_steps(batch, step)
            candidate = mask & (cov > self.cov_low) & (cov < self.cov_high)
            count = batch.advantage.new_zeros(num).index_add(
                0, step_RC[mask], torch.ones_like(batch.advantage[mask]))
            budget = _budget(self.ratio, count)
            n_cand = batch.advantage.new_zeros(num).index_add(
                0, step_RC[candidate], torch.ones_like(batch.advantage[candidate]))
            scale = torch.ones_like(batch.advantage)
            if self.selection == "expected":
                keep = 1 - torch.minimum(budget, n_cand) / n_cand.clamp(min=1)
                scale = torch.where(candidate, keep[step_RC], scale)
            elif bool(candidate.any()):
                drawn = _selected_fraction(step_RC[candidate], budget,
                                           _priority(batch, self.seed)[candidate],
                                           cov[candidate])
                scale[candidate] = 1 - drawn
        return batch.replace(token_extras={**batch.token_extras, CLIP_COV_SCALE: scale})

    def __call__(self, logprobs_RC, batch):
        scale = _extra(batch, CLIP_COV_SCALE, "Clip-Cov")
        terms = ppo_clip_term(logprobs_RC, self._old(batch), batch.advantage,
                              eps_low=self.eps_low, eps_high=self.eps_high)
        return terms._replace(term_RC=terms.term_RC * scale,
                              clipped_RC=terms.clipped_RC | (scale < 1))

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"Clip-Cov PPO [1-0.2, 1+0.2], r=0.0002, cov in (1, 5), random 0"``.
        """
        how = f"random {self.seed}" if self.selection == "random" else "expected"
        return (f"Clip-Cov PPO [1-{self.eps_low:g}, 1+{self.eps_high:g}], r={self.ratio:g}, "
                f"cov in ({self.cov_low:g}, {self.cov_high:g}), {how}")


@dataclasses.dataclass(frozen=True)
class KLCov(Surrogate):
    """KL-Cov: ``r_t Â - β m_t |log π_θ - log π_old|``, ``m_t = 1`` on the ``max(⌊k N⌋, 1)``
    tokens of largest covariance of the step (``prepare_step``), else 0.

    Ties in the covariance are broken by the same content hash as Clip-Cov's (seed 0), and
    identical tokens at the cut share the places left (``m_t`` = places / ties), so the
    selection weighs exactly ``max(⌊k N⌋, 1)`` tokens (capped at ``N``) in any layout; verl's
    ``topk`` breaks ties by position. The gradient of ``|log r|`` is ``sign(log r)``, 0 at
    ``π_θ = π_old`` (:func:`~tokenmdp.estimators.kl_abs`): at the first mini-batch the term
    changes nothing.

    Parameters
    ----------
    ratio : float, default 2e-4
        ``k``: the fraction of the step's loss tokens penalized (verl ``kl_cov_ratio`` 2e-4; the
        paper tunes it per model).
    coef : float, default 0.1
        ``β`` (verl ``ppo_kl_coef``: 0.1 in its config; the loss function falls back to 1.0 when
        the key is unset).
    """

    couples_sequences = True
    """The term of a token depends on the other sequences' ``log π_old`` (the covariance and the
    selection), not only on their rewards and counts: the exact lab's exchangeability method
    does not apply."""

    ratio: float = 2e-4
    coef: float = 0.1

    def __post_init__(self):
        _check_ratio("ratio", self.ratio)
        check_nonnegative("coef", self.coef)

    def prepare_step(self, batch, step):  # numpydoc ignore=PR01,RT01
        """Select the step's tokens of largest covariance; store ``m_t`` in ``token_extras``."""
        with torch.no_grad():
            cov = token_covariance(batch, step).to(torch.float32)
            mask = batch.loss_mask
            step_RC, num = _token_steps(batch, step)
            count = batch.advantage.new_zeros(num).index_add(
                0, step_RC[mask], torch.ones_like(batch.advantage[mask]))
            selected = torch.zeros_like(batch.advantage)
            if bool(mask.any()):
                selected[mask] = _selected_fraction(step_RC[mask], _budget(self.ratio, count),
                                                    -cov[mask], _priority(batch, 0)[mask])
        return batch.replace(token_extras={**batch.token_extras, KL_COV_SELECTED: selected})

    def __call__(self, logprobs_RC, batch):
        selected = _extra(batch, KL_COV_SELECTED, "KL-Cov")
        old = self._old(batch)
        terms = token_ratio_term(logprobs_RC, old, batch.advantage)
        penalty = kl_abs(logprobs_RC, old)
        term = terms.term_RC - (self.coef * selected) * penalty
        return terms._replace(term_RC=term, clipped_RC=selected > 0)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"KL-Cov r A - 0.1 |log r| on top 0.0002 cov"``.
        """
        return f"KL-Cov r A - {self.coef:g} |log r| on top {self.ratio:g} cov"
