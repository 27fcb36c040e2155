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
from tokenmdp.rl.replay_bias import ReplayGradient, ReplayWorld, replay_gradients
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


def bias_grid(sigmas: Sequence[float], stalenesses: Sequence[float], estimator=None, *,
              known: Mapping[tuple, ReplayGradient] | None = None) -> dict[tuple, ReplayGradient]:
    """:func:`~tokenmdp.rl.replay_bias.replay_gradient` for every engine noise, staleness and
    replay, the targets that no replay changes computed once per point.

    At each ``(σ, s)`` the three replays share ``∇J`` of the freely routed policy, the engine's
    ``∇J(μ_θ)`` and the surrogate's gradient; each replay adds its own exact moments and (R2,
    R3) the gradient of its replayed policy. The entries equal ``replay_gradient``'s.

    Parameters
    ----------
    sigmas : sequence of float
        Router-score noises of ``fp64`` engines (selection only).
    stalenesses : sequence of float
        Distances of ``θ`` from ``θ_old`` along ``∇J(π_old)`` (0: the first mini-batch).
    estimator : Estimator, optional
        Default :func:`tr09_estimator`.
    known : mapping, optional
        ``(σ, s, replay) -> ReplayGradient`` already computed with this estimator (by
        ``replay_gradient`` on ``tr09_world(σ)``): taken as they are.

    Returns
    -------
    dict
        ``(σ, s, replay) -> ReplayGradient``.
    """
    estimator = tr09_estimator() if estimator is None else estimator
    known = {} if known is None else known
    out = {}
    for sigma in sigmas:
        world = tr09_world(sigma)
        for s in stalenesses:
            model = world.old if s == 0 else world.stale(s)
            todo = [replay for replay in REPLAYS if (sigma, s, replay) not in known]
            fresh = replay_gradients(world, model, estimator, todo) if todo else {}
            for replay in REPLAYS:
                out[sigma, s, replay] = (fresh[replay] if replay in fresh
                                         else known[sigma, s, replay])
    return out


def bias_figure(grid: Mapping[tuple, ReplayGradient]):
    """Two stacked panels: the relative bias of each replay against the trainer's ``∇J(π_θ)``
    (top) and against the engine's ``∇J(μ_θ)`` (bottom), over the staleness.

    Colour is the replay, line style the engine noise; the top panel carries one legend for
    each, so that the figure reads at a page's column width (7.5 in wide, fonts of 9 pt and
    more).

    Parameters
    ----------
    grid : mapping
        As :func:`bias_grid` returns it.

    Returns
    -------
    matplotlib.figure.Figure
        The figure.
    """
    from matplotlib.lines import Line2D

    sigmas = sorted({k[0] for k in grid})
    stalenesses = sorted({k[1] for k in grid})
    colors, styles = dict(zip(REPLAYS, ("0.35", "C0", "C3"))), dict(zip(sigmas, ("-", "--", ":")))
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 7.4), sharex=True, sharey=True)
    for ax, attr, target, who in zip(axes, ("relative_bias", "engine_bias"), ("π_θ", "μ_θ"),
                                     ("the trainer's", "the engine's")):
        for replay in REPLAYS:
            for sigma in sigmas:
                ax.plot(stalenesses, [getattr(grid[sigma, s, replay], attr) for s in stalenesses],
                        styles[sigma], marker="o", ms=3, color=colors[replay])
        finish(ax, title=f"E ĝ against {who} gradient ∇J({target})",
               xlabel="staleness ‖θ − θ_old‖" if ax is axes[-1] else "",
               ylabel=f"‖E ĝ − ∇J({target})‖ / ‖∇J({target})‖", legend=False)
    top = axes[0]
    noise = top.legend(handles=[Line2D([], [], color="0.5", ls=styles[s], label=f"σ = {s:g}")
                                for s in sigmas], title="engine noise", fontsize=9,
                       title_fontsize=9, loc="upper left")
    top.add_artist(noise)
    top.legend(handles=[Line2D([], [], color=colors[r], marker="o", ms=3, label=r)
                        for r in REPLAYS], title="replay", fontsize=9, title_fontsize=9,
               loc="lower right")
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
