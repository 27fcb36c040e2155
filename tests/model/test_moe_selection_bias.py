"""The MoE selection-only bias (an inference engine's perturbation) moves the top-K *selection*
and never the gates: ``chosen = topK(s + b_sel)``, ``g = softmax(s[chosen])`` over the unbiased
scores. Checked against a per-token reference, on a bias that changes the selection of some
tokens and the relative scores of the chosen experts (so biased gates would differ)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmdp.model.moe import MoE

D, H, E, K, N = 6, 5, 5, 2, 40
TOL = dict(rtol=0, atol=1e-12)     # float64, the same terms summed in another order


def _layer() -> MoE:
    m = MoE(D, H, E, K, std=0.5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        m.selection_bias.copy_(torch.tensor([0.8, -0.5, 0.0, 0.3, -0.2], dtype=torch.float64))
    return m


def _reference(m: MoE, x: torch.Tensor, gate_bias: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Per token: ``Σ_k softmax((s + gate_bias)[chosen])_k expert_k(x)``, chosen by ``s + b_sel``."""
    ys, chosen_all = [], []
    for x_D in x:
        s = x_D @ m.router
        chosen = sorted(torch.topk(s + m.selection_bias, K).indices.tolist())
        gates = torch.softmax((s + gate_bias)[chosen], dim=-1)
        y = sum(g * (F.silu(x_D @ m.w_gate[e]) * (x_D @ m.w_up[e])) @ m.w_down[e]
                for g, e in zip(gates, chosen))
        ys.append(y)
        chosen_all.append(chosen)
    return torch.stack(ys), chosen_all


def test_gates_are_the_softmax_of_the_unbiased_scores_of_the_biased_selection():
    m = _layer()
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        y, chosen, _ = m(x, valid_N=torch.ones(N, dtype=torch.bool))
        expected, ref_chosen = _reference(m, x, torch.zeros(E, dtype=torch.float64))
        biased_gates, _ = _reference(m, x, m.selection_bias)
        unbiased = torch.topk(x @ m.router, K, dim=-1).indices.sort(-1).values
    assert [sorted(c) for c in chosen.tolist()] == ref_chosen
    torch.testing.assert_close(y, expected, **TOL)
    # not vacuous: the bias moves some selections, and gates with the bias would differ
    assert (unbiased != chosen.sort(-1).values).any(-1).sum() >= 3
    assert float((biased_gates - expected).abs().max()) > 1e-3


def test_the_router_gradient_does_not_see_the_selection_bias():
    """With the selection fixed (replayed), the bias changes nothing: output and gradient."""
    m = _layer()
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    valid = torch.ones(N, dtype=torch.bool)
    with torch.no_grad():
        _, chosen, _ = m(x, valid_N=valid)
    outs = []
    for bias in (m.selection_bias.clone(), torch.zeros(E, dtype=torch.float64)):
        with torch.no_grad():
            m.selection_bias.copy_(bias)
        m.router.grad = None
        y, _, _ = m(x, valid_N=valid, replay_NK=chosen)
        y.square().sum().backward()
        outs.append((y.detach(), m.router.grad.clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], **TOL)
    torch.testing.assert_close(outs[0][1], outs[1][1], **TOL)
