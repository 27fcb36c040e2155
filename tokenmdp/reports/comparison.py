"""The comparison behind ``tokenmdp compare``: one small MDP, one scenario, many estimators.

* :class:`Setup` — the MDP, policy and scenario as a frozen dataclass (the defaults are those of
  ``tokenmdp compare``);
* :class:`Lab` / :func:`build_lab` — the built MDP, ``π_θ``, ``π_old``, the sampler ``μ`` and the
  state-action Jacobian, shared by every estimator compared at this ``θ``;
* :func:`measure` / :func:`summary_row` — one estimator's exact (or Monte Carlo) moments and the
  row written to the table, CSV and JSON;
* :func:`rescaled_mse` — the best positive rescaling ``c*`` and the MSE after it;
* :func:`describe_scenario` and :data:`LEGEND` — the scenario and the columns in words.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from tokenmdp import estimators
from tokenmdp.exact import (
    LogLinearPolicy,
    Moments,
    MomentsWorkspace,
    NeuralPolicy,
    TabularPolicy,
    TokenMDP,
    inference_copy,
    moments,
    stale_copy,
)
from tokenmdp.exact.lab.step_gradients import state_action_jacobian
from tokenmdp.exact.world import rewards

__all__ = ["LEGEND", "Lab", "Setup", "build_lab", "build_mdp", "build_policy", "build_reward",
           "describe_scenario", "measure", "rescaled_mse", "summary_row", "timed_row"]

REWARDS = ("count", "exact", "contains", "parity", "length", "random")
SCENARIOS = ("on-policy", "stale", "discrepancy", "both")
POLICIES = ("tabular", "loglinear", "neural")
METHODS = ("auto", "exact", "monte_carlo")


MAX_SEED = 2 ** 63 - 2  # the largest seed: seed + 1 (the engine's noise) is still a generator's


@dataclasses.dataclass(frozen=True)
class Setup:
    """One comparison's MDP, policy and scenario (the defaults are ``tokenmdp compare``'s).

    Parameters
    ----------
    vocab : int, default 3
        Vocabulary size ``V`` (the last token is EOS).
    max_len : int, default 3
        Maximum response length ``L``.
    prompts : int, default 2
        Number of prompts ``(0,), (1,), ...``, drawn uniformly.
    reward : str, default "random"
        A built-in reward (:func:`build_reward`).
    policy : str, default "tabular"
        Policy class: tabular, loglinear or neural.
    seed : int, default 0
        Seed of the policy's initialization (``seed + 1`` draws μ's logit noise).
    scenario : str, default "both"
        on-policy; stale (π_old ≠ π_θ); discrepancy (μ ≠ π_old); both.
    stale_distance : float, default 0.5
        ``‖θ − θ_old‖`` along ``∇J`` in the stale scenarios.
    rounding : str, default "none"
        μ's logits rounded to none, bf16, fp16, fp8_e4m3 or a number of mantissa bits.
    noise : float, default 0.3
        Standard deviation of μ's fixed Gaussian logit perturbation.
    group_size : int, default 4
        Responses per prompt ``G`` (one prompt per batch).
    method : str, default "auto"
        auto, exact (enumeration or exchangeability) or monte_carlo.
    samples : int, default 4096
        Monte Carlo batches.
    """

    vocab: int = 3
    max_len: int = 3
    prompts: int = 2
    reward: str = "random"
    policy: str = "tabular"
    seed: int = 0
    scenario: str = "both"
    stale_distance: float = 0.5
    rounding: str = "none"
    noise: float = 0.3
    group_size: int = 4
    method: str = "auto"
    samples: int = 4096

    def __post_init__(self):
        for name, choices in (("reward", REWARDS), ("scenario", SCENARIOS),
                              ("policy", POLICIES), ("method", METHODS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}: expected one of {', '.join(choices)}, got "
                                 f"{getattr(self, name)!r}")
        if self.vocab >= 2 and not 1 <= self.prompts <= self.vocab - 1:
            raise ValueError(f"prompts: must be in [1, {self.vocab - 1}] (one token per prompt)")
        for name, low, high in (("group_size", 1, None), ("samples", 2, None),
                                ("seed", 0, MAX_SEED), ("stale_distance", 0, None),
                                ("noise", 0, None)):
            value = getattr(self, name)
            if value < low or (high is not None and value > high):
                raise ValueError(f"{name}: must be {f'in [{low}, {high}]' if high else f'>= {low}'}"
                                 f", got {value}")

    @property
    def stale(self) -> bool:
        """Whether ``π_old`` is a stale copy of ``π_θ``."""
        return self.scenario in ("stale", "both")

    @property
    def discrepant(self) -> bool:
        """Whether the sampler ``μ`` is ``π_old`` seen through other numerics."""
        return self.scenario in ("discrepancy", "both")


def build_reward(name: str, vocab_size: int):
    """A built-in reward by name (targets chosen from the vocabulary).

    Parameters
    ----------
    name : str
        One of count, exact, contains, parity, length or random.
    vocab_size : int
        Vocabulary size ``V`` of the MDP (the last token is EOS).

    Returns
    -------
    Reward
        The reward of :mod:`tokenmdp.exact.world.rewards`.
    """
    eos = vocab_size - 1
    table = {
        "count": lambda: rewards.TokenCount(0),
        "exact": lambda: rewards.ExactMatch((0, min(1, eos - 1), eos)),
        "contains": lambda: rewards.ContainsPattern((0, 0)),
        "parity": lambda: rewards.Parity(1),
        "length": lambda: rewards.LengthReward(-0.1, content=rewards.TokenCount(0)),
        "random": lambda: rewards.RandomTable(seed=0),
    }
    if name not in table:
        raise ValueError(f"reward: expected one of {', '.join(REWARDS)}, got {name!r}")
    return table[name]()


def build_policy(mdp: TokenMDP, kind: str, seed: int) -> nn.Module:
    """A ``tabular``, ``loglinear`` or ``neural`` policy initialized from ``seed``.

    Parameters
    ----------
    mdp : TokenMDP
        The MDP the policy acts in.
    kind : str
        tabular, loglinear or neural.
    seed : int
        Seed of the initialization.

    Returns
    -------
    nn.Module
        The policy (:mod:`tokenmdp.exact.world.policies`).
    """
    cls = {"tabular": TabularPolicy, "loglinear": LogLinearPolicy, "neural": NeuralPolicy}
    if kind not in cls:
        raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {kind!r}")
    return cls[kind](mdp, generator=torch.Generator().manual_seed(seed))


def _rounding(value: str):
    return None if value == "none" else (int(value) if value.isdigit() else value)


@dataclasses.dataclass(frozen=True)
class Lab:
    """The built objects of a :class:`Setup`, shared by every estimator compared.

    Parameters
    ----------
    setup : Setup
        The setup it was built from.
    mdp : TokenMDP
        The setup's MDP (:func:`build_mdp`).
    policy : nn.Module
        ``π_θ``, whose gradient ``∇J`` is estimated.
    old : nn.Module
        ``π_old``, the training engine at the rollout weights (the ratios' denominator).
    behavior : nn.Module
        ``μ``, the engine that sampled.
    jacobian : Tensor
        ``∇_θ log π(a|s)`` of ``π_θ`` for every state-action pair.
    workspace : MomentsWorkspace, optional
        The estimator-independent tables of the exact moments (log-probabilities, sampling
        probabilities, ``∇J``), built once and shared by every estimator measured; ``None``
        computes them afresh for each.
    """

    setup: Setup
    mdp: TokenMDP
    policy: nn.Module
    old: nn.Module
    behavior: nn.Module
    jacobian: torch.Tensor
    workspace: MomentsWorkspace | None = None


def build_mdp(setup: Setup) -> tuple[TokenMDP, nn.Module]:
    """The setup's MDP and its policy ``π_θ``.

    Parameters
    ----------
    setup : Setup
        Vocabulary, length, prompts, reward, policy class and seed.

    Returns
    -------
    (TokenMDP, nn.Module)
        The MDP and ``π_θ``.
    """
    mdp = TokenMDP(setup.vocab, setup.max_len, build_reward(setup.reward, setup.vocab),
                   prompts=[(i,) for i in range(setup.prompts)])
    return mdp, build_policy(mdp, setup.policy, setup.seed)


def build_lab(setup: Setup) -> Lab:
    """Build the MDP, ``π_θ``, ``π_old`` (stale copy), ``μ`` (inference copy) and the Jacobian.

    Parameters
    ----------
    setup : Setup
        The comparison to build.

    Returns
    -------
    Lab
        The built objects (``π_old = π_θ`` on-policy, ``μ = π_old`` without discrepancy).
    """
    mdp, policy = build_mdp(setup)
    old = stale_copy(mdp, policy, distance=setup.stale_distance) if setup.stale else policy
    behavior = old
    if setup.discrepant:
        behavior = inference_copy(old, rounding=_rounding(setup.rounding), noise_std=setup.noise,
                                  generator=torch.Generator().manual_seed(setup.seed + 1))
    jacobian = state_action_jacobian(mdp, policy)
    workspace = MomentsWorkspace(mdp, policy, behavior=behavior, old=old, reference=old,
                                 jacobian=jacobian)
    return Lab(setup, mdp, policy, old, behavior, jacobian, workspace)


def measure(lab: Lab, estimator: estimators.Estimator | Callable, *,
            behavior: nn.Module | None = None) -> Moments:
    """:func:`tokenmdp.exact.moments` of ``estimator`` in ``lab`` (``π_ref = π_old``).

    ``behavior`` replaces the lab's sampler ``μ`` (for counterfactuals such as "sampled from
    ``π_old``"); the Monte Carlo generator is seeded with the setup's seed.

    Parameters
    ----------
    lab : Lab
        The built comparison (group size, method and samples from its setup).
    estimator : Estimator or callable
        The estimator whose moments are computed, or a loss callable
        ``loss_fn(logprobs_RC, batch) -> scalar`` (see :func:`tokenmdp.exact.moments`).
    behavior : nn.Module, optional
        The sampler to use instead of ``lab.behavior``.

    Returns
    -------
    Moments
        Mean, total variance, bias and ``∇J`` of the estimator's gradient.
    """
    s = lab.setup
    options = dict(group_size=s.group_size, method=s.method, num_samples=s.samples,
                   generator=torch.Generator().manual_seed(s.seed))
    if behavior is None and lab.workspace is not None:     # the shared tables: bit for bit equal
        return lab.workspace.moments(estimator, **options)
    return moments(lab.mdp, lab.policy, estimator,
                   behavior=lab.behavior if behavior is None else behavior, old=lab.old,
                   reference=lab.old, jacobian=lab.jacobian, **options)


def rescaled_mse(m: Moments) -> tuple[float, float]:
    """The best positive rescaling of an estimator and its MSE after it.

    ``MSE(c) = E‖c ĝ − ∇J‖² = c² E‖ĝ‖² − 2c ⟨E ĝ, ∇J⟩ + ‖∇J‖²`` with ``E‖ĝ‖² = ‖E ĝ‖² + tr Cov ĝ``
    is minimized over ``c ≥ 0`` by ``c* = max(0, ⟨E ĝ, ∇J⟩ / E‖ĝ‖²)``. (``Moments.scale`` divides by
    ``‖E ĝ‖²`` instead: the rescaling that best matches the *mean*, ignoring the variance.)

    Parameters
    ----------
    m : Moments
        The estimator's moments (:func:`measure`).

    Returns
    -------
    (float, float)
        ``c*`` and ``MSE(c*)``; ``MSE(0) = ‖∇J‖²`` is "no step at all".
    """
    mean, g = m.mean, m.true_gradient
    second = float(mean @ mean) + m.total_variance
    dot, g2 = float(mean @ g), float(g @ g)
    c = max(0.0, dot / second) if second > 0 else 0.0
    return c, max(0.0, c * c * second - 2.0 * c * dot + g2)


def summary_row(name: str, m: Moments, seconds: float = 0.0) -> dict:
    """``m.summary()`` with ``c_star``, ``mse_c_star``, ``no_step_mse = ‖∇J‖²``, the method
    and the seconds it took: one row of the table, CSV and JSON.

    Parameters
    ----------
    name : str
        The estimator's name (the row's ``estimator``).
    m : Moments
        Its moments (:func:`measure`).
    seconds : float, default 0.0
        How long computing them took.

    Returns
    -------
    dict
        Column name → value (floats, and the strings ``estimator`` and ``method``).
    """
    c, mse_c = rescaled_mse(m)
    return {"estimator": name, **m.summary(), "c_star": c, "mse_c_star": mse_c,
            "no_step_mse": float(m.true_gradient @ m.true_gradient), "method": m.method,
            "seconds": seconds}


def timed_row(lab: Lab, estimator: str | estimators.Estimator) -> tuple[dict, Moments]:
    """:func:`summary_row` of ``estimator``, timed, and its moments.

    Parameters
    ----------
    lab : Lab
        The built comparison.
    estimator : str or Estimator
        A registry name (``tokenmdp estimators`` lists them) or a composed estimator (its name).

    Returns
    -------
    (dict, Moments)
        The row (with the seconds :func:`measure` took) and the moments.
    """
    t0 = time.perf_counter()
    est = estimators.get(estimator) if isinstance(estimator, str) else estimator
    m = measure(lab, est)
    return summary_row(est.name, m, time.perf_counter() - t0), m


def describe_scenario(setup: Setup) -> str:
    """The scenario in words: what ``π_old`` and the sampler ``μ`` are, and ``G``.

    Parameters
    ----------
    setup : Setup
        The comparison described.

    Returns
    -------
    str
        One sentence (``π_ref = π_old`` for KL penalties included).
    """
    if setup.stale:
        old = (f"π_old is a stale copy {setup.stale_distance:g} away from π_θ along ∇J "
               f"(θ_old = θ − {setup.stale_distance:g} ∇J/‖∇J‖)")
    else:
        old = "π_old = π_θ (fresh weights)"
    if setup.discrepant:
        parts = []
        if setup.noise > 0:
            parts.append(f"adds fixed logit noise of std {setup.noise:g}")
        if setup.rounding != "none":
            bits = setup.rounding.isdigit()
            parts.append(f"rounds the logits to {setup.rounding}{' mantissa bits' if bits else ''}")
        mu = ("the sampler μ " + " and ".join(parts) + " to π_old") if parts else \
             "the sampler μ = π_old (no noise, no rounding: no discrepancy)"
    else:
        mu = "the sampler μ = π_old"
    return (f"{old}; {mu}; G = {setup.group_size} responses per prompt, one prompt per batch, "
            f"π_ref = π_old for KL penalties.")


#: The columns of ``tokenmdp compare`` (and of an estimator card's reference row), in words.
LEGEND = (
    ("rel. bias", "‖E ĝ − ∇J‖ / ‖∇J‖, the bias of the expected gradient relative to ∇J"),
    ("cosine", "cos(E ĝ, ∇J): 1 means the expected step points along ∇J, < 0 downhill"),
    ("total var", "tr Cov ĝ = E‖ĝ − E ĝ‖², the spread of one batch's gradient"),
    ("MSE", "E‖ĝ − ∇J‖² = ‖bias‖² + total var, at the estimator's own scale"),
    ("c*", "max(0, ⟨E ĝ, ∇J⟩ / E‖ĝ‖²): the step-size factor that minimizes E‖c ĝ − ∇J‖²"),
    ("MSE(c*)", "E‖c* ĝ − ∇J‖², the MSE after the best rescaling (compare with ‖∇J‖²)"),
    ("method", "enumeration / exchangeability (exact) or monte_carlo (± one standard error)"),
    ("s", "seconds this row took"),
)
