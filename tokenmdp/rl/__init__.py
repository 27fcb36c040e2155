"""The trainer world's RL loop pieces: the rollout engine and routing replay (R2, R3).

* :mod:`tokenmdp.rl.rollout` — :class:`RolloutEngine` (batched sampling with a KV cache in its own
  numerics), :class:`RoutingReplay` and the helpers that record and replay routing for training.
"""

from tokenmdp.rl.rollout import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    PRECISIONS,
    RolloutEngine,
    RoutingReplay,
    compute_old_logprobs,
    replay_routing,
    routing_mismatch_rate,
    simulate_fp8,
    training_inference_kl,
)

__all__ = ["ENGINE_ROUTING", "OLD_ROUTING", "PRECISIONS", "RolloutEngine", "RoutingReplay",
           "compute_old_logprobs", "replay_routing", "routing_mismatch_rate", "simulate_fp8",
           "training_inference_kl"]
