"""Tilted message passes: a response's score sum under ``μ`` re-weighted per token, per node.

Every exact quantity of :mod:`~tokenmdp.exact.lattice.moments` is a sum over responses of a
product of per-token factors times a terminal weight, times the score sum
``X = Σ_t φ_t (e_{a_t} − π(·|t, z_t))`` (or ``‖X‖²``). A per-token factor is a *tilt* of ``μ``:

``τ_p(t, z, a) = μ(a|t,z) · κ(t,z,a)^p · e^{−s ν(t,z,a)}``

— ``κ^p`` the ratio product a sequence kind carries (``p = 0, 1, 2``), ``e^{−sν}`` the Laplace
factor of a random normalizer at node ``s``. A token ``t`` splits its response into the tokens
before it (measure ``pre``), itself (``own``) and those after (``post``, with the terminal weight
``f(|y|)`` and the reward class), so

``E[X · tilt · 1{c}] = Σ_{t,z,a} α^{pre}_t(z) τ_own(t,z,a) φ(t,z,a) B^{post}_t(z,a,c) (e_a − π)``

and, for the tabular policy (scores of different positions on disjoint parameters), the same
with ``φ² ‖e_a − π‖²`` for ``E[‖X‖² · tilt · 1{c}]``. :func:`sweep` runs all Laplace nodes at
once: one forward pass per ``pre`` power, then one backward pass that accumulates the vectors'
contractions, their Gram matrices and the squares position by position, so no ``[T, K, V]``
table per node is ever held. :mod:`~tokenmdp.exact.lattice.node_passes` gives one node's tables and
the full ``E[X Xᵀ]`` for small lattices.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.exact.lattice.mdp import LatticeMDP

__all__ = ["Powers", "Sweep", "class_weights", "forward", "sweep"]


@dataclasses.dataclass(frozen=True)
class Powers:
    """The power of ``κ`` on each part of a response, for the mean (1) and the square (2).

    Parameters
    ----------
    pre1, own1, post1 : int, default 0
        The mean's powers before a token, at it and after it.
    pre2, own2, post2 : int, default 0
        The square's.
    mid2 : int, default 0
        The square's between two positions of a cross term of ``E[X Xᵀ]`` (and at the later
        position itself).
    """

    pre1: int = 0
    own1: int = 0
    post1: int = 0
    pre2: int = 0
    own2: int = 0
    mid2: int = 0
    post2: int = 0

    @staticmethod
    def of(kind: str) -> Powers:
        """The powers of a :class:`~tokenmdp.exact.lattice.LatticeForm` kind.

        Parameters
        ----------
        kind : {"local", "sequence", "per_decision"}
            Local: no ratio; sequence: ``κ(y)`` on every token (``κ²`` squared); per-decision:
            ``κ_{1:t}`` on token ``t``'s prefix and itself.

        Returns
        -------
        Powers
            The powers.
        """
        if kind == "local":
            return Powers()
        if kind == "sequence":
            return Powers(1, 1, 1, 2, 2, 2, 2)
        return Powers(1, 1, 0, 2, 2, 1, 0)


def _tilt(log_mu_t, log_kappa_t, nu_t, s, power):
    """``τ_p`` at one position for every node: ``[n, K, V]``."""
    log = log_mu_t if (power == 0 or log_kappa_t is None) else log_mu_t + power * log_kappa_t
    out = log.exp()[None]
    if nu_t is not None:
        out = out * torch.exp(-s[:, None, None] * nu_t[None])
    return out


def _counts_every_token(log_kappa, nu, power) -> bool:
    """The tilt is ``μ e^{−s}`` per token: the forward weight is ``e^{−st}`` times ``μ``'s."""
    return (power == 0 or log_kappa is None) and nu is not None and bool((nu == 1).all())


def forward(mdp: LatticeMDP, log_mu, log_kappa, nu, s, power: int) -> torch.Tensor:
    """``α^τ_t(z)`` for every node: the tilted weight of reaching ``(t, z)``, ``[n, T + 1, K]``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    log_mu : Tensor ``[T, K, V]``
        ``log μ``.
    log_kappa : Tensor ``[T, K, V]`` or None
        ``log κ``.
    nu : Tensor ``[T, K, V]`` or None
        The normalizer's per-token term (None: no Laplace factor).
    s : Tensor ``[n]``
        The nodes.
    power : int
        The power of ``κ``.

    Returns
    -------
    Tensor ``[n, T + 1, K]``
        Float64 (position ``T``: the truncated responses' last state).
    """
    T, K, V = mdp.shape
    if _counts_every_token(log_kappa, nu, power):
        plain = forward(mdp, log_mu, None, None, s[:1], 0)[0]
        steps = torch.arange(T + 1, dtype=torch.float64)
        return torch.exp(-s[:, None] * steps)[..., None] * plain
    n = s.numel()
    out = log_mu.new_zeros(n, T + 1, K)
    alpha = log_mu.new_zeros(n, K)
    alpha[:, mdp.automaton.start] = 1.0
    idx = mdp.transitions.reshape(-1)
    for t in range(T):
        out[:, t] = alpha
        tau = _tilt(log_mu[t], None if log_kappa is None else log_kappa[t],
                    None if nu is None else nu[t], s, power)
        flow = (alpha[:, :, None] * tau[:, :, :V - 1]).reshape(n, -1)
        alpha = log_mu.new_zeros(n, K).index_add_(1, idx, flow)
    out[:, T] = alpha
    return out


def _terminal(mdp: LatticeMDP, f: torch.Tensor):
    """Terminal weights per (class, weight): ``f [T + 1]`` or a stack ``[A, T + 1]`` of length
    weights gives ``A·m`` columns, column ``a·m + c`` being ``f_a(|y|) 1{class c}``."""
    values, eos_class, trunc_class = mdp.reward_classes
    m = values.numel()
    f = f[None] if f.dim() == 1 else f
    A, T = f.shape[0], mdp.max_len
    eos = f.T[1:, None, :, None] * torch.nn.functional.one_hot(eos_class, m).to(
        torch.float64)[:, :, None]                            # [T, K, A, m]
    trunc = f[:, T][None, :, None] * torch.nn.functional.one_hot(trunc_class, m).to(
        torch.float64)[:, None]                               # [K, A, m]
    return eos.reshape(T, -1, A * m), trunc.reshape(-1, A * m)


def _continue(mdp, beta, eos_t):
    """``B_t[n, z, a, c]`` from the message after the token ``β_{t+1}[n, z', c]``."""
    n, K, m = beta.shape
    V = mdp.vocab_size
    out = beta.new_empty(n, K, V, m)
    out[:, :, :V - 1] = beta[:, mdp.transitions]
    out[:, :, V - 1] = eos_t
    return out


def class_weights(mdp: LatticeMDP, log_mu, log_kappa, nu, s, power: int = 0,
                  f: torch.Tensor | None = None) -> torch.Tensor:
    """``E_μ[Π_t κ_t^p e^{−s ν_t} f(|y|) 1{class c}]`` for every node and class: ``[n, m]``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    log_mu, log_kappa, nu, s, power
        As :func:`forward`.
    f : Tensor ``[T + 1]``, optional
        The terminal weight by length (default 1).

    Returns
    -------
    Tensor ``[n, m]``
        Float64.
    """
    T = mdp.max_len
    f = torch.ones(T + 1, dtype=torch.float64) if f is None else f
    eos, trunc = _terminal(mdp, f)
    if _counts_every_token(log_kappa, nu, power):    # Σ_ℓ P(|y| = ℓ, c) f(ℓ) e^{−sℓ}
        alpha = forward(mdp, log_mu, None, None, s[:1], 0)[0]
        by_length = torch.cat([(alpha[:T, :, None] * log_mu[:, :, -1:].exp() * eos).sum(1),
                               (alpha[T][:, None] * trunc).sum(0, keepdim=True)])   # [T+1, m]
        steps = torch.arange(1, T + 1, dtype=torch.float64)
        steps = torch.cat([steps, steps[-1:]])
        return torch.exp(-s[:, None] * steps) @ by_length
    beta = trunc[None].expand(s.numel(), *trunc.shape).clone()
    for t in range(T - 1, -1, -1):
        tau = _tilt(log_mu[t], None if log_kappa is None else log_kappa[t],
                    None if nu is None else nu[t], s, power)
        beta = (tau[..., None] * _continue(mdp, beta, eos[t])).sum(2)
    return beta[:, mdp.automaton.start]


@dataclasses.dataclass
class Sweep:
    """What :func:`sweep` accumulated (each None when not asked for).

    Parameters
    ----------
    contracted : Tensor ``[R, T, K, V]`` or None
        ``Σ_{n,b,c} weights[n, r, b, c] M_{b,c}(s_n)``.
    gram : Tensor ``[n, Q, Q]`` or None
        ``⟨M_q, M_{q'}⟩`` per node, ``q = b·m + c``.
    squares : Tensor ``[n, nb, nb, m]``
        ``E[Σ_t Φ_b Φ_{b'} ‖e_a − π‖² tilt₂ f₂ 1{c}]`` (tabular).
    vectors : Tensor ``[n, Q, T, K, V]`` or None
        Every ``M_q(s_n)`` (small lattices).
    """

    contracted: torch.Tensor | None
    gram: torch.Tensor | None
    squares: torch.Tensor
    vectors: torch.Tensor | None


def sweep(mdp: LatticeMDP, log_mu, pi, log_kappa, nu, s, powers: Powers, basis, f1, f2, *,
          weights: torch.Tensor | None = None, gram: bool = False,
          keep_vectors: bool = False, features: torch.Tensor | None = None) -> Sweep:
    """All nodes' member vectors ``M_{b,c}(s)`` and squares in one backward pass.

    ``M_{b,c}(s) = E_μ[Π κ^{p} e^{−sν} f₁(|y|) 1{c} Σ_t Φ_b (e_{a_t} − π)]`` (powers
    ``pre1/own1/post1``), ``squares`` with ``Φ_b Φ_{b'}`` and ``f₂`` (powers ``pre2/own2/post2``).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    log_mu, pi : Tensor ``[T, K, V]``
        ``log μ`` and ``π_θ``.
    log_kappa, nu : Tensor ``[T, K, V]`` or None
        The ratio and the normalizer's per-token term.
    s : Tensor ``[n]``
        The Laplace nodes (``[0.]`` for none).
    powers : Powers
        The kind's powers of ``κ``.
    basis : Tensor ``[nb, T, K, V]``
        The coefficient tables ``Φ_b``.
    f1, f2 : Tensor ``[T + 1]`` or ``[A, T + 1]``
        Terminal weights of the mean and of the square (a stack: one "class" per weight and
        reward class, index ``a·m + c``).
    weights : Tensor ``[n, R, nb, m]``, optional
        Contract the vectors into ``R`` outputs as they are made.
    gram : bool, default False
        Accumulate each node's Gram matrix.
    keep_vectors : bool, default False
        Keep every vector.
    features : Tensor ``[T, K, F]``, optional
        A shared policy's feature map: the Gram matrices are then those of the vectors in its
        parameter, ``Dᵀ M`` (``squares`` stay tabular: see
        :func:`~tokenmdp.exact.lattice.member_square` for the shared ones).

    Returns
    -------
    Sweep
        The accumulations.
    """
    T, K, V = mdp.shape
    n, nb = s.numel(), basis.shape[0]
    m = mdp.reward_classes[0].numel() * (1 if f1.dim() == 1 else f1.shape[0])
    Q = nb * m
    lk = (lambda t: None) if log_kappa is None else (lambda t: log_kappa[t])
    nt = (lambda t: None) if nu is None else (lambda t: nu[t])
    alpha = {p: forward(mdp, log_mu, log_kappa, nu, s, p) for p in {powers.pre1, powers.pre2}}
    eos1, trunc1 = _terminal(mdp, f1)
    eos2, trunc2 = _terminal(mdp, f2)
    beta1 = trunc1[None].expand(n, K, m).clone()
    beta2 = trunc2[None].expand(n, K, m).clone()
    same = powers.post1 == powers.post2 and torch.equal(f1, f2)     # one backward message
    score_sq = 1 - 2 * pi + (pi * pi).sum(-1, keepdim=True)
    contracted = None if weights is None else pi.new_zeros(weights.shape[1], T, K, V)
    grams = pi.new_zeros(n, Q, Q) if gram and features is None else None
    projected = pi.new_zeros(n, Q, features.shape[-1], V) if gram and features is not None \
        else None
    squares = pi.new_zeros(n, nb, nb, m)
    vectors = pi.new_zeros(n, Q, T, K, V) if keep_vectors else None
    for t in range(T - 1, -1, -1):
        tau = {p: _tilt(log_mu[t], lk(t), nt(t), s, p)
               for p in {powers.own1, powers.post1, powers.own2, powers.post2}}
        B1 = _continue(mdp, beta1, eos1[t])                          # [n, K, V, m]
        B2 = B1 if same else _continue(mdp, beta2, eos2[t])
        w1 = alpha[powers.pre1][:, t, :, None] * tau[powers.own1]     # [n, K, V]
        u = (w1[:, None] * basis[:, t][None])[:, :, None] * B1.permute(0, 3, 1, 2)[:, None]
        M = u - pi[t] * u.sum(-1, keepdim=True)                      # [n, nb, m, K, V]
        flat = M.reshape(n, Q, K * V)
        if weights is not None:
            contracted[:, t] = (weights.reshape(n, -1, Q).transpose(0, 1).reshape(-1, n * Q)
                                @ flat.reshape(n * Q, K * V)).reshape(-1, K, V)
        if grams is not None:
            grams += flat @ flat.transpose(1, 2)
        if projected is not None:
            projected += torch.einsum("zf,nqza->nqfa", features[t], M.reshape(n, Q, K, V))
        if keep_vectors:
            vectors[:, :, t] = M.reshape(n, Q, K, V)
        w2 = alpha[powers.pre2][:, t, :, None] * tau[powers.own2] * score_sq[t]
        wb = (w2[:, None] * basis[:, t][None])[:, :, None] * basis[:, t][None, None]
        squares += (wb.reshape(n, nb * nb, K * V) @ B2.reshape(n, K * V, m)).reshape(
            n, nb, nb, m)
        beta1 = (tau[powers.post1][..., None] * B1).sum(2)
        beta2 = beta1 if same else (tau[powers.post2][..., None] * B2).sum(2)
    if projected is not None:
        flat = projected.reshape(n, Q, -1)
        grams = flat @ flat.transpose(1, 2)
    return Sweep(contracted=contracted, gram=grams, squares=squares, vectors=vectors)
