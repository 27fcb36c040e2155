"""Tiny model configurations shared by the model and rollout tests."""

import torch

from tokenmdp.model import ModelConfig, MoETransformer

TINY = ModelConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2, n_experts=4, top_k=2,
                   expert_hidden=16, init_std=0.3)


def make_model(config: ModelConfig = TINY, *, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> MoETransformer:
    return MoETransformer(config, generator=torch.Generator().manual_seed(seed), dtype=dtype)
