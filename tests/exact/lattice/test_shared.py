"""Shared-parameter lattice policies (``logits = features @ W``): their ground truth in ``W``
against the enumeration engine, finite differences and the tabular special case, and the
same-member second moment by vector messages against a sum over every path (float64)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import exact as E
from tokenmdp.exact import lattice as L
from tokenmdp.exact.lattice.ground_truth import _forward
from tokenmdp.testing.lattice_strategies import lattice_mdps

from .conftest import twin

#: The ground truth of a shared policy against the enumeration engine (relative).
GROUND_TOL = 1e-10
#: The vector-message second moments against the sum over paths, and exact identities.
TOL = 1e-12
#: Central finite differences of J in W (step 1e-5, truncation error ~1e-10).
FD_TOL = 1e-7
F64 = torch.float64


def close(a, b, tol=TOL):
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    return a.shape == b.shape and bool(((a - b).abs() <= tol * (1 + b.abs())).all())


def shared_policy(mdp, seed, num_features):
    """A shared policy: default (one-hot over z) features for ``None``, else random ones."""
    g = torch.Generator().manual_seed(seed)
    T, K, _ = mdp.shape
    feats = None if num_features is None else torch.randn(T, K, num_features, generator=g,
                                                          dtype=F64)
    return L.SharedLatticePolicy(mdp, feats, generator=g)


# ------------------------------------------------------------------ ground truth in W
@settings(max_examples=40, deadline=None)
@given(lattice_mdps(), st.integers(0, 2 ** 16), st.sampled_from([None, 1, 2, 3]))
def test_shared_ground_truth_equals_enumeration(mdp, seed, num_features):
    pi = shared_policy(mdp, seed, num_features)
    mu = L.inference_copy(pi, noise_std=0.3, generator=torch.Generator().manual_seed(seed))
    tm, e_pi, e_mu = twin(mdp, pi, mu)
    assert [p is pi.weight for p in e_pi.parameters()] == [True]
    assert close(L.objective(mdp, pi).detach(), E.objective(tm, e_pi).detach(), GROUND_TOL)
    grad = L.gradient(mdp, pi)
    assert grad.shape == (pi.weight.numel(),)
    assert close(grad, E.gradient(tm, e_pi), GROUND_TOL)
    assert close(L.sequence_kl(mdp, pi, mu).detach(), E.sequence_kl(tm, e_pi, e_mu).detach(),
                 GROUND_TOL)
    assert close(L.entropy(mdp, pi).detach(),
                 E.token_entropy(tm, e_pi, reduction="sum").detach(), GROUND_TOL)


def test_gradient_is_the_finite_difference_of_the_objective():
    mdp = L.LatticeMDP(L.pattern_appeared([0, 1], 3), 5, length_reward=-0.05)
    pi = shared_policy(mdp, 3, 4)
    w0, h = pi.parameter_vector(), 1e-5
    fd = torch.zeros_like(w0)
    for i in range(w0.numel()):
        e = torch.zeros_like(w0)
        e[i] = h
        up = float(L.objective(mdp, pi.with_parameters(w0 + e)).detach())
        down = float(L.objective(mdp, pi.with_parameters(w0 - e)).detach())
        fd[i] = (up - down) / (2 * h)
    assert close(L.gradient(mdp, pi), fd, FD_TOL)


def test_gradient_is_the_autograd_gradient_at_long_lengths():
    """The projected policy-gradient theorem against autograd through the forward recursion,
    time-homogeneous, at a length the enumeration cannot do."""
    mdp = L.LatticeMDP(L.pattern_appeared([0, 1], 4), 200, length_reward=-0.002)
    pi = L.SharedLatticePolicy(mdp, generator=torch.Generator().manual_seed(1))
    auto = torch.autograd.grad(L.objective(mdp, pi), pi.weight)[0].reshape(-1)
    assert close(L.gradient(mdp, pi), auto)
    logits = pi.logits.detach()
    assert close(logits, logits[:1].expand_as(logits), 0.0)     # one table at every position


@settings(max_examples=25, deadline=None)
@given(lattice_mdps(), st.integers(0, 2 ** 16))
def test_node_features_reproduce_the_tabular_policy(mdp, seed):
    T, K, V = mdp.shape
    tab = L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(seed))
    shared = L.SharedLatticePolicy(mdp, L.node_features(mdp),
                                   weight=tab.logits.detach().reshape(T * K, V))
    assert close(shared.logits.detach(), tab.logits.detach(), 0.0)
    assert close(L.objective(mdp, shared).detach(), L.objective(mdp, tab).detach())
    assert close(L.gradient(mdp, shared), L.gradient(mdp, tab))
    assert close(L.values(mdp, shared).Q, L.values(mdp, tab).Q)
    u = torch.randn(T * K * V, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    old_s = L.stale_copy(mdp, shared, direction=u, distance=0.3)
    old_t = L.stale_copy(mdp, tab, direction=u, distance=0.3)
    assert isinstance(old_s, L.SharedLatticePolicy)
    assert close(old_s.parameter_vector(), old_t.parameter_vector())
    assert close(shared.project(u), u, 0.0)


def test_project_is_the_transpose_of_the_jacobian():
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 3)
    pi = shared_policy(mdp, 5, 3)
    d, p = pi.logits.numel(), pi.num_parameters
    D = torch.autograd.functional.jacobian(
        lambda w: torch.einsum("tkf,fv->tkv", pi.features, w), pi.weight.detach()).reshape(d, p)
    g = torch.Generator().manual_seed(2)
    v, M = torch.randn(d, generator=g, dtype=F64), torch.randn(d, d, generator=g, dtype=F64)
    assert close(pi.project(v), D.T @ v)
    assert close(pi.project(v.view(mdp.shape)), D.T @ v)
    assert close(pi.project_matrix(M), D.T @ M @ D)
    tab = L.LatticePolicy(mdp, generator=g)
    assert close(tab.project(v.view(mdp.shape)), v, 0.0)
    assert close(tab.project_matrix(M), M, 0.0)
    with pytest.raises(ValueError, match="table"):
        pi.project(v[:-1])


def test_copies_of_a_shared_policy():
    mdp = L.LatticeMDP(L.token_count(1, 3, cap=2), 5)
    pi = shared_policy(mdp, 0, None)
    old = L.stale_copy(mdp, pi, distance=0.3)
    assert isinstance(old, L.SharedLatticePolicy)
    assert old.features.data_ptr() == pi.features.data_ptr()      # shared, not copied
    assert close((pi.weight - old.weight).norm().detach(), 0.3)
    assert float(L.objective(mdp, pi).detach()) > float(L.objective(mdp, old).detach())
    steps = L.stale_copy(mdp, pi, steps=2, lr=0.5)
    once = pi.parameter_vector() - 0.5 * L.gradient(mdp, pi)
    twice = once - 0.5 * L.gradient(mdp, pi.with_parameters(once))
    assert close(steps.parameter_vector(), twice)
    mu = L.inference_copy(pi)                     # the engine's numerics per node: tabular
    assert type(mu) is L.LatticePolicy and not mu.logits.requires_grad
    assert close(mu.logits, pi.logits.detach(), 0.0)
    L.check_lattice_policy(mdp, pi)
    with pytest.raises(ValueError, match="direction"):
        L.stale_copy(mdp, pi, direction=torch.ones(mdp.max_len * 3 * 3), distance=0.1)


@pytest.mark.parametrize("make, error, match", [
    (lambda T, K: torch.zeros(T, K + 1, 2, dtype=F64), ValueError, "features"),
    (lambda T, K: torch.zeros(T, K, 0, dtype=F64), ValueError, "features"),
    (lambda T, K: torch.zeros(T, K, dtype=F64), ValueError, "features"),
    (lambda T, K: torch.full((T, K, 2), float("nan"), dtype=F64), ValueError, "features"),
    (lambda T, K: torch.zeros(T, K, 2, dtype=torch.float32), TypeError, "features"),
    (lambda T, K: [[[0.0]] * K] * T, TypeError, "features"),
])
def test_bad_features_are_refused(make, error, match):
    mdp = L.LatticeMDP(L.exact_match([1, 0], 3), 4)
    with pytest.raises(error, match=match):
        L.SharedLatticePolicy(mdp, make(mdp.max_len, mdp.num_states),
                              generator=torch.Generator())


def test_bad_weight_and_generator_are_refused():
    mdp = L.LatticeMDP(L.exact_match([1, 0], 3), 4)
    K, V = mdp.num_states, mdp.vocab_size
    with pytest.raises(ValueError, match="weight"):
        L.SharedLatticePolicy(mdp, weight=torch.zeros(K, V + 1))
    with pytest.raises(ValueError, match="weight"):
        L.SharedLatticePolicy(mdp, weight=torch.full((K, V), float("inf")))
    with pytest.raises(TypeError, match="generator"):
        L.SharedLatticePolicy(mdp)
    with pytest.raises(TypeError, match="mdp"):
        L.SharedLatticePolicy("mdp", generator=torch.Generator())


# ------------------------------------------------------------------ member_square
def instance(mdp, seed, num_features):
    """Random non-normalized ``τ``, ``π``, ``φ``, a terminal weight per (length, state), the
    ``back`` it gives by the backward recursion, ``α``, and features (or ``None``)."""
    g = torch.Generator().manual_seed(seed)
    T, K, V = mdp.shape
    tau = 1.5 * torch.rand(T, K, V, generator=g, dtype=F64)
    pi = torch.softmax(torch.randn(T, K, V, generator=g, dtype=F64), -1)
    phi = torch.randn(T, K, V, generator=g, dtype=F64)
    eos_term = torch.rand(T, K, generator=g, dtype=F64) + 0.1
    trunc_term = torch.rand(K, generator=g, dtype=F64) + 0.1
    back, beta = torch.zeros(T, K, V, dtype=F64), trunc_term
    for t in range(T - 1, -1, -1):
        back[t, :, :V - 1] = beta[mdp.transitions]
        back[t, :, V - 1] = eos_term[t]
        beta = (tau[t] * back[t]).sum(-1)
    feats = None if num_features is None else torch.randn(T, K, num_features, generator=g,
                                                          dtype=F64)
    tables = dict(alpha=_forward(mdp, tau)[:-1], tau=tau, pi=pi, phi=phi, back=back)
    return tables, feats, eos_term, trunc_term


def brute_force(mdp, tables, feats, eos_term, trunc_term):
    """``Σ_y Π τ · term(y) · x xᵀ`` with ``x = Σ_t φ_t Dᵀ(e_a − π)``, over every path."""
    T, K, V = mdp.shape
    feats = L.node_features(mdp) if feats is None else feats
    tau, pi, phi = tables["tau"], tables["pi"], tables["phi"]
    eye = torch.eye(V, dtype=F64)
    total = torch.zeros(feats.shape[2] * V, feats.shape[2] * V, dtype=F64)
    for n in range(1, T + 1):
        for body in itertools.product(range(V - 1), repeat=n - 1):
            ends = [V - 1] if n < T else list(range(V))       # length T: EOS or truncation
            for last in ends:
                z, w = mdp.automaton.start, 1.0
                x = torch.zeros(feats.shape[2], V, dtype=F64)
                for t, a in enumerate((*body, last)):
                    w = w * tau[t, z, a]
                    x += phi[t, z, a] * torch.outer(feats[t, z], eye[a] - pi[t, z])
                    if a != V - 1:
                        z = int(mdp.transitions[z, a])
                w = w * (eos_term[n - 1, z] if last == V - 1 else trunc_term[z])
                total += w * torch.outer(x.reshape(-1), x.reshape(-1))
    return total


@settings(max_examples=40, deadline=None)
@given(lattice_mdps(max_len=4, max_states=3, max_vocab=3), st.integers(0, 2 ** 16),
       st.sampled_from([None, 1, 2, 3]))
def test_member_square_equals_the_sum_over_paths(mdp, seed, num_features):
    tables, feats, eos_term, trunc_term = instance(mdp, seed, num_features)
    exact = brute_force(mdp, tables, feats, eos_term, trunc_term)
    assert close(L.member_square(mdp, **tables, features=feats), exact.trace())
    assert close(L.member_square_matrix(mdp, **tables, features=feats), exact)


def test_member_square_of_a_tabular_policy_is_the_per_position_sum():
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 4, length_reward=-0.1)
    tables, _, _, _ = instance(mdp, 7, None)
    alpha, tau, pi, phi, back = tables.values()
    per_position = (alpha[..., None] * tau * phi ** 2 * back
                    * (1 - 2 * pi + (pi * pi).sum(-1, keepdim=True))).sum()
    assert close(L.member_square(mdp, **tables), per_position)
    assert close(L.member_square(mdp, **tables, features=L.node_features(mdp)), per_position)
    assert close(L.member_square_matrix(mdp, **tables, features=L.node_features(mdp)),
                 L.member_square_matrix(mdp, **tables), 0.0)


def test_the_cross_position_part_is_there():
    """Dropping the cross-position terms would fail the brute-force test: here they are 4.5% of
    the whole (the same-position part alone is the per-position sum, ``‖f‖² = 1``)."""
    mdp = L.LatticeMDP(L.pattern_appeared([0, 1], 3), 4)
    tables, feats, eos_term, trunc_term = instance(mdp, 11, None)
    feats = L.state_features(mdp)
    alpha, tau, pi, phi, back = tables.values()
    same = float((alpha[..., None] * tau * phi ** 2 * back
                  * (1 - 2 * pi + (pi * pi).sum(-1, keepdim=True))).sum())
    full = L.member_square(mdp, **tables, features=feats)
    assert close(full, brute_force(mdp, tables, feats, eos_term, trunc_term).trace())
    assert abs(full - same) > 0.01 * abs(full)


def test_member_square_refuses_bad_tables():
    mdp = L.LatticeMDP(L.exact_match([1, 0], 3), 3)
    tables, _, _, _ = instance(mdp, 0, None)
    with pytest.raises(ValueError, match="back"):
        L.member_square(mdp, **{**tables, "back": tables["back"][:-1]})
    with pytest.raises(TypeError, match="features"):
        L.member_square(mdp, **tables, features=torch.zeros(3, mdp.num_states, 2))
    with pytest.raises(ValueError, match="memory budget"):
        L.member_square_matrix(mdp, **tables, memory_budget=1000)
