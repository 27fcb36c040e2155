"""The exchangeability method of :func:`~tokenmdp.exact.moments`: exact moments from types.

With one prompt per batch, sample ``i``'s own gradient term ``g_i`` depends on the other samples
only through their *types* (effective reward, counted tokens), so ``E[ĝ] = G E[g_1]`` and
``E‖ĝ‖² = G E‖g_1‖² + G(G−1) E<g_1, g_2>`` need ``y_1`` (and ``y_2``) and the type distribution
of the others only (the derivation: :mod:`tokenmdp.exact.lab.moments`). Every term ``g(y; m)`` (a
response ``y`` against others of types ``m``) is evaluated once, packed: a batch of the full
multiset ``M`` of ``G`` types holds in each slot a new response of the slot's type, so all its
``G`` own terms are used (``Σ_M max_τ ⌈n_τ / c_τ(M)⌉`` batches, at most the
``n · C(K+G−2, G−1)`` of one batch per term, against the enumeration's ``C(n+G−1, G)``, for
``n`` responses and ``K`` types).

The types are the effective rewards, the counted tokens only where a part reads the other
samples' counts (:func:`others_counts_matter`: a token-mean normalizer, a length-aware advantage,
a step-wide ``prepare_step``; then the loss tokens too where rejects that leave the normalizer
make them differ), and each part's ``exchangeable_type``. Only the slots that hold a
new response go through the loss and its backward pass; the padding slots (a type's responses
run out) are prepared with their batch and left out after (a micro-batch of the prepared step).

Here: the types of every response, :func:`exchangeability_cost` (the number of batches, which
:func:`~tokenmdp.exact.moments` compares with the enumeration's count) and the moments
themselves. The types and multisets come from :mod:`~tokenmdp.exact.lab.group_draws`;
:func:`exchangeability_cost` is re-exported by :mod:`tokenmdp.exact.lab.moments`.
"""

from __future__ import annotations

import math

import torch

from tokenmdp.estimators import (
    Advantage,
    Aggregation,
    Correction,
    SequenceCount,
    Surrogate,
    counted_mask,
)
from tokenmdp.exact.lab.group_draws import exchangeable_types, multisets
from tokenmdp.exact.lab.step_gradients import StepGradients
from tokenmdp.exact.world.mdp import TokenMDP

__all__ = ["exchangeability_cost", "others_counts_matter", "reduces_to_types"]


def _parts(est) -> list:
    """The estimator's parts, wrapped surrogates (``.base``) unwrapped too."""
    parts, todo = [], [est.surrogate, est.correction, est.advantage]
    while todo:
        part = todo.pop()
        parts.append(part)
        if getattr(part, "base", None) is not None:
            todo.append(part.base)
    return parts


def reduces_to_types(estimator) -> bool:
    """Whether a sample's own gradient term depends on the other samples of its group only
    through their types, so that the exchangeability method is exact for ``estimator``.

    A part that couples the sequences otherwise (a step-wide token selection such as Clip-Cov's,
    a token whitening) says so with ``couples_sequences = True``; a part whose coupling is one
    more per-sequence value (self-normalized IS's weight sum) gives it by
    ``exchangeable_type(batch)``, added to the types.

    Parameters
    ----------
    estimator : Estimator
        The estimator whose parts are asked.

    Returns
    -------
    bool
        False when any part (wrapped ones included) has ``couples_sequences`` set.
    """
    return not any(getattr(part, "couples_sequences", False) for part in _parts(estimator))


#: The aggregations whose weight of a sequence's token reads no other sequence's counted tokens
#: (``1/(S |y_i|)``, ``1/S``, ``1/(S L_max)``, ``1``; ``S`` the sampled sequences, ``G``).
_OWN_COUNT_AGGREGATIONS = (Aggregation.SEQUENCE_MEAN_TOKEN_MEAN,
                           Aggregation.SEQUENCE_MEAN_TOKEN_SUM, Aggregation.CONSTANT,
                           Aggregation.TOKEN_SUM)


def others_counts_matter(estimator) -> bool:
    """Whether another sample's counted tokens can reach a sample's own gradient term.

    They reach it through the aggregation's normalizer (``N_tokens`` of ``TOKEN_MEAN``, ``N_g``
    of ``PROMPT_MEAN_TOKEN_MEAN``, the ``S`` of ``SequenceCount.WITH_LOSS_TOKENS``), through an
    advantage part that reads the lengths (one that overrides ``per_sequence`` or ``from_batch``,
    or a token-level one) and possibly through a surrogate's or correction's step-wide
    ``prepare_step``. When none of these is present the counted tokens are left out of the
    types, which then are the effective rewards alone (and any ``exchangeable_type``): fewer
    types, far fewer batches, the same moments. Anything not known to be free of the counts
    (any part that overrides ``prepare_step``, wrapped ones included) keeps them.

    Parameters
    ----------
    estimator : Estimator
        The estimator whose parts are asked.

    Returns
    -------
    bool
        False when the other samples' counted tokens provably do not enter a sample's own term.
    """
    if estimator.aggregation not in _OWN_COUNT_AGGREGATIONS \
            or estimator.sequence_count is not SequenceCount.SAMPLED:
        return True
    adv = estimator.advantage
    if adv.token_level or type(adv).per_sequence is not Advantage.per_sequence \
            or type(adv).from_batch is not Advantage.from_batch:
        return True
    defaults = (Surrogate.prepare_step, Correction.prepare_step)
    return any(getattr(type(part), "prepare_step", defaults[0]) not in defaults
               for part in _parts(estimator))


def _type_keys(steps: StepGradients, *, with_counts: bool | None = None) -> torch.Tensor:
    """``[N, k]``: (effective reward, counted tokens, loss tokens where a reject leaves them apart,
    and each part's ``exchangeable_type``) of every response: all that another sample
    contributes to a sample's own gradient term (group statistics and normalizers). The counts
    only when :func:`others_counts_matter`
    (``with_counts`` forces them in or out: the full key is the reference the reduced one is
    tested against)."""
    cache = steps.__dict__.setdefault("_type_keys", {})    # asked by _choose, then the method
    if with_counts not in cache:
        cache[with_counts] = _compute_type_keys(steps, with_counts)
    return cache[with_counts]


def _compute_type_keys(steps: StepGradients, with_counts: bool | None) -> torch.Tensor:
    est = steps.estimator
    batch = steps.tables.batch
    reward = batch.reward
    if est.kl is not None and est.kl.in_reward:
        reward = reward - est.kl.reward_penalty(batch)
    keys = [reward[:, None]]
    if others_counts_matter(est) if with_counts is None else with_counts:
        counted = batch.sequence_sum(counted_mask(batch, est).to(torch.float64))
        keys.append(counted[:, None])
        # a length-aware advantage reads every loss token (a reject that leaves the
        # normalizer removes some from the counted ones only): both counts, where they differ
        loss_tokens = batch.sequence_sum(batch.loss_mask.to(torch.float64))
        if not torch.equal(loss_tokens, counted):
            keys.append(loss_tokens[:, None])
    for part in _parts(est):
        extra = getattr(part, "exchangeable_type", None)
        if extra is not None:
            keys.append(extra(batch).reshape(batch.num_sequences, -1).to(torch.float64))
    return torch.cat(keys, dim=1)


#: Above this many full multisets of types, :func:`exchangeability_cost` returns its closed-form
#: upper bound instead of counting the packed batches one multiset at a time.
MAX_COUNTED_MULTISETS = 200_000
#: Entries of one chunk of the cross term's gathered rows (two such chunks live at once).
CROSS_CHUNK_ENTRIES = 1 << 24
#: Sequences of one stacked batch prepared at once: about 10^5 keeps its temporaries small
#: (ten times that spent a third of the time in page faults at G = 16 on the 10^4 MDP).
BLOCK_SEQUENCES = 1 << 17
#: Packed batches built at once (whole multisets of types; their per-slot arrays are freed after).
PACK_BLOCK = 1 << 17


def _members(type_of: torch.Tensor, q: torch.Tensor, K: int) -> list[torch.Tensor]:
    """The responses (local ids) of each type that have positive probability."""
    live = (q > 0).nonzero(as_tuple=True)[0]
    order = torch.argsort(type_of[live], stable=True)
    counts = torch.bincount(type_of[live], minlength=K).tolist()
    return list(torch.split(live[order], counts))


def _packed_count(full: torch.Tensor, n_type: torch.Tensor) -> int:
    """``Σ_M max_{τ ∈ M} ⌈n_τ / c_τ(M)⌉`` over full multisets ``M`` ``[MF, G]`` of types."""
    K = n_type.numel()
    counts = torch.zeros(full.shape[0], K, dtype=torch.long).scatter_add_(
        1, full, torch.ones_like(full))
    need = torch.where(counts > 0, (n_type[None, :] + counts - 1) // counts.clamp(min=1), 0)
    return int(need.amax(1).sum())


def exchangeability_cost(mdp: TokenMDP, type_key_N: torch.Tensor, probs_N: torch.Tensor,
                         group_size: int) -> int:
    """Batches the exchangeability method evaluates: ``Σ_x Σ_M max_{τ ∈ M} ⌈n_τ / c_τ(M)⌉``.

    ``M`` runs over the multisets of ``G`` types of prompt ``x``, ``c_τ(M)`` is the multiplicity
    of type ``τ`` in ``M`` and ``n_τ`` the number of responses of type ``τ`` with positive
    probability: each batch of ``M`` fills its ``c_τ`` slots of type ``τ`` with ``c_τ`` new such
    responses, so every slot is a useful evaluation. It is at most ``Σ_x n_x C(K_x + G − 2,
    G − 1)`` (one batch per response and multiset of the others), the value returned when
    there are more than ``MAX_COUNTED_MULTISETS`` multisets.

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
        The number of batches of ``G`` responses to evaluate.
    """
    total = 0
    n = mdp.responses_per_prompt
    for x, (type_of, p, _) in enumerate(exchangeable_types(type_key_N, mdp, probs_N)):
        K = p.numel()
        q = probs_N[x * n:(x + 1) * n]
        n_type = torch.tensor([m.numel() for m in _members(type_of, q, K)], dtype=torch.long)
        if math.comb(K + group_size - 1, group_size) > MAX_COUNTED_MULTISETS:
            total += int(n_type.sum()) * math.comb(K + group_size - 2, group_size - 1)
        else:
            total += _packed_count(multisets(K, group_size)[0], n_type)
    return total


def _packed_groups(full: torch.Tensor, members: list[torch.Tensor], rep: torch.Tensor,
                   others_index: dict, G: int, block: int | None = None):
    """The batches of every full multiset of types, each slot filled with a new response of its
    type (a representative, flagged invalid, once they run out), yielded about ``block`` batches
    at a time (whole multisets) so that the per-slot arrays stay bounded.

    Yields ``ids [B, G]`` (local response ids), and per slot ``valid [B, G]`` and ``row [B, G]``:
    the row ``τ · Mo + index(M − τ)`` of the accumulator ``A`` that the slot's term belongs to."""
    Mo = len(others_index)
    block = PACK_BLOCK if block is None else block
    n_type = [m.numel() for m in members]
    ids, valid, rows, count = [], [], [], 0
    for M in full.tolist():
        types = sorted(set(M))
        nb = max(-(-n_type[t] // M.count(t)) for t in types)
        if nb == 0:
            continue
        b_ids = torch.empty(nb, G, dtype=torch.long)
        b_valid = torch.empty(nb, G, dtype=torch.bool)
        b_rows = torch.empty(nb, G, dtype=torch.long)
        col = 0
        for t in types:
            c = M.count(t)
            k = torch.arange(nb * c).view(nb, c)
            ok = k < n_type[t]
            pool = members[t] if n_type[t] else rep[t:t + 1]
            b_ids[:, col:col + c] = torch.where(ok, pool[k.clamp(max=max(n_type[t] - 1, 0))],
                                                pool[0])
            b_valid[:, col:col + c] = ok
            rest = list(M)
            rest.remove(t)
            b_rows[:, col:col + c] = t * Mo + others_index[tuple(rest)]
            col += c
        ids.append(b_ids)
        valid.append(b_valid)
        rows.append(b_rows)
        count += nb
        if count >= block:
            yield torch.cat(ids), torch.cat(valid), torch.cat(rows)
            ids, valid, rows, count = [], [], [], 0
    if ids:
        yield torch.cat(ids), torch.cat(valid), torch.cat(rows)


def _packed_batches(full, members, rep, others_index, G):
    """All of :func:`_packed_groups` at once."""
    parts = list(_packed_groups(full, members, rep, others_index, G))
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


def _cross(A: torch.Tensor, p_rest: torch.Tensor, rest: torch.Tensor, others_index: dict,
           K: int, keep_cov: bool):
    """``Σ_{τ1, τ2, m'} p(m') <A[τ1, m' + τ2], A[τ2, m' + τ1]>`` (and its outer-product sum),
    gathered in chunks of rows so that no ``[K² |m'|, d]`` tensor is built at once."""
    d = A.shape[-1]
    t1, t2, r = torch.meshgrid(torch.arange(K), torch.arange(K), torch.arange(rest.shape[0]),
                               indexing="ij")
    t1, t2, r = t1.reshape(-1), t2.reshape(-1), r.reshape(-1)
    rest_rows = rest.tolist()
    o1 = torch.tensor([others_index[tuple(sorted(rest_rows[ri] + [b]))]
                       for ri, b in zip(r.tolist(), t2.tolist())], dtype=torch.long)
    o2 = torch.tensor([others_index[tuple(sorted(rest_rows[ri] + [a]))]
                       for ri, a in zip(r.tolist(), t1.tolist())], dtype=torch.long)
    cross = A.new_zeros(())
    outer = A.new_zeros(d, d) if keep_cov else None
    step = max(1, CROSS_CHUNK_ENTRIES // max(d, 1))
    for lo in range(0, t1.numel(), step):
        sl = slice(lo, lo + step)
        a1, a2, pr = A[t1[sl], o1[sl]], A[t2[sl], o2[sl]], p_rest[r[sl]]
        cross += pr @ (a1 * a2).sum(1)
        if keep_cov:
            outer += (a1 * pr[:, None]).T @ a2
    return cross, outer


def _by_exchangeability(steps: StepGradients, mdp: TokenMDP, probs_N: torch.Tensor, G: int,
                        keep_cov: bool):
    """``(E[ĝ], E‖ĝ‖², E[ĝ ĝ^T] or None, batches evaluated)`` by exchangeability (see the module).

    ``A[τ, m] = Σ_{y of type τ} μ(y) g(y; m)``, the own term of a response of type ``τ`` whose
    group's others have types ``m``, is accumulated from packed batches: a batch of the full
    multiset ``M`` of types evaluates, in each slot, a response of the slot's type ``τ``
    against the others ``M − τ`` (:func:`_packed_groups`)."""
    d = steps.num_params
    n = mdp.responses_per_prompt
    mean = torch.zeros(d, dtype=torch.float64)
    second = torch.zeros((), dtype=torch.float64)
    outer = torch.zeros(d, d, dtype=torch.float64) if keep_cov else None
    evaluated = 0
    block = max(1, BLOCK_SEQUENCES // G)
    for x, (type_of, p_type, rep) in enumerate(exchangeable_types(_type_keys(steps), mdp,
                                                                    probs_N)):
        K = p_type.numel()
        others, p_others = multisets(K, G - 1, p_type)                 # [Mo, G-1], [Mo]
        Mo = others.shape[0]
        others_index = {tuple(row): i for i, row in enumerate(others.tolist())}
        q = probs_N[x * n:(x + 1) * n]
        A_C = torch.zeros(K * Mo, steps.num_pairs, dtype=torch.float64)
        sq1 = torch.zeros((), dtype=torch.float64)
        S1 = torch.zeros(d, d, dtype=torch.float64) if keep_cov else None
        for local, valid, rows in _packed_groups(multisets(K, G)[0], _members(type_of, q, K),
                                                 rep - x * n, others_index, G):
            ids = x * n + local                                         # [B, G]
            q_slot = torch.where(valid, q[local], 0.0).reshape(-1)     # μ(y), 0 if padding
            w_slot = q_slot * p_others[rows % Mo].reshape(-1)          # P(y) P(others)
            row_slot = rows.reshape(-1)
            for sl, (seq, pair, coef) in steps.sparse_blocks(ids, per_sequence=True, keep=valid,
                                                             block=block):
                base = sl.start * G
                n_seq = int(ids[sl].numel())
                w = w_slot[base:base + n_seq]
                sq1 += w @ steps.sq_norms(seq, pair, coef, n_seq, one_path=True)
                A_C.index_put_((row_slot[base + seq], pair), coef * q_slot[base + seq],
                               accumulate=True)
                if keep_cov:
                    g = steps.to_params(steps.dense(seq, pair, coef, n_seq))
                    S1 += (g * w[:, None]).T @ g
            evaluated += ids.shape[0]
        A = steps.to_params_(A_C)
        del A_C
        A = A.view(K, Mo, d)
        mean_x = G * torch.einsum("m,kmd->d", p_others, A)
        # cross term: types τ1, τ2 of samples 1, 2 and the multiset m' of the other G-2;
        # sample 1 sees others o1 = m' + {τ2}, sample 2 sees o2 = m' + {τ1}; the type
        # probabilities of τ1, τ2 cancel against the normalization of A.
        rest, p_rest = multisets(K, G - 2, p_type)
        cross, cross_outer = _cross(A, p_rest, rest, others_index, K, keep_cov)
        D = float(mdp.prompt_probs[x])
        mean += D * mean_x
        second += D * (G * sq1 + G * (G - 1) * cross)
        if keep_cov:
            outer += D * (G * S1 + G * (G - 1) * 0.5 * (cross_outer + cross_outer.T))
    return mean, second, outer, evaluated
