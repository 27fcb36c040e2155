"""Behaviour policies on the lattice: staleness and training–inference discrepancy.

As :mod:`tokenmdp.exact.world.behavior` builds them for the enumerable MDP: :func:`stale_copy`
(``π_old``: the parameter moved back along a direction or by exact gradient steps; a shared
policy's copy is shared) and :func:`inference_copy` (``μ``: the same logits rounded to a
low-precision grid, perturbed by a fixed noise or an engine mismatch mode keyed by the node,
tempered; tabular). Both return
:class:`~tokenmdp.exact.lattice.LatticePolicy` objects.
"""

from __future__ import annotations

import torch

from tokenmdp.exact.lattice.ground_truth import gradient
from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.lattice.policy import LatticePolicy, check_lattice_policy
from tokenmdp.exact.world.behavior import check_fixed_mismatch, round_logits
from tokenmdp.exact.world.engine_mismatch import (
    EngineMismatch,
    apply_direction,
    context_keys,
    mismatch_direction,
)
from tokenmdp.exact.world.policies import check_number

__all__ = ["stale_copy", "inference_copy"]


def stale_copy(mdp: LatticeMDP, policy: LatticePolicy, *, direction: torch.Tensor | None = None,
               distance: float | None = None, steps: int | None = None,
               lr: float | None = None) -> LatticePolicy:
    """``π_old``: a copy with its parameter moved back (as :func:`tokenmdp.exact.stale_copy`).

    Give either ``distance`` (``θ_old = θ − distance · u/‖u‖``, ``u = direction``, default
    ``∇J(θ)``) or ``steps`` and ``lr`` (``k`` exact gradient-descent steps on ``J``). ``θ`` is
    the policy's own parameter: the logits of a tabular policy, ``W`` of a shared one (which
    stays shared).

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice (``∇J`` is computed on it).
    policy : LatticePolicy
        The current policy ``π_θ``.
    direction : Tensor, optional
        ``u`` in the policy's coordinates, ``p`` entries (``[T·K·V]`` or ``[T, K, V]`` for a
        tabular policy, ``[F·V]`` or ``[F, V]`` for a shared one; with ``distance`` only).
    distance : float, optional
        ``‖θ − θ_old‖ >= 0``.
    steps : int, optional
        Gradient-descent steps ``>= 0``.
    lr : float, optional
        Their learning rate ``> 0``.

    Returns
    -------
    LatticePolicy
        The moved copy, of ``policy``'s kind; ``policy`` is unchanged.
    """
    check_lattice_policy(mdp, policy)
    if (distance is None) == (steps is None):
        raise ValueError("distance, steps: give exactly one of them")
    theta = policy.parameter_vector()
    if distance is not None:
        distance = check_number("distance", distance)
        u = gradient(mdp, policy) if direction is None else torch.as_tensor(
            direction, dtype=torch.float64).reshape(-1)
        if u.shape != theta.shape:
            raise ValueError(f"direction: expected {theta.numel()} entries, got {u.numel()}")
        norm = u.norm()
        if distance > 0 and not norm > 0:
            raise ValueError("direction: has zero norm")
        step = u / norm * distance if distance > 0 else torch.zeros_like(theta)
        return policy.with_parameters(theta - step, mdp=mdp)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected an int >= 0, got {steps!r}")
    if lr is None:
        raise ValueError("lr: a positive learning rate is required with steps")
    lr = check_number("lr", lr, strict=True)
    old = policy.with_parameters(theta, mdp=mdp)
    for _ in range(steps):
        old = old.with_parameters(old.parameter_vector() - lr * gradient(mdp, old))
    return old


def inference_copy(policy: LatticePolicy, *, rounding: str | int | None = None,
                   noise_std: float = 0.0, temperature: float = 1.0,
                   generator: torch.Generator | None = None,
                   mismatch: EngineMismatch | None = None) -> LatticePolicy:
    """``μ``: the same logits through an engine's numerics, frozen (as
    :class:`tokenmdp.exact.InferencePolicy`): ``(round(logits + noise) + offset) / temperature``.

    Parameters
    ----------
    policy : LatticePolicy
        The policy whose logits are copied (a shared policy's expanded ``[T, K, V]`` table: the
        engine's numerics act per node, so ``μ`` is tabular).
    rounding : {None, "bf16", "fp16", "fp8_e4m3"} or int
        The numeric mode; see :func:`tokenmdp.exact.round_logits`.
    noise_std : float, default 0
        Standard deviation of a fixed Gaussian logit perturbation (drawn once per entry from
        ``generator``: the fixed mode, drawn rather than keyed; give it or ``mismatch``).
    temperature : float, default 1
        Sampling temperature ``> 0``.
    generator : torch.Generator, optional
        Needed when ``noise_std > 0``.
    mismatch : EngineMismatch, optional
        An engine mismatch mode, ``"fixed"``, ``"heavy"`` or ``"growing"``
        (:mod:`tokenmdp.exact.world.engine_mismatch`), added after the rounding; a node
        ``(t, z)`` is its state, keyed by the two numbers ``t, z`` as a context of two tokens
        (the lattice has no prefixes: every prefix that reaches the node shares its
        perturbation). ``"fresh"`` is refused (no fixed policy).

    Returns
    -------
    LatticePolicy
        A new policy with ``requires_grad`` off.
    """
    if not isinstance(policy, LatticePolicy):
        raise TypeError(f"policy: expected a LatticePolicy, got {type(policy).__name__}")
    noise_std = check_number("noise_std", noise_std)
    temperature = check_number("temperature", temperature, strict=True)
    mismatch = check_fixed_mismatch(mismatch)
    if noise_std > 0 and mismatch.active:
        raise ValueError("noise_std, mismatch: give one of them (noise_std is the fixed mode "
                         "drawn from a generator)")
    logits = policy.logits.detach()
    if noise_std > 0:
        if not isinstance(generator, torch.Generator):
            raise TypeError("generator: a torch.Generator is required when noise_std > 0")
        logits = logits + torch.randn(logits.shape, generator=generator,
                                      dtype=torch.float64) * noise_std
    logits = round_logits(logits, rounding)
    if mismatch.active:
        T, K, V = logits.shape
        nodes = torch.cartesian_prod(torch.arange(T), torch.arange(K))   # (t, z), row-major
        direction = mismatch_direction(context_keys(nodes, mismatch.seed), V, mismatch)
        logits = apply_direction(logits, direction.reshape(T, K, V), mismatch)
    mu = LatticePolicy(policy.mdp, logits=logits / temperature)
    return mu.requires_grad_(False)
