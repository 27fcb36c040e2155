"""Per-batch gradients of an estimator, for many batches at once (the engine of the exact lab).

``loss`` depends on ``θ`` only through the token log-probs, so on one batch
``ĝ = Σ_tokens c_t ∇_θ log π(y_t|s_t)`` with ``c_t = −∂loss/∂ log π(y_t|s_t)``, and
``∇_θ log π(a|s)`` is one row of the Jacobian of the state-action log-probs
(:func:`state_action_jacobian`). :class:`StepGradients` stacks many batches (rows of the MDP's
enumeration) as independent steps of one big batch — ``prepare(..., step=...)`` keeps their counts
and statistics apart — takes every ``c`` with one backward pass, and maps the per-batch
coefficient vectors to parameter space. The estimator code is the library's own: nothing here
re-derives a formula.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import Estimator, loss, prepare
from tokenmdp.estimators._common import take
from tokenmdp.exact.lab._stacked import _select_rows, _stacked_batch
from tokenmdp.exact.world.ground_truth import state_logprobs
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import TabularPolicy, check_policy

__all__ = ["state_action_jacobian", "PolicyTables", "StepGradients"]

#: Entries of one dense ``[batches, state-action pairs]`` coefficient block.
MAX_BLOCK_ENTRIES = 20_000_000


def state_action_jacobian(mdp: TokenMDP, policy: nn.Module, *, chunk: int = 256) -> torch.Tensor:
    """``∇_θ log π(a|s)`` for every state-action pair: ``[num_states * V, num_params]``.

    Row ``s * V + a``; columns in ``policy.parameters()`` order. For a :class:`TabularPolicy` it
    is the closed form ``∂ log π(a|s) / ∂ z_{s', b} = 1[s = s'] (1[a = b] − π(b|s))``; for any
    other policy it is computed with batched vector-Jacobian products (``chunk`` rows at a time).

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.
    chunk : int, default 256
        Rows per batched vector-Jacobian product (memory against speed; non-tabular only).

    Returns
    -------
    Tensor ``[num_states * V, num_params]``
        The float64 Jacobian (no gradient).
    """
    check_policy(mdp, policy)
    if type(policy) is TabularPolicy:
        with torch.no_grad():
            probs = torch.cat([x.exp().reshape(-1, mdp.vocab_size)
                               for x in state_logprobs(mdp, policy)])       # [num_states, V]
            V = mdp.vocab_size
            block = torch.eye(V, dtype=torch.float64)[None] - probs[:, None, :]  # [S, a, b]
            return _block_diag(block)
    params = [p for p in policy.parameters()]
    with torch.enable_grad():
        lp = torch.cat([x.reshape(-1) for x in state_logprobs(mdp, policy)])
        rows = []
        for start in range(0, lp.numel(), chunk):
            stop = min(start + chunk, lp.numel())
            eye = torch.zeros(stop - start, lp.numel(), dtype=lp.dtype)
            eye[torch.arange(stop - start), torch.arange(start, stop)] = 1.0
            grads = torch.autograd.grad(lp, params, grad_outputs=eye, retain_graph=True,
                                        is_grads_batched=True, allow_unused=True)
            rows.append(torch.cat([(torch.zeros(stop - start, p.numel(), dtype=lp.dtype)
                                    if g is None else g.reshape(stop - start, -1))
                                   for p, g in zip(params, grads)], dim=1))
    return torch.cat(rows)


def _block_diag(blocks: torch.Tensor) -> torch.Tensor:
    """Block-diagonal matrix of ``[n, V, V]`` blocks, built with one index_put."""
    n, V, _ = blocks.shape
    out = torch.zeros(n * V, n * V, dtype=blocks.dtype)
    base = (torch.arange(n) * V)[:, None, None]
    rows = base + torch.arange(V)[None, :, None]
    cols = base + torch.arange(V)[None, None, :]
    out[rows.expand(n, V, V), cols.expand(n, V, V)] = blocks
    return out


class PolicyTables:
    """What :class:`StepGradients` reads of the policy and the enumeration, whatever the estimator.

    The enumeration (its log-prob ``fields`` validated once), ``log π_θ`` of its tokens, each
    token's state-action pair, and the map from coefficients to parameters (the tabular policy's
    probabilities, or the state-action Jacobian): computed once at one ``θ`` and shared by the
    :class:`StepGradients` of many estimators (:class:`~tokenmdp.exact.MomentsWorkspace`).

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        ``π_θ`` (float64).
    fields : dict of str -> Tensor ``[N, C]``
        Log-prob fields of the enumeration (``behavior_logprob``, ``old_logprob``, and
        ``ref_logprob`` when needed), validated here once.
    jacobian : Tensor, optional
        A precomputed :func:`state_action_jacobian` (only used for non-tabular policies).
    pi_logprob : Tensor ``[N, C]``, optional
        ``policy.token_logprobs(mdp.enumerate())`` when the caller has it already.
    """

    def __init__(self, mdp: TokenMDP, policy: nn.Module, fields: dict[str, torch.Tensor],
                 jacobian: torch.Tensor | None = None,
                 pi_logprob: torch.Tensor | None = None) -> None:
        self.enum = mdp.enumerate()
        self.batch = self.enum.replace(**fields)  # validate once (_stacked_batch trusts them)
        self.fields = fields
        if pi_logprob is None:
            with torch.no_grad():
                pi_logprob = policy.token_logprobs(self.enum)
        self.pi_logprob = pi_logprob
        sa = mdp.token_state_index(self.enum) * mdp.vocab_size + self.enum.tokens
        self.sa_index = torch.where(self.enum.response_mask, sa, -1)
        self.num_pairs = mdp.num_states * mdp.vocab_size
        self.num_params = sum(p.numel() for p in policy.parameters())
        self.tabular_probs = self.tabular_sumsq = self.jacobian = None
        if type(policy) is TabularPolicy and jacobian is None:
            # closed form: ĝ[s, b] = C[s, b] − π(b|s) Σ_a C[s, a]; no dense Jacobian needed
            with torch.no_grad():
                self.tabular_probs = torch.cat([x.exp().reshape(-1, mdp.vocab_size)
                                                for x in state_logprobs(mdp, policy)])
                self.tabular_sumsq = (self.tabular_probs ** 2).sum(-1)     # ‖π(·|s)‖²
        else:
            self.jacobian = state_action_jacobian(mdp, policy) if jacobian is None else jacobian
            if self.jacobian.shape != (self.num_pairs, self.num_params):
                raise ValueError(f"jacobian: expected shape ({self.num_pairs}, "
                                 f"{self.num_params}), got {tuple(self.jacobian.shape)}")


class StepGradients:
    """``ĝ`` of ``estimator`` for batches made of rows of ``mdp.enumerate()``.

    Parameters
    ----------
    mdp, policy, estimator
    fields : dict of str -> Tensor ``[N, C]``
        Log-prob fields of the enumeration (``behavior_logprob``, ``old_logprob``, and
        ``ref_logprob`` when needed).
    group_size : int
        ``G``: consecutive sequences of a batch form groups of this size.
    jacobian : Tensor, optional
        A precomputed :func:`state_action_jacobian` (only used for non-tabular policies).
    tables : PolicyTables, optional
        The estimator-independent tables of ``policy`` and ``fields`` built once for many
        estimators (then ``fields`` and ``jacobian`` are the tables').
    """

    def __init__(self, mdp: TokenMDP, policy: nn.Module, estimator: Estimator,
                 fields: dict[str, torch.Tensor], group_size: int,
                 jacobian: torch.Tensor | None = None, *,
                 tables: PolicyTables | None = None) -> None:
        self.mdp, self.estimator, self.group_size = mdp, estimator, group_size
        self.tables = PolicyTables(mdp, policy, fields, jacobian) if tables is None else tables
        t = self.tables
        self.enum, self.fields, self.pi_logprob, self.sa_index = (t.enum, t.fields,
                                                                  t.pi_logprob, t.sa_index)
        self.num_pairs, self.num_params = t.num_pairs, t.num_params
        self.tabular_probs, self.tabular_sumsq, self.jacobian = (t.tabular_probs,
                                                                 t.tabular_sumsq, t.jacobian)

    @property
    def chunk(self) -> int:
        """Batches per block, so that one dense coefficient block stays bounded."""
        return max(1, min(8192, MAX_BLOCK_ENTRIES // max(self.num_pairs, self.num_params)))

    def _stacked(self, ids: torch.Tensor) -> tuple[TokenBatch, torch.Tensor]:
        return _stacked_batch(self.enum, ids, self.group_size, self.fields)

    def coefficients(self, ids: torch.Tensor, *, first_only: bool = False,
                     per_sequence: bool = False, keep: torch.Tensor | None = None):
        """Per-token coefficients of batches ``ids`` ``[D, width]`` (enumeration rows).

        Returns ``(draw, pair, coef)``, one entry per loss token: ``ĝ_draw = Σ coef ·
        ∇_θ log π(pair)`` with ``pair = state * V + action``. With ``first_only`` only the first
        sequence's own term ``g_1`` is kept (its tokens' coefficients, computed in the presence of
        the others), as the exchangeability method needs.

        Parameters
        ----------
        ids : LongTensor ``[D, width]``
            Each batch's sequences, as rows of ``mdp.enumerate()`` (``width`` a multiple of
            ``group_size``).
        first_only : bool, default False
            Keep only the tokens of each batch's first sequence.
        per_sequence : bool, default False
            Return each token's sequence, ``batch * width + slot`` (its entry of ``ids``
            flattened), in place of its batch.
        keep : BoolTensor ``[D, width]``, optional
            The sequences whose tokens are wanted: the batches are prepared whole, the loss
            and its backward pass run on the kept sequences only (the same coefficients).

        Returns
        -------
        draw : LongTensor ``[T]``
            The batch (row of ``ids``) of each loss token (its sequence with ``per_sequence``).
        pair : LongTensor ``[T]``
            Its state-action pair ``state * V + action``.
        coef : Tensor ``[T]``
            Its coefficient ``c_t = −∂loss/∂log π(y_t|s_t)``.
        """
        batch, step = self._stacked(ids)
        batch = prepare(batch, self.estimator, step=step, max_len=self.mdp.max_len)
        rows = ids.reshape(-1)
        slot = torch.arange(rows.numel())                     # each sequence's entry of ids
        if keep is not None:
            slot = keep.reshape(-1).nonzero(as_tuple=True)[0]
            batch, rows, step = _select_rows(batch, slot), rows[slot], step[slot]
        lp = take(self.pi_logprob, rows).requires_grad_(True)
        value, _ = loss(lp, batch, self.estimator, metrics=False)
        (coef,) = torch.autograd.grad(-value, lp)            # c_t = −∂loss/∂log π
        sa = take(self.sa_index, rows)
        on = sa >= 0
        if first_only:
            on = on & (slot % ids.shape[1] == 0)[:, None]
        owner = slot if per_sequence else step
        return owner[:, None].expand_as(sa)[on], sa[on], coef[on]

    def dense(self, draw: torch.Tensor, pair: torch.Tensor, coef: torch.Tensor,
              num_draws: int) -> torch.Tensor:
        """The coefficient matrix ``[num_draws, num_states * V]``.

        Parameters
        ----------
        draw, pair, coef : Tensor ``[T]``
            Per-token batch, state-action pair and coefficient (:meth:`coefficients`).
        num_draws : int
            The number of batches (rows of the matrix).

        Returns
        -------
        Tensor ``[num_draws, num_states * V]``
            Float64; the coefficients of a batch's tokens summed per state-action pair.
        """
        C = torch.zeros(num_draws, self.num_pairs, dtype=torch.float64)
        return C.index_put_((draw, pair), coef, accumulate=True)

    def to_params(self, C: torch.Tensor) -> torch.Tensor:
        """Map coefficient rows ``[n, num_states * V]`` to gradients ``[n, num_params]``.

        Parameters
        ----------
        C : Tensor ``[n, num_states * V]``
            Coefficient rows (:meth:`dense`).

        Returns
        -------
        Tensor ``[n, num_params]``
            ``C`` times the state-action Jacobian (closed form for a tabular policy).
        """
        if self.jacobian is not None:
            return C @ self.jacobian
        C = C.view(C.shape[0], -1, self.mdp.vocab_size)
        return (C - self.tabular_probs * C.sum(-1, keepdim=True)).reshape(C.shape[0], -1)

    def to_params_(self, C: torch.Tensor) -> torch.Tensor:
        """:meth:`to_params`, overwriting ``C`` when the policy is tabular (no second copy of a
        large coefficient matrix); ``C`` must not be used afterwards.

        Parameters
        ----------
        C : Tensor ``[n, num_states * V]``
            Coefficient rows, contiguous.

        Returns
        -------
        Tensor ``[n, num_params]``
            The gradients (``C``'s memory for a tabular policy).
        """
        if self.jacobian is not None:
            return self.to_params(C)
        view = C.view(C.shape[0], -1, self.mdp.vocab_size)
        view.addcmul_(self.tabular_probs, view.sum(-1, keepdim=True), value=-1.0)
        return C

    def sq_norms(self, draw: torch.Tensor, pair: torch.Tensor, coef: torch.Tensor,
                 num_draws: int, *, one_path: bool = False) -> torch.Tensor:
        """``‖ĝ_draw‖²`` ``[num_draws]``, touching only the states each draw visits (tabular).

        ``one_path``: each draw's tokens come from one response, so its states are distinct and
        ``‖ĝ‖² = Σ_t c_t² ‖e_{a_t} − π(·|s_t)‖² = Σ_t c_t² (1 − 2π(a_t|s_t) + ‖π(·|s_t)‖²)``.

        Parameters
        ----------
        draw, pair, coef : Tensor ``[T]``
            Per-token batch, state-action pair and coefficient (:meth:`coefficients`).
        num_draws : int
            The number of batches.
        one_path : bool, default False
            Every batch's tokens come from one response (tabular shortcut above).

        Returns
        -------
        Tensor ``[num_draws]``
            Float64 ``‖ĝ_draw‖²`` of each batch.
        """
        if self.jacobian is not None:
            g = self.to_params(self.dense(draw, pair, coef, num_draws))
            return (g * g).sum(1)
        V = self.mdp.vocab_size
        state, action = pair // V, pair % V
        if one_path:
            norm2 = 1 - 2 * self.tabular_probs[state, action] + self.tabular_sumsq[state]
            return torch.zeros(num_draws, dtype=torch.float64).index_add_(0, draw,
                                                                          coef * coef * norm2)
        keys, inverse = torch.unique(draw * self.mdp.num_states + state, return_inverse=True)
        buf = torch.zeros(keys.numel(), V, dtype=torch.float64)
        buf.index_put_((inverse, action), coef, accumulate=True)       # C[draw, state, :]
        g = buf - self.tabular_probs[keys % self.mdp.num_states] * buf.sum(-1, keepdim=True)
        return torch.zeros(num_draws, dtype=torch.float64).index_add_(
            0, keys // self.mdp.num_states, (g * g).sum(-1))

    def gradient_rows(self, draw: torch.Tensor, pair: torch.Tensor, coef: torch.Tensor,
                      num_draws: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``ĝ`` of each batch as rows over the parameters it touches (the sparse form).

        Tabular: one row per (batch, visited state), ``ĝ[s, ·] = C[s, ·] − π(·|s) Σ_a C[s, a]``
        over that state's ``V`` logits; otherwise one dense row per batch.

        Parameters
        ----------
        draw, pair, coef : Tensor ``[T]``
            Per-token batch, state-action pair and coefficient (:meth:`coefficients`).
        num_draws : int
            The number of batches.

        Returns
        -------
        row_draw : LongTensor ``[U]``
            The batch of each row.
        cols : LongTensor ``[U, w]``
            The parameter indices of each row (distinct within a batch).
        vals : Tensor ``[U, w]``
            The gradient entries.
        """
        if self.jacobian is not None:
            g = self.to_params(self.dense(draw, pair, coef, num_draws))
            cols = torch.arange(self.num_params).expand(num_draws, -1)
            return torch.arange(num_draws), cols, g
        V, S = self.mdp.vocab_size, self.mdp.num_states
        state, action = pair // V, pair % V
        keys, inverse = torch.unique(draw * S + state, return_inverse=True)
        buf = torch.zeros(keys.numel(), V, dtype=torch.float64)
        buf.index_put_((inverse, action), coef, accumulate=True)       # C[draw, state, :]
        states = keys % S
        vals = buf - self.tabular_probs[states] * buf.sum(-1, keepdim=True)
        return keys // S, states[:, None] * V + torch.arange(V), vals

    def __call__(self, ids: torch.Tensor, *, first_only: bool = False) -> torch.Tensor:
        """``ĝ`` ``[D, num_params]`` of batches ``ids`` ``[D, width]`` (dense)."""
        draw, pair, coef = self.coefficients(ids, first_only=first_only)
        return self.to_params(self.dense(draw, pair, coef, ids.shape[0]))

    def blocks(self, ids: torch.Tensor, **kwargs):
        """Yield ``(slice, ĝ)`` over ``ids`` in memory-bounded blocks.

        Parameters
        ----------
        ids : LongTensor ``[D, width]``
            Each batch's sequences, as rows of ``mdp.enumerate()``.
        **kwargs
            ``first_only``, as for :meth:`coefficients`.

        Yields
        ------
        slice
            The rows of ``ids`` in this block (:attr:`chunk` of them at most).
        Tensor ``[rows, num_params]``
            Their gradients ``ĝ``.
        """
        for start in range(0, ids.shape[0], self.chunk):
            sl = slice(start, start + self.chunk)
            yield sl, self(ids[sl], **kwargs)

    def sparse_blocks(self, ids: torch.Tensor, *, block: int = 65536, **kwargs):
        """Yield ``(slice, (draw, pair, coef))`` over ``ids``; ``draw`` is relative to the slice.

        Parameters
        ----------
        ids : LongTensor ``[D, width]``
            Each batch's sequences, as rows of ``mdp.enumerate()``.
        block : int, default 65536
            Batches per block.
        **kwargs
            ``first_only``, ``per_sequence`` and ``keep`` (``[D, width]``, sliced with
            ``ids``), as for :meth:`coefficients`.

        Yields
        ------
        slice
            The rows of ``ids`` in this block.
        tuple of Tensor
            Their ``(draw, pair, coef)`` (:meth:`coefficients`).
        """
        keep = kwargs.pop("keep", None)
        for start in range(0, ids.shape[0], block):
            sl = slice(start, start + block)
            more = {} if keep is None else {"keep": keep[sl]}
            yield sl, self.coefficients(ids[sl], **more, **kwargs)
