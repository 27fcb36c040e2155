"""The trainer world: tasks, the rollout engine, routing replay (R2, R3) and the trainer.

* :mod:`tokenmdp.rl.tasks` — a character tokenizer and verifiable tasks with held-out splits;
* :mod:`tokenmdp.rl.rollout` — :class:`RolloutEngine` (batched sampling with a KV cache in its own
  numerics), :class:`RoutingReplay` and the helpers that record and replay routing for training;
* :mod:`tokenmdp.rl.config` and :mod:`tokenmdp.rl.trainer` — :class:`TrainConfig` and
  :func:`train` (RL and SFT through the same loss); :mod:`tokenmdp.rl.update` — one optimizer
  update (the training pass, mini-batch weights and split); :mod:`tokenmdp.rl.cli_commands` — the
  ``tokenmdp sft`` / ``tokenmdp train`` commands generated from the config.

The trainer modules are imported on use (``from tokenmdp.rl.trainer import train``).
"""

from tokenmdp.rl.rollout import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    PRECISIONS,
    RolloutEngine,
    RoutingReplay,
    compute_old_logprobs,
    replay_routing,
    routing_mismatch_counts,
    routing_mismatch_rate,
    simulate_fp8,
    training_inference_kl,
)

__all__ = ["ENGINE_ROUTING", "OLD_ROUTING", "PRECISIONS", "RolloutEngine", "RoutingReplay",
           "compute_old_logprobs", "replay_routing", "routing_mismatch_counts",
           "routing_mismatch_rate", "simulate_fp8",
           "training_inference_kl"]
