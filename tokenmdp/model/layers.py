"""The transformer's layers: RMSNorm, rotary position embeddings, attention (SDPA with a boolean
mask on the CPU, FlexAttention on CUDA), and the pre-norm block with its MoE or dense MLP.

Not public API: :class:`tokenmdp.model.MoETransformer` composes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmdp.model.config import ModelConfig
from tokenmdp.model.moe import DenseMLP, MoE, _normal, float32_if_half


class RMSNorm(nn.Module):
    """``x / rms(x) * w``, computed in float32 at least (as inference engines do)."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = float32_if_half(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope_tables(position_RC: torch.Tensor, head_size: int, base: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[R, 1, C, d/2]`` of angle ``position * base^{-2i/d}`` (float64, then cast)."""
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64,
                                      device=position_RC.device) / head_size)
    angle_RCd = position_RC.to(torch.float64)[..., None] * inv_freq
    return angle_RCd.cos()[:, None].to(dtype), angle_RCd.sin()[:, None].to(dtype)


def apply_rope(x_RhCd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x_i, x_{i + d/2})`` by the position's angles."""
    x1, x2 = x_RhCd.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Multi-head attention with RoPE; with a cache it writes this call's keys and values at
    ``cache_cols_RC`` and attends over the whole cache."""

    def __init__(self, config: ModelConfig, *, generator: torch.Generator, device, dtype) -> None:
        super().__init__()
        D, std = config.d_model, config.init_std
        self.n_heads = config.n_heads
        self.w_qkv = _normal((D, 3 * D), std, generator, device, dtype)
        self.w_out = _normal((D, D), std, generator, device, dtype)

    def forward(self, x_RCD: torch.Tensor, cos, sin, mask_R1CT: torch.Tensor, *,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache_cols_RC: torch.Tensor | None = None) -> torch.Tensor:
        R, C, D = x_RCD.shape
        h = self.n_heads
        q, k, v = (x_RCD @ self.w_qkv).split(D, dim=-1)
        q, k, v = (t.view(R, C, h, D // h).transpose(1, 2) for t in (q, k, v))  # (R, h, C, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k_cache, v_cache = cache                                           # (R, h, T, d)
            rows_R1 = torch.arange(R, device=x_RCD.device)[:, None]
            k_cache[rows_R1, :, cache_cols_RC] = k.transpose(1, 2)             # (R, C, h, d)
            v_cache[rows_R1, :, cache_cols_RC] = v.transpose(1, 2)
            k, v = k_cache, v_cache
        if isinstance(mask_R1CT, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_R1CT)  # (R, h, C, d)
        else:  # a FlexAttention BlockMask (tokenmdp.model.flex)
            from tokenmdp.model.flex import flex_attention
            y = flex_attention(q, k, v, mask_R1CT)                             # (R, h, C, d)
        return y.transpose(1, 2).reshape(R, C, D) @ self.w_out                 # (R, C, D)


class Block(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))`` with an MoE or dense MLP."""

    def __init__(self, config: ModelConfig, *, generator: torch.Generator, device, dtype) -> None:
        super().__init__()
        std = config.init_std
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, device=device, dtype=dtype)
        self.attn = Attention(config, generator=generator, device=device, dtype=dtype)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, device=device, dtype=dtype)
        if config.dense:
            self.mlp: nn.Module = DenseMLP(config.d_model, config.expert_hidden, std=std,
                                           generator=generator, device=device, dtype=dtype)
        else:
            self.mlp = MoE(config.d_model, config.expert_hidden, config.n_experts, config.top_k,
                           std=std, generator=generator,
                           capacity_factor=config.expert_capacity_factor, device=device, dtype=dtype)

    def forward(self, x_RCD, cos, sin, mask_R1CT, valid_RC, replay_RCK, cache, cache_cols_RC,
                aux: bool = True):
        R, C, D = x_RCD.shape
        x_RCD = x_RCD + self.attn(self.attn_norm(x_RCD), cos, sin, mask_R1CT, cache=cache,
                                  cache_cols_RC=cache_cols_RC)
        h_ND = self.mlp_norm(x_RCD).reshape(R * C, D)                         # (R*C, D)
        if isinstance(self.mlp, DenseMLP):
            return x_RCD + self.mlp(h_ND).view(R, C, D), None, None
        # explicit K (not -1): an empty batch (R = 0) has no size to infer it from
        replay_NK = None if replay_RCK is None else replay_RCK.reshape(R * C,
                                                                       replay_RCK.shape[-1])
        y_ND, chosen_NK, lb = self.mlp(h_ND, valid_N=valid_RC.reshape(-1), replay_NK=replay_NK,
                                       aux=aux)
        return x_RCD + y_ND.view(R, C, D), chosen_NK.view(R, C, chosen_NK.shape[-1]), lb
