"""One Laplace node at a time: its tilted tables, and the full ``E[X Xᵀ]`` of small lattices.

:func:`~tokenmdp.exact.lattice.sweep.sweep` runs every node at once but keeps only
contractions; the vector messages of :func:`~tokenmdp.exact.lattice.member_square` need one
node's forward sums, token weights and backward sums as tables (:func:`node_tables`), and the
covariance of a small lattice needs the cross-position blocks of ``E[X Xᵀ]`` through the
transitions of the measure between two positions (:func:`second_matrix`).
"""

from __future__ import annotations

import torch

from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.lattice.sweep import Powers, _continue, _terminal, _tilt, forward

__all__ = ["node_tables", "second_matrix"]


def node_tables(mdp: LatticeMDP, log_mu, log_kappa, nu, s: float, power: int, f):
    """One node's ``(α [T, K], τ [T, K, V], B [T, K, V, m])`` under the single measure ``τ_p``
    (every part of the response at the same power), for the vector messages of
    :func:`~tokenmdp.exact.lattice.member_square`.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    log_mu, log_kappa, nu
        As :func:`sweep`.
    s : float
        The node.
    power : int
        The power of ``κ``.
    f : Tensor ``[T + 1]``
        The terminal weight.

    Returns
    -------
    tuple of Tensor
        Forward sums, token weights and the backward sums after each token, per class.
    """
    T, K, V = mdp.shape
    node = torch.tensor([float(s)], dtype=torch.float64)
    tau = torch.stack([_tilt(log_mu[t], None if log_kappa is None else log_kappa[t],
                             None if nu is None else nu[t], node, power)[0] for t in range(T)])
    alpha = forward(mdp, log_mu, log_kappa, nu, node, power)[0, :T]
    eos, trunc = _terminal(mdp, f)
    beta = trunc[None].clone()
    back = log_mu.new_zeros(T, K, V, eos.shape[-1])
    for t in range(T - 1, -1, -1):
        back[t] = _continue(mdp, beta, eos[t])[0]
        beta = (tau[t][..., None] * back[t]).sum(1)[None]
    return alpha, tau, back


def second_matrix(mdp: LatticeMDP, log_mu, pi, log_kappa, nu, s, node_weights, powers: Powers,
                  phi_a, phi_b, f2, c: int) -> torch.Tensor:
    """``Σ_n w_n E[sym(X_a X_bᵀ) · tilt₂(s_n) · f₂ · 1{c}]``, ``[d, d]``: same-position blocks
    and the cross-position ones through the ``mid2`` measure's transitions (small lattices).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    log_mu, pi, log_kappa, nu
        As :func:`sweep`.
    s, node_weights : Tensor ``[n]``
        The nodes and the weight of each node's matrix in the sum.
    powers : Powers
        The kind's powers.
    phi_a, phi_b : Tensor ``[T, K, V]``
        The two coefficient tables (``X_a = Σ_t φ_a (e_{a_t} − π)``).
    f2 : Tensor ``[T + 1]``
        The terminal weight.
    c : int
        The reward class.

    Returns
    -------
    Tensor ``[d, d]``
        Symmetric, float64.
    """
    T, K, V = mdp.shape
    n = s.numel()
    lk = (lambda t: None) if log_kappa is None else (lambda t: log_kappa[t])
    nt = (lambda t: None) if nu is None else (lambda t: nu[t])

    def table(power):                                       # [n, T, K, V]
        return torch.stack([_tilt(log_mu[t], lk(t), nt(t), s, power) for t in range(T)], 1)
    own, mid, post = table(powers.own2), table(powers.mid2), table(powers.post2)
    alpha = forward(mdp, log_mu, log_kappa, nu, s, powers.pre2) * node_weights[:, None, None]
    eos, trunc = _terminal(mdp, f2)
    beta = trunc[None].expand(n, K, eos.shape[-1]).clone()
    Bc = pi.new_zeros(n, T, K, V)
    for t in range(T - 1, -1, -1):
        Bt = _continue(mdp, beta, eos[t])
        Bc[:, t] = Bt[..., c]
        beta = (post[:, t][..., None] * Bt).sum(2)
    eye = torch.eye(V, dtype=torch.float64)
    score = eye[None, None] - pi[:, :, None, :]                 # [T, K, a, v]
    out = torch.zeros(T, K, V, T, K, V, dtype=torch.float64)
    idx = mdp.transitions
    end = mid * Bc                                              # [n, T, K, V]
    for t in range(T):
        w = alpha[:, t, :, None] * own[:, t]                     # [n, K, V]
        diag = torch.einsum("nza,zav,zaw->zvw", w * phi_a[t] * phi_b[t] * Bc[:, t], score[t],
                            score[t])
        out[t, torch.arange(K), :, t, torch.arange(K), :] = diag
        for first, second in ((phi_a, phi_b), (phi_b, phi_a)):
            gamma = w.new_zeros(n, K, V, K)                    # [n, (z, a), z'] after token t
            gamma[:, :, :V - 1].scatter_(3, idx[None, ..., None].expand(n, K, V - 1, 1),
                                         (w * first[t])[:, :, :V - 1, None])
            for t2 in range(t + 1, T):
                Y = torch.einsum("nzaZ,nZA->zaZA", gamma, end[:, t2] * second[t2])
                block = torch.einsum("zaZA,zav,ZAw->zvZw", Y, score[t], score[t2]) / 2
                out[t, :, :, t2] += block
                out[t2, :, :, t] += block.permute(2, 3, 0, 1)
                step = mid[:, t2, :, :V - 1]                    # [n, Z, A]: the next token
                gamma = gamma.new_zeros(n, K, V, K).index_add_(
                    3, idx.reshape(-1), (gamma[..., None] * step[:, None, None]).reshape(
                        n, K, V, -1))
    return out.reshape(T * K * V, T * K * V)
