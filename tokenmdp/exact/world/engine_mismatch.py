"""Engine mismatch modes: how an inference engine's next-token logits differ from the trainer's.

The rollout engine (:class:`tokenmdp.rl.RolloutEngine`) and the exact worlds' engine copies
(:func:`tokenmdp.exact.inference_copy`, :func:`tokenmdp.exact.lattice.inference_copy`) add the
same perturbation to the logits of the state they act at, before the temperature. An
:class:`EngineMismatch` names it:

* ``"fresh"`` — ``scale · ε`` with ``ε ~ N(0, I)`` drawn afresh at every decoding step: the same
  prefix gets other logits in another call. Kept for comparison (the trainer's
  ``rollout_logit_noise``); **real engines do not do this** — their logits are a function of the
  prefix (and of the batch's shape, for kernels that are not batch-invariant) — and ``μ`` is then
  no fixed policy: the recorded ``log μ`` is that of one draw. The exact worlds refuse it.
* ``"fixed"`` — ``scale · z(s, v)``, ``z`` a standard Gaussian that is a deterministic function of
  the context ``s`` (prompt and response tokens so far), the token ``v`` and ``seed``: the same at
  every visit, so ``μ`` is a fixed distribution per state;
* ``"heavy"`` — ``± scale`` on a share ``fraction`` of the (context, token) pairs (which ones, and
  the sign, deterministic as in ``"fixed"``), 0 elsewhere: rare large deviations, as a routing
  flip or a near-tie resolved the other way makes them;
* ``"growing"`` — ``scale · |ℓ_v − mean_v ℓ| · z(s, v)``: an error relative to the logit's size
  (centred, so adding a constant to the logits changes nothing, as for the softmax), as a
  low-precision format's error grows with the numbers it rounds. As training sharpens the
  policy the mismatch grows, so an uncorrected bias can feed it.

``fraction`` (default 1) thins ``"fixed"`` and ``"growing"`` the same way (only that share of the
pairs is perturbed). The engine's low-precision arithmetic — the **numeric** mode — is not one of
these: it is the engine's ``precision`` (``RolloutEngine(precision="fp8")``) and the copies'
``rounding``, and composes with any of them.

Determinism: a context's key is a chain of integer mixing steps (multiplications modulo the prime
``2^31 − 1``, with xor-shifts), one per token, from ``seed``; the draws of token ``v`` mix the key
with ``v``. Every product fits in an int64, so the keys are the same on every device and in every
batch layout. :func:`context_keys` keys whole contexts, :func:`key_start` and :func:`key_step`
extend keys token by token (the engine's decoding loop), :func:`mismatch_direction` gives the
per-(context, token) pattern and :func:`apply_direction` / :func:`perturb_logits` the logits.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["DETERMINISTIC_MODES", "MODES", "EngineMismatch", "apply_direction", "check_mismatch",
           "context_keys", "key_start", "key_step", "mismatch_direction", "perturb_logits"]

MODES = ("none", "fresh", "fixed", "heavy", "growing")
"""The engine-mismatch modes (module docstring)."""
DETERMINISTIC_MODES = ("fixed", "heavy", "growing")
"""The modes whose perturbation is a function of (context, token): ``μ`` is a fixed policy."""

_PRIME = 2 ** 31 - 1
"""The modulus of the key arithmetic (a Mersenne prime): keys lie in ``[0, 2^31)``."""
_MULTIPLIERS = (742938285, 950706376, 1226874159, 62089911)
"""Multipliers of the mixing rounds (L'Ecuyer 1999's for modulus ``2^31 − 1``)."""
_TOKEN_BASE = 1048583
"""Spreads a key before a token id (< 2^20) is added: ``key · base + token + 1 < 2^52``."""
_SALTS = (0x2545F491, 0x1B873593)
"""Xor'ed into a key for the Gaussian and the uniform streams of its tokens."""
MAX_TOKEN_ID = 2 ** 20
"""Token ids (and lattice coordinates) a key step accepts: ``[0, MAX_TOKEN_ID)``."""


@dataclasses.dataclass(frozen=True)
class EngineMismatch:
    """How an engine's logits differ from the trainer's (module docstring for the modes).

    Parameters
    ----------
    mode : {"none", "fresh", "fixed", "heavy", "growing"}, default "none"
        The kind of perturbation.
    scale : float, default 0.0
        Its size, a finite number ``>= 0``: the standard deviation of ``"fresh"`` and ``"fixed"``,
        the offset of ``"heavy"``, the relative standard deviation of ``"growing"``. 0 perturbs
        nothing (and draws nothing); ``"none"`` takes only 0.
    fraction : float, default 1.0
        Share ``(0, 1]`` of the (context, token) pairs perturbed (``"fixed"``, ``"heavy"``,
        ``"growing"``); ``"fresh"`` and ``"none"`` take only 1.
    seed : int, default 0
        Key of the deterministic modes' pattern, in ``[0, 2^31 − 1)``: two engines with the same
        mode, scale, fraction and seed perturb every context alike.

    Raises
    ------
    ValueError, TypeError
        Naming the field at fault.
    """

    mode: str = "none"
    scale: float = 0.0
    fraction: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("scale", "fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
            object.__setattr__(self, name, float(value))
        if not (math.isfinite(self.scale) and self.scale >= 0):
            raise ValueError(f"scale: expected a finite number >= 0, got {self.scale!r}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction: expected a number in (0, 1], got {self.fraction!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed: expected an int, got {type(self.seed).__name__}")
        if not 0 <= self.seed < _PRIME:
            raise ValueError(f"seed: expected an int in [0, 2^31 - 1), got {self.seed}")
        if self.mode == "none" and self.scale != 0:
            raise ValueError(f"scale: mode 'none' perturbs nothing; got scale {self.scale:g} "
                             "(choose a mode)")
        if self.mode in ("none", "fresh") and self.fraction != 1:
            raise ValueError(f"fraction: mode {self.mode!r} takes no fraction (only 1), got "
                             f"{self.fraction:g}")

    @property
    def active(self) -> bool:
        """Whether it perturbs anything (a mode other than none, ``scale > 0``)."""
        return self.mode != "none" and self.scale > 0

    @property
    def deterministic(self) -> bool:
        """Whether it is active and a function of (context, token): ``μ`` is a fixed policy."""
        return self.active and self.mode in DETERMINISTIC_MODES


def check_mismatch(mismatch, name: str = "mismatch") -> EngineMismatch:
    """``mismatch`` as an :class:`EngineMismatch` (None: the one that perturbs nothing).

    Parameters
    ----------
    mismatch : EngineMismatch or None
        The value to check.
    name : str, default "mismatch"
        The argument's name in the error.

    Returns
    -------
    EngineMismatch
        ``mismatch``, or ``EngineMismatch()`` for None.

    Raises
    ------
    TypeError
        For anything else (a mode's name included: build an ``EngineMismatch``).
    """
    if mismatch is None:
        return EngineMismatch()
    if not isinstance(mismatch, EngineMismatch):
        raise TypeError(f"{name}: expected an EngineMismatch or None, got "
                        f"{type(mismatch).__name__}")
    return mismatch


# ------------------------------------------------------------------------------ keys
def _mix(x: torch.Tensor) -> torch.Tensor:
    """Four rounds of ``x ← (x m + 1) mod (2^31 − 1); x ← x ^ (x >> 16)`` on int64 keys."""
    for m in _MULTIPLIERS:
        x = torch.remainder(x * m + 1, _PRIME)
        x = torch.bitwise_xor(x, torch.bitwise_right_shift(x, 16))
    return x


def _check_tokens(tokens: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (
            torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"{name}: expected an integer tensor, got "
                        f"{getattr(tokens, 'dtype', type(tokens).__name__)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= MAX_TOKEN_ID):
        raise ValueError(f"{name}: token ids must lie in [0, {MAX_TOKEN_ID})")
    return tokens.long()


def key_start(seed: int, n: int, *, device=None) -> torch.Tensor:
    """The keys ``[n]`` of ``n`` empty contexts under ``seed`` (int64, all equal).

    Parameters
    ----------
    seed : int
        The pattern's seed (``EngineMismatch.seed``).
    n : int
        How many.
    device : optional
        Their device.

    Returns
    -------
    LongTensor ``[n]``
    """
    return _mix(torch.full((n,), seed % _PRIME, dtype=torch.long, device=device))


def key_step(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The keys of the contexts ``keys`` extended by one token each (elementwise).

    Parameters
    ----------
    keys : LongTensor, any shape
        Keys of :func:`key_start` or earlier steps.
    tokens : integer tensor, the shape of ``keys``
        The appended token ids, in ``[0, 2^20)`` (not checked here: the engine's hot loop).

    Returns
    -------
    LongTensor
        The new keys.
    """
    return _mix(torch.remainder(keys * _TOKEN_BASE + tokens.long() + 1, _PRIME))


def context_keys(tokens_NK: torch.Tensor, seed: int) -> torch.Tensor:
    """The keys ``[N]`` of ``N`` contexts of ``K`` tokens each (:func:`key_step` from the start).

    Parameters
    ----------
    tokens_NK : integer tensor ``[N, K]``
        The contexts' token ids (prompt then response tokens), in ``[0, 2^20)``.
    seed : int
        The pattern's seed.

    Returns
    -------
    LongTensor ``[N]``
    """
    tokens_NK = _check_tokens(tokens_NK, "tokens_NK")
    if tokens_NK.dim() != 2:
        raise ValueError(f"tokens_NK: expected a 2-d tensor, got shape {tuple(tokens_NK.shape)}")
    keys = key_start(seed, tokens_NK.shape[0], device=tokens_NK.device)
    for j in range(tokens_NK.shape[1]):
        keys = key_step(keys, tokens_NK[:, j])
    return keys


def _uniforms(keys_N: torch.Tensor, vocab_size: int, salt: int) -> torch.Tensor:
    """Uniforms ``[N, V]`` in ``(0, 1)`` (float64), one per (context, token), from one stream."""
    v_V = torch.arange(vocab_size, device=keys_N.device)
    x = torch.bitwise_xor(keys_N, salt)[:, None] * _TOKEN_BASE + v_V + 1
    return (_mix(torch.remainder(x, _PRIME)).double() + 0.5) / 2.0 ** 31


# ------------------------------------------------------------------------------ perturbations
def mismatch_direction(keys_N: torch.Tensor, vocab_size: int,
                       mismatch: EngineMismatch) -> torch.Tensor:
    """The deterministic pattern ``d [N, V]`` (float64) of a mode at contexts keyed ``keys_N``.

    ``"fixed"`` and ``"growing"``: ``z · 1{u < fraction}``; ``"heavy"``: ``sign(z) · 1{u <
    fraction}``, with ``z`` standard Gaussian and ``u`` uniform, independent functions of (key,
    token). :func:`apply_direction` turns it into logits.

    Parameters
    ----------
    keys_N : LongTensor ``[N]``
        Context keys (:func:`context_keys`).
    vocab_size : int
        ``V``.
    mismatch : EngineMismatch
        A deterministic mode (:data:`DETERMINISTIC_MODES`).

    Returns
    -------
    Tensor ``[N, V]``
        Float64.
    """
    mismatch = check_mismatch(mismatch)
    if mismatch.mode not in DETERMINISTIC_MODES:
        raise ValueError(f"mismatch: mode {mismatch.mode!r} has no deterministic pattern; "
                         f"expected one of {', '.join(DETERMINISTIC_MODES)}")
    z = torch.special.ndtri(_uniforms(keys_N, vocab_size, _SALTS[0]))
    d = torch.sign(z) if mismatch.mode == "heavy" else z
    if mismatch.fraction < 1:
        d = torch.where(_uniforms(keys_N, vocab_size, _SALTS[1]) < mismatch.fraction, d, 0.0)
    return d


def apply_direction(logits: torch.Tensor, direction: torch.Tensor,
                    mismatch: EngineMismatch) -> torch.Tensor:
    """``logits`` perturbed by a deterministic mode's pattern (:func:`mismatch_direction`).

    ``"fixed"``, ``"heavy"``: ``ℓ + scale · d``; ``"growing"``: ``ℓ + scale · |ℓ − mean ℓ| · d``
    (mean over the last axis, over the finite entries; a non-finite logit stays as it is).

    Parameters
    ----------
    logits : Tensor ``[..., V]``
        Any floating dtype.
    direction : Tensor, broadcastable to ``logits``
        The pattern.
    mismatch : EngineMismatch
        The mode and scale.

    Returns
    -------
    Tensor
        In ``logits``' dtype (the perturbation is computed in float64).
    """
    mismatch = check_mismatch(mismatch)
    if not mismatch.active:
        return logits
    x = logits.double()
    offset = mismatch.scale * direction.double()
    if mismatch.mode == "growing":
        finite = torch.isfinite(x)
        mean = torch.where(finite, x, 0.0).sum(-1, keepdim=True) / finite.sum(
            -1, keepdim=True).clamp(min=1)
        offset = torch.where(finite, offset * (x - mean).abs(), 0.0)
    return (x + offset).to(logits.dtype)


def perturb_logits(logits_NV: torch.Tensor, mismatch: EngineMismatch | None, *,
                   keys_N: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """The engine's logits: ``logits_NV`` with the mode's perturbation (before the temperature).

    Parameters
    ----------
    logits_NV : Tensor ``[N, V]``
        The logits at ``N`` contexts.
    mismatch : EngineMismatch or None
        The mode (None or inactive: ``logits_NV`` itself).
    keys_N : LongTensor ``[N]``, optional
        The contexts' keys (:func:`context_keys`), needed by the deterministic modes.
    generator : torch.Generator, optional
        Source of ``"fresh"``'s draws (on ``logits_NV``'s device), needed by it.

    Returns
    -------
    Tensor ``[N, V]``
        ``"fresh"``: float32 ``logits + scale · ε`` (as the engine has always drawn it); the
        deterministic modes: in ``logits_NV``' dtype.
    """
    mismatch = check_mismatch(mismatch)
    if not mismatch.active:
        return logits_NV
    if mismatch.mode == "fresh":
        if not isinstance(generator, torch.Generator):
            raise TypeError("generator: a torch.Generator is required by mode 'fresh'")
        return logits_NV.float() + mismatch.scale * torch.randn(
            logits_NV.shape, generator=generator, device=logits_NV.device)
    if not isinstance(keys_N, torch.Tensor) or keys_N.shape != logits_NV.shape[:1]:
        raise ValueError(f"keys_N: mode {mismatch.mode!r} needs one context key per row "
                         f"({logits_NV.shape[0]}), got "
                         f"{getattr(keys_N, 'shape', type(keys_N).__name__)}")
    direction = mismatch_direction(keys_N, logits_NV.shape[-1], mismatch)
    return apply_direction(logits_NV, direction, mismatch)
