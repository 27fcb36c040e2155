"""Mixture-of-Experts MLP with top-K routing, routing replay and a load-balancing loss.

Router scores ``s = x W_r`` ``[N, E]``; the token goes to the top-K experts of ``s + b_sel``
(``b_sel`` a selection-only bias, zero unless an inference engine perturbs it); gates are the
softmax over the selected experts' scores, ``g_i = I_i e^{s_i} / Σ_j I_j e^{s_j}``
(ESTIMATORS.md, "Routing replay"). Dropless: every token reaches all of its K experts.

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


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator, device, dtype) -> nn.Parameter:
    w = torch.randn(shape, generator=generator, dtype=torch.float64) * std
    return nn.Parameter(w.to(device=device, dtype=dtype))


def load_balancing_loss(scores_NE: torch.Tensor, chosen_NK: torch.Tensor,
                        valid_N: torch.Tensor) -> torch.Tensor:
    """Switch-style auxiliary loss ``E Σ_e f_e P_e`` over the valid tokens.

    ``f_e`` is the fraction of (token, slot) assignments to expert ``e`` (no gradient) and
    ``P_e`` the mean router probability ``softmax(s)_e``; the loss is 1 under uniform routing.
    """
    E = scores_NE.shape[-1]
    n = valid_N.sum().clamp(min=1)
    probs_NE = torch.softmax(scores_NE.float(), dim=-1) * valid_N[:, None]
    counts_E = F.one_hot(chosen_NK, E).sum(1)[valid_N].sum(0).to(probs_NE.dtype)
    f_E = counts_E / (n * chosen_NK.shape[-1])
    P_E = probs_NE.sum(0) / n
    return E * (f_E * P_E).sum()


class DenseMLP(nn.Module):
    """SwiGLU MLP ``W_down (silu(x W_gate) * x W_up)`` (the ``dense`` option)."""

    def __init__(self, d_model: int, hidden: int, *, std: float, generator: torch.Generator,
                 device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w_gate = _normal((d_model, hidden), std, generator, device, dtype)
        self.w_up = _normal((d_model, hidden), std, generator, device, dtype)
        self.w_down = _normal((hidden, d_model), std, generator, device, dtype)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
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
        return self.router.shape[1]

    def forward(self, x_ND: torch.Tensor, *, valid_N: torch.Tensor,
                replay_NK: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mix the experts of each token.

        Parameters
        ----------
        x_ND : Tensor ``[N, D]``
        valid_N : BoolTensor ``[N]``
            Real tokens (the load-balancing loss counts only these).
        replay_NK : LongTensor ``[N, K]``, optional
            Experts to use; a row with any entry ``< 0`` is routed by the layer itself.

        Returns
        -------
        y_ND : Tensor ``[N, D]``
        chosen_NK : LongTensor ``[N, K]``
            The experts used (the routing record of this layer).
        aux : Tensor ``[]``
            The load-balancing loss of this layer (float32).
        """
        scores_NE = x_ND @ self.router
        chosen_NK = torch.topk(scores_NE + self.selection_bias, self.top_k, dim=-1).indices
        if replay_NK is not None:
            routed_N = (replay_NK >= 0).all(-1)
            chosen_NK = torch.where(routed_N[:, None], replay_NK, chosen_NK)
        # Gates from the full score vector: a replayed expert keeps its score's gradient.
        gates_NK = torch.softmax(scores_NE.gather(-1, chosen_NK), dim=-1)
        y_ND = torch.zeros_like(x_ND)
        capacity = None
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * int(valid_N.sum()) * self.top_k
                                 / self.n_experts)
        for e in range(self.n_experts):  # loop over experts, never over tokens
            tok, slot = (chosen_NK == e).nonzero(as_tuple=True)          # in row-major order
            if capacity is not None:  # the counter-example: drop beyond capacity
                keep = valid_N[tok]
                tok, slot = tok[keep][:capacity], slot[keep][:capacity]
            if tok.numel() == 0:
                continue
            x_MD = x_ND[tok]
            h_MH = F.silu(x_MD @ self.w_gate[e]) * (x_MD @ self.w_up[e])
            y_ND = y_ND.index_add(0, tok, (h_MH @ self.w_down[e]) * gates_NK[tok, slot, None])
        return y_ND, chosen_NK, load_balancing_loss(scores_NE, chosen_NK, valid_N)
