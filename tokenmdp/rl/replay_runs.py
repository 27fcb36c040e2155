"""Short trainer-world runs on an enumerable MDP, with the exact ``J`` after every step.

:func:`mdp_training_run` is the trainer's RL step (:mod:`tokenmdp.rl.trainer`) with the task
replaced by a :class:`~tokenmdp.exact.TokenMDP`: the rollout engine
(:class:`~tokenmdp.rl.rollout.RolloutEngine`, its own precision and router-score noise) samples
``G`` responses for each prompt drawn from ``D``, the reward is the MDP's, the ``old_logprob`` pass
records or replays the routing (:func:`~tokenmdp.rl.mismatch.compute_old_logprobs`),
:func:`~tokenmdp.estimators.prepare` runs once on the step, and ``N`` mini-batch updates follow
(:func:`~tokenmdp.rl.update.split_minibatches`, :func:`~tokenmdp.rl.update.prepare_minibatch`,
:func:`~tokenmdp.rl.update.minibatch_loss`, AdamW). Because the world is enumerable, every step
also records the exact ``J`` of the model, the exact expected routing flip fraction between the
engine and the trainer and the exact ``KL(μ‖π_old)`` per token, beside the trainer's logged
(sampled) ``routing_mismatch`` and ``train_infer_kl_k3``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from tokenmdp import estimators
from tokenmdp.exact import TokenMDP, expected_length, objective, sequence_kl
from tokenmdp.model import MoETransformer
from tokenmdp.rl.mismatch import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    RoutingReplay,
    compute_old_logprobs,
    routing_mismatch_rate,
    training_inference_kl,
)
from tokenmdp.rl.replay_exact import (
    EnginePolicy,
    RoutedPolicy,
    enumeration_routing,
    expected_flip_fraction,
)
from tokenmdp.rl.rollout import RolloutEngine
from tokenmdp.rl.update import minibatch_loss, prepare_minibatch, split_minibatches

__all__ = ["RunTrace", "mdp_training_run"]


@dataclasses.dataclass(frozen=True)
class RunTrace:
    """What one :func:`mdp_training_run` recorded, one entry per step (``J`` has one more: the
    start).

    Parameters
    ----------
    J : list of float
        The exact ``J`` of the model before the first step and after every step.
    flip_fraction : list of float
        The exact expected share of (token, layer) records where the engine and the trainer's
        ``old_logprob`` pass (un-replayed) pick different experts, at each step's weights.
    train_infer_kl : list of float
        The exact ``KL(μ‖π_old)`` per token (``KL`` of responses over ``E_μ|y|``) that the
        ``old_logprob`` pass of this replay sees, at each step's weights.
    logged_mismatch : list of float
        The trainer's ``routing_mismatch`` of the step's sampled batch.
    logged_kl : list of float
        The trainer's ``train_infer_kl_k3`` of the step's sampled batch.
    engine_J : list of float
        The exact ``J`` of the engine's policy ``μ`` (synced to the model) before the first step
        and after every step: the objective of the policy that samples (and is served).
    """

    J: list
    flip_fraction: list
    train_infer_kl: list
    logged_mismatch: list
    logged_kl: list
    engine_J: list


def _rewards(mdp: TokenMDP, batch) -> torch.Tensor:
    table = {pair: float(r) for pair, r in zip(mdp.responses(), mdp.rewards)}
    return torch.tensor([table[tuple(x), tuple(y)] for x, y in batch.sequences()],
                        dtype=torch.float64)


def _exact_step_stats(mdp: TokenMDP, model: MoETransformer, engine: RolloutEngine,
                      replay: RoutingReplay) -> tuple[float, float]:
    mu = EnginePolicy(mdp, engine.model)
    engine_routing = enumeration_routing(mdp, engine.model)
    flips = expected_flip_fraction(mdp, engine_routing, enumeration_routing(mdp, model), mu)
    old = RoutedPolicy(mdp, model, engine_routing if replay is RoutingReplay.R3 else None)
    with torch.no_grad():
        kl = float(sequence_kl(mdp, mu, old) / expected_length(mdp, mu))
    return flips, kl


def mdp_training_run(mdp: TokenMDP, model: MoETransformer, estimator, *,
                     replay: RoutingReplay | str = "none", minibatches: int = 1, steps: int = 10,
                     prompts_per_step: int = 8, group_size: int = 2, lr: float = 1e-2,
                     precision: str = "fp32", selection_noise: float = 0.0,
                     engine_seed: int = 0, seed: int = 0) -> RunTrace:
    """Train a copy of ``model`` on ``mdp`` with the trainer's RL step; exact ``J`` every step.

    Parameters
    ----------
    mdp : TokenMDP
        The task: prompts from ``D``, rewards ``R(x, y)``, responses of at most ``max_len``.
    model : MoETransformer
        The float64 starting model (copied, never modified).
    estimator : Estimator or str
        The estimator (a registry name or a composition).
    replay : RoutingReplay or str, default "none"
        ``none``, ``r2`` or ``r3``.
    minibatches : int, default 1
        ``N`` optimizer updates per rollout (each its own step; updates 2..N are stale).
    steps : int, default 10
        Rollouts.
    prompts_per_step : int, default 8
        Prompts per rollout, each answered ``group_size`` times.
    group_size : int, default 2
        ``G``.
    lr : float, default 1e-2
        AdamW's learning rate.
    precision : str, default "fp32"
        The rollout engine's numerics: ``fp32``, ``bf16``, ``fp16`` or ``fp8`` (simulated).
    selection_noise : float, default 0.0
        The engine's router-score noise (selection only).
    engine_seed : int, default 0
        Seed of that noise (the same engine for every run with this seed).
    seed : int, default 0
        Seed of the prompts, the samples and the mini-batch shuffle.

    Returns
    -------
    RunTrace
        Exact ``J``, flip fraction and KL per step, and the trainer's logged values.
    """
    if not isinstance(mdp, TokenMDP):
        raise TypeError(f"mdp: expected a TokenMDP, got {type(mdp).__name__}")
    if not isinstance(model, MoETransformer) or model.embed.dtype != torch.float64:
        raise TypeError("model: expected a float64 MoETransformer")
    for name, value in (("minibatches", minibatches), ("steps", steps),
                        ("prompts_per_step", prompts_per_step), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if minibatches > prompts_per_step * group_size:
        raise ValueError(f"minibatches: {minibatches} exceeds the {prompts_per_step * group_size} "
                         "sequences of a step")
    replay = RoutingReplay(replay)
    est = estimators.get(estimator) if isinstance(estimator, str) else estimator
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    engine = RolloutEngine(model, precision=precision, selection_noise=selection_noise,
                           generator=torch.Generator().manual_seed(engine_seed))
    gen = torch.Generator().manual_seed(seed)
    shuffle = torch.Generator().manual_seed(seed + 1)
    capacity = max(len(p) for p in mdp.prompts) + mdp.max_len
    trace = RunTrace([float(objective(mdp, model).detach())], [], [], [], [], [])
    trace.engine_J.append(float(objective(mdp, EnginePolicy(mdp, engine.model))))
    for _ in range(steps):  # the engine holds the model's weights (synced at the end of each step)
        flips, kl = _exact_step_stats(mdp, model, engine, replay)
        trace.flip_fraction.append(flips)
        trace.train_infer_kl.append(kl)
        prompt_ids = torch.multinomial(mdp.prompt_probs, prompts_per_step, replacement=True,
                                       generator=gen).repeat_interleave(group_size)
        batch = engine.generate([mdp.prompts[i] for i in prompt_ids.tolist()],
                                max_new_tokens=mdp.max_len, eos_id=mdp.eos, generator=gen,
                                groups=torch.arange(prompts_per_step).repeat_interleave(group_size),
                                prompt_index=prompt_ids, dtype=torch.float64)
        batch = compute_old_logprobs(model, batch.replace(reward=_rewards(mdp, batch)), replay)
        trace.logged_mismatch.append(routing_mismatch_rate(batch.token_extras[ENGINE_ROUTING],
                                                           batch.token_extras[OLD_ROUTING]))
        trace.logged_kl.append(training_inference_kl(batch, kind="k3"))
        batch = estimators.prepare(batch, est, max_len=mdp.max_len)
        for part in split_minibatches(batch, minibatches, generator=shuffle, capacity=capacity):
            part = prepare_minibatch(part, est, max_len=mdp.max_len)
            optimizer.zero_grad(set_to_none=True)
            loss, _ = minibatch_loss(model, part, est, replay)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        trace.J.append(float(objective(mdp, model).detach()))
        engine.sync(model)
        trace.engine_J.append(float(objective(mdp, EnginePolicy(mdp, engine.model))))
    return trace
