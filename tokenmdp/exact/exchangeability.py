"""The exchangeability method of :func:`~tokenmdp.exact.moments`: exact moments from types.

With one prompt per batch, sample ``i``'s own gradient term ``g_i`` depends on the other samples
only through their *types* (effective reward, counted tokens), so ``E[ĝ] = G E[g_1]`` and
``E‖ĝ‖² = G E‖g_1‖² + G(G−1) E<g_1, g_2>`` need ``y_1`` (and ``y_2``) and the type distribution
of the others only: ``n · C(K+G−2, G−1)`` batches instead of the enumeration's ``C(n+G−1, G)``
for ``n`` responses and ``K`` types (the derivation: :mod:`tokenmdp.exact.moments`).

Here: the types of every response, :func:`exchangeability_cost` (the number of batches, which
:func:`~tokenmdp.exact.moments` compares with the enumeration's count) and the moments
themselves. The types and multisets come from :mod:`~tokenmdp.exact.group_draws`;
:func:`exchangeability_cost` is re-exported by :mod:`tokenmdp.exact.moments`.
"""

from __future__ import annotations

import math

import torch

from tokenmdp.estimators import counted_mask
from tokenmdp.exact.group_draws import exchangeable_types, multisets
from tokenmdp.exact.mdp import TokenMDP
from tokenmdp.exact.step_gradients import StepGradients

__all__ = ["exchangeability_cost"]


def _type_keys(steps: StepGradients) -> torch.Tensor:
    """``[N, 2]``: (effective reward, counted tokens) of every response: all that another sample
    contributes to a sample's own gradient term (group statistics and normalizers)."""
    est = steps.estimator
    batch = steps.enum.replace(**steps.fields)
    reward = batch.reward
    if est.kl is not None and est.kl.in_reward:
        reward = reward - est.kl.reward_penalty(batch)
    counted = batch.sequence_sum(counted_mask(batch, est).to(torch.float64))
    return torch.stack([reward, counted], dim=1)


def exchangeability_cost(mdp: TokenMDP, type_key_N: torch.Tensor, probs_N: torch.Tensor,
                         group_size: int) -> int:
    """Batches the exchangeability method evaluates: ``Σ_x n_x C(K_x + G − 2, G − 1)``.

    ``n_x`` is the number of responses to prompt ``x`` with positive probability and ``K_x``
    the number of distinct types among them.

    Parameters
    ----------
    mdp : TokenMDP
        The world whose responses are typed.
    type_key_N : Tensor ``[N, k]``
        The type of every response in canonical order (rows equal iff the types are): for the
        moments, its effective reward and counted tokens.
    probs_N : float64 ``[N]``
        Sampling probability ``μ(y | x)`` of every response.
    group_size : int
        ``G``, responses per group (at least 2).

    Returns
    -------
    int
        The number of batches (``y_1`` and a multiset of the others' types) to evaluate.
    """
    total = 0
    per_prompt = probs_N.view(mdp.num_prompts, -1)
    for x, (_, p, _) in enumerate(exchangeable_types(type_key_N, mdp, probs_N)):
        n_x = int((per_prompt[x] > 0).sum())
        total += n_x * math.comb(p.numel() + group_size - 2, group_size - 1)
    return total


def _by_exchangeability(steps: StepGradients, mdp: TokenMDP, probs_N: torch.Tensor, G: int,
                        keep_cov: bool):
    """``(E[ĝ], E‖ĝ‖², E[ĝ ĝ^T] or None, batches evaluated)`` by exchangeability (see the module)."""
    d = steps.num_params
    n = mdp.responses_per_prompt
    mean = torch.zeros(d, dtype=torch.float64)
    second = torch.zeros((), dtype=torch.float64)
    outer = torch.zeros(d, d, dtype=torch.float64) if keep_cov else None
    evaluated = 0
    for x, (type_of, p_type, rep) in enumerate(exchangeable_types(_type_keys(steps), mdp,
                                                                    probs_N)):
        K = p_type.numel()
        others, p_others = multisets(K, G - 1, p_type)                 # [Mo, G-1], [Mo]
        Mo = others.shape[0]
        q = probs_N[x * n:(x + 1) * n]
        resp = (q > 0).nonzero(as_tuple=True)[0]
        ids = torch.cat([(x * n + resp).repeat_interleave(Mo)[:, None],
                         rep[others].repeat(resp.numel(), 1)], dim=1)   # [steps, G]
        q_step = q[resp].repeat_interleave(Mo)
        w = q_step * p_others.repeat(resp.numel())                      # P(y_1) P(others)
        slot = type_of[resp].repeat_interleave(Mo) * Mo + torch.arange(Mo).repeat(resp.numel())
        # A[τ, m] = Σ_{y_1 of type τ} μ(y_1) g_1(y_1; m), accumulated in coefficient space
        A_C = torch.zeros(K * Mo, steps.num_pairs, dtype=torch.float64)
        sq1 = torch.zeros((), dtype=torch.float64)
        S1 = torch.zeros(d, d, dtype=torch.float64) if keep_cov else None
        for sl, (draw, pair, coef) in steps.sparse_blocks(ids, first_only=True):
            n_sl = int(w[sl].numel())
            sq1 += w[sl] @ steps.sq_norms(draw, pair, coef, n_sl, one_path=True)
            A_C.index_put_((slot[sl][draw], pair), coef * q_step[sl][draw], accumulate=True)
            if keep_cov:
                g = steps.to_params(steps.dense(draw, pair, coef, n_sl))
                S1 += (g * w[sl, None]).T @ g
        A = steps.to_params(A_C)
        evaluated += ids.shape[0]
        A = A.view(K, Mo, d)
        mean_x = G * torch.einsum("m,kmd->d", p_others, A)
        # cross term: types τ1, τ2 of samples 1, 2 and the multiset m' of the other G-2;
        # sample 1 sees others o1 = m' + {τ2}, sample 2 sees o2 = m' + {τ1}; the type
        # probabilities of τ1, τ2 cancel against the normalization of A.
        rest, p_rest = multisets(K, G - 2, p_type)
        index = {tuple(row): i for i, row in enumerate(others.tolist())}
        t1, t2, r = torch.meshgrid(torch.arange(K), torch.arange(K), torch.arange(rest.shape[0]),
                                   indexing="ij")
        t1, t2, r = t1.reshape(-1), t2.reshape(-1), r.reshape(-1)
        o1 = torch.tensor([index[tuple(sorted(rest[ri].tolist() + [b]))]
                           for ri, b in zip(r.tolist(), t2.tolist())], dtype=torch.long)
        o2 = torch.tensor([index[tuple(sorted(rest[ri].tolist() + [a]))]
                           for ri, a in zip(r.tolist(), t1.tolist())], dtype=torch.long)
        a1, a2, pr = A[t1, o1], A[t2, o2], p_rest[r]
        cross = (pr * (a1 * a2).sum(1)).sum()
        D = float(mdp.prompt_probs[x])
        mean += D * mean_x
        second += D * (G * sq1 + G * (G - 1) * cross)
        if keep_cov:
            cross_outer = (a1 * pr[:, None]).T @ a2
            outer += D * (G * S1 + G * (G - 1) * 0.5 * (cross_outer + cross_outer.T))
    return mean, second, outer, evaluated
