"""Behaviour policies: staleness and training–inference discrepancy, dialled separately.

Three log-probs per token (docs: Concepts › Estimators, after Zheng et al. 2025,
arXiv 2512.01374): ``pi_theta`` (current), ``pi_old`` (training engine at the rollout weights)
and ``mu`` (the inference engine that sampled). Here

* :func:`stale_copy` builds ``pi_old``: the same policy with its parameters moved back along a
  direction, or by ``k`` exact gradient steps, so ``pi_theta != pi_old`` (staleness);
* :class:`InferencePolicy` builds ``mu``: the *same* weights seen through other numerics —
  logits rounded to bf16 / fp16 / an fp8-e4m3 grid / ``b`` mantissa bits (the numeric mode), a
  fixed per-state perturbation (an engine mismatch mode of
  :mod:`~tokenmdp.exact.world.engine_mismatch`: fixed, heavy-tailed or growing with the logits,
  keyed by the state's tokens as the rollout engine keys them; or the older ``noise_std``, a fixed
  Gaussian drawn from a generator), a sampling temperature — so ``mu != pi_old`` (discrepancy).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tokenmdp.exact.world.engine_mismatch import (
    DETERMINISTIC_MODES,
    EngineMismatch,
    apply_direction,
    check_mismatch,
    context_keys,
    key_step,
    mismatch_direction,
)
from tokenmdp.exact.world.ground_truth import gradient
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import PrefixPolicy, check_number, check_policy

__all__ = ["InferencePolicy", "check_fixed_mismatch", "inference_copy", "round_logits",
           "stale_copy"]

#: Largest finite magnitude of float8 e4m3fn.
FP8_E4M3_MAX = 448.0


def round_logits(logits: torch.Tensor, rounding: str | int | None) -> torch.Tensor:
    """Round float64 logits to a lower-precision grid and return them as float64.

    Parameters
    ----------
    logits : Tensor
        Float64 logits, any shape.
    rounding : {None, "bf16", "fp16", "fp8_e4m3"} or int
        A named format (round-to-nearest-even through that dtype; fp8 saturates at ±448), or an
        int ``b >= 1``: keep ``b`` mantissa bits (``m 2^e`` with ``m`` rounded to multiples of
        ``2^-b`` on ``[0.5, 1)``); None returns ``logits`` as they are.

    Returns
    -------
    Tensor
        Float64, the shape of ``logits``: each value replaced by its nearest grid value.
    """
    if rounding is None:
        return logits
    if isinstance(rounding, bool):
        raise TypeError("rounding: expected None, a format name or an int, got a bool")
    if isinstance(rounding, int):
        if rounding < 1:
            raise ValueError(f"rounding: bits must be >= 1, got {rounding}")
        mantissa, exponent = torch.frexp(logits)
        scale = float(2 ** rounding)
        return torch.ldexp(torch.round(mantissa * scale) / scale, exponent)
    if rounding == "bf16":
        return logits.to(torch.bfloat16).to(torch.float64)
    if rounding == "fp16":
        return logits.to(torch.float16).to(torch.float64)
    if rounding == "fp8_e4m3":
        return logits.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float64)
    raise ValueError(f"rounding: expected None, 'bf16', 'fp16', 'fp8_e4m3' or an int, got "
                     f"{rounding!r}")


class InferencePolicy(PrefixPolicy):
    """A frozen copy of a prefix policy seen through an inference engine's numerics.

    ``logits_mu(s) = (round(logits_pi(s) + noise(s)) + offset(s)) / temperature``, where
    ``noise(s)`` is drawn once per (state, token) from ``N(0, noise_std^2)`` and ``offset(s)`` is
    the ``mismatch`` mode's perturbation, a function of the state's tokens (its prompt, then its
    prefix) and the mode's seed, as :class:`tokenmdp.rl.RolloutEngine` computes it for the same
    tokens: so ``mu`` is a fixed policy, and a policy copied here and an engine with the same
    ``mismatch`` perturb every state alike.

    Parameters
    ----------
    base : PrefixPolicy
        The policy whose weights are copied (a snapshot: later updates of ``base`` do not leak in).
    rounding : see :func:`round_logits`
        The numeric mode: the engine's low-precision logits.
    noise_std : float
        Standard deviation of the fixed logit perturbation drawn from ``generator`` (the fixed
        mode, drawn rather than keyed; give it or ``mismatch``, not both).
    temperature : float
        Sampling temperature ``> 0``.
    generator : torch.Generator, optional
        Needed when ``noise_std > 0``.
    mismatch : EngineMismatch, optional
        An engine mismatch mode: ``"fixed"``, ``"heavy"`` or ``"growing"``
        (:mod:`~tokenmdp.exact.world.engine_mismatch`); ``"fresh"`` is refused, since it draws new
        noise at every visit and is no fixed policy. Added after the rounding, as the engine adds
        it to its own low-precision logits.
    """

    def __init__(self, base: PrefixPolicy, *, rounding: str | int | None = None,
                 noise_std: float = 0.0, temperature: float = 1.0,
                 generator: torch.Generator | None = None,
                 mismatch: EngineMismatch | None = None) -> None:
        if not isinstance(base, PrefixPolicy):
            raise TypeError(f"base: expected a PrefixPolicy, got {type(base).__name__}")
        super().__init__(base.mdp)
        noise_std = check_number("noise_std", noise_std)
        temperature = check_number("temperature", temperature, strict=True)
        self.mismatch = check_fixed_mismatch(mismatch)
        if noise_std > 0 and self.mismatch.active:
            raise ValueError("noise_std, mismatch: give one of them (noise_std is the fixed mode "
                             "drawn from a generator)")
        round_logits(torch.zeros(1, dtype=torch.float64), rounding)  # validate early
        self.base = copy.deepcopy(base).requires_grad_(False)
        self.rounding, self.temperature = rounding, float(temperature)
        noise = torch.zeros(self.mdp.num_states, self.mdp.vocab_size, dtype=torch.float64)
        if noise_std > 0:
            if not isinstance(generator, torch.Generator):
                raise TypeError("generator: a torch.Generator is required when noise_std > 0")
            noise = torch.randn(noise.shape, generator=generator, dtype=torch.float64) * noise_std
        self.register_buffer("noise", noise)
        direction = None
        if self.mismatch.active:
            direction = mismatch_direction(_state_keys(self.mdp, self.mismatch.seed),
                                           self.mdp.vocab_size, self.mismatch)
        self.register_buffer("mismatch_direction", direction)

    def _transform(self, logits: torch.Tensor, noise: torch.Tensor,
                   direction: torch.Tensor | None) -> torch.Tensor:
        logits = round_logits(logits + noise, self.rounding)
        if direction is not None:
            logits = apply_direction(logits, direction, self.mismatch)
        return logits / self.temperature

    def logits(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """``logits_mu``: the base policy's logits plus the fixed noise, rounded, over ``T``.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
            The prompt of each state.
        prefix : LongTensor ``[N, k]``
            The response tokens so far of each state (all at depth ``k``).

        Returns
        -------
        Tensor ``[N, V]``
            Float64 logits of ``mu``.
        """
        state = self.mdp.state_index(prompt_index, prefix)
        direction = None if self.mismatch_direction is None else self.mismatch_direction[state]
        return self._transform(self.base.logits(prompt_index, prefix), self.noise[state],
                               direction)

    def level_logits(self, k: int) -> torch.Tensor:
        """``logits_mu`` of every state at depth ``k``, from the base policy's level logits.

        Parameters
        ----------
        k : int
            The depth, ``0 <= k < L``.

        Returns
        -------
        Tensor ``[P * b^k, V]``
            Float64 logits of ``mu``, in global state order.
        """
        offs = self.mdp.level_offsets
        direction = (None if self.mismatch_direction is None
                     else self.mismatch_direction[offs[k]:offs[k + 1]])
        return self._transform(self.base.level_logits(k), self.noise[offs[k]:offs[k + 1]],
                               direction)


def check_fixed_mismatch(mismatch: EngineMismatch | None) -> EngineMismatch:
    """``mismatch`` checked for an exact world's engine copy: a fixed policy's mode or none.

    Parameters
    ----------
    mismatch : EngineMismatch or None
        The mode (None: none).

    Returns
    -------
    EngineMismatch
        The mode (``EngineMismatch()`` for None).

    Raises
    ------
    TypeError
        When it is not an ``EngineMismatch``.
    ValueError
        For ``"fresh"``: new noise at every visit is no fixed policy.
    """
    mismatch = check_mismatch(mismatch)
    if mismatch.active and mismatch.mode not in DETERMINISTIC_MODES:
        raise ValueError(f"mismatch: mode {mismatch.mode!r} draws new noise at every visit, so "
                         "mu is no fixed policy; the exact world takes "
                         f"{', '.join(DETERMINISTIC_MODES)}")
    return mismatch


def _state_keys(mdp: TokenMDP, seed: int) -> torch.Tensor:
    """The engine-mismatch keys ``[num_states]`` of every state's tokens (prompt, then prefix),
    in global state order."""
    prompt_keys = torch.cat([context_keys(torch.tensor([p]), seed) for p in mdp.prompts])
    keys = []
    for k in range(mdp.max_len):
        prompt_index, prefix = mdp.level_prefixes(k)
        level = prompt_keys[prompt_index]
        for j in range(k):
            level = key_step(level, prefix[:, j])
        keys.append(level)
    return torch.cat(keys)


def inference_copy(policy: PrefixPolicy, **kwargs) -> InferencePolicy:
    """``mu``: a frozen :class:`InferencePolicy` of ``policy`` (keyword arguments as there).

    Parameters
    ----------
    policy : PrefixPolicy
        The policy whose weights are copied.
    **kwargs
        ``rounding``, ``noise_std``, ``temperature``, ``generator``, ``mismatch`` of
        :class:`InferencePolicy`.

    Returns
    -------
    InferencePolicy
        The frozen copy; ``policy`` is unchanged.
    """
    return InferencePolicy(policy, **kwargs)


def stale_copy(mdp: TokenMDP, policy: nn.Module, *, direction: torch.Tensor | None = None,
               distance: float | None = None, steps: int | None = None,
               lr: float | None = None) -> nn.Module:
    """``pi_old``: a copy of ``policy`` with its parameters moved back.

    Give either ``distance`` (``theta_old = theta - distance * u / ||u||`` with ``u = direction``,
    by default ``∇J(theta)``, so ``pi_theta`` improves on ``pi_old``), or ``steps`` and ``lr``
    (``k`` exact gradient-descent steps on ``J`` from ``theta``, approximately undoing ``k``
    ascent steps: ``theta_old <- theta_old - lr ∇J(theta_old)``).

    Parameters
    ----------
    mdp : TokenMDP
        The MDP ``policy`` was built for (``∇J`` is computed on it).
    policy : nn.Module
        A float64 policy of ``mdp``.
    direction : Tensor, optional
        ``u``, of the shape of the flat parameter vector (default ``∇J(theta)``); with
        ``distance`` only.
    distance : float, optional
        ``||theta - theta_old|| >= 0`` (0 gives an identical copy).
    steps : int, optional
        The number ``k >= 0`` of gradient-descent steps.
    lr : float, optional
        Their learning rate ``> 0`` (required with ``steps``).

    Returns
    -------
    nn.Module
        A deep copy; ``policy`` is unchanged.
    """
    check_policy(mdp, policy)
    if (distance is None) == (steps is None):
        raise ValueError("distance, steps: give exactly one of them")
    old = copy.deepcopy(policy)
    theta = parameters_to_vector(old.parameters()).detach()
    if distance is not None:
        distance = check_number("distance", distance)
        u = gradient(mdp, old) if direction is None else torch.as_tensor(direction)
        if u.shape != theta.shape:
            raise ValueError(f"direction: expected shape {tuple(theta.shape)}, got "
                             f"{tuple(u.shape)}")
        norm = u.norm()
        if distance > 0 and not norm > 0:
            raise ValueError("direction: has zero norm")
        step = u / norm * distance if distance > 0 else torch.zeros_like(theta)
        vector_to_parameters(theta - step, old.parameters())
        return old
    if steps < 0:
        raise ValueError(f"steps: must be >= 0, got {steps}")
    if lr is None:
        raise ValueError("lr: a positive learning rate is required with steps")
    lr = check_number("lr", lr, strict=True)
    for _ in range(steps):
        g = gradient(mdp, old)
        theta = parameters_to_vector(old.parameters()).detach()
        vector_to_parameters(theta - lr * g, old.parameters())
    return old
