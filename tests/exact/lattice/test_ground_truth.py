"""The lattice's ground truth against the enumeration engine on the twin TokenMDP (float64),
against autograd, and its log-space χ² at lengths no enumeration reaches."""

import math

import pytest
import torch
from hypothesis import given, settings

from tokenmdp import exact as E
from tokenmdp.exact import lattice as L
from tokenmdp.exact.world.chi_square import chi_square as enum_chi_square
from tokenmdp.testing.lattice_strategies import lattice_mdps

from .conftest import policies, twin

TOL = 1e-12


def close(a, b, tol=TOL):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return bool(((a - b).abs() <= tol * (1 + b.abs())).all())


@settings(max_examples=40, deadline=None)
@given(lattice_mdps())
def test_ground_truth_equals_enumeration(mdp):
    pi, mu, old = policies(mdp, seed=mdp.max_len)
    tm, e_pi, e_mu, e_old = twin(mdp, pi, mu, old)
    assert close(L.objective(mdp, pi).detach(), E.objective(tm, e_pi).detach())
    assert close(L.gradient(mdp, pi), E.gradient(tm, e_pi))
    assert close(L.sequence_kl(mdp, pi, mu).detach(), E.sequence_kl(tm, e_pi, e_mu).detach())
    for G in (1, 3):
        assert close(L.chi_square(mdp, old, mu, group_size=G),
                     enum_chi_square(tm, e_old, e_mu, group_size=G))
    assert close(L.chi_square(mdp, old, mu, level="token"),
                 enum_chi_square(tm, e_old, e_mu, level="token"))
    assert close(L.entropy(mdp, pi, reduction="mean").detach(),
                 E.token_entropy(tm, e_pi).detach())
    assert close(L.entropy(mdp, pi).detach(), E.token_entropy(tm, e_pi, reduction="sum").detach())
    assert close(L.expected_length(mdp, pi).detach(),
                 E.expected_length(tm, e_pi).detach())
    assert close(L.surrogate(mdp, pi, old).detach(), E.surrogate(tm, e_pi, e_old).detach())
    assert close(L.trust_region_bound(mdp, pi, old), E.trust_region_bound(tm, e_pi, e_old))


def test_values_and_visitation_equal_enumeration():
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 4, length_reward=-0.1)
    pi, _, _ = policies(mdp)
    tm, e_pi = twin(mdp, pi)
    tables, e_tables = L.values(mdp, pi), E.values(tm, e_pi)
    d, e_d = L.visitation(mdp, pi).detach(), E.state_visitation(tm, e_pi).detach()
    prompt_index, _ = tm.level_prefixes(0)
    for k in range(mdp.max_len):              # every prefix of depth k is one lattice node
        pidx, prefix = tm.level_prefixes(k)
        ids = tm.state_index(pidx, prefix)
        z = torch.tensor([mdp.automaton.run(p) for p in prefix.tolist()], dtype=torch.long)
        assert close(tables.Q[k, z], e_tables.Q[ids])
        assert close(tables.V[k, z], e_tables.V[ids])
        node_mass = torch.zeros(mdp.num_states, dtype=torch.float64).index_add(0, z, e_d[ids])
        assert close(d[k], node_mass)


def test_gradient_is_the_autograd_gradient_of_the_objective():
    """The analytic policy-gradient theorem on the lattice against autograd through the
    forward recursion (an independent computation), at a length the enumeration cannot do."""
    mdp = L.LatticeMDP(L.pattern_appeared([0, 1], 4), 200, length_reward=-0.002)
    pi = L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(1))
    auto = torch.autograd.grad(L.objective(mdp, pi), pi.logits)[0].reshape(-1)
    assert close(L.gradient(mdp, pi), auto)


def test_log_second_moment_at_long_lengths():
    """With one automaton state and a position-independent mismatch, Σ_y p²/q has the closed
    form Σ_t c^t e + c^T (c = Σ_{a≠EOS} p²/q, e = p²/q at EOS); at T = 4096 it is far beyond
    float64 while its log is exact."""
    T, V = 4096, 4
    mdp = L.LatticeMDP(L.RewardAutomaton([[0] * (V - 1)], [1.0]), T)
    base = torch.tensor([1.0, 0.5, -0.3, -4.0], dtype=torch.float64)
    shift = torch.tensor([1.0, -0.8, 0.5, 0.6], dtype=torch.float64)
    p = L.LatticePolicy(mdp, logits=base.expand(T, 1, V))
    q = L.LatticePolicy(mdp, logits=(base + shift).expand(T, 1, V))
    w = (2 * torch.log_softmax(base, 0) - torch.log_softmax(base + shift, 0)).exp()
    c, e = float(w[:-1].sum()), float(w[-1])
    assert c > 1
    # Σ_{t<T} c^t e + c^T = c^T (e (1 - c^-T) / (c - 1) + 1)
    log_closed = T * math.log(c) + math.log(e * -math.expm1(-T * math.log(c)) / (c - 1) + 1)
    got = float(L.log_second_moment(mdp, p, q))
    assert math.isfinite(got) and got > 710            # exp(got) overflows float64
    assert abs(got - log_closed) <= 1e-12 * abs(log_closed)
    assert abs(float(L.log_second_moment(mdp, p, q, group_size=8)) - 8 * got) <= 1e-9 * got


def test_kl_and_chi_square_vanish_between_equal_policies():
    mdp = L.LatticeMDP(L.exact_match([1, 0], 3), 6)
    pi, _, _ = policies(mdp)
    copy = L.LatticePolicy(mdp, logits=pi.logits.detach())
    assert abs(float(L.sequence_kl(mdp, pi, copy).detach())) < 1e-15
    assert abs(float(L.log_second_moment(mdp, pi, copy))) < 1e-13


@pytest.mark.parametrize("distance", [0.0, 0.3])
def test_stale_copy_moves_back_by_distance(distance):
    mdp = L.LatticeMDP(L.token_count(1, 3, cap=2), 5)
    pi, _, _ = policies(mdp)
    old = L.stale_copy(mdp, pi, distance=distance)
    assert close((pi.logits - old.logits).norm().detach(), distance)
    if distance > 0:
        assert float(L.objective(mdp, pi).detach()) > float(L.objective(mdp, old).detach())
    steps = L.stale_copy(mdp, pi, steps=2, lr=0.5)
    g1 = L.gradient(mdp, pi)
    once = pi.logits.detach().reshape(-1) - 0.5 * g1
    twice = once - 0.5 * L.gradient(mdp, L.LatticePolicy(mdp, logits=once.view(mdp.shape)))
    assert close(steps.logits.detach().reshape(-1), twice)
