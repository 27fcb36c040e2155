"""Policies whose positions share parameters: ``logits[t, z] = features[t, z] @ W``, float64.

A language model uses one set of weights at every position; the lattice's tabular
:class:`~tokenmdp.exact.lattice.LatticePolicy` gives each node its own logits instead.
:class:`SharedLatticePolicy` is the linear middle ground: a fixed feature map
``features [T, K, F]`` of the node and one trainable matrix ``W [F, V]``. With the default
features, one-hot over the automaton state (:func:`state_features`, ``F = K``), it is the
time-homogeneous policy: one table over ``z`` used at every position. One-hot over the node
(:func:`node_features`, ``F = T·K``) gives back the tabular policy.

The logits are linear in ``W``, ``logits = D W`` with ``D`` the map above, so a gradient in the
logits maps to ``W`` by the chain rule ``Dᵀ g`` (:meth:`SharedLatticePolicy.project`): the ground
truth of :mod:`~tokenmdp.exact.lattice.ground_truth` is computed in the logits and projected.
The scores of different positions now overlap in ``W``, so second moments have cross-position
terms (:mod:`~tokenmdp.exact.lattice.second_moments`).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.lattice.policy import LatticePolicy, _logit_matrix, _logit_table
from tokenmdp.exact.world.policies import check_number

__all__ = ["SharedLatticePolicy", "state_features", "node_features", "check_features"]


def state_features(mdp: LatticeMDP) -> torch.Tensor:
    """One-hot over the automaton state, the same at every position: ``[T, K, K]``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.

    Returns
    -------
    Tensor ``[T, K, K]``
        Float64, ``features[t, z] = e_z`` (an expanded view: ``K²`` numbers in memory).
    """
    T, K = mdp.max_len, mdp.num_states
    return torch.eye(K, dtype=torch.float64).expand(T, K, K)


def node_features(mdp: LatticeMDP) -> torch.Tensor:
    """One-hot over the node ``(t, z)``: ``[T, K, T·K]``, the tabular policy as a shared one.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.

    Returns
    -------
    Tensor ``[T, K, T·K]``
        Float64, ``features[t, z] = e_{t·K + z}``; ``W`` is then the logit table reshaped to
        ``[T·K, V]``.
    """
    T, K = mdp.max_len, mdp.num_states
    return torch.eye(T * K, dtype=torch.float64).reshape(T, K, T * K)


def check_features(mdp: LatticeMDP, features, *, name: str = "features") -> torch.Tensor:
    """Raise unless ``features`` is a finite float64 tensor ``[T, K, F]`` (``F >= 1``).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice (``T``, ``K``).
    features : object
        The feature map to check.
    name : str, default "features"
        The argument's name in the messages.

    Returns
    -------
    Tensor ``[T, K, F]``
        ``features`` itself.

    Raises
    ------
    TypeError
        Not a tensor, or not float64.
    ValueError
        Of another shape than ``[T, K, F]``, ``F = 0``, or not finite.
    """
    if not isinstance(features, torch.Tensor):
        raise TypeError(f"{name}: expected a float64 tensor [T, K, F], got "
                        f"{type(features).__name__}")
    if features.dtype != torch.float64:
        raise TypeError(f"{name}: expected dtype float64, got {features.dtype}")
    T, K = mdp.max_len, mdp.num_states
    if features.dim() != 3 or tuple(features.shape[:2]) != (T, K) or features.shape[2] < 1:
        raise ValueError(f"{name}: expected shape ({T}, {K}, F) (T, K, features) with F >= 1, "
                         f"got {tuple(features.shape)}")
    if not torch.isfinite(features).all():
        raise ValueError(f"{name}: must be finite")
    return features


class SharedLatticePolicy(LatticePolicy):
    """``π(a | t, z) = softmax(features[t, z] @ W)[a]`` with a trainable float64 ``W [F, V]``.

    A :class:`~tokenmdp.exact.lattice.LatticePolicy` everywhere one is used: ``logits`` is the
    expanded ``[T, K, V]`` table (computed, differentiable in ``W``), the one parameter is
    ``weight``, and :func:`~tokenmdp.exact.lattice.gradient`,
    :func:`~tokenmdp.exact.lattice.stale_copy` and
    :func:`~tokenmdp.exact.lattice.as_prefix_policy` work in ``W``'s coordinates (flat
    ``[F·V]``, row-major).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice the policy acts on.
    features : Tensor ``[T, K, F]``, optional
        The fixed feature map, float64, finite (kept as a buffer, not copied: do not modify
        it in place afterwards). Default
        :func:`state_features`: one table over ``z`` shared by every position.
    generator : torch.Generator, optional
        Source of the initial ``W ~ N(0, init_std²)`` (required unless ``weight`` is given).
    init_std : float, default 1.0
        Its standard deviation (0: the uniform policy).
    weight : Tensor ``[F, V]``, optional
        Initial ``W`` instead (copied, float64).

    Raises
    ------
    TypeError
        ``mdp`` not a LatticeMDP; ``features`` not a float64 tensor; no ``generator`` and no
        ``weight``.
    ValueError
        ``features`` not ``[T, K, F]`` or not finite; ``weight`` not ``[F, V]`` or not finite.
    """

    def __init__(self, mdp: LatticeMDP, features: torch.Tensor | None = None, *,
                 generator: torch.Generator | None = None, init_std: float = 1.0,
                 weight: torch.Tensor | None = None) -> None:
        # LatticePolicy.__init__ would make a free logit table: this class has none
        nn.Module.__init__(self)
        if not isinstance(mdp, LatticeMDP):
            raise TypeError(f"mdp: expected a LatticeMDP, got {type(mdp).__name__}")
        self.mdp = mdp
        feats = state_features(mdp) if features is None else check_features(mdp, features)
        shape = (feats.shape[2], mdp.vocab_size)
        if weight is None:
            if not isinstance(generator, torch.Generator):
                raise TypeError("generator: a torch.Generator is required unless weight is given")
            std = check_number("init_std", init_std)
            w = torch.randn(shape, generator=generator, dtype=torch.float64) * std
        else:
            w = torch.as_tensor(weight, dtype=torch.float64).detach().clone()
            if tuple(w.shape) != shape:
                raise ValueError(f"weight: expected shape {shape} (features, vocabulary), got "
                                 f"{tuple(w.shape)}")
            if not torch.isfinite(w).all():
                raise ValueError("weight: must be finite")
        self.register_buffer("_features", feats.detach())
        self.weight = nn.Parameter(w)

    @property
    def features(self) -> torch.Tensor:
        """The feature map ``[T, K, F]``."""
        return self._features

    @property
    def logits(self) -> torch.Tensor:
        """``features @ W``, float64 ``[T, K, V]`` (not a leaf: differentiable in ``W``)."""
        return torch.einsum("tkf,fv->tkv", self._features, self.weight)

    @property
    def num_parameters(self) -> int:
        """``p = F·V``."""
        return self.weight.numel()

    def parameter_vector(self) -> torch.Tensor:
        """``W`` as one detached flat float64 copy ``[F·V]`` (row-major).

        Returns
        -------
        Tensor ``[F·V]``
            The parameter.
        """
        return self.weight.detach().reshape(-1).clone()

    def with_parameters(self, vector: torch.Tensor, *, mdp: LatticeMDP | None = None
                        ) -> SharedLatticePolicy:
        """A shared policy with the same features and ``W = vector`` reshaped ``[F, V]``.

        Parameters
        ----------
        vector : Tensor ``[F·V]``
            The flat parameter (copied).
        mdp : LatticeMDP, optional
            The lattice of the copy (default this policy's; same shape).

        Returns
        -------
        SharedLatticePolicy
            The new policy, ``requires_grad`` on.
        """
        vector = torch.as_tensor(vector, dtype=torch.float64)
        if vector.numel() != self.num_parameters:
            raise ValueError(f"vector: expected {self.num_parameters} entries, got "
                             f"{vector.numel()}")
        return SharedLatticePolicy(self.mdp if mdp is None else mdp, self._features,
                                   weight=vector.reshape(self.weight.shape))

    def project(self, table: torch.Tensor) -> torch.Tensor:
        """``Dᵀ table``: ``out[f, v] = Σ_{t,z} features[t, z, f] table[t, z, v]``, flat.

        Parameters
        ----------
        table : Tensor ``[T·K·V]`` or ``[T, K, V]``
            A vector in the logits' coordinates (a gradient, a mean).

        Returns
        -------
        Tensor ``[F·V]``
            Float64, in ``W``'s coordinates.
        """
        table = _logit_table(self.mdp, table, "table")
        return torch.einsum("tkf,tkv->fv", self._features, table).reshape(-1)

    def project_matrix(self, matrix: torch.Tensor) -> torch.Tensor:
        """``Dᵀ matrix D``: a ``[T·K·V, T·K·V]`` matrix in ``W``'s coordinates.

        Parameters
        ----------
        matrix : Tensor ``[T·K·V, T·K·V]``
            The matrix in the logits' coordinates (a covariance; small lattices).

        Returns
        -------
        Tensor ``[F·V, F·V]``
            Float64.
        """
        T, K, V = self.mdp.shape
        m = _logit_matrix(self.mdp, matrix).reshape(T, K, V, T, K, V)
        half = torch.einsum("tkf,tkvsjw->fvsjw", self._features, m)
        p = self.num_parameters
        return torch.einsum("fvsjw,sjg->fvgw", half, self._features).reshape(p, p)

    def node_logits(self, t: int, z: torch.Tensor) -> torch.Tensor:
        """``features[t, z] @ W`` ``[N, V]`` (differentiable in ``W``).

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
        return self._features[t, z] @ self.weight
