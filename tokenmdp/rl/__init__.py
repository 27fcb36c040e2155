"""The trainer world: tasks, the rollout engine, routing replay (R2, R3) and the trainer.

* :mod:`tokenmdp.rl.tasks` — a character tokenizer and verifiable tasks with held-out splits;
* :mod:`tokenmdp.rl.rollout` — :class:`RolloutEngine`: batched sampling with a KV cache in its
  own numerics (:mod:`tokenmdp.rl.engine_numerics`: its precisions, the numeric mismatch mode)
  and with an engine mismatch mode (:class:`tokenmdp.exact.EngineMismatch`), recording ``log μ``
  and the routing of every sampled token;
* :mod:`tokenmdp.rl.tree_rollout` — the engine's forks (``RolloutEngine.generate_tree``): one
  response tree per prompt, each shared prefix fed once and its KV cache replicated per branch,
  on the fork schedules of :mod:`tokenmdp.rl.tree_schedule` (fixed depths and branching,
  entropy-guided); :mod:`tokenmdp.rl.tree_step`, the trainer's step with trees
  (``--rollout-tree``: packed or expanded passes over them);
* :mod:`tokenmdp.rl.mismatch` — :class:`RoutingReplay` (R2, R3), the ``old_logprob`` pass that
  records or replays routing, and the training–inference KL and routing-mismatch metrics;
* :mod:`tokenmdp.rl.config` and :mod:`tokenmdp.rl.trainer` — :class:`TrainConfig` and
  :func:`train` (RL and SFT through the same loss), built from :mod:`tokenmdp.rl.run_setup`,
  :mod:`tokenmdp.rl.run_state` and :mod:`tokenmdp.rl.update` (one optimizer update: the
  training pass, mini-batch weights and split), with :mod:`tokenmdp.rl.checkpoint`,
  :mod:`tokenmdp.rl.run_folder` and :mod:`tokenmdp.rl.logger` for what a run writes;
* :mod:`tokenmdp.rl.options` and :mod:`tokenmdp.rl.cli_commands` — the ``tokenmdp sft`` /
  ``tokenmdp train`` commands generated from the config; :mod:`tokenmdp.rl.plot`, the curves;
* :mod:`tokenmdp.rl.replay_exact`, :mod:`tokenmdp.rl.replay_bias` and
  :mod:`tokenmdp.rl.replay_runs` — the MoE transformer as a policy of an enumerable MDP, so that
  routing replay's bias is exact.

The trainer modules are imported on use (``from tokenmdp.rl.trainer import train``).

Floors, top to bottom::

    cli_commands
    trainer
    run_state
    options, replay_bias, replay_runs, run_setup
    config, replay_exact
    plot, rollout, run_folder, tree_step, update
    step_stats, tree_rollout
    checkpoint, engine_numerics, logger, mismatch, tasks, tree_schedule

It imports the model, the estimators, the narrow waist and, for routing replay analysed exactly
(``replay_*``), the exact world; never a front end above it.
"""

from tokenmdp.rl.engine_numerics import PRECISIONS, simulate_fp4, simulate_fp8
from tokenmdp.rl.mismatch import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    RoutingReplay,
    compute_old_logprobs,
    replay_routing,
    routing_mismatch_counts,
    routing_mismatch_rate,
    training_inference_kl,
)
from tokenmdp.rl.rollout import RolloutEngine

__all__ = ["ENGINE_ROUTING", "OLD_ROUTING", "PRECISIONS", "RolloutEngine", "RoutingReplay",
           "compute_old_logprobs", "replay_routing", "routing_mismatch_counts",
           "routing_mismatch_rate", "simulate_fp4", "simulate_fp8",
           "training_inference_kl"]
