"""The configuration of the tiny MoE transformer: one frozen dataclass, every field documented."""

from __future__ import annotations

import dataclasses

__all__ = ["ModelConfig"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder-only MoE transformer of :mod:`tokenmdp.model.transformer`.

    Raises ``TypeError`` / ``ValueError`` naming the field on a bad value.

    Parameters
    ----------
    vocab_size : int, default 32
        Number of token ids ``V`` (the output distribution is over all of them).
    d_model : int, default 32
        Width ``D`` of the residual stream.
    n_layers : int, default 2
        Number of transformer blocks (each: attention, then an MoE or dense MLP).
    n_heads : int, default 2
        Attention heads; ``d_model`` must be divisible by it and the head size must be even (RoPE).
    n_experts : int, default 4
        Experts ``E`` per MoE layer (ignored when ``dense``).
    top_k : int, default 2
        Experts ``K`` each token is routed to; gates are the softmax of their router scores.
    expert_hidden : int, default 32
        Hidden width of each expert's SwiGLU MLP (of the dense MLP when ``dense``).
    dense : bool, default False
        Use one dense SwiGLU MLP per block instead of experts (no router, empty routing traces).
    rope_base : float, default 10000.0
        Base ``b`` of the rotary frequencies ``b^{-2i/h}``.
    norm_eps : float, default 1e-6
        Epsilon of RMSNorm.
    init_std : float, default 0.02
        Standard deviation of the normal initialisation of every weight matrix.
    expert_capacity_factor : float or None, default None
        ``None``: dropless (the default). A number ``c``: each expert takes at most
        ``ceil(c N K / E)`` of the ``N`` real tokens of the forward pass, in row-major order, and
        drops the rest.
        Which tokens are dropped depends on the layout, so this exists only as the named
        counter-example to layout invariance.
    attention : str, default "auto"
        Attention of batch forward passes: ``"sdpa"`` (``scaled_dot_product_attention`` with a
        boolean mask), ``"flex"`` (FlexAttention with a document block mask; on the CPU eager, slow
        and forward-only) or ``"auto"`` (flex on CUDA, sdpa elsewhere). KV-cache decoding always
        uses sdpa.
    """

    vocab_size: int = 32
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 32
    dense: bool = False
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    expert_capacity_factor: float | None = None
    attention: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k",
                     "expert_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if not isinstance(self.dense, bool):
            raise TypeError(f"dense: expected a bool, got {type(self.dense).__name__}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"n_heads: d_model={self.d_model} must split into {self.n_heads} "
                             "heads of even size (RoPE rotates pairs)")
        if not self.dense and self.top_k > self.n_experts:
            raise ValueError(f"top_k: must be <= n_experts={self.n_experts}, got {self.top_k}")
        if self.attention not in ("auto", "sdpa", "flex"):
            raise ValueError(f"attention: expected 'auto', 'sdpa' or 'flex', got {self.attention!r}")
        c = self.expert_capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise ValueError(f"expert_capacity_factor: expected None or a positive number, got {c!r}")
        for name in ("rope_base", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")

    @property
    def head_size(self) -> int:
        """``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def routed_layers(self) -> int:
        """Number of layers with a router (``n_layers``, or 0 when ``dense``)."""
        return 0 if self.dense else self.n_layers
