"""One response's second moment ``E‖DᵀX‖²`` on the lattice, by vector-valued messages.

A response ``y`` drawn along the lattice contributes ``X = Σ_t φ_t s_t`` with the softmax score
``s_t = e_{a_t} − π(·|t, z_t)`` in the logits and ``φ_t = φ(t, z_t, a_t)`` the estimator's
token coefficient; in a policy's own parameter it is ``DᵀX`` (``D`` the Jacobian of the logits,
:meth:`~tokenmdp.exact.lattice.LatticePolicy.project`). For a feature-linear policy
``logits[t, z] = features[t, z] @ W`` the score of one token is the outer product
``features[t, z] ⊗ s_t`` and

``‖DᵀX‖² = Σ_t φ_t² ‖f_t‖² ‖s_t‖² + 2 Σ_{t < t'} φ_t φ_{t'} ⟨f_t, f_{t'}⟩ ⟨s_t, s_{t'}⟩``.

Tabular (``f`` one-hot over the node) the cross terms vanish and the expectation is one pass.
Shared, they do not: the earlier tokens' ``Σ φ f ⊗ s`` is carried forward as a message
``M_t(z) ∈ R^{F×V}`` summed over the paths reaching ``(t, z)``,

``M_{t+1}(z') = Σ_{z, a ≠ EOS: δ(z, a) = z'} τ(a|t,z) (M_t(z) + α_t(z) φ(t,z,a) f_t(z) ⊗ s(t,z,a))``,

and each token meets it once: ``O(T·K²·F·V)`` time, ``O(K·F·V)`` memory per position (held for a
chunk of positions at a time, ``CHUNK_FLOATS``), no ``T × T`` table.
The weights ``τ`` need not be probabilities (a sampler times per-token tilts), so one pass
serves every conditional moment of :mod:`~tokenmdp.exact.lattice.moments`.
"""

from __future__ import annotations

import torch

from tokenmdp.exact.lattice.ground_truth import transition_matrices
from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.lattice.shared import check_features, node_features
from tokenmdp.exact.world.budget import check_budget

__all__ = ["member_square", "member_square_matrix"]


def _check_tables(mdp: LatticeMDP, alpha, tau, pi, phi, back) -> None:
    if not isinstance(mdp, LatticeMDP):
        raise TypeError(f"mdp: expected a LatticeMDP, got {type(mdp).__name__}")
    T, K, V = mdp.shape
    for name, table, shape in (("alpha", alpha, (T, K)), ("tau", tau, (T, K, V)),
                               ("pi", pi, (T, K, V)), ("phi", phi, (T, K, V)),
                               ("back", back, (T, K, V))):
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"{name}: expected a float64 tensor, got {type(table).__name__}")
        if tuple(table.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(table.shape)}")


#: Floats of messages (and their new terms) formed at once: the positions of one chunk.
CHUNK_FLOATS = 1 << 20


def _messages(mdp: LatticeMDP, alpha, tau, pi, phi, feats, extra: int = 0):
    """Yield ``(ts, M)``: positions ``ts`` (a slice) and their messages ``M_t`` ``[n, K, F, V]``,
    the earlier tokens' ``Σ φ f ⊗ s``, in chunks covering ``t = 0 .. T − 1`` (``extra``: the
    caller's floats per position in a chunk)."""
    T, K, V = mdp.shape
    F = feats.shape[2]
    routes = transition_matrices(mdp, tau).transpose(1, 2).contiguous()   # P_tᵀ [T, K, K]
    emit = alpha[..., None] * tau * phi                               # an earlier token's weight
    emit_to = transition_matrices(mdp, emit)                          # its sum per (z, z')
    rows = torch.arange(K)[:, None].expand(K, V - 1)
    cols = torch.arange(V - 1)[None].expand(K, V - 1)
    chunk = max(1, CHUNK_FLOATS // (K * K * V + 2 * K * F * V + extra))
    M = tau.new_zeros(K, F * V)
    for t0 in range(0, T, chunk):
        ts = slice(t0, min(t0 + chunk, T))
        n = ts.stop - t0
        # U[t, z, z'] = Σ_{a ≠ EOS: δ(z,a) = z'} emit[t, z, a] (e_a − π(·|t, z)), and the new
        # term of M_{t+1}(z'): Σ_z f_t(z) ⊗ U[t, z, z'] (it does not depend on M)
        U = tau.new_zeros(n, K, K, V)
        U[:, rows, mdp.transitions, cols] = emit[ts, :, :V - 1]
        U -= emit_to[ts][..., None] * pi[ts][:, :, None, :]
        new = torch.bmm(feats[ts].transpose(1, 2), U.reshape(n, K, K * V))
        new = new.reshape(n, F, K, V).transpose(1, 2).reshape(n, K, F * V)
        out = tau.new_empty(n, K, F * V)
        for i in range(n):
            out[i] = M
            M = routes[t0 + i] @ M + new[i]
        yield ts, out.reshape(n, K, F, V)


def member_square(mdp: LatticeMDP, alpha: torch.Tensor, tau: torch.Tensor, pi: torch.Tensor,
                  phi: torch.Tensor, back: torch.Tensor, features: torch.Tensor | None = None
                  ) -> float:
    """``Σ_y (Π_{t<|y|} τ(a_t|t,z_t)) · term(y) · ‖Σ_t φ(t,z_t,a_t) Dᵀ(e_{a_t} − π(·|t,z_t))‖²``.

    The path weights are given by their forward and backward sums: ``alpha[t, z]`` the sum of
    ``Π τ`` over the prefixes reaching ``(t, z)`` (``ground_truth._forward(mdp, tau)[:-1]``),
    ``back[t, z, a]`` the sum over the continuations after ``a`` is drawn at ``(t, z)`` of
    ``Π`` (later ``τ``) times the terminal weight ``term(y)``. Same-position part:
    ``Σ α τ φ² back ‖f‖² ‖e_a − π‖²``; cross-position part by the forward message of the module
    docstring, ``O(T·K²·F·V)``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    alpha : Tensor ``[T, K]``
        Forward sums of ``τ``.
    tau : Tensor ``[T, K, V]``
        Non-negative token weights (not necessarily normalized).
    pi : Tensor ``[T, K, V]``
        ``π_θ``'s probabilities, whose score is taken.
    phi : Tensor ``[T, K, V]``
        The token coefficient ``φ``.
    back : Tensor ``[T, K, V]``
        Backward sums, consistent with ``tau``.
    features : Tensor ``[T, K, F]``, optional
        The policy's feature map (``D``: ``logits = features @ W``); ``None``: tabular
        (``D = I``), where the result is ``Σ α τ φ² back ‖e_a − π‖²``.

    Returns
    -------
    float
        The weighted second moment, in the policy's coordinates.
    """
    _check_tables(mdp, alpha, tau, pi, phi, back)
    score_sq = 1 - 2 * pi + (pi * pi).sum(-1, keepdim=True)          # ‖e_a − π‖²
    w2 = alpha[..., None] * tau * phi * phi * back
    if features is None:
        return float((w2 * score_sq).sum())
    feats = check_features(mdp, features)
    total = (w2 * score_sq * (feats * feats).sum(-1)[..., None]).sum()
    later = tau * phi * back                                         # a later token's weight
    r = later - later.sum(-1, keepdim=True) * pi                     # Σ_a later (e_a − π)
    cross = tau.new_zeros(())
    for ts, M in _messages(mdp, alpha, tau, pi, phi, feats):
        # Σ_z ⟨M_t(z), f_t(z) ⊗ r_t(z)⟩
        cross += torch.einsum("tkfv,tkf,tkv->", M, feats[ts], r[ts])
    return float(total + 2 * cross)


def member_square_matrix(mdp: LatticeMDP, alpha: torch.Tensor, tau: torch.Tensor,
                         pi: torch.Tensor, phi: torch.Tensor, back: torch.Tensor,
                         features: torch.Tensor | None = None, *,
                         memory_budget: int | str | None = None) -> torch.Tensor:
    """The matrix ``Σ_y (Π τ) term(y) (DᵀX)(DᵀX)ᵀ`` ``[p, p]`` whose trace is
    :func:`member_square`.

    The same forward message, now met by an outer product: ``O(T·K·(F·V)²)`` time and
    ``O((F·V)²)`` memory, so a shared policy with few parameters gets its full matrix at any
    length; a tabular one (``p = T·K·V``) only on small lattices.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    alpha, tau, pi, phi, back : Tensor
        As in :func:`member_square`.
    features : Tensor ``[T, K, F]``, optional
        The policy's feature map; ``None``: tabular (:func:`~tokenmdp.exact.lattice.node_features`,
        ``p = T·K·V`` in the order of the logits).
    memory_budget : int or str, optional
        Bytes the matrices may take (:func:`~tokenmdp.exact.world.budget.memory_budget`).

    Returns
    -------
    Tensor ``[p, p]``
        Float64, symmetric, ``p = F·V`` in ``W``'s row-major order.
    """
    _check_tables(mdp, alpha, tau, pi, phi, back)
    T, K, V = mdp.shape
    feats = node_features(mdp) if features is None else check_features(mdp, features)
    F = feats.shape[2]
    p = F * V
    check_budget(f"F = {F} features, vocab_size = {V}", p * p, "second-moment matrix entries",
                 8 * (3 * p * p + K * F * F + K * p), memory_budget=memory_budget)
    w2 = alpha[..., None] * tau * phi * phi * back
    later = tau * phi * back
    r = later - later.sum(-1, keepdim=True) * pi                     # Σ_a later (e_a − π)
    same = tau.new_zeros(F * F, V * V)                                 # [(f, g), (v, w)]
    cross = tau.new_zeros(p, p)                                        # earlier ⊗ later
    for ts, M in _messages(mdp, alpha, tau, pi, phi, feats, extra=K * (F * F + 3 * V * V)):
        f, w, q = feats[ts], w2[ts], pi[ts]
        n = f.shape[0]
        # Σ_a w (e_a − π)(e_a − π)ᵀ = diag(w) − w πᵀ − π wᵀ + (Σ w) π πᵀ, per node
        Q = (torch.diag_embed(w) - w[..., :, None] * q[..., None, :]
             - q[..., :, None] * w[..., None, :]
             + w.sum(-1)[..., None, None] * q[..., :, None] * q[..., None, :])
        same += (f[..., :, None] * f[..., None, :]).reshape(n * K, F * F).T @ Q.reshape(
            n * K, V * V)
        cross += M.reshape(n * K, p).T @ (f[..., :, None] * r[ts][..., None, :]).reshape(n * K, p)
    same = same.reshape(F, F, V, V).permute(0, 2, 1, 3).reshape(p, p)
    return same + cross + cross.T
