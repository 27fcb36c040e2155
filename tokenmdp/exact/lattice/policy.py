"""Policies on the lattice: one softmax per node ``(t, z)``, float64.

:class:`LatticePolicy` holds free logits ``[T, K, V]``; ``π(a | t, z) = softmax(logits[t, z])[a]``.
The score of position ``t`` lives in the block ``logits[t]``, so the scores of different
positions are on disjoint parameters (what makes the second moments per-position sums in
:mod:`~tokenmdp.exact.lattice.moments`). A time-homogeneous or feature-linear policy, whose
positions share parameters as a language model's do, is
:class:`~tokenmdp.exact.lattice.shared.SharedLatticePolicy`: a subclass whose ``logits`` is a
linear image of its parameter. Every lattice policy states its own coordinates:
:meth:`LatticePolicy.project` maps a vector over the ``T·K·V`` logits to them (the identity here),
:meth:`LatticePolicy.parameter_vector` and :meth:`LatticePolicy.with_parameters` read and
rebuild it.

Stale and engine-like copies are in :mod:`~tokenmdp.exact.lattice.behavior`.
:func:`as_prefix_policy` views a lattice policy as a
:class:`~tokenmdp.exact.PrefixPolicy` of :func:`~tokenmdp.exact.lattice.to_token_mdp`'s twin,
sharing its parameter, so the enumeration engine's gradients are in the same coordinates.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import PrefixPolicy, check_number

__all__ = ["LatticePolicy", "check_lattice_policy", "as_prefix_policy"]


class LatticePolicy(nn.Module):
    """``π(a | t, z) = softmax(logits[t, z])[a]`` with a free float64 table ``[T, K, V]``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice the policy acts on.
    generator : torch.Generator, optional
        Source of the initial logits ``N(0, init_std²)`` (required unless ``logits`` is given).
    init_std : float, default 1.0
        Their standard deviation (0: the uniform policy).
    logits : Tensor ``[T, K, V]``, optional
        Initial logits instead (copied, float64).
    """

    def __init__(self, mdp: LatticeMDP, *, generator: torch.Generator | None = None,
                 init_std: float = 1.0, logits: torch.Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(mdp, LatticeMDP):
            raise TypeError(f"mdp: expected a LatticeMDP, got {type(mdp).__name__}")
        self.mdp = mdp
        if logits is None:
            if not isinstance(generator, torch.Generator):
                raise TypeError("generator: a torch.Generator is required unless logits is given")
            std = check_number("init_std", init_std)
            table = torch.randn(mdp.shape, generator=generator, dtype=torch.float64) * std
        else:
            table = torch.as_tensor(logits, dtype=torch.float64).detach().clone()
            if tuple(table.shape) != mdp.shape:
                raise ValueError(f"logits: expected shape {mdp.shape} (T, K, V), got "
                                 f"{tuple(table.shape)}")
            if not torch.isfinite(table).all():
                raise ValueError("logits: must be finite")
        self.logits = nn.Parameter(table)

    def logprobs(self) -> torch.Tensor:
        """``log π(· | t, z)`` at every node, float64 ``[T, K, V]`` (differentiable).

        Returns
        -------
        Tensor ``[T, K, V]``
            Log-probabilities; each ``[t, z]`` row sums (in probability) to 1.
        """
        return torch.log_softmax(self.logits, dim=-1)

    @property
    def features(self) -> torch.Tensor | None:
        """The feature map ``[T, K, F]`` of a shared policy; ``None`` here (tabular)."""
        return None

    @property
    def num_parameters(self) -> int:
        """``p``, the length of :meth:`parameter_vector` (``T·K·V`` here)."""
        return self.logits.numel()

    def parameter_vector(self) -> torch.Tensor:
        """The policy's parameter as one detached flat float64 copy ``[p]``.

        Returns
        -------
        Tensor ``[p]``
            The logits, flat in ``(t, z, a)`` order.
        """
        return self.logits.detach().reshape(-1).clone()

    def with_parameters(self, vector: torch.Tensor, *, mdp: LatticeMDP | None = None
                        ) -> LatticePolicy:
        """A new policy of the same kind with parameter ``vector`` (the inverse of
        :meth:`parameter_vector`).

        Parameters
        ----------
        vector : Tensor ``[p]``
            The flat parameter (copied).
        mdp : LatticeMDP, optional
            The lattice of the copy (default this policy's; same shape).

        Returns
        -------
        LatticePolicy
            The new policy, ``requires_grad`` on.
        """
        mdp = self.mdp if mdp is None else mdp
        vector = torch.as_tensor(vector, dtype=torch.float64)
        if vector.numel() != self.num_parameters:
            raise ValueError(f"vector: expected {self.num_parameters} entries, got "
                             f"{vector.numel()}")
        return LatticePolicy(mdp, logits=vector.reshape(mdp.shape))

    def project(self, table: torch.Tensor) -> torch.Tensor:
        """``Dᵀ table``: a vector over the ``T·K·V`` logits in the policy's coordinates.

        ``D`` is the Jacobian of the logits in the parameter; a gradient in the logits maps to
        the parameter's by the chain rule. Here ``D`` is the identity.

        Parameters
        ----------
        table : Tensor ``[T·K·V]`` or ``[T, K, V]``
            The vector in the logits' coordinates.

        Returns
        -------
        Tensor ``[p]``
            Float64.
        """
        return _logit_table(self.mdp, table, "table").reshape(-1)

    def project_matrix(self, matrix: torch.Tensor) -> torch.Tensor:
        """``Dᵀ matrix D``: a ``[T·K·V, T·K·V]`` matrix (a covariance) in the policy's
        coordinates.

        Parameters
        ----------
        matrix : Tensor ``[T·K·V, T·K·V]``
            The matrix in the logits' coordinates.

        Returns
        -------
        Tensor ``[p, p]``
            Float64.
        """
        return _logit_matrix(self.mdp, matrix)

    def node_logits(self, t: int, z: torch.Tensor) -> torch.Tensor:
        """``logits[t, z]`` ``[N, V]`` at position ``t`` and states ``z`` (differentiable).

        Parameters
        ----------
        t : int
            The position.
        z : LongTensor ``[N]``
            Automaton states.

        Returns
        -------
        Tensor ``[N, V]``
            Float64 logits.
        """
        return self.logits[t, z]


def _logit_table(mdp: LatticeMDP, table, name: str) -> torch.Tensor:
    """``table`` as a float64 ``[T, K, V]`` tensor, from ``[T·K·V]`` or ``[T, K, V]``."""
    table = torch.as_tensor(table, dtype=torch.float64)
    T, K, V = mdp.shape
    if tuple(table.shape) not in ((T * K * V,), (T, K, V)):
        raise ValueError(f"{name}: expected shape ({T * K * V},) or {mdp.shape} (T, K, V), got "
                         f"{tuple(table.shape)}")
    return table.reshape(T, K, V)


def _logit_matrix(mdp: LatticeMDP, matrix) -> torch.Tensor:
    """``matrix`` as a float64 ``[T·K·V, T·K·V]`` tensor."""
    matrix = torch.as_tensor(matrix, dtype=torch.float64)
    d = mdp.max_len * mdp.num_states * mdp.vocab_size
    if tuple(matrix.shape) != (d, d):
        raise ValueError(f"matrix: expected shape ({d}, {d}) (T·K·V squared), got "
                         f"{tuple(matrix.shape)}")
    return matrix


def check_lattice_policy(mdp: LatticeMDP, policy, *, name: str = "policy") -> None:
    """Raise unless ``policy`` is a :class:`LatticePolicy` of a lattice of ``mdp``'s shape.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice it is about to be used with.
    policy : object
        The policy to check.
    name : str, default "policy"
        The argument's name in the messages.

    Raises
    ------
    TypeError
        Not a LatticePolicy.
    ValueError
        Built for a lattice of another shape.
    """
    if not isinstance(policy, LatticePolicy):
        raise TypeError(f"{name}: expected a LatticePolicy, got {type(policy).__name__}")
    if policy.mdp.shape != mdp.shape:
        raise ValueError(f"{name}: built for a lattice of shape {policy.mdp.shape}, "
                         f"used with {mdp!r}")


class _LatticePrefixPolicy(PrefixPolicy):
    """A lattice policy seen by the enumeration engine: ``logits(prefix) = logits[k, z(prefix)]``,
    the lattice policy a submodule (so its parameters, and gradients, are the same)."""

    def __init__(self, token_mdp: TokenMDP, policy: LatticePolicy) -> None:
        super().__init__(token_mdp)
        self.lattice = policy
        self.register_buffer("delta", policy.mdp.transitions.clone(), persistent=False)
        self.start = policy.mdp.automaton.start

    def logits(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """``logits[k, z]`` with ``z`` the automaton state after each prefix.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
            The prompt of each state (the twin has one).
        prefix : LongTensor ``[N, k]``
            Non-EOS response tokens so far.

        Returns
        -------
        Tensor ``[N, V]``
            Float64 logits.
        """
        z = torch.full((prefix.shape[0],), self.start, dtype=torch.long)
        for j in range(prefix.shape[1]):
            z = self.delta[z, prefix[:, j]]
        return self.lattice.node_logits(prefix.shape[1], z)


def as_prefix_policy(token_mdp: TokenMDP, policy: LatticePolicy) -> PrefixPolicy:
    """``policy`` as a :class:`~tokenmdp.exact.PrefixPolicy` of its enumerable twin.

    Parameters
    ----------
    token_mdp : TokenMDP
        :func:`~tokenmdp.exact.lattice.to_token_mdp` of the policy's lattice.
    policy : LatticePolicy
        The lattice policy (tabular or shared); its parameter is shared, not copied.

    Returns
    -------
    PrefixPolicy
        The lattice policy's parameters (the ``[T, K, V]`` table, or a shared policy's
        ``weight``): flat gradients agree coordinate by coordinate.
    """
    if not isinstance(policy, LatticePolicy):
        raise TypeError(f"policy: expected a LatticePolicy, got {type(policy).__name__}")
    mdp = policy.mdp
    if (token_mdp.vocab_size, token_mdp.max_len, token_mdp.num_prompts) != (
            mdp.vocab_size, mdp.max_len, 1):
        raise ValueError(f"token_mdp: {token_mdp!r} is not the twin of {mdp!r}")
    return _LatticePrefixPolicy(token_mdp, policy)
