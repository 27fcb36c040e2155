"""Mixture-of-Experts MLP with top-K routing, routing replay and a load-balancing loss.

Router scores ``s = x W_r`` ``[N, E]``; the token goes to the top-K experts of ``s + b_sel``
(``b_sel`` a selection-only bias, zero unless an inference engine perturbs it); gates are the
softmax over the selected experts' scores, ``g_i = I_i e^{s_i} / Σ_j I_j e^{s_j}``
(docs: Concepts › The trainer world, "Routing replay"). Dropless: every token reaches all of its K experts.

Replay substitutes the selection ``I`` and keeps the softmax over the *current* scores gathered
from the full score vector, so the router keeps its gradient when K >= 2 (with K = 1 the gate is
identically 1 and the router gets none). Replaying the selection the layer would have made
anyway runs exactly the same operations, so it is a bitwise no-op.

A capacity-limited variant (``capacity_factor``) drops the assignments beyond each expert's
capacity in row-major token order: the output of a token then depends on the other tokens of the
batch and on their order, which breaks layout invariance (the named counter-example).

Shape suffixes: ``N`` tokens, ``M`` the tokens sent to one expert, ``D`` model width, ``H`` expert
hidden width, ``E`` experts, ``K`` experts per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoE", "DenseMLP", "load_balancing_loss"]


def float32_if_half(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is bfloat16 or float16 (for reductions and normalizations), else
    ``x`` itself (float32 and float64 keep their precision)."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator, device, dtype) -> nn.Parameter:
    # drawn where the generator lives (a CPU or a CUDA generator), then moved
    w = torch.randn(shape, generator=generator, dtype=torch.float64, device=generator.device) * std
    # device None means the CPU (where every other tensor of the model is created), whatever
    # the generator's device
    return nn.Parameter(w.to(device=torch.device("cpu") if device is None else device, dtype=dtype))


def load_balancing_loss(scores_NE: torch.Tensor, chosen_NK: torch.Tensor,
                        valid_N: torch.Tensor) -> torch.Tensor:
    """Switch-style auxiliary loss ``E Σ_e f_e P_e`` over the valid tokens.

    ``f_e`` is the fraction of (token, slot) assignments to expert ``e`` (no gradient) and
    ``P_e`` the mean router probability ``softmax(s)_e``; the loss is 1 under uniform routing.

    Parameters
    ----------
    scores_NE : Tensor ``[N, E]``
        Router scores of each token (before the softmax).
    chosen_NK : LongTensor ``[N, K]``
        The experts each token was assigned to.
    valid_N : BoolTensor ``[N]``
        Real tokens; the others count neither in ``f_e`` nor in ``P_e``.

    Returns
    -------
    Tensor ``[]``
        The loss (float32 for half-precision scores, else their dtype; 0 without valid tokens).
    """
    E = scores_NE.shape[-1]
    K = chosen_NK.shape[-1]
    n = valid_N.sum().clamp(min=1)
    probs_NE = torch.softmax(float32_if_half(scores_NE), dim=-1) * valid_N[:, None]
    # Integer counts of the valid assignments by scatter-add: no one_hot (whose range check
    # synchronises with the device) and no boolean mask (whose output size does).
    weight_NK = valid_N[:, None].expand(-1, K).to(torch.long)
    counts_E = torch.zeros(E, dtype=torch.long, device=chosen_NK.device).scatter_add_(
        0, chosen_NK.reshape(-1), weight_NK.reshape(-1)).to(probs_NE.dtype)
    f_E = counts_E / (n * K)
    P_E = probs_NE.sum(0) / n
    return E * (f_E * P_E).sum()


class DenseMLP(nn.Module):
    """SwiGLU MLP ``W_down (silu(x W_gate) * x W_up)`` (the ``dense`` option).

    Parameters
    ----------
    d_model, hidden : int
        Width ``D`` and hidden width.
    std : float
        Initialisation standard deviation.
    generator : torch.Generator
        Source of the initial weights.
    device, dtype
        Where and in which dtype the weights live (default: the CPU, float32).
    """

    def __init__(self, d_model: int, hidden: int, *, std: float, generator: torch.Generator,
                 device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w_gate = _normal((d_model, hidden), std, generator, device, dtype)
        self.w_up = _normal((d_model, hidden), std, generator, device, dtype)
        self.w_down = _normal((hidden, d_model), std, generator, device, dtype)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to each token.

        Parameters
        ----------
        x_ND : Tensor ``[N, D]``
            The tokens' (normalized) hidden states.

        Returns
        -------
        Tensor ``[N, D]``
            The MLP's output, added to the residual stream by the block.
        """
        return (F.silu(x_ND @ self.w_gate) * (x_ND @ self.w_up)) @ self.w_down


class MoE(nn.Module):
    """E SwiGLU experts behind a top-K router (dropless).

    Parameters
    ----------
    d_model, hidden, n_experts, top_k : int
        Width, expert hidden width, ``E`` and ``K``.
    std : float
        Initialisation standard deviation.
    generator : torch.Generator
        Source of the initial weights.
    capacity_factor : float, optional
        ``None`` (dropless) or the token-dropping counter-example (see the module docstring).
    device, dtype
        Where and in which dtype the weights live.
    """

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int, *, std: float,
                 generator: torch.Generator, capacity_factor: float | None = None, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = _normal((d_model, n_experts), std, generator, device, dtype)
        self.w_gate = _normal((n_experts, d_model, hidden), std, generator, device, dtype)
        self.w_up = _normal((n_experts, d_model, hidden), std, generator, device, dtype)
        self.w_down = _normal((n_experts, hidden, d_model), std, generator, device, dtype)
        # Added to the scores for the top-K *selection* only (never to the gates). Zero in the
        # trainer; an inference engine may set it to select experts differently.
        self.register_buffer("selection_bias", torch.zeros(n_experts, device=device, dtype=dtype))

    @property
    def n_experts(self) -> int:
        """Number of experts ``E``."""
        return self.router.shape[1]

    def forward(self, x_ND: torch.Tensor, *, valid_N: torch.Tensor,
                replay_NK: torch.Tensor | None = None, aux: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mix the experts of each token.

        The (token, slot) assignments are grouped by expert with a stable sort, so each expert
        sees its tokens in row-major order; the only host-device synchronisation is the one read
        of the per-expert counts.

        Parameters
        ----------
        x_ND : Tensor ``[N, D]``
            The tokens' (normalized) hidden states, rows flattened.
        valid_N : BoolTensor ``[N]``
            Real tokens (the load-balancing loss counts only these).
        replay_NK : LongTensor ``[N, K]``, optional
            Experts to use; a row with any entry ``< 0`` is routed by the layer itself.
        aux : bool, default True
            Compute the load-balancing loss. ``False`` (for example during KV-cache decoding,
            where nobody uses it) skips it and returns a zero scalar instead.

        Returns
        -------
        y_ND : Tensor ``[N, D]``
            The gated mixture of the chosen experts' outputs.
        chosen_NK : LongTensor ``[N, K]``
            The experts used (the routing record of this layer).
        aux : Tensor ``[]``
            The load-balancing loss of this layer (float32 for half-precision weights, else their
            dtype); a float32 ``0`` when ``aux`` is ``False``.
        """
        scores_NE = x_ND @ self.router
        chosen_NK = torch.topk(scores_NE + self.selection_bias, self.top_k, dim=-1).indices
        if replay_NK is not None:
            routed_N = (replay_NK >= 0).all(-1)
            chosen_NK = torch.where(routed_N[:, None], replay_NK, chosen_NK)
        # Gates from the full score vector: a replayed expert keeps its score's gradient.
        gates_NK = torch.softmax(scores_NE.gather(-1, chosen_NK), dim=-1)
        y_ND = self._dispatch(x_ND, valid_N, chosen_NK, gates_NK)
        if aux:
            loss = load_balancing_loss(scores_NE, chosen_NK, valid_N)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=x_ND.device)
        return y_ND, chosen_NK, loss

    def _dispatch(self, x_ND: torch.Tensor, valid_N: torch.Tensor, chosen_NK: torch.Tensor,
                  gates_NK: torch.Tensor) -> torch.Tensor:
        """``Σ_k g_nk expert_{chosen_nk}(x_n)``, one batched pass per expert (never per token).

        The flattened assignments ``A = N K`` (row-major: token, then slot) are sorted by a key
        with a *stable* sort, so within an expert they stay in row-major order; the per-expert
        counts are read to the host once. Without capacity the key is the expert id. With
        capacity it is ``2 e + invalid``: expert ``e``'s block holds its valid assignments first
        (in row-major order), of which the first ``capacity`` are kept, then its invalid ones,
        which the counter-example drops.
        """
        E, K = self.n_experts, chosen_NK.shape[-1]
        expert_A = chosen_NK.reshape(-1)
        limited = self.capacity_factor is not None
        if limited:
            invalid_A = (~valid_N)[:, None].expand(-1, K).reshape(-1)
            key_A, n_bins = expert_A * 2 + invalid_A, 2 * E
        else:
            key_A, n_bins = expert_A, E
        # Counts by scatter-add (CUDA bincount would synchronise twice more, for its min/max);
        # an expert id outside [0, E) raises (CPU) or asserts on the device, like one_hot did.
        counts = torch.zeros(n_bins, dtype=torch.long, device=key_A.device).scatter_add_(
            0, key_A, torch.ones_like(key_A)).tolist()                  # the one host sync
        order_A = torch.argsort(key_A, stable=True)
        blocks = order_A.split(counts)
        if limited:
            n_valid = sum(counts[0::2]) // K                          # = valid_N.sum(), exactly
            capacity = math.ceil(self.capacity_factor * n_valid * self.top_k / E)
            blocks = [blocks[2 * e][:capacity] for e in range(E)]
        gates_A = gates_NK.reshape(-1)
        y_ND = torch.zeros_like(x_ND)
        for e in range(E):  # loop over experts, never over tokens
            idx_M = blocks[e]                                         # (token, slot) row-major
            if idx_M.numel() == 0:
                continue
            tok_M = idx_M.div(K, rounding_mode="floor")
            x_MD = x_ND[tok_M]
            h_MH = F.silu(x_MD @ self.w_gate[e]) * (x_MD @ self.w_up[e])
            y_ND = y_ND.index_add(0, tok_M, (h_MH @ self.w_down[e]) * gates_A[idx_M, None])
        return y_ND
