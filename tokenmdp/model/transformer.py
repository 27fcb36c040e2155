"""A tiny decoder-only MoE transformer that implements the exact world's policy protocol.

Token embedding, RoPE with the positions the batch gives (they restart at 0 for every
sequence), RMSNorm, attention that is causal *and* restricted to the token's own sequence
(so sequences packed in one row never see each other), and MoE (or dense) SwiGLU MLPs.

The policy protocol (:mod:`tokenmdp.exact.world.policies`):

* ``token_logprobs(batch) -> [R, C]``: ``log pi(y_t | x, y_<t)`` of each response token, 0 on
  prompt tokens and padding; the token at column ``c`` is predicted by the output at ``c - 1``;
* ``next_token_logprobs(batch) -> [R, C, V]``: the full distribution each response token was
  drawn from, 0 elsewhere;
* ``token_outputs(batch, entropy=True)``: the log-probs, the routing, the load-balancing loss
  and the entropy ``[R, C]`` from one forward pass (:class:`TokenOutputs`; the trainer's passes).
* ``tree_token_outputs(...)``: the same over a packed tree (every node once, each token
  attending to its ancestors only; :mod:`tokenmdp.tree_packing` packs and gathers).

Routing: ``token_logprobs(batch, routing=trace, record_routing=True)`` replays a
:class:`RoutingTrace` (expert ids ``[R, C, layers, K]``, ``-1`` where a token has no record) and
returns the routing it used; each (token, layer) record holds ``K`` distinct expert ids in
``[0, E)`` or is all ``-1`` (no record). Traces are per-token data: put ``trace.experts`` in
``batch.token_extras`` and packing moves it with the tokens.

On the CPU attention is ``scaled_dot_product_attention`` with a boolean mask; on CUDA a
FlexAttention document mask (:mod:`tokenmdp.model.flex`, config ``attention``). Shape suffixes:
``R`` rows, ``C`` columns (queries), ``T`` key columns, ``D`` width, ``h`` heads, ``d`` head size,
``L`` routed layers, ``K`` experts per token, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.model.config import ModelConfig
from tokenmdp.model.layers import Block, RMSNorm, rope_tables
from tokenmdp.model.moe import _normal, float32_if_half
from tokenmdp.model.outputs import (
    SIGNED_INTS,
    KVCache,
    ModelOutput,
    RoutingTrace,
    TokenOutputs,
    sequence_attention_mask,
    tree_attention_mask,
)

__all__ = ["MoETransformer"]


class MoETransformer(nn.Module):
    """The trainer world's policy: a decoder-only MoE transformer over token batches.

    Parameters
    ----------
    config : ModelConfig
    generator : torch.Generator
        Source of the initial weights (drawn in float64 on the generator's device, then cast and
        moved: the same seed gives the same model in every dtype up to rounding).
    device, dtype
        Where and in which floating-point dtype the weights live (float64 for the exact world).
    """

    def __init__(self, config: ModelConfig, *, generator: torch.Generator, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
        self.config = config
        std = config.init_std
        V, D = config.vocab_size, config.d_model
        self.embed = _normal((V, D), std, generator, device, dtype)
        self.blocks = nn.ModuleList(Block(config, generator=generator, device=device, dtype=dtype)
                                    for _ in range(config.n_layers))
        self.final_norm = RMSNorm(D, config.norm_eps, device=device, dtype=dtype)
        self.lm_head = _normal((D, V), std, generator, device, dtype)

    # ------------------------------------------------------------------ core
    def forward_tokens(self, tokens_RC: torch.Tensor, position_RC: torch.Tensor,
                       mask_R1CT: torch.Tensor, valid_RC: torch.Tensor, *,
                       routing_RCLK: torch.Tensor | None = None, cache: KVCache | None = None,
                       cache_cols_RC: torch.Tensor | None = None, aux: bool = True
                       ) -> ModelOutput:
        """The forward pass on raw tensors (the batch API and the rollout engine both call it).

        ``mask_R1CT`` says which keys each query sees (``T = C`` without a cache, the cache
        capacity with one); ``routing_RCLK`` replays experts where its entries are ``>= 0``.
        ``aux=False`` skips the load-balancing loss (returned as 0; the rollout engine's case).
        Nothing is validated here (no host sync for checks in a decoding step): callers check
        their inputs.

        Parameters
        ----------
        tokens_RC : LongTensor ``[R, C]``
            Token ids (any id ``< V`` on padding).
        position_RC : LongTensor ``[R, C]``
            Position of each token in its sequence (the RoPE angle).
        mask_R1CT : BoolTensor ``[R, 1, C, T]`` or BlockMask
            Which keys each query sees (a FlexAttention ``BlockMask`` for flex attention).
        valid_RC : BoolTensor ``[R, C]``
            Real tokens (the MoE routes and balances only them).
        routing_RCLK : LongTensor ``[R, C, L, K]``, optional
            Experts to replay (``-1``: routed by the model).
        cache : KVCache, optional
            Keys and values of earlier columns; this call's are written into it.
        cache_cols_RC : LongTensor ``[R, C]``, optional
            Cache column of each token (with ``cache``).
        aux : bool, default True
            Compute the load-balancing loss.

        Returns
        -------
        ModelOutput
            Logits, the experts used (padding not yet set to ``-1``) and the load-balancing loss.
        """
        cfg = self.config
        x = self.embed[tokens_RC]                                              # (R, C, D)
        cos, sin = rope_tables(position_RC, cfg.head_size, cfg.rope_base, x.dtype)
        experts, balance = [], x.new_zeros((), dtype=torch.float32)
        for i, block in enumerate(self.blocks):
            replay = None if routing_RCLK is None or cfg.dense else routing_RCLK[:, :, i]
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, chosen_RCK, layer_balance = block(x, cos, sin, mask_R1CT, valid_RC, replay, kv,
                                                 cache_cols_RC, aux)
            if chosen_RCK is not None:
                experts.append(chosen_RCK)
                balance = balance + layer_balance
        logits = self.final_norm(x) @ self.lm_head                             # (R, C, V)
        R, C = tokens_RC.shape
        experts_RCLK = (torch.stack(experts, dim=2) if experts else
                        torch.zeros(R, C, 0, cfg.top_k, dtype=torch.long, device=tokens_RC.device))
        return ModelOutput(logits, experts_RCLK, balance)

    def forward(self, batch: TokenBatch, *, routing: RoutingTrace | torch.Tensor | None = None,
                aux: bool = True) -> ModelOutput:
        """Logits at every column of ``batch`` (each predicting the next token of its sequence),
        the routing used and (unless ``aux=False``) the load-balancing loss.

        Parameters
        ----------
        batch : TokenBatch
            Any layout; token ids must be ``< V``.
        routing : RoutingTrace or LongTensor ``[R, C, L, K]``, optional
            Experts to replay (as in :meth:`token_logprobs`); padding is never replayed.
        aux : bool, default True
            Compute the load-balancing loss (0 otherwise).

        Returns
        -------
        ModelOutput
            Logits ``[R, C, V]``, the experts used (``-1`` on padding) and the load-balancing
            loss.
        """
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
        valid_RC = batch.sequence_id >= 0
        routing_RCLK = self._replayed(routing, batch.tokens, valid_RC, "batch")
        if self._flex(batch.tokens):
            from tokenmdp.model.flex import document_block_mask
            mask = document_block_mask(batch.sequence_id)
        else:
            mask = sequence_attention_mask(batch.sequence_id)
        out = self.forward_tokens(batch.tokens, batch.position, mask, valid_RC,
                                  routing_RCLK=routing_RCLK, aux=aux)
        experts = torch.where(valid_RC[:, :, None, None], out.experts_RCLK, -1)
        return dataclasses.replace(out, experts_RCLK=experts)

    def _flex(self, tokens_RC: torch.Tensor) -> bool:
        """Whether batch passes use FlexAttention (config ``attention``)."""
        backend = self.config.attention
        return backend == "flex" or (backend == "auto" and tokens_RC.is_cuda)

    def _replayed(self, routing, tokens_RC: torch.Tensor, valid_RC: torch.Tensor,
                  what: str) -> torch.Tensor | None:
        """The routing to replay, checked (shape, ids), ``-1`` on padding; token ids checked."""
        routing_RCLK = None
        if routing is not None:
            routing_RCLK = routing.experts if isinstance(routing, RoutingTrace) else routing
            expected = (*tokens_RC.shape, self.config.routed_layers, self.config.top_k)
            if not isinstance(routing_RCLK, torch.Tensor) or tuple(routing_RCLK.shape) != expected:
                raise ValueError(f"routing: expected experts of shape {expected}, got "
                                 f"{getattr(routing_RCLK, 'shape', type(routing_RCLK).__name__)}")
            if routing_RCLK.dtype not in SIGNED_INTS:
                raise TypeError(f"routing: expected signed integer expert ids (-1 marks no "
                                f"record), got {routing_RCLK.dtype}")
        if tokens_RC.numel() and int(tokens_RC.max()) >= self.config.vocab_size:
            raise ValueError(f"{what}: token ids must be < vocab_size={self.config.vocab_size}")
        if routing_RCLK is not None:  # packing fills padding with 0: padding is never replayed
            routing_RCLK = torch.where(valid_RC[:, :, None, None], routing_RCLK.long(), -1)
            self._check_routing(routing_RCLK)
        return routing_RCLK

    def _check_routing(self, routing_RCLK: torch.Tensor) -> None:
        """Every (token, layer) record is ``K`` distinct ids in ``[0, E)`` or all ``-1``."""
        if not routing_RCLK.numel():
            return
        ids = routing_RCLK.sort(-1).values
        recorded = ids >= 0
        bad = (ids < -1) | (ids >= self.config.n_experts) | (recorded.any(-1, keepdim=True)
                                                             & ~recorded)
        bad[..., 1:] |= (ids[..., 1:] == ids[..., :-1]) & recorded[..., 1:]
        if bool(bad.any()):  # one host sync for all the checks
            raise ValueError(f"routing: every (token, layer) record must hold top_k="
                             f"{self.config.top_k} distinct expert ids in [0, n_experts="
                             f"{self.config.n_experts}) or be all -1 (no record)")

    # ------------------------------------------------------------------ policy protocol
    def _predicting_logprobs(self, batch: TokenBatch, routing, aux: bool = False
                             ) -> tuple[torch.Tensor, ModelOutput]:
        """``log pi(. | prefix)`` ``[R, C, V]`` for the token *at* each column (shifted by one),
        0 at sequence starts and padding. Half-precision logits are normalized in float32 (and
        the log-probs returned in float32), as the rollout engine does."""
        out = self.forward(batch, routing=routing, aux=aux)
        lp_RCV = torch.log_softmax(float32_if_half(out.logits_RCV), dim=-1)
        shifted = torch.zeros_like(lp_RCV)
        shifted[:, 1:] = lp_RCV[:, :-1]
        has_prefix_RC = (batch.sequence_id >= 0) & (batch.position > 0)
        if bool((batch.loss_mask & ~has_prefix_RC).any()):
            raise ValueError("batch: a loss token is the first token of its sequence; the model "
                             "needs a prompt of at least one token")
        return torch.where(has_prefix_RC[..., None], shifted, 0.0), out

    def token_logprobs(self, batch: TokenBatch, routing: RoutingTrace | torch.Tensor | None = None,
                       record_routing: bool = False):
        """``[R, C]`` ``log pi(y_t | x, y_<t)`` of each response token (0 elsewhere), and with
        ``record_routing`` the :class:`RoutingTrace` used (``-1`` on padding).

        Parameters
        ----------
        batch : TokenBatch
            Any layout; every loss token needs a prompt token before it.
        routing : RoutingTrace or LongTensor ``[R, C, L, K]``, optional
            Experts to replay: each (token, layer) record holds ``K`` distinct ids in
            ``[0, E)``, or is all ``-1`` (that token is routed by the model); anything else is a
            ``ValueError``.
        record_routing : bool
            Also return the routing used.

        Returns
        -------
        Tensor ``[R, C]`` or (Tensor ``[R, C]``, RoutingTrace)
            The log-probs (float32 for half-precision weights), with ``record_routing`` also the
            routing used.
        """
        out = self.token_outputs(batch, routing, aux=False)
        return (out.logprob_RC, out.routing) if record_routing else out.logprob_RC

    def token_outputs(self, batch: TokenBatch,
                      routing: RoutingTrace | torch.Tensor | None = None, *,
                      entropy: bool = False, aux: bool = True) -> TokenOutputs:
        """Everything a training pass reads from one forward pass: the log-probs of
        :meth:`token_logprobs`, the routing used, the summed load-balancing loss and, with
        ``entropy``, the entropy ``H_t = -sum_v pi(v | x, y_<t) log pi(v | x, y_<t)`` of the
        distribution each response token was drawn from (terms with ``pi(v) = 0`` count 0).
        ``aux=False`` skips the load-balancing loss (0), for passes that do not train.

        Parameters
        ----------
        batch : TokenBatch
            Any layout; every loss token needs a prompt token before it.
        routing : RoutingTrace or LongTensor ``[R, C, L, K]``, optional
            Experts to replay (as in :meth:`token_logprobs`).
        entropy : bool, default False
            Also compute the per-token entropy.
        aux : bool, default True
            Compute the load-balancing loss.

        Returns
        -------
        TokenOutputs
            Log-probs, routing, load-balancing loss and (with ``entropy``) entropy.
        """
        lp_RCV, out = self._predicting_logprobs(batch, routing, aux)
        lp_RC = lp_RCV.gather(-1, batch.tokens[..., None]).squeeze(-1) * batch.response_mask
        entropy_RC = None
        if entropy:
            plogp_RCV = torch.where(lp_RCV > -torch.inf, lp_RCV.exp() * lp_RCV, 0.0)
            entropy_RC = -plogp_RCV.sum(-1) * batch.response_mask
        return TokenOutputs(lp_RC, RoutingTrace(out.experts_RCLK), out.load_balancing_loss,
                            entropy_RC)

    def tree_token_outputs(self, tokens_RC: torch.Tensor, position_RC: torch.Tensor,
                           tree_end_RC: torch.Tensor, parent_RC: torch.Tensor,
                           valid_RC: torch.Tensor, *,
                           routing: RoutingTrace | torch.Tensor | None = None,
                           entropy: bool = False, aux: bool = True) -> TokenOutputs:
        """:meth:`token_outputs` on a packed tree (:func:`tokenmdp.tree_packing.pack_tree`):
        every slot attends to its ancestors and itself only, and its token's log-prob is read
        from its *parent's* output (the token before it on every path through it).

        The tensors are a :class:`~tokenmdp.tree_packing.PackedTree`'s (plain tensors: the
        model knows no packing). Gathered to the expanded batch, the log-probs and the routing
        are those of :meth:`token_outputs` on the expanded paths (up to summation order); the
        load-balancing loss counts each node once (the expanded pass counts it once per leaf).

        Parameters
        ----------
        tokens_RC, position_RC : LongTensor ``[R', C']``
            Each slot's token and position (the RoPE angle of its sequences).
        tree_end_RC : LongTensor ``[R', C']``
            One past the last column of each slot's subtree (:func:`tree_attention_mask`).
        parent_RC : LongTensor ``[R', C']``
            The column of each slot's parent, ``-1`` at roots and on padding.
        valid_RC : BoolTensor ``[R', C']``
            Slots holding a node (the MoE routes and balances only them).
        routing : RoutingTrace or LongTensor ``[R', C', L, K]``, optional
            Experts to replay per slot (as in :meth:`token_logprobs`).
        entropy : bool, default False
            Also compute the entropy of each slot's next-token distribution (read at its parent).
        aux : bool, default True
            Compute the load-balancing loss (0 otherwise).

        Returns
        -------
        TokenOutputs
            Per slot: ``log pi(token | ancestors)`` (0 at roots and on padding; prompt slots
            included: mask them after gathering), the routing used (``-1`` on padding), the
            load-balancing loss and (with ``entropy``) the entropy.
        """
        shape = tuple(tokens_RC.shape)
        for name, t in (("position_RC", position_RC), ("tree_end_RC", tree_end_RC),
                        ("parent_RC", parent_RC), ("valid_RC", valid_RC)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected a tensor of shape {shape} (tokens_RC's)")
        routing_RCLK = self._replayed(routing, tokens_RC, valid_RC, "tokens_RC")
        if self._flex(tokens_RC):
            from tokenmdp.model.flex import tree_block_mask
            mask = tree_block_mask(tree_end_RC)
        else:
            mask = tree_attention_mask(tree_end_RC)
        out = self.forward_tokens(tokens_RC, position_RC, mask, valid_RC,
                                  routing_RCLK=routing_RCLK, aux=aux)
        experts = torch.where(valid_RC[:, :, None, None], out.experts_RCLK, -1)
        has_parent_RC = valid_RC & (parent_RC >= 0)
        V = out.logits_RCV.shape[-1]
        at_parent = parent_RC.clamp(min=0)[..., None].expand(*shape, V)
        lp_RCV = torch.log_softmax(float32_if_half(out.logits_RCV).gather(1, at_parent), dim=-1)
        lp_RC = torch.where(has_parent_RC, lp_RCV.gather(-1, tokens_RC[..., None])[..., 0], 0.0)
        entropy_RC = None
        if entropy:
            plogp_RCV = torch.where(lp_RCV > -torch.inf, lp_RCV.exp() * lp_RCV, 0.0)
            entropy_RC = torch.where(has_parent_RC, -plogp_RCV.sum(-1), 0.0)
        return TokenOutputs(lp_RC, RoutingTrace(experts), out.load_balancing_loss, entropy_RC)

    def next_token_logprobs(self, batch: TokenBatch,
                            routing: RoutingTrace | torch.Tensor | None = None) -> torch.Tensor:
        """``[R, C, V]``: the distribution each response token was drawn from, 0 elsewhere.

        Parameters
        ----------
        batch : TokenBatch
            Any layout; every loss token needs a prompt token before it.
        routing : RoutingTrace or LongTensor ``[R, C, L, K]``, optional
            Experts to replay (as in :meth:`token_logprobs`).

        Returns
        -------
        Tensor ``[R, C, V]``
            ``log pi(v | x, y_<t)`` for every vocabulary token ``v`` at each response token.
        """
        lp_RCV, _ = self._predicting_logprobs(batch, routing)
        return lp_RCV * batch.response_mask[..., None]
