"""The first-order approximation along a path: contact, quadratic gap, bound, linear gradient error."""

import torch

from tests.exact.conftest import make_policy
from tokenmdp.exact import TabularPolicy, gradient, objective, surrogate
from tokenmdp.exact.analysis.first_order import first_order_path, max_state_tv, trust_region_bound

EXACT_TOL = 1e-12
#: how close halving the step must bring the ratios to their asymptotic values (2 and 4)
ORDER_TOL = 0.1


def test_gap_is_second_order_and_gradient_error_first_order(mdp, policy):
    u = torch.randn(sum(p.numel() for p in policy.parameters()),
                    generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    steps = [1e-2, 5e-3, 2.5e-3]
    pts = first_order_path(mdp, policy, u, [0.0] + steps)
    assert abs(pts[0].gap) < EXACT_TOL and pts[0].gradient_error < EXACT_TOL
    for a, b in zip(pts[1:-1], pts[2:]):
        # halving the step divides the gap by 4 and the gradient error by 2
        assert abs(a.gap / b.gap - 4) < 4 * ORDER_TOL
        assert abs(a.gradient_error / b.gradient_error - 2) < 2 * ORDER_TOL
    for p in pts:
        assert abs(p.gap) <= p.bound + EXACT_TOL
        assert abs(p.sequence_is_improvement - p.true_improvement) < EXACT_TOL


def test_bound_holds_far_from_old_policy(mdp):
    old = make_policy(TabularPolicy, mdp, seed=2)
    pts = first_order_path(mdp, old, gradient(mdp, old), [0.5, 1.0, 3.0, 10.0])
    for p in pts:
        assert abs(p.gap) <= p.bound
        assert p.max_tv > 0
    assert abs(pts[-1].gap) > 1e-3  # far away the surrogate is visibly wrong


def test_path_values_match_direct_computation(mdp):
    old = make_policy(TabularPolicy, mdp, seed=3)
    new = make_policy(TabularPolicy, mdp, seed=3)
    u = gradient(mdp, old)
    with torch.no_grad():
        new.table += 0.7 * (u / u.norm()).view_as(new.table)
    (p,) = first_order_path(mdp, old, u, [0.7])
    with torch.no_grad():
        j_old = float(objective(mdp, old))
        assert abs(p.true_improvement - (float(objective(mdp, new)) - j_old)) < EXACT_TOL
        assert abs(p.token_surrogate_improvement
                   - (float(surrogate(mdp, new, old)) - j_old)) < EXACT_TOL
    assert abs(p.bound - float(trust_region_bound(mdp, new, old))) < EXACT_TOL
    assert abs(p.max_tv - float(max_state_tv(mdp, new, old))) < EXACT_TOL
