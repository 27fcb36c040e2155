"""The trainer world's model: a tiny decoder-only Mixture-of-Experts transformer.

* :mod:`tokenmdp.model.config` — :class:`ModelConfig`, the documented shape of the model;
* :mod:`tokenmdp.model.moe` — top-K router with routing replay, the experts, the load-balancing loss;
* :mod:`tokenmdp.model.transformer` — :class:`MoETransformer` (the policy protocol of the exact
  world, plus routing record and replay, and the pass over a packed tree with its ancestor mask,
  :func:`tree_attention_mask`) and :class:`RoutingTrace`.

Floors, top to bottom::

    transformer
    layers, outputs
    config, flex, moe

It imports :mod:`tokenmdp.batch` only; it never imports the estimators, the exact world or the
trainer.
"""

from tokenmdp.model.config import ModelConfig
from tokenmdp.model.moe import MoE, load_balancing_loss
from tokenmdp.model.outputs import (
    KVCache,
    ModelOutput,
    RoutingTrace,
    TokenOutputs,
    sequence_attention_mask,
    tree_attention_mask,
)
from tokenmdp.model.transformer import MoETransformer

__all__ = ["ModelConfig", "MoE", "MoETransformer", "RoutingTrace", "TokenOutputs", "KVCache",
           "ModelOutput", "load_balancing_loss", "sequence_attention_mask", "tree_attention_mask"]
