"""The exact moments of a :class:`~tokenmdp.exact.lattice.LatticeForm`: class counts × passes.

Given the reward classes ``c_1 .. c_G`` of a group (their counts ``k`` have multinomial
probabilities), the members are independent, each drawn from ``μ`` conditioned on its class, and
every member of class ``c`` has the same advantage ``A_c``. A member's coefficient table is a
combination ``φ(A) = Σ_b λ_b(A) Φ_b`` of a few basis tables (``Φ_0 + A g_±`` for the clipped,
corrected and KL-penalised surrogates, checked on probe advantages; else one table per
advantage), so every pass runs once per basis table and class.

*Per-member normalizers* (``constant``, ``length``, ``kept``): ``ĝ = w_0 Σ_i h_i X_i`` with
``h_i`` a function of member ``i`` alone, so with ``m_i = E[h_i X_i | c_i]`` and
``s_i = E[h_i² ‖X_i‖² | c_i]``: ``E[ĝ | k] = w_0 Σ_i m_i`` and
``E‖ĝ‖² | k = w_0² (Σ_i (s_i − ‖m_i‖²) + ‖Σ_i m_i‖²)``. A kept count's ``1/K_i`` and ``1/K_i²``
are Laplace sums over the nodes of :func:`~tokenmdp.exact.lattice.laplace_rule`.

*The group normalizer* (``total``, ``N = Σ_j ν(y_j)``): with ``q_c(s) = E[e^{−sν(y)} | c]``,
``M_c(s) = E[X e^{−sν(y)} | c]`` and ``S_c(s) = E[‖X‖² e^{−sν(y)} | c]``,

``E[ĝ | k] = w_0 Σ_n w_{1,n} Σ_i M_{c_i}(s_n) Π_{j≠i} q_{c_j}(s_n)``,

``E‖ĝ‖² | k = w_0² Σ_n w_{2,n} [Σ_i S_{c_i} Π_{j≠i} q_{c_j} + Σ_{i≠j} ⟨M_{c_i}, M_{c_j}⟩
Π_{l≠i,j} q_{c_l}]``,

the products taken as powers of the class counts (no division, so an underflowing ``q`` is
harmless). The ``ratio`` normalizer (token-level self-normalized IS under a constant weight,
``N/W`` with ``N = Σ_j |y_j|``) puts ``N`` in the numerator: every member quantity becomes a
polynomial in ``r`` of ``E[e^{r|y|} ...]`` to degree 2 (terminal weights ``|y|^a / a!``), the
products are polynomial products, and ``E[N^k ...] = k! [r^k]``.
The scalar coefficients are summed over the class counts first; one sweep then
contracts the vectors and accumulates each node's Gram matrix.
"""

from __future__ import annotations

import itertools
import math

import torch

from tokenmdp.exact.lab.moments_result import Moments, _exact_moments
from tokenmdp.exact.lattice.coefficients import token_coefficients, token_table
from tokenmdp.exact.lattice.laplace import laplace_rule
from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.lattice.node_passes import node_tables, second_matrix
from tokenmdp.exact.lattice.policy import LatticePolicy
from tokenmdp.exact.lattice.second_moments import member_square
from tokenmdp.exact.lattice.structure import LatticeForm
from tokenmdp.exact.lattice.sweep import Powers, class_weights, sweep

__all__ = ["form_moments", "BASIS_TOL", "PROBE_ADVANTAGES"]

#: Relative tolerance of the check that ``φ(A) = Φ_0 + A g_±``.
BASIS_TOL = 1e-12
#: Advantages the basis is checked on (beyond 0 and ±1, which build it).
PROBE_ADVANTAGES = (2.5, -1.75, 0.375)


def _configurations(mdp, estimator, G, p_class):
    """``(counts, probability, advantage per class)`` of every class-count configuration."""
    values = mdp.reward_classes[0]
    m = values.numel()
    log_fact = math.lgamma(G + 1)
    out = []
    for classes in itertools.combinations_with_replacement(range(m), G):
        counts = torch.bincount(torch.tensor(classes), minlength=m)
        if any(p_class[c] <= 0 for c in classes):
            continue
        prob = math.exp(log_fact + sum(float(k) * math.log(float(p_class[c])) - math.lgamma(
            float(k) + 1) for c, k in enumerate(counts.tolist()) if k > 0))
        adv = estimator.advantage(values[list(classes)], torch.zeros(G, dtype=torch.long), None)
        per_class = {c: float(a) for c, a in zip(classes, adv.tolist())}
        out.append((counts.tolist(), prob, per_class))
    return out


def _basis(form: LatticeForm, logp, advantages, shape):
    """``(Φ [nb, T, K, V], λ)``: ``φ(A) = Σ_b λ(A)_b Φ_b`` for every advantage of the group."""
    if form.kind != "local":
        return torch.ones(1, *shape, dtype=torch.float64), lambda a: [a]
    fields = {k: v for k, v in logp.items() if k != "policy"}

    def phi(a):
        return token_coefficients(form.local, a, logp["policy"], fields)
    zero, plus, minus = phi(0.0), phi(1.0), phi(-1.0)
    g_pos, g_neg = plus - zero, zero - minus
    scale = max(float(zero.abs().max()), float(g_pos.abs().max()), float(g_neg.abs().max()),
                1e-300)
    fits = all((phi(a) - zero - a * (g_pos if a > 0 else g_neg)).abs().max() <= BASIS_TOL *
               scale * max(1.0, abs(a)) for a in PROBE_ADVANTAGES)
    if not fits:
        values = sorted(set(advantages))
        index = {a: i for i, a in enumerate(values)}
        return torch.stack([phi(a) for a in values]), lambda a: [
            1.0 if i == index[a] else 0.0 for i in range(len(values))]
    tables, parts = [], []
    if (g_pos - g_neg).abs().max() <= BASIS_TOL * scale:
        tables.append(g_pos)
        parts.append(lambda a: a)
    else:
        tables += [g_pos, g_neg]
        parts += [lambda a: max(a, 0.0), lambda a: min(a, 0.0)]
    if zero.abs().max() > 0:
        tables.append(zero)
        parts.append(lambda a: 1.0)
    return torch.stack(tables), lambda a: [p(a) for p in parts]


def _counted(form: LatticeForm, logp, shape) -> torch.Tensor | None:
    """``ν``: the normalizer's term of each token."""
    if form.counted == "all":
        return torch.ones(shape, dtype=torch.float64)
    fields = {k: v for k, v in logp.items() if k != "policy"}
    if form.counted == "kept":
        correction = form.local.correction
        return token_table(lambda b: correction(b).keep_RC.to(torch.float64), shape, fields)
    log_w = logp["old_logprob"] - logp["behavior_logprob"]
    cap = getattr(form.local.correction, "cap", None)
    return (log_w if cap is None else log_w.clamp(max=math.log(cap))).exp()


def _shared_squares(mdp, log_mu, pi, log_kappa, nu, s, power, basis, f2, features, needed):
    """``E[sym(⟨DᵀX_b, DᵀX_b'⟩) · tilt(s_n) f₂ 1{c}]`` ``[n, nb, nb, m]`` by the vector
    messages of :func:`~tokenmdp.exact.lattice.member_square` (polarized for ``b ≠ b'``),
    where ``needed[n, b, b', c]``."""
    n, nb, _, m = needed.shape
    out = torch.zeros(n, nb, nb, m, dtype=torch.float64)
    for k in range(n):
        if not needed[k].any():
            continue
        alpha, tau, back = node_tables(mdp, log_mu, log_kappa, nu, float(s[k]), power, f2)
        for c in range(m):
            if not needed[k, ..., c].any():
                continue
            own = [member_square(mdp, alpha, tau, pi, basis[b], back[..., c], features)
                   for b in range(nb)]
            for b in range(nb):
                out[k, b, b, c] = own[b]
                for b2 in range(b + 1, nb):
                    both = member_square(mdp, alpha, tau, pi, basis[b] + basis[b2],
                                         back[..., c], features)
                    out[k, b, b2, c] = out[k, b2, b, c] = (both - own[b] - own[b2]) / 2
    return out


def form_moments(mdp: LatticeMDP, logp: dict, form: LatticeForm, estimator, G: int,
                 true_grad: torch.Tensor, *, keep_cov: bool,
                 policy: LatticePolicy | None = None) -> Moments:
    """The exact :class:`~tokenmdp.exact.Moments` of an estimator of a known form.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    logp : dict of str to Tensor ``[T, K, V]``
        ``policy``, ``behavior_logprob``, ``old_logprob`` (and ``ref_logprob``), detached.
    form : LatticeForm
        From :func:`~tokenmdp.exact.lattice.lattice_form`.
    estimator : Estimator
        The estimator (its advantage part).
    G : int
        The group size.
    true_grad : Tensor ``[d]``
        ``∇J``.
    keep_cov : bool
        Compute the full covariance too (in the logits; a shared policy's is projected).
    policy : LatticePolicy, optional
        ``π_θ``; a :class:`~tokenmdp.exact.lattice.SharedLatticePolicy` puts the moments in
        its parameter ``W`` (:meth:`~tokenmdp.exact.lattice.LatticePolicy.project`). With
        ``keep_cov`` the logit-space matrix is computed and projected (``Dᵀ E[ĝĝᵀ] D``);
        otherwise the Gram matrices are those of the projected vectors and the same-member
        squares come from vector messages (the kinds with one measure per response: local
        and sequence).

    Returns
    -------
    Moments
        ``method="lattice"``.
    """
    features = None if policy is None else policy.features
    if features is not None and keep_cov:
        tab = form_moments(mdp, logp, form, estimator, G, torch.zeros(math.prod(mdp.shape),
                           dtype=torch.float64), keep_cov=True)
        outer = policy.project_matrix(tab.covariance + torch.outer(tab.mean, tab.mean))
        return _exact_moments(policy.project(tab.mean), outer.trace(), outer, true_grad,
                              tab.num_draws, 1.0, "lattice")
    T, K, V = shape = mdp.shape
    m = mdp.reward_classes[0].numel()
    log_mu, pi = logp["behavior_logprob"], logp["policy"].exp()
    log_kappa = form.log_kappa(logp)
    powers = Powers.of(form.kind)
    zero = torch.zeros(1, dtype=torch.float64)
    p_class = class_weights(mdp, log_mu, None, None, zero)[0]
    configs = _configurations(mdp, estimator, G, p_class)
    basis, lam = _basis(form, logp, [a for _, _, pc in configs for a in pc.values()], shape)
    nb = basis.shape[0]
    Q = nb * m
    lengths = torch.arange(T + 1, dtype=torch.float64).clamp(min=1)
    ones = torch.ones(T + 1, dtype=torch.float64)
    nu, s, w1, w2 = None, zero, torch.ones(1, dtype=torch.float64), torch.ones(1,
                                                                              dtype=torch.float64)
    f1 = f2 = ones
    if form.normalizer == "length":
        f1, f2 = lengths.reciprocal(), lengths.reciprocal() ** 2
    elif form.normalizer in ("kept", "total", "ratio"):
        nu = _counted(form, logp, shape)
        if not float(nu.max()) < math.inf or (form.counted == "weight" and
                                              not float(nu.min()) > 0):
            raise ValueError("behavior: the importance weight π_old/μ of some token is 0 or "
                             "infinite in float64, so the self-normalized normalizer Σ w can be "
                             "0 or infinite; the Laplace rule needs it positive and finite")
        if form.counted == "kept":       # a rejected token has loss weight 0: no term at all
            basis = basis * nu
        group = 1 if form.normalizer == "kept" else G
        low = 1.0 if form.counted == "kept" else group * float(nu.min())
        # every token rejected everywhere: no term, ĝ = 0, any rule will do
        rule = laplace_rule(low, max(low, group * T * float(nu.max())))
        s, w1, w2 = rule.nodes, rule.weights[1], rule.weights[2]
    w0 = form.w0
    outer = torch.zeros(T * K * V, T * K * V, dtype=torch.float64) if keep_cov else None

    def matrix(coef_bbc, f2):          # Σ_{n,b,b',c} coef[n,b,b',c] E[sym(X_b X_b'ᵀ) ...]
        total = torch.zeros_like(outer)
        for b, b2, c in itertools.product(range(nb), range(nb), range(coef_bbc.shape[-1])):
            if b2 >= b and coef_bbc[:, b, b2, c].abs().max() > 0:
                k = coef_bbc[:, b, b2, c] + (coef_bbc[:, b2, b, c] if b2 != b else 0)
                total += second_matrix(mdp, log_mu, pi, log_kappa, nu, s, k, powers, basis[b],
                                       basis[b2], f2, c)
        return total

    if form.normalizer not in ("total", "ratio"):
        eye = torch.eye(Q, dtype=torch.float64).reshape(Q, nb, m)
        res = sweep(mdp, log_mu, pi, log_kappa, nu, s, powers, basis, f1, f2,
                    weights=w1[:, None, None, None] * eye[None])
        mbar = res.contracted.reshape(Q, -1)                     # [(b, c), d]
        if features is not None:                                 # [(b, c), p]
            mbar = torch.stack([policy.project(row) for row in mbar])
        gram = mbar @ mbar.T
        squares = res.squares if features is None else _shared_squares(
            mdp, log_mu, pi, log_kappa, nu, s, powers.own2, basis, f2, features,
            torch.ones(s.numel(), nb, nb, m, dtype=torch.bool))
        sbar = (w2[:, None, None, None] * squares).sum(0)       # [nb, nb, m]
        coef = torch.zeros(Q, dtype=torch.float64)
        second = 0.0
        s_coef = torch.zeros(1, nb, nb, m, dtype=torch.float64)
        for counts, prob, per_class in configs:
            v = torch.zeros(Q, dtype=torch.float64)
            for c, a in per_class.items():
                lc = torch.tensor(lam(a), dtype=torch.float64)
                u = torch.zeros(nb, m, dtype=torch.float64)
                u[:, c] = lc / p_class[c]
                u = u.reshape(Q)
                v += counts[c] * u
                sq = float(lc @ sbar[:, :, c] @ lc) / float(p_class[c])
                second += prob * w0 ** 2 * counts[c] * (sq - float(u @ gram @ u))
                if keep_cov:
                    mu_c = mbar.T @ u
                    outer -= prob * w0 ** 2 * counts[c] * torch.outer(mu_c, mu_c)
                    s_coef[0, :, :, c] += prob * w0 ** 2 * counts[c] * torch.outer(lc, lc) / \
                        p_class[c]
            coef += prob * w0 * v
            second += prob * w0 ** 2 * float(v @ gram @ v)
            if keep_cov:
                mv = mbar.T @ v
                outer += prob * w0 ** 2 * torch.outer(mv, mv)
        mean = mbar.T @ coef
        if keep_cov:
            outer += matrix(w2[:, None, None, None] * s_coef, f2)
        return _exact_moments(mean, torch.tensor(second, dtype=torch.float64), outer, true_grad,
                              len(configs), 1.0, "lattice")

    # the group normalizers: coefficients per node first, then one sweep. "ratio" carries
    # the token count N = Σ_j |y_j| in the numerator: per member the polynomial in r of
    # E[e^{rL} ...] to degree 2 (terminal weights |y|^a / a!), E[N^k ...] = k! [r^k].
    n = s.numel()
    A = 3 if form.normalizer == "ratio" else 1
    d1, d2 = (1, 2) if A == 3 else (0, 0)
    f1 = f2 = torch.stack([lengths ** a / math.factorial(a) for a in range(A)])
    qp = (class_weights(mdp, log_mu, None, nu, s, f=f1).reshape(n, A, m).transpose(1, 2) /
          p_class.clamp(min=1e-300)[None, :, None])                       # [n, m, A]
    coef1 = torch.zeros(n, nb, A, m, dtype=torch.float64)
    coefS = torch.zeros(n, nb, nb, A, m, dtype=torch.float64)
    coefP = torch.zeros(n, nb, A, m, nb, A, m, dtype=torch.float64)

    def times(x, y):                                    # polynomials [n, A], truncated
        out = torch.zeros_like(x)
        for i in range(A):
            out[:, i:] += x[:, i:i + 1] * y[:, :A - i]
        return out

    def others(counts, *drop):
        e = list(counts)
        for c in drop:
            e[c] -= 1
        out = torch.zeros(n, A, dtype=torch.float64)
        out[:, 0] = 1.0
        for c, k in enumerate(e):
            for _ in range(k):
                out = times(out, qp[:, c])
        return out

    for counts, prob, per_class in configs:
        for c, a in per_class.items():
            lc = torch.tensor(lam(a), dtype=torch.float64)
            rest = others(counts, c) / p_class[c]
            for k in range(d1 + 1):
                coef1[:, :, k, c] += prob * w0 * counts[c] * (w1 * rest[:, d1 - k])[:, None] * lc
            for k in range(d2 + 1):
                coefS[:, :, :, k, c] += math.factorial(d2) * prob * w0 ** 2 * counts[c] * (
                    w2 * rest[:, d2 - k])[:, None, None] * torch.outer(lc, lc)
            for c2, a2 in per_class.items():
                pairs = counts[c] * (counts[c2] - (c == c2))
                if pairs == 0:
                    continue
                l2 = torch.tensor(lam(a2), dtype=torch.float64)
                rest2 = others(counts, c, c2) / (p_class[c] * p_class[c2])
                for k, k2 in itertools.product(range(d2 + 1), repeat=2):
                    if k + k2 <= d2:
                        coefP[:, :, k, c, :, k2, c2] += math.factorial(d2) * prob * w0 ** 2 * \
                            pairs * (w2 * rest2[:, d2 - k - k2])[:, None, None] * \
                            torch.outer(lc, l2)
    Q = nb * A * m
    coef1, coefS = coef1.reshape(n, nb, A * m), coefS.reshape(n, nb, nb, A * m)
    res = sweep(mdp, log_mu, pi, log_kappa, nu, s, powers, basis, f1, f2,
                weights=coef1[:, None], gram=True, keep_vectors=keep_cov, features=features)
    mean = res.contracted[0].reshape(-1)
    mean = mean if features is None else policy.project(mean)
    squares = res.squares if features is None else _shared_squares(
        mdp, log_mu, pi, log_kappa, nu, s, powers.own2, basis, f2, features, coefS != 0)
    second = float((coefP.reshape(n, Q, Q) * res.gram).sum() + (coefS * squares).sum())
    if keep_cov:
        vec = res.vectors.reshape(n, Q, -1)
        outer = torch.einsum("nqd,nqr,nre->de", vec, coefP.reshape(n, Q, Q), vec) + \
            matrix(coefS, f2)
    return _exact_moments(mean, torch.tensor(second, dtype=torch.float64), outer, true_grad,
                          len(configs), 1.0, "lattice")
