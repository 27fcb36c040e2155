"""The trust-region bound ``2 ε α² L (L − 1)`` and the first-order path, by hand.

The MDP: vocabulary ``{0, EOS}``, responses of at most ``L = 2`` tokens to one prompt, reward the
number of 0s. The responses are ``(EOS)``, ``(0, EOS)`` and ``(0, 0)`` (truncated), with rewards
0, 1, 2. Two states: the root ``s0`` and ``s1`` after one 0.

``π_old`` is uniform. Then ``Q(s1, ·) = (2, 1)``, ``V(s1) = 3/2``, ``Q(s0, ·) = (3/2, 0)``,
``V(s0) = 3/4 = J(π_old)``, so ``A(s1, ·) = ±1/2``, ``A(s0, ·) = ±3/4`` and ``ε = 3/4``.

``π`` puts ``p = π(0|s0)`` and ``q = π(0|s1)``. Then ``α = max(|p − ½|, |q − ½|)``,
``J(π) = p (1 + q)``, and the token-level surrogate is
``L(π) = J_old + Σ_a π(a|s0) A(s0, a) + ½ Σ_a π(a|s1) A(s1, a) = 3p/2 + q/2 − 1/4``,
so the gap is ``J − L = (p − ½)(q − ½)``. With ``p = 3/4``, ``q = 1/4``: ``α = 1/4``,
``J = 15/16``, ``L = 1``, gap ``−1/16`` and the bound ``2 · ¾ · (¼)² · 2 · 1 = 3/16``.
"""

import math

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from tokenmdp.exact import TabularPolicy, TokenMDP
from tokenmdp.exact.analysis.first_order import first_order_path, max_state_tv, trust_region_bound
from tokenmdp.exact.world.ground_truth import objective, values
from tokenmdp.exact.world.rewards import TokenCount

EXACT = 1e-12
P, Q = 0.75, 0.25


def _mdp() -> TokenMDP:
    return TokenMDP(2, 2, TokenCount(0), prompts=[(0,)], prompt_probs=[1.0])


def _policy(mdp: TokenMDP, p: float, q: float) -> TabularPolicy:
    """``π(0|s0) = p``, ``π(0|s1) = q`` (logits ``log p``, ``log(1 − p)``, ...)."""
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0), init_std=0.0)
    with torch.no_grad():
        pi.table.copy_(torch.tensor([[math.log(p), math.log(1 - p)],
                                     [math.log(q), math.log(1 - q)]], dtype=torch.float64))
    return pi


def _bound(eps: float, alpha: float, L: int) -> float:
    return 2 * eps * alpha ** 2 * L * (L - 1)


def test_the_hand_worked_mdp():
    mdp = _mdp()
    assert mdp.num_states == 2 and mdp.responses_per_prompt == 3
    assert sorted(mdp.rewards.tolist()) == [0.0, 1.0, 2.0]
    old = _policy(mdp, 0.5, 0.5)
    tables = values(mdp, old)
    torch.testing.assert_close(tables.A, torch.tensor([[0.75, -0.75], [0.5, -0.5]],
                                                      dtype=torch.float64), rtol=0, atol=EXACT)
    with torch.no_grad():
        assert float(objective(mdp, old)) == pytest.approx(0.75, abs=EXACT)
        assert float(objective(mdp, _policy(mdp, P, Q))) == pytest.approx(P * (1 + Q), abs=EXACT)


@pytest.mark.parametrize(("p", "q"), [(0.75, 0.25), (0.5, 0.9), (0.2, 0.6), (0.5, 0.5)])
def test_trust_region_bound_is_its_closed_form(p, q):
    mdp = _mdp()
    old, pi = _policy(mdp, 0.5, 0.5), _policy(mdp, p, q)
    alpha = max(abs(p - 0.5), abs(q - 0.5))
    assert float(max_state_tv(mdp, pi, old)) == pytest.approx(alpha, abs=EXACT)
    assert float(trust_region_bound(mdp, pi, old)) == pytest.approx(_bound(0.75, alpha, 2),
                                                                    abs=EXACT)


def test_trust_region_bound_scales_as_l_times_l_minus_one():
    """``L = 3`` (states s0, s1, s2 after zero, one, two 0s; rewards 0..3), uniform ``π_old``:
    ``Q(s2, ·) = (3, 2)``, ``V(s2) = 5/2``; ``Q(s1, ·) = (5/2, 1)``, ``V(s1) = 7/4``;
    ``Q(s0, ·) = (7/4, 0)``, so ``A = ±1/2, ±3/4, ±7/8`` and ``ε = 7/8``. Moving only ``s0`` to
    ``π(0|s0) = 0.9`` gives ``α = 0.4`` and the bound ``2 · 7/8 · 0.4² · 3 · 2``."""
    mdp = TokenMDP(2, 3, TokenCount(0), prompts=[(0,)], prompt_probs=[1.0])
    old = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0), init_std=0.0)
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0), init_std=0.0)
    with torch.no_grad():
        pi.table[0] = torch.tensor([math.log(0.9), math.log(0.1)], dtype=torch.float64)
    torch.testing.assert_close(values(mdp, old).A.abs().max(),
                               torch.tensor(7 / 8, dtype=torch.float64), rtol=0, atol=EXACT)
    assert float(trust_region_bound(mdp, pi, old)) == pytest.approx(_bound(7 / 8, 0.4, 3),
                                                                    abs=EXACT)


def test_first_order_path_point_is_the_hand_worked_one():
    mdp = _mdp()
    old, pi = _policy(mdp, 0.5, 0.5), _policy(mdp, P, Q)
    u = (parameters_to_vector(pi.parameters()) - parameters_to_vector(old.parameters())).detach()
    (point,) = first_order_path(mdp, old, u, [float(u.norm())])
    j_old, j, surrogate = 0.75, P * (1 + Q), 1.5 * P + 0.5 * Q - 0.25
    assert point.step == pytest.approx(float(u.norm()))
    assert point.true_improvement == pytest.approx(j - j_old, abs=EXACT)          # 3/16
    assert point.token_surrogate_improvement == pytest.approx(surrogate - j_old, abs=EXACT)
    assert point.sequence_is_improvement == pytest.approx(j - j_old, abs=EXACT)   # unbiased
    assert point.gap == pytest.approx((P - 0.5) * (Q - 0.5), abs=EXACT)           # -1/16
    assert point.max_tv == pytest.approx(0.25, abs=EXACT)
    assert point.bound == pytest.approx(3 / 16, abs=EXACT)
    assert abs(point.gap) <= point.bound
    # at θ_old itself: no gap, no bound, and ∇L = ∇J (the first-order match)
    (start,) = first_order_path(mdp, old, u, [0.0])
    assert start.gap == pytest.approx(0.0, abs=EXACT) and start.bound == 0.0
    assert start.gradient_error == pytest.approx(0.0, abs=EXACT) and start.gradient_norm > 0
