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

:func:`~tokenmdp.exact.lattice.structure.exact_support` says whether an estimator has a form the
lattice computes exactly (a whitelist of the surrogate, correction and KL parts) and why not
otherwise; :func:`weight_form` also recognises the token mean ``W_i = w_0 / Σ_j |y_j|``.
"""

from __future__ import annotations

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import Estimator, loss, prepare

__all__ = ["length_weights", "token_coefficients", "token_table", "weight_form"]

#: Relative tolerance when recognising the form of the probe weights.
WEIGHT_TOL = 1e-12


def _probe_group(lengths: list[int], fields: tuple[str, ...]) -> TokenBatch:
    G = len(lengths)
    batch = TokenBatch.from_sequences([[0]] * G, [[0] * n for n in lengths], rewards=[0.0] * G,
                                      groups=[0] * G)
    zeros = torch.zeros_like(batch.advantage)
    return batch.replace(**{f: zeros for f in fields})


def length_weights(estimator: Estimator, group_size: int, *, max_len: int = 2
                   ) -> tuple[float, bool] | None:
    """The aggregation's weight ``W_i`` as ``(w_0, per_length)``, from :func:`prepare`.

    ``per_length`` False: ``W_i = w_0`` for every response; True: ``W_i = w_0 / |y_i|``; None
    for any other form (the token mean at ``G >= 2``, whose form :func:`weight_form` names).

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
    found = weight_form(estimator, group_size, max_len=max_len)
    if found is None or found[1] == "total":
        return None
    return found[0], found[1] == "length"


def weight_form(estimator: Estimator, group_size: int, *, max_len: int = 2
                ) -> tuple[float, str] | None:
    """The aggregation's weight ``W_i`` of a response, as ``(w_0, form)``, from :func:`prepare`.

    ``form`` is ``"constant"`` (``W_i = w_0``), ``"length"`` (``W_i = w_0 / |y_i|``) or
    ``"total"`` (``W_i = w_0 / Σ_j |y_j|``, the token mean over the group). The form is
    recognised on probe groups of lengths ``1`` and ``1, 2, 1, 2, ...`` (and ``2`` when
    ``G = 1``, where the token mean is the ``"length"`` form); None when none fits.

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
    tuple of (float, str) or None
        ``(w_0, form)``, or None.
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
        return w0, "constant"
    if (wm * n - w0).abs().max() <= WEIGHT_TOL * abs(w0):
        return w0, "length"
    total = w0 * G        # W_i = w_0' / Σ_j |y_j| with w_0' = w_0 · G (all lengths 1)
    if G > 1 and (wm * n.sum() - total).abs().max() <= WEIGHT_TOL * abs(total):
        return total, "total"
    return None


def _probe_batch(shape: tuple[int, int, int], advantage: float,
                 fields: dict[str, torch.Tensor]) -> TokenBatch:
    """One probe row per position ``t``: its ``K·V`` entries ``(z, a)`` as the response (after a
    one-token prompt), loss weight 1, advantage ``A``, the fields' log-probs at every entry."""
    T, K, V = shape
    R, W = T, K * V
    cols = torch.arange(W + 1)
    tokens = torch.cat([torch.zeros(R, 1, dtype=torch.long),
                        torch.arange(V).repeat(K).expand(R, W)], dim=1)
    mask = (cols >= 1).expand(R, W + 1)
    maskf = mask.to(torch.float64)
    return TokenBatch(tokens=tokens, sequence_id=torch.arange(R)[:, None].expand(R, W + 1),
                      position=cols.expand(R, W + 1), loss_mask=mask,
                      advantage=maskf * float(advantage), loss_weight=maskf,
                      reward=torch.zeros(R, dtype=torch.float64),
                      group=torch.arange(R), length=torch.full((R,), W),
                      prompt_index=torch.zeros(R, dtype=torch.long),
                      **{k: _per_token(v) for k, v in fields.items()})


def _per_token(table: torch.Tensor) -> torch.Tensor:
    T = table.shape[0]
    return torch.cat([table.new_zeros(T, 1), table.reshape(T, -1)], dim=1)


def token_table(quantity, shape: tuple[int, int, int], fields: dict[str, torch.Tensor],
                *, advantage: float = 0.0) -> torch.Tensor:
    """A per-token quantity of the library at every lattice entry ``(t, z, a)`` at once.

    Parameters
    ----------
    quantity : callable
        ``quantity(batch) -> Tensor [R, C]`` on a probe batch whose rows are the positions and
        whose response tokens are the ``K·V`` entries ``(z, a)`` (for example a correction's
        ``keep_RC``).
    shape : tuple of int
        ``(T, K, V)``.
    fields : dict of str to Tensor ``[T, K, V]``
        The log-prob fields of the probe (``old_logprob``, ``behavior_logprob``, ...).
    advantage : float, default 0
        The probe's advantage.

    Returns
    -------
    Tensor ``[T, K, V]``
        The quantity on each entry.
    """
    batch = _probe_batch(shape, advantage, fields)
    return quantity(batch)[:, 1:].reshape(shape)


def token_coefficients(estimator: Estimator, advantage: float, logprob: torch.Tensor,
                       fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """``φ(t, z, a; A) = −∂ loss / ∂ log π(a|t,z)`` at every lattice entry, by autograd.

    Parameters
    ----------
    estimator : Estimator
        A token-local estimator (:func:`~tokenmdp.exact.lattice.exact_support`).
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
    shape = tuple(logprob.shape)
    batch = _probe_batch(shape, advantage, fields)
    lp = _per_token(logprob.detach()).requires_grad_(True)
    with torch.enable_grad():
        value, _ = loss(lp, batch, estimator, metrics=False)
        (grad,) = torch.autograd.grad(value, lp)
    return -grad[:, 1:].reshape(shape)
