"""The sort-based expert dispatch of :class:`MoE` against slow, obvious references (float64).

The references loop over tokens and slots (``y_n = Σ_k g_nk expert_{c_nk}(x_n)``) and, for the
capacity-limited counter-example, keep per expert the first ``capacity`` valid assignments in
row-major (token, slot) order. A second reference is the per-expert ``nonzero`` dispatch the
layer used before the sort (bitwise equal: same rows, same order, same accumulation).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tokenmdp.model.moe import MoE, load_balancing_loss

D, H, E = 6, 5, 5
TOL = dict(rtol=0, atol=1e-12)
#: a float32 softmax and sum of a few dozen terms vs the same in float64.
FLOAT32_ATOL = 1e-6


def _moe(top_k: int, capacity_factor: float | None = None, seed: int = 0) -> MoE:
    return MoE(D, H, E, top_k, std=0.5, generator=torch.Generator().manual_seed(seed),
               capacity_factor=capacity_factor, dtype=torch.float64)


def _inputs(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    valid = torch.rand(n, generator=g) > 0.25
    return x, valid


def _replay(n: int, top_k: int, seed: int = 2) -> torch.Tensor:
    """Distinct experts per row; every third row has a ``-1`` (route yourself)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(n)]) if n else \
        torch.zeros(0, top_k, dtype=torch.long)
    r[::3, -1] = -1
    return r


def _old_aux(scores, chosen, valid):
    """The one_hot formula the layer used before (written out independently), in float64 (the
    layer's softmax was float32 then; now it keeps float64 scores in float64)."""
    n = valid.sum().clamp(min=1)
    probs = torch.softmax(scores.double(), dim=-1) * valid[:, None]
    counts = F.one_hot(chosen, scores.shape[-1]).sum(1)[valid].sum(0).to(probs.dtype)
    return scores.shape[-1] * ((counts / (n * chosen.shape[-1])) * (probs.sum(0) / n)).sum()


def _expert(m: MoE, e: int, x_D: torch.Tensor) -> torch.Tensor:
    h = F.silu(x_D @ m.w_gate[e]) * (x_D @ m.w_up[e])
    return h @ m.w_down[e]


def _reference(m: MoE, x, valid, replay=None):
    """Per-token loop; capacity: per expert the first ``capacity`` valid assignments."""
    scores = x @ m.router
    chosen = torch.topk(scores + m.selection_bias, m.top_k, dim=-1).indices
    if replay is not None:
        for n in range(x.shape[0]):
            if bool((replay[n] >= 0).all()):
                chosen[n] = replay[n]
    gates = torch.softmax(scores.gather(-1, chosen), dim=-1)
    keep = [[True] * m.top_k for _ in range(x.shape[0])]
    if m.capacity_factor is not None:
        cap = math.ceil(m.capacity_factor * int(valid.sum()) * m.top_k / E)
        used = [0] * E
        for n in range(x.shape[0]):
            for k in range(m.top_k):
                e = int(chosen[n, k])
                keep[n][k] = bool(valid[n]) and used[e] < cap
                used[e] += keep[n][k]
    rows = []
    for n in range(x.shape[0]):
        y_n = torch.zeros(D, dtype=x.dtype)
        for k in range(m.top_k):
            if keep[n][k]:
                y_n = y_n + gates[n, k] * _expert(m, int(chosen[n, k]), x[n])
        rows.append(y_n)
    y = torch.stack(rows) if rows else torch.zeros(0, D, dtype=x.dtype)
    return y, chosen, _old_aux(scores, chosen, valid)


def _nonzero_dispatch(m: MoE, x, valid, replay=None):
    """The pre-sort implementation: one ``nonzero`` per expert."""
    scores = x @ m.router
    chosen = torch.topk(scores + m.selection_bias, m.top_k, dim=-1).indices
    if replay is not None:
        chosen = torch.where((replay >= 0).all(-1)[:, None], replay, chosen)
    gates = torch.softmax(scores.gather(-1, chosen), dim=-1)
    y = torch.zeros_like(x)
    cap = None
    if m.capacity_factor is not None:
        cap = math.ceil(m.capacity_factor * int(valid.sum()) * m.top_k / E)
    for e in range(E):
        tok, slot = (chosen == e).nonzero(as_tuple=True)
        if cap is not None:
            tok, slot = tok[valid[tok]][:cap], slot[valid[tok]][:cap]
        if tok.numel():
            y = y.index_add(0, tok, _expert(m, e, x[tok]) * gates[tok, slot, None])
    return y, chosen, _old_aux(scores, chosen, valid)


def _run(fn, m: MoE, x, valid, replay):
    """Outputs and the gradients of a fixed functional of (y, aux) w.r.t. params and x."""
    m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y, chosen, aux = fn(x, valid, replay)
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    ((y * w).sum() + 0.3 * aux.double()).backward()
    grads = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
             for name, p in m.named_parameters()}
    grads["x"] = x.grad.clone() if x.grad is not None else torch.zeros_like(x)
    return y.detach(), chosen, aux.detach(), grads


def _layer(m):
    return lambda x, valid, replay: m(x, valid_N=valid, replay_NK=replay)


CASES = [  # (top_k, capacity_factor, replay?, n)
    (1, None, False, 17), (2, None, False, 17), (1, None, True, 17), (2, None, True, 17),
    (1, 0.6, False, 23), (2, 0.6, False, 23), (2, 0.6, True, 23), (2, 1.3, True, 23),
    (3, None, True, 19), (3, 0.5, False, 19),
]


def _layer_and(other, top_k, capacity_factor, replay, n):
    """``_run`` of the layer and of ``other(m, x, valid, replay)`` on the same case."""
    m = _moe(top_k, capacity_factor)
    x, valid = _inputs(n)
    r = _replay(n, top_k) if replay else None
    return _run(_layer(m), m, x, valid, r), _run(lambda *a: other(m, *a), m, x, valid, r)


@pytest.mark.parametrize("top_k,capacity_factor,replay,n", CASES)
def test_dispatch_matches_per_token_reference(top_k, capacity_factor, replay, n):
    (y, chosen, aux, grads), (y_ref, chosen_ref, aux_ref, grads_ref) = _layer_and(
        _reference, top_k, capacity_factor, replay, n)
    assert torch.equal(chosen, chosen_ref)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(aux.double(), aux_ref.double(), **TOL)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], **TOL, msg=name)
    if capacity_factor is not None:  # the counter-example really drops something here
        assert (y.abs().sum(-1) == 0).any()


@pytest.mark.parametrize("top_k,capacity_factor,replay,n", CASES)
def test_dispatch_bitwise_equals_nonzero_dispatch(top_k, capacity_factor, replay, n):
    (y, chosen, aux, grads), (y_old, chosen_old, aux_old, grads_old) = _layer_and(
        _nonzero_dispatch, top_k, capacity_factor, replay, n)
    assert torch.equal(chosen, chosen_old) and torch.equal(y, y_old)
    assert torch.equal(aux, aux_old)
    for name in grads_old:
        assert torch.equal(grads[name], grads_old[name]), name


@pytest.mark.parametrize("capacity_factor", [None, 0.7])
@pytest.mark.parametrize("top_k", [1, 2])
def test_empty_input(top_k, capacity_factor):
    m = _moe(top_k, capacity_factor)
    x = torch.zeros(0, D, dtype=torch.float64, requires_grad=True)
    y, chosen, aux = m(x, valid_N=torch.zeros(0, dtype=torch.bool),
                       replay_NK=torch.zeros(0, top_k, dtype=torch.long))
    assert y.shape == (0, D) and chosen.shape == (0, top_k)
    assert aux.dtype == torch.float64 and float(aux.detach()) == 0.0
    (y.sum() + aux).backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("capacity_factor", [None, 0.8])
def test_experts_without_tokens(capacity_factor):
    m = _moe(2, capacity_factor)
    with torch.no_grad():
        m.selection_bias[[0, 3]] = -1e3  # never selected
    x, valid = _inputs(13)
    y, chosen, aux, grads = _run(_layer(m), m, x, valid, None)
    y_ref, _, aux_ref, grads_ref = _run(lambda *a: _reference(m, *a), m, x, valid, None)
    assert not ((chosen == 0) | (chosen == 3)).any()
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(aux.double(), aux_ref.double(), **TOL)
    for name in ("w_gate", "w_up", "w_down"):
        assert torch.equal(grads[name][[0, 3]], torch.zeros_like(grads[name][[0, 3]]))
        torch.testing.assert_close(grads[name], grads_ref[name], **TOL)


def test_aux_false_returns_zero_and_same_outputs():
    m = _moe(2)
    x, valid = _inputs(11)
    y, chosen, aux = m(x, valid_N=valid)
    y0, chosen0, aux0 = m(x, valid_N=valid, aux=False)
    assert torch.equal(y, y0) and torch.equal(chosen, chosen0)
    assert aux0.shape == () and aux0.dtype == torch.float32 and float(aux0) == 0.0
    assert float(aux.detach()) != 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_load_balancing_loss_matches_one_hot_formula(dtype):
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(40, 7, generator=g, dtype=dtype)
    chosen = torch.topk(torch.randn(40, 7, generator=g), 3, dim=-1).indices
    valid = torch.rand(40, generator=g) > 0.3
    new, old = load_balancing_loss(scores, chosen, valid), _old_aux(scores, chosen, valid)
    assert new.dtype == dtype  # float32 stays float32, float64 (the exact world) float64
    tol = TOL if dtype == torch.float64 else dict(rtol=0, atol=FLOAT32_ATOL)
    torch.testing.assert_close(new.double(), old, **tol)
    half = load_balancing_loss(scores.bfloat16(), chosen, valid)
    assert half.dtype == torch.float32  # half-precision scores are normalized in float32
    none = torch.zeros(40, dtype=torch.bool)
    assert float(load_balancing_loss(scores, chosen, none)) == 0.0


def test_load_balancing_loss_rejects_out_of_range_expert():
    scores = torch.randn(4, 3, dtype=torch.float64)
    chosen = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 2]])
    with pytest.raises((RuntimeError, IndexError)):
        load_balancing_loss(scores, chosen, torch.ones(4, dtype=torch.bool))
