"""The trainer world's model: a tiny decoder-only Mixture-of-Experts transformer.

* :mod:`tokenmdp.model.config` — :class:`ModelConfig`, the documented shape of the model;
* :mod:`tokenmdp.model.moe` — top-K router with routing replay, the experts, the load-balancing loss;
* :mod:`tokenmdp.model.transformer` — :class:`MoETransformer` (the policy protocol of the exact
  world, plus routing record and replay) and :class:`RoutingTrace`.
"""

from tokenmdp.model.config import ModelConfig
from tokenmdp.model.moe import MoE, load_balancing_loss
from tokenmdp.model.transformer import (
    KVCache,
    ModelOutput,
    MoETransformer,
    RoutingTrace,
    TokenOutputs,
    sequence_attention_mask,
)

__all__ = ["ModelConfig", "MoE", "MoETransformer", "RoutingTrace", "TokenOutputs", "KVCache",
           "ModelOutput", "load_balancing_loss", "sequence_attention_mask"]
