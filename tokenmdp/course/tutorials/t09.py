"""Tutorial 9's worlds, tables and figures: routing replay on a tiny MoE policy, exactly.

* :func:`tr09_estimator` and :func:`tr09_world` — the notebook's estimator (leave-one-out
  advantage, token ratio, no correction) and its worlds (the copy task, a float64 MoE policy,
  an engine with router-score noise);
* :func:`engine_rows` — section 2's table: flip fraction and ``KL(μ‖π_old)`` with and without R3
  for each engine;
* :func:`sampled_engine_stats` — the same two numbers as the trainer logs them, from batches that
  the real :class:`~tokenmdp.rl.rollout.RolloutEngine` samples;
* :func:`bias_grid` and :func:`bias_figure` — section 5's exact bias of none / R2 / R3 against
  the trainer's and the engine's ``∇J`` as staleness and mismatch grow;
* :func:`run_rows` — section 6's trainer runs, summarized as mean ± standard error over seeds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import torch

from tokenmdp.course.display import finish
from tokenmdp.course.setups import copy_task
from tokenmdp.estimators import Aggregation, Estimator, LeaveOneOut, NoCorrection, TokenRatio
from tokenmdp.exact import expected_length, sequence_kl
from tokenmdp.rl.mismatch import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    compute_old_logprobs,
    routing_mismatch_counts,
    training_inference_kl,
)
from tokenmdp.rl.replay_bias import ReplayGradient, ReplayWorld, replay_gradient
from tokenmdp.rl.replay_exact import engine_model, moe_policy
from tokenmdp.rl.replay_runs import mdp_training_run
from tokenmdp.rl.rollout import RolloutEngine

__all__ = ["REPLAYS", "bias_figure", "bias_grid", "engine_rows", "run_rows",
           "sampled_engine_stats", "tr09_estimator", "tr09_world"]

#: The three routing modes, in the order of every table.
REPLAYS = ("none", "r2", "r3")
#: Seed of the notebook's MoE policy and of the engines' router-score noise.
POLICY_SEED, ENGINE_SEED = 0, 1


def tr09_estimator() -> Estimator:
    """RLOO with the token ratio and no train–inference correction (tutorial 7's ``rloo``).

    Returns
    -------
    Estimator
        ``−1/S Σ_i Σ_t (π_θ/π_old)_t (R_i − R_j) ...`` (token ratio, leave-one-out advantage,
        sequence mean of token sums); unbiased on ``π_old``'s own samples.
    """
    return Estimator(surrogate=TokenRatio(), advantage=LeaveOneOut(), correction=NoCorrection(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


def tr09_world(selection_noise: float = 1.0, precision: str = "fp64", *, top_k: int = 2):
    """The copy task, its float64 MoE policy ``π_old`` and one engine, as a :class:`ReplayWorld`.

    Parameters
    ----------
    selection_noise : float, default 1.0
        The engine's router-score noise (selection only).
    precision : str, default "fp64"
        The engine's numerics (:func:`~tokenmdp.rl.replay_exact.engine_model`).
    top_k : int, default 2
        Experts per token (of 4).

    Returns
    -------
    ReplayWorld
        Fresh on every call.
    """
    mdp, _ = copy_task()
    old = moe_policy(mdp, seed=POLICY_SEED, top_k=top_k)
    return ReplayWorld(mdp, old, engine_model(old, precision=precision,
                                              selection_noise=selection_noise, seed=ENGINE_SEED))


def engine_rows(engines: Mapping[str, dict]) -> list[tuple]:
    """For each engine: the exact flip fraction and ``KL(μ‖π_old)`` without replay and under R3,
    per response and per token (over ``E_μ|y|``).

    Parameters
    ----------
    engines : mapping of str to dict
        Name -> keyword arguments of :func:`tr09_world` (``selection_noise``, ``precision``).

    Returns
    -------
    list of tuple
        ``(name, flip fraction, KL none, KL R3, KL none per token, KL R3 per token)``.
    """
    rows = []
    for name, kw in engines.items():
        world = tr09_world(**kw)
        with torch.no_grad():
            kl = [float(sequence_kl(world.mdp, world.mu, world.old_policy(r))) for r in ("none", "r3")]
            length = float(expected_length(world.mdp, world.mu))
        rows.append((name, world.flip_fraction(), *kl, *(k / length for k in kl)))
    return rows


def sampled_engine_stats(world: ReplayWorld, *, precision: str, selection_noise: float,
                         batches: int = 8, batch_size: int = 256, seed: int = 0) -> dict:
    """The trainer's ``routing_mismatch`` and ``train_infer_kl_k3`` (no replay) on batches that the
    real rollout engine samples (KV cache, its own numerics), with standard errors over batches.

    Parameters
    ----------
    world : ReplayWorld
        ``π_old`` (the trainer's model) and the MDP.
    precision, selection_noise
        The engine (:class:`~tokenmdp.rl.rollout.RolloutEngine`, bias seed ``ENGINE_SEED``).
    batches, batch_size : int
        Number of sampled batches and responses per batch.
    seed : int
        Seed of the prompts and samples.

    Returns
    -------
    dict
        ``mismatch``, ``mismatch_se``, ``kl``, ``kl_se`` (per token).
    """
    mdp = world.mdp
    engine = RolloutEngine(world.old, precision=precision, selection_noise=selection_noise,
                           generator=torch.Generator().manual_seed(ENGINE_SEED))
    gen = torch.Generator().manual_seed(seed)
    mismatch, kl = [], []
    for _ in range(batches):
        ids = torch.multinomial(mdp.prompt_probs, batch_size, replacement=True, generator=gen)
        batch = engine.generate([mdp.prompts[i] for i in ids.tolist()], max_new_tokens=mdp.max_len,
                                eos_id=mdp.eos, generator=gen, prompt_index=ids, dtype=torch.float64)
        batch = compute_old_logprobs(world.old, batch, "none")
        differ, compared = routing_mismatch_counts(batch.token_extras[ENGINE_ROUTING],
                                                   batch.token_extras[OLD_ROUTING])
        mismatch.append(differ / compared)
        kl.append(training_inference_kl(batch, kind="k3"))
    out = {}
    for name, xs in (("mismatch", mismatch), ("kl", kl)):
        x = torch.tensor(xs, dtype=torch.float64)
        out[name], out[name + "_se"] = float(x.mean()), float(x.std() / math.sqrt(len(xs)))
    return out


def bias_grid(sigmas: Sequence[float], stalenesses: Sequence[float], estimator=None
              ) -> dict[tuple, ReplayGradient]:
    """:func:`~tokenmdp.rl.replay_bias.replay_gradient` for every engine noise, staleness and
    replay.

    Parameters
    ----------
    sigmas : sequence of float
        Router-score noises of ``fp64`` engines (selection only).
    stalenesses : sequence of float
        Distances of ``θ`` from ``θ_old`` along ``∇J(π_old)`` (0: the first mini-batch).
    estimator : Estimator, optional
        Default :func:`tr09_estimator`.

    Returns
    -------
    dict
        ``(σ, s, replay) -> ReplayGradient``.
    """
    estimator = tr09_estimator() if estimator is None else estimator
    out = {}
    for sigma in sigmas:
        world = tr09_world(sigma)
        for s in stalenesses:
            model = world.old if s == 0 else world.stale(s)
            for replay in REPLAYS:
                out[sigma, s, replay] = replay_gradient(world, model, estimator, replay)
    return out


def bias_figure(grid: Mapping[tuple, ReplayGradient]):
    """Two panels: the relative bias of each replay against the trainer's ``∇J(π_θ)`` and against
    the engine's ``∇J(μ_θ)``, over the staleness, one line style per engine noise.

    Parameters
    ----------
    grid : mapping
        As :func:`bias_grid` returns it.

    Returns
    -------
    matplotlib.figure.Figure
        The figure.
    """
    sigmas = sorted({k[0] for k in grid})
    stalenesses = sorted({k[1] for k in grid})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for ax, attr, target in zip(axes, ("relative_bias", "engine_bias"), ("π_θ", "μ_θ")):
        for replay, color in zip(REPLAYS, ("0.35", "C0", "C3")):
            for sigma, style in zip(sigmas, ("-", "--", ":")):
                ax.plot(stalenesses, [getattr(grid[sigma, s, replay], attr) for s in stalenesses],
                        style, marker="o", ms=3, color=color, label=f"{replay}, σ = {sigma:g}")
        finish(ax, title=f"E ĝ against ∇J({target})", xlabel="staleness ‖θ − θ_old‖",
               ylabel=f"‖E ĝ − ∇J({target})‖ / ‖∇J({target})‖", legend=ax is axes[0],
               legend_fontsize=7)
    fig.tight_layout()
    return fig


def run_rows(mdp, model, estimator, *, minibatches: Sequence[int], seeds: Sequence[int],
             **run_kw) -> tuple[list[tuple], dict]:
    """Trainer runs (:func:`~tokenmdp.rl.replay_runs.mdp_training_run`) for every ``N`` and
    replay, summarized over the seeds.

    Parameters
    ----------
    mdp, model, estimator
        As for :func:`~tokenmdp.rl.replay_runs.mdp_training_run`.
    minibatches : sequence of int
        The ``N`` values.
    seeds : sequence of int
        At least 2 seeds per configuration.
    **run_kw
        Passed on (steps, lr, engine settings).

    Returns
    -------
    (list of tuple, dict)
        Rows ``(N, replay, J, se, J_μ, se, J_μ − J, se, logged mismatch, exact flip fraction)``
        (final values, means over seeds; the mismatch columns averaged over steps too), and the
        traces by ``(N, replay)``.
    """
    if len(seeds) < 2:
        raise ValueError("seeds: need at least 2 for a standard error")
    rows, traces = [], {}
    for n in minibatches:
        for replay in REPLAYS:
            runs = [mdp_training_run(mdp, model, estimator, replay=replay, minibatches=n,
                                     seed=seed, **run_kw) for seed in seeds]
            traces[n, replay] = runs
            cols = []
            for xs in ([r.J[-1] for r in runs], [r.engine_J[-1] for r in runs],
                       [r.engine_J[-1] - r.J[-1] for r in runs]):
                x = torch.tensor(xs, dtype=torch.float64)
                cols += [float(x.mean()), float(x.std() / math.sqrt(len(xs)))]
            logged = sum(sum(r.logged_mismatch) / len(r.logged_mismatch) for r in runs) / len(runs)
            exact = sum(sum(r.flip_fraction) / len(r.flip_fraction) for r in runs) / len(runs)
            rows.append((n, replay, *cols, logged, exact))
    return rows, traces
