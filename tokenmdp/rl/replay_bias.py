"""The exact bias of routing replay: ``π_old``, an engine and their routing records on one
enumerable MDP, and the expected gradient of any estimator under none / R2 / R3.

:class:`ReplayWorld` holds the trainer's model at the rollout weights, the engine's copy
(:func:`~tokenmdp.rl.replay_exact.engine_model`) and both routing records; R2 and R3 are one-line
swaps of whose record is replayed, through the trainer's own
:func:`~tokenmdp.rl.mismatch.replay_routing`. :func:`replay_gradient` gives the exact ``E[ĝ]`` of
an estimator under a replay with three targets: ``∇J`` of the freely routed ``π_θ`` (what the
trainer should follow), ``∇J`` of the replayed policy (the target the replay substitutes) and the
gradient of the first-order surrogate ``L_{π_old}(π_θ)``.

Zheng et al. (2025, arXiv 2512.01374, Sec. 3.2): replay restores the first-order approximation
but may introduce bias, since the policy optimized is no longer the one deployed; R2 changes it
only where the routing drifts during the updates (never on the first mini-batch), R3 wherever the
engine's routing differs from the trainer's, from the first mini-batch on.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.exact import TokenMDP, flat_grad, gradient, moments, surrogate
from tokenmdp.model import MoETransformer
from tokenmdp.rl.mismatch import ENGINE_ROUTING, OLD_ROUTING, RoutingReplay, replay_routing
from tokenmdp.rl.replay_exact import EnginePolicy, RoutedPolicy, enumeration_routing, expected_flip_fraction

__all__ = ["ReplayGradient", "ReplayWorld", "replay_gradient", "replay_gradients"]


@dataclasses.dataclass
class ReplayWorld:
    """``π_old``, the rollout engine and their routing records on one enumerable MDP.

    The records are taken once, at construction: ``old_routing`` is what the trainer's
    ``old_logprob`` pass records (R2 replays it), ``engine_routing`` what the engine used (R3
    replays it). :meth:`routing` picks one of them with the trainer's own
    :func:`~tokenmdp.rl.mismatch.replay_routing`, so R2 and R3 are one-line swaps here as there.

    Parameters
    ----------
    mdp : TokenMDP
        The MDP.
    old : MoETransformer
        The trainer's float64 model at the rollout weights (``θ_old``; not modified).
    engine : MoETransformer
        The engine's copy (:func:`engine_model`), in any numerics.
    """

    mdp: TokenMDP
    old: MoETransformer
    engine: MoETransformer

    def __post_init__(self) -> None:
        if not isinstance(self.mdp, TokenMDP):
            raise TypeError(f"mdp: expected a TokenMDP, got {type(self.mdp).__name__}")
        for name in ("old", "engine"):
            if not isinstance(getattr(self, name), MoETransformer):
                raise TypeError(f"{name}: expected a MoETransformer, got "
                                f"{type(getattr(self, name)).__name__}")
        self.old_routing = enumeration_routing(self.mdp, self.old)
        self.engine_routing = enumeration_routing(self.mdp, self.engine)
        self.mu = EnginePolicy(self.mdp, self.engine)

    def batch(self) -> TokenBatch:
        """The enumeration with both records in ``token_extras`` (``OLD_ROUTING``,
        ``ENGINE_ROUTING``), as the trainer's batch holds them after its ``old_logprob`` pass.

        Returns
        -------
        TokenBatch
            :meth:`TokenMDP.enumerate` with the two routing records.
        """
        return dataclasses.replace(self.mdp.enumerate(), token_extras={
            OLD_ROUTING: self.old_routing, ENGINE_ROUTING: self.engine_routing})

    def routing(self, replay: RoutingReplay | str) -> torch.Tensor | None:
        """The routing the update passes replay: None (``none``), the old pass's (``r2``) or the
        engine's (``r3``).

        Parameters
        ----------
        replay : RoutingReplay or str
            ``none``, ``r2`` or ``r3``.

        Returns
        -------
        LongTensor ``[R, C, L, K]`` or None
            As :func:`~tokenmdp.rl.mismatch.replay_routing` returns it for :meth:`batch`.
        """
        return replay_routing(self.batch(), replay)

    def policy(self, model: MoETransformer, replay: RoutingReplay | str) -> RoutedPolicy:
        """``π_θ`` as an update pass under ``replay`` computes it.

        Parameters
        ----------
        model : MoETransformer
            The float64 model at the current weights ``θ``.
        replay : RoutingReplay or str
            ``none``, ``r2`` or ``r3``.

        Returns
        -------
        RoutedPolicy
            ``model`` with the replayed routing.
        """
        return RoutedPolicy(self.mdp, model, self.routing(replay))

    def old_policy(self, replay: RoutingReplay | str) -> RoutedPolicy:
        """``π_old`` as the ``old_logprob`` pass computes it: with the engine's routing under R3,
        routed freely otherwise (:func:`~tokenmdp.rl.mismatch.compute_old_logprobs`).

        Parameters
        ----------
        replay : RoutingReplay or str
            ``none``, ``r2`` or ``r3``.

        Returns
        -------
        RoutedPolicy
            The old model under that pass's routing.
        """
        r3 = RoutingReplay(replay) is RoutingReplay.R3
        return RoutedPolicy(self.mdp, self.old, self.engine_routing if r3 else None)

    def flip_fraction(self) -> float:
        """The expected share of (token, layer) records where the engine and the trainer's
        ``old_logprob`` pass pick different experts, in responses sampled by ``μ``
        (:func:`expected_flip_fraction`; the trainer logs it as ``routing_mismatch``).

        Returns
        -------
        float
            A fraction in ``[0, 1]``.
        """
        return expected_flip_fraction(self.mdp, self.engine_routing, self.old_routing, self.mu)

    def engine_at(self, model: MoETransformer) -> MoETransformer:
        """The float64 engine at ``model``'s weights: a differentiable copy of ``model`` with the
        engine's selection bias, so ``∇J`` of it is the gradient of the objective of the policy
        that samples. Only for an ``fp64`` engine (one that differs only in its selection).

        Parameters
        ----------
        model : MoETransformer
            The float64 model whose weights the engine holds.

        Returns
        -------
        MoETransformer
            A new float64 model (``requires_grad`` on), the engine's selection biases.
        """
        if self.engine.embed.dtype != torch.float64:
            raise TypeError(f"engine: its gradient is exact only for an fp64 engine, this one "
                            f"computes in {self.engine.embed.dtype}")
        out = copy.deepcopy(model).requires_grad_(True)
        for mine, theirs in zip(out.blocks, self.engine.blocks):
            if hasattr(mine.mlp, "selection_bias"):
                mine.mlp.selection_bias.copy_(theirs.mlp.selection_bias)
        return out

    def stale(self, distance: float, direction: torch.Tensor | None = None) -> MoETransformer:
        """A copy of ``old`` moved by ``distance`` along ``direction`` (default ``∇J(π_old)``,
        normalized): the model of a later mini-batch update.

        Parameters
        ----------
        distance : float
            The step length in parameter space (0: the first mini-batch, ``θ = θ_old``).
        direction : Tensor ``[num_params]``, optional
            In ``old.parameters()`` order (non-zero).

        Returns
        -------
        MoETransformer
            A new float64 model, ``θ_old + distance u / ‖u‖``.
        """
        u = gradient(self.mdp, self.old) if direction is None else direction.double()
        if not u.norm() > 0:
            raise ValueError("direction: has zero norm")
        moved = copy.deepcopy(self.old)
        theta = nn.utils.parameters_to_vector(self.old.parameters()).detach()
        nn.utils.vector_to_parameters(theta + float(distance) * u / u.norm(), moved.parameters())
        return moved


@dataclasses.dataclass(frozen=True)
class ReplayGradient:
    """The exact expected gradient of an estimator under a routing replay, and its targets.

    Parameters
    ----------
    mean : Tensor ``[num_params]``
        ``E[ĝ]``: data from ``μ``, ``log π_θ`` and ``log π_old`` under the replay's routing.
    true_grad : Tensor ``[num_params]``
        ``∇J(π_θ)`` of the un-replayed (freely routed) policy: what the trainer should follow.
    replayed_grad : Tensor ``[num_params]``
        ``∇J`` of the replayed policy (experts fixed): the target the replay substitutes.
    surrogate_grad : Tensor ``[num_params]``
        ``∇_θ L_{π_old}(π_θ)`` of the un-replayed policy around the un-replayed ``π_old``
        (:func:`~tokenmdp.exact.surrogate`): the first-order target.
    variance : float
        ``tr Cov[ĝ]``.
    engine_grad : Tensor ``[num_params]`` or None
        ``∇J`` of the engine's policy ``μ_θ`` at the same weights (:meth:`ReplayWorld.engine_at`;
        None unless the engine is ``fp64``): the gradient of the policy that samples.
    """

    mean: torch.Tensor
    true_grad: torch.Tensor
    replayed_grad: torch.Tensor
    surrogate_grad: torch.Tensor
    variance: float
    engine_grad: torch.Tensor | None = None

    @property
    def relative_bias(self) -> float:
        """``‖E ĝ − ∇J(π_θ)‖ / ‖∇J(π_θ)‖``."""
        return float((self.mean - self.true_grad).norm() / self.true_grad.norm())

    @property
    def surrogate_gap(self) -> float:
        """``‖E ĝ − ∇L_{π_old}(π_θ)‖ / ‖∇J(π_θ)‖``."""
        return float((self.mean - self.surrogate_grad).norm() / self.true_grad.norm())

    @property
    def target_shift(self) -> float:
        """``‖∇J(replayed) − ∇J(π_θ)‖ / ‖∇J(π_θ)‖``: the bias of the replay itself."""
        return float((self.replayed_grad - self.true_grad).norm() / self.true_grad.norm())

    @property
    def engine_bias(self) -> float:
        """``‖E ĝ − ∇J(μ_θ)‖ / ‖∇J(μ_θ)‖`` (NaN without ``engine_grad``)."""
        if self.engine_grad is None:
            return float("nan")
        return float((self.mean - self.engine_grad).norm() / self.engine_grad.norm())

    @property
    def cosine(self) -> float:
        """``cos(E ĝ, ∇J(π_θ))``."""
        return float(self.mean @ self.true_grad / (self.mean.norm() * self.true_grad.norm()))


def replay_gradient(world: ReplayWorld, model: MoETransformer, estimator,
                    replay: RoutingReplay | str, *, group_size: int = 2,
                    method: str = "enumeration") -> ReplayGradient:
    """Exact moments of ``estimator`` at ``θ = model`` under ``replay``, with its targets.

    The estimator sees what the trainer's update sees: responses from ``μ`` (``world.mu``),
    ``log π_old`` from the ``old_logprob`` pass (:meth:`ReplayWorld.old_policy`) and
    ``log π_θ`` under the replayed routing (:meth:`ReplayWorld.policy`), through
    :func:`~tokenmdp.exact.moments`.

    Parameters
    ----------
    world : ReplayWorld
        ``π_old``, the engine and the routing records.
    model : MoETransformer
        The float64 model at the update's weights (``world.old`` itself on the first
        mini-batch, :meth:`ReplayWorld.stale` later).
    estimator : Estimator or callable
        Any composition (``tokenmdp.estimators.get(...)``) or loss callable.
    replay : RoutingReplay or str
        ``none``, ``r2`` or ``r3``.
    group_size : int, default 2
        ``G``.
    method : str, default "enumeration"
        As for :func:`~tokenmdp.exact.moments`.

    Returns
    -------
    ReplayGradient
        ``E[ĝ]``, ``∇J`` free and replayed, the surrogate's gradient, the variance and (for an
        ``fp64`` engine) the engine's ``∇J``.
    """
    return replay_gradients(world, model, estimator, (replay,), group_size=group_size,
                            method=method)[replay]


def replay_gradients(world: ReplayWorld, model: MoETransformer, estimator,
                     replays, *, group_size: int = 2,
                     method: str = "enumeration") -> dict:
    """:func:`replay_gradient` under each of ``replays`` at one ``θ``: the targets that no replay
    changes (``∇J`` routed freely, the engine's ``∇J``, the surrogate's gradient) computed once.

    Parameters
    ----------
    world, model, estimator, group_size, method
        As for :func:`replay_gradient`.
    replays : iterable of RoutingReplay or str
        ``none``, ``r2``, ``r3``, in any number.

    Returns
    -------
    dict
        ``replay -> ReplayGradient``, keyed by the replays as given.
    """
    if not isinstance(world, ReplayWorld):
        raise TypeError(f"world: expected a ReplayWorld, got {type(world).__name__}")
    free = RoutedPolicy(world.mdp, model)
    true = gradient(world.mdp, free)
    engine = (gradient(world.mdp, world.engine_at(model))
              if world.engine.embed.dtype == torch.float64 else None)
    with torch.enable_grad():
        sur = flat_grad(surrogate(world.mdp, free, RoutedPolicy(world.mdp, world.old)), free)
    out = {}
    for replay in replays:
        policy = world.policy(model, replay)
        m = moments(world.mdp, policy, estimator, group_size=group_size, behavior=world.mu,
                    old=world.old_policy(replay), method=method)
        replayed = true if world.routing(replay) is None else gradient(world.mdp, policy)
        out[replay] = ReplayGradient(mean=m.mean, true_grad=true, replayed_grad=replayed,
                                     surrogate_grad=sur, variance=m.total_variance,
                                     engine_grad=engine)
    return out
