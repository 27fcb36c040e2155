"""Ground truth on the lattice by forward/backward recursions in ``O(T·K·V)``, float64.

* forward: ``α_0 = 1[z = start]``, ``α_{t+1}(z') = Σ_{z, a ≠ EOS: δ(z,a) = z'} α_t(z) π(a|t,z)``:
  the probability that the response is still running at ``(t, z)`` (the visitation ``d^π``);
* backward: ``V_T(z) = R_trunc(z)``, ``Q_t(z, EOS) = R_eos(t, z)``,
  ``Q_t(z, a) = V_{t+1}(δ(z, a))``, ``V_t(z) = Σ_a π(a|t,z) Q_t(z, a)``;
* ``J = V_0(start)`` and the policy-gradient theorem on the lattice:
  ``∂J/∂logits[t, z, a] = α_t(z) π(a|t,z) (Q_t(z, a) − V_t(z))``, mapped to a shared policy's
  parameter by the chain rule.

Divergences between two policies ``p``, ``q`` follow the same lattice: ``KL(p‖q) = Σ_{t,z}
α^p_t(z) KL(p(·|t,z) ‖ q(·|t,z))`` (the sequence log-ratio is the sum of the token ones), and
``E_q[(p/q)²] = Σ_y p(y)²/q(y)`` is a forward recursion with weights ``p²/q`` per token, run in
log space (it grows like ``(1 + χ²_token)^T``), so sequence-IS's second moment is exact at
``T = 4096``. Entropy: ``H(π(·|x)) = Σ_{t,z} α_t(z) H(π(·|t,z))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.lattice.policy import LatticePolicy, check_lattice_policy

__all__ = ["transition_matrices", "visitation", "objective", "gradient", "values",
           "LatticeValues", "expected_length", "entropy", "sequence_kl", "log_second_moment",
           "chi_square", "surrogate", "max_node_tv", "trust_region_bound"]


def _logprobs(mdp: LatticeMDP, policy: LatticePolicy, name: str = "policy") -> torch.Tensor:
    check_lattice_policy(mdp, policy, name=name)
    return policy.logprobs()


def transition_matrices(mdp: LatticeMDP, probs: torch.Tensor) -> torch.Tensor:
    """``P_t[z, z'] = Σ_{a ≠ EOS: δ(z,a) = z'} π(a|t,z)``, float64 ``[T, K, K]``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    probs : Tensor ``[T, K, V]``
        Per-node probabilities (or any non-negative weights per token).

    Returns
    -------
    Tensor ``[T, K, K]``
        The sub-stochastic transition matrix of each position (differentiable in ``probs``).
    """
    T, K, V = mdp.shape
    idx = mdp.transitions[None].expand(T, K, V - 1)
    return probs.new_zeros(T, K, K).scatter_add(2, idx, probs[..., :V - 1])


def _forward(mdp: LatticeMDP, probs: torch.Tensor) -> torch.Tensor:
    """``α`` ``[T + 1, K]`` under per-node probabilities ``probs``."""
    T, K, _ = mdp.shape
    P = transition_matrices(mdp, probs)
    alpha = [probs.new_zeros(K).index_fill(0, torch.tensor([mdp.automaton.start]), 1.0)]
    for t in range(T):
        alpha.append(alpha[-1] @ P[t])
    return torch.stack(alpha)


def visitation(mdp: LatticeMDP, policy: LatticePolicy) -> torch.Tensor:
    """``d^π(t, z) = P(the response is running at position t in state z)``, ``[T + 1, K]``.

    Row ``T`` is the probability of truncation in each state; rows ``0 .. T − 1`` sum to
    ``E|y|`` (one action per node visited).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    policy : LatticePolicy
        ``π``.

    Returns
    -------
    Tensor ``[T + 1, K]``
        Float64, differentiable in the policy's logits.
    """
    return _forward(mdp, _logprobs(mdp, policy).exp())


def expected_length(mdp: LatticeMDP, policy: LatticePolicy) -> torch.Tensor:
    """``E|y|`` under ``policy``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    policy : LatticePolicy
        ``π``.

    Returns
    -------
    Tensor
        The float64 scalar.
    """
    return visitation(mdp, policy)[:-1].sum()


def objective(mdp: LatticeMDP, policy: LatticePolicy) -> torch.Tensor:
    """``J = E_{y~π}[R(y)]`` as a differentiable float64 scalar (forward recursion).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    policy : LatticePolicy
        ``π``.

    Returns
    -------
    Tensor
        The scalar ``J``.
    """
    probs = _logprobs(mdp, policy).exp()
    alpha = _forward(mdp, probs)
    return ((alpha[:-1] * probs[..., mdp.eos] * mdp.eos_rewards).sum()
            + alpha[-1] @ mdp.truncation_rewards)


@dataclass(frozen=True)
class LatticeValues:
    """``V^π`` ``[T + 1, K]`` and ``Q^π`` ``[T, K, V]`` on the lattice.

    Parameters
    ----------
    V : Tensor ``[T + 1, K]``
        ``V_t(z)``; row ``T`` is the truncation reward.
    Q : Tensor ``[T, K, V]``
        ``Q_t(z, a)``.
    """

    V: torch.Tensor
    Q: torch.Tensor

    @property
    def A(self) -> torch.Tensor:
        """``A = Q − V`` ``[T, K, V]``."""
        return self.Q - self.V[:-1, :, None]


def _values(mdp: LatticeMDP, probs: torch.Tensor) -> LatticeValues:
    T, K, V = mdp.shape
    delta = mdp.transitions
    v_next = mdp.truncation_rewards
    Vs, Qs = [v_next], []
    for t in range(T - 1, -1, -1):
        q = torch.cat([v_next[delta], mdp.eos_rewards[t][:, None]], dim=1)
        v_next = (probs[t] * q).sum(-1)
        Qs.append(q)
        Vs.append(v_next)
    return LatticeValues(V=torch.stack(Vs[::-1]), Q=torch.stack(Qs[::-1]))


def values(mdp: LatticeMDP, policy: LatticePolicy) -> LatticeValues:
    """``V^π`` and ``Q^π`` (and ``A^π``) at every node by backward recursion.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    policy : LatticePolicy
        ``π``.

    Returns
    -------
    LatticeValues
        ``V`` ``[T + 1, K]``, ``Q`` ``[T, K, V]``; ``V[0, start]`` is ``J``.
    """
    with torch.no_grad():
        return _values(mdp, _logprobs(mdp, policy).exp())


def gradient(mdp: LatticeMDP, policy: LatticePolicy) -> torch.Tensor:
    """The true ``∇J`` in the policy's parameter, flat (the order of
    :meth:`~tokenmdp.exact.lattice.LatticePolicy.parameter_vector`).

    ``∂J/∂logits[t, z, a] = α_t(z) π(a|t,z) A^π_t(z, a)`` (one forward and one backward pass):
    the tabular gradient, flat ``[T·K·V]``; a shared policy's is its chain rule
    ``Σ_{t,z} features[t, z, f] ∂J/∂logits[t, z, v]``, flat ``[F·V]``
    (:meth:`~tokenmdp.exact.lattice.LatticePolicy.project`).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    policy : LatticePolicy
        ``π``.

    Returns
    -------
    Tensor ``[p]``
        Float64, no autograd graph.
    """
    with torch.no_grad():
        probs = _logprobs(mdp, policy).exp()
        alpha = _forward(mdp, probs)
        tables = _values(mdp, probs)
        return policy.project(alpha[:-1, :, None] * probs * tables.A)


def entropy(mdp: LatticeMDP, policy: LatticePolicy, *, reduction: str = "sum") -> torch.Tensor:
    """The entropy of the response distribution, or the mean token entropy.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    policy : LatticePolicy
        ``π``.
    reduction : {"sum", "mean"}
        ``"sum"``: ``H(π(·|x)) = Σ_{t,z} α_t(z) H(π(·|t,z))``, the sequence entropy;
        ``"mean"``: that divided by ``E|y|``, the per-token entropy a trainer logs.

    Returns
    -------
    Tensor
        The float64 scalar, in nats.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    lp = _logprobs(mdp, policy)
    alpha = _forward(mdp, lp.exp())[:-1]
    total = (alpha * -(lp.exp() * lp).sum(-1)).sum()
    return total if reduction == "sum" else total / alpha.sum()


def sequence_kl(mdp: LatticeMDP, p: LatticePolicy, q: LatticePolicy) -> torch.Tensor:
    """``KL(p ‖ q) = Σ_y p(y) log(p(y)/q(y)) = Σ_{t,z} α^p_t(z) KL(p(·|t,z) ‖ q(·|t,z))``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    p, q : LatticePolicy
        The two policies.

    Returns
    -------
    Tensor
        The float64 scalar ``>= 0`` (differentiable in both).
    """
    lp, lq = _logprobs(mdp, p, "p"), _logprobs(mdp, q, "q")
    alpha = _forward(mdp, lp.exp())[:-1]
    return (alpha * (lp.exp() * (lp - lq)).sum(-1)).sum()


def log_second_moment(mdp: LatticeMDP, target: LatticePolicy, behavior: LatticePolicy, *,
                      group_size: int = 1) -> torch.Tensor:
    """``log E_{y~q}[(p(y)/q(y))^2] = log(1 + χ²(p ‖ q))`` of whole responses, in log space.

    With ``group_size = G`` the joint weight of ``G`` independent responses:
    ``G · log Σ_y p²/q``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    target : LatticePolicy
        ``p`` (``π_old``, or ``π_θ``).
    behavior : LatticePolicy
        ``q`` (``μ``), the sampler.
    group_size : int, default 1
        ``G >= 1``.

    Returns
    -------
    Tensor
        The float64 scalar (finite however large ``T``; no gradient).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    T, K, V = mdp.shape
    with torch.no_grad():
        lw = 2 * _logprobs(mdp, target, "target") - _logprobs(mdp, behavior, "behavior")
        delta = mdp.transitions.reshape(-1)
        la = torch.full((K,), -torch.inf, dtype=torch.float64)
        la[mdp.automaton.start] = 0.0
        ends = []
        for t in range(T):
            x = la[:, None] + lw[t]                                   # [K, V]
            shift = x.max()
            e = (x - shift).exp()
            ends.append(e[:, V - 1].sum().log() + shift)
            nxt = torch.zeros(K, dtype=torch.float64).index_add_(0, delta,
                                                                  e[:, :V - 1].reshape(-1))
            la = nxt.log() + shift
        ends.append(torch.logsumexp(la, 0))
        return group_size * torch.logsumexp(torch.stack(ends), 0)


def chi_square(mdp: LatticeMDP, target: LatticePolicy, behavior: LatticePolicy, *,
               level: str = "sequence", group_size: int = 1) -> torch.Tensor:
    """``χ²(target ‖ behavior)`` of whole responses or per token (as
    :func:`tokenmdp.exact.world.chi_square.chi_square`).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    target, behavior : LatticePolicy
        ``p`` and the sampler ``q``.
    level : {"sequence", "token"}
        ``"sequence"``: ``E_q[(p/q)²]^G − 1`` (``expm1`` of :func:`log_second_moment`; ``inf``
        once it exceeds float64, use the log then); ``"token"``: ``Σ d^q χ²_node / Σ d^q``.
    group_size : int, default 1
        ``G`` (sequence level only).

    Returns
    -------
    Tensor
        The float64 scalar ``>= 0``.
    """
    if level == "sequence":
        return torch.expm1(log_second_moment(mdp, target, behavior, group_size=group_size))
    if level != "token":
        raise ValueError(f"level: expected 'sequence' or 'token', got {level!r}")
    if group_size != 1:
        raise ValueError("group_size: only the sequence level has groups")
    with torch.no_grad():
        lp, lq = _logprobs(mdp, target, "target"), _logprobs(mdp, behavior, "behavior")
        alpha = _forward(mdp, lq.exp())[:-1]
        per_node = (2 * lp - lq).exp().sum(-1) - 1.0
        return (alpha * per_node).sum() / alpha.sum()


def surrogate(mdp: LatticeMDP, policy: LatticePolicy, behavior: LatticePolicy) -> torch.Tensor:
    """The trust-region surrogate ``L_μ(π) = J(μ) + Σ_{t,z} d^μ(t,z) Σ_a π(a|t,z) A^μ_t(z,a)``.

    As :func:`tokenmdp.exact.surrogate` (Kakade & Langford 2002; Schulman et al. 2015,
    arXiv 1502.05477, Eq. 3); differentiable in ``policy``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    policy : LatticePolicy
        ``π``.
    behavior : LatticePolicy
        ``μ``, the policy the surrogate is taken around.

    Returns
    -------
    Tensor
        The float64 scalar.
    """
    with torch.no_grad():
        mu = _logprobs(mdp, behavior, "behavior").exp()
        alpha = _forward(mdp, mu)[:-1]
        tables = _values(mdp, mu)
        j_mu = tables.V[0, mdp.automaton.start]
    pi = _logprobs(mdp, policy).exp()
    return j_mu + (alpha[..., None] * pi * tables.A).sum()


def max_node_tv(mdp: LatticeMDP, p: LatticePolicy, q: LatticePolicy) -> torch.Tensor:
    """``max TV(p(·|t,z), q(·|t,z))`` over the reachable nodes.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    p, q : LatticePolicy
        The two policies.

    Returns
    -------
    Tensor
        The float64 scalar in ``[0, 1]``.
    """
    with torch.no_grad():
        tv = 0.5 * (_logprobs(mdp, p, "p").exp() - _logprobs(mdp, q, "q").exp()).abs().sum(-1)
        return tv[mdp.reachable[:-1]].max()


def trust_region_bound(mdp: LatticeMDP, policy: LatticePolicy, old: LatticePolicy
                       ) -> torch.Tensor:
    """``2 ε α² T (T − 1)`` with ``α = max TV(π, π_old)``, ``ε = max |A^{π_old}|`` over
    reachable nodes: the bound of :func:`tokenmdp.exact.trust_region_bound` on
    ``|J(π) − L_{π_old}(π)|``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice (``T`` its length).
    policy : LatticePolicy
        ``π``.
    old : LatticePolicy
        ``π_old``.

    Returns
    -------
    Tensor
        The float64 scalar bound.
    """
    alpha = max_node_tv(mdp, policy, old)
    eps = values(mdp, old).A.abs()[mdp.reachable[:-1]].max()
    T = mdp.max_len
    return 2 * eps * alpha ** 2 * T * (T - 1)
