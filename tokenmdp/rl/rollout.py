"""The rollout engine: the behaviour policy mu, in its own numerics, with a KV cache.

:class:`RolloutEngine` holds its own copy of the trainer's weights in its own precision (fp32,
bf16, fp16, or fp32 compute on fp8- or fp4-rounded weights, and fp8 activations;
:mod:`~tokenmdp.rl.engine_numerics`) and samples with a KV cache, so the
distribution it samples from, ``mu``, differs from the trainer's ``pi_old`` exactly as in
production. It records ``log mu`` of every sampled token and its routing trace
(``ENGINE_ROUTING``), which :mod:`~tokenmdp.rl.mismatch` replays under R3.

Beyond its precision (the numeric mode), an engine can perturb its next-token logits by an
engine mismatch mode (:class:`~tokenmdp.exact.EngineMismatch`, ``RolloutEngine(mismatch=...)``):
``"fixed"``, ``"heavy"`` and ``"growing"`` are functions of the context's tokens (keyed as
:mod:`tokenmdp.exact.world.engine_mismatch` keys them; the same in every call and batch layout,
so ``mu`` is a fixed policy), ``"fresh"`` draws new noise at every step (``logit_noise``, what
engines do not do).

The engine never routes the last sampled token (nothing is generated after it): its trace holds
``-1`` there, and a replaying forward pass routes that token by itself. The output at that token
predicts nothing inside the sequence, so no loss term depends on that choice.

Shape suffixes: ``B`` sequences being generated (one per row), ``T`` columns, ``V`` vocabulary,
``L`` routed layers, ``K`` experts per token.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.exact.world.engine_mismatch import (
    EngineMismatch,
    check_mismatch,
    key_start,
    key_step,
    perturb_logits,
)
from tokenmdp.model import KVCache, MoETransformer
from tokenmdp.rl.engine_numerics import PRECISIONS, engine_weight, round_activations
from tokenmdp.rl.mismatch import ENGINE_ROUTING
from tokenmdp.rl.tree_rollout import TreeRollout, generate_tree

__all__ = ["RolloutEngine"]


class RolloutEngine:
    """Batched sampling from a copy of the trainer's model in the engine's own numerics.

    Parameters
    ----------
    model : MoETransformer
        The trainer's model; its weights are copied (:meth:`sync`), never shared.
    precision : {"fp32", "bf16", "fp16", "fp8", "fp8_w8a8", "fp4"}
        Numerics of the engine's weights and compute (the numeric mode;
        :data:`~tokenmdp.rl.engine_numerics.PRECISIONS`).
    selection_noise : float
        Standard deviation of a per-layer, per-expert bias added to the router scores for the
        top-K *selection* only (gates unchanged): an engine that differs only in which experts it
        picks. 0 disables it.
    generator : torch.Generator, optional
        Source of the selection bias (required when ``selection_noise > 0``; any device).
    device : optional
        Device of the engine (default: the model's).
    logit_noise : float, default 0.0
        The older spelling of ``mismatch=EngineMismatch("fresh", logit_noise)``: standard
        deviation ``sigma`` of Gaussian noise added to every next-token logit before sampling
        (and before the temperature), drawn afresh at every decoding step from the sampling
        generator, so the same prefix gets other logits in another call — which real engines do
        not do (their logits are a function of the prefix). For small ``sigma`` the expected
        ``KL(mu || pi_old)`` of a token is about ``sigma^2 (1 - sum_v pi_v^2) / (2 T^2)`` at
        temperature ``T`` (second order in the perturbation; 0 where ``pi`` is one-hot). 0 (the
        default) draws nothing and samples exactly as without it.
    mismatch : EngineMismatch, optional
        The engine mismatch mode (:mod:`tokenmdp.exact.world.engine_mismatch`): ``"fixed"``,
        ``"heavy"`` or ``"growing"``, a function of the context's tokens (prompt and response so
        far) and the mode's seed, or ``"fresh"`` (as ``logit_noise``). Added to the logits in
        float32 after the engine's own numerics, before the temperature. Give it or
        ``logit_noise``, not both.
    """

    def __init__(self, model: MoETransformer, *, precision: str = "fp32",
                 selection_noise: float = 0.0, generator: torch.Generator | None = None,
                 device=None, logit_noise: float = 0.0,
                 mismatch: EngineMismatch | None = None) -> None:
        if not isinstance(model, MoETransformer):
            raise TypeError(f"model: expected a MoETransformer, got {type(model).__name__}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {sorted(PRECISIONS)}, got {precision!r}")
        if isinstance(selection_noise, bool) or not isinstance(selection_noise, (int, float)) \
                or not selection_noise >= 0:
            raise ValueError(f"selection_noise: expected a number >= 0, got {selection_noise!r}")
        if selection_noise > 0 and not isinstance(generator, torch.Generator):
            raise TypeError("generator: a torch.Generator is required when selection_noise > 0")
        if isinstance(logit_noise, bool) or not isinstance(logit_noise, (int, float)) \
                or not 0 <= logit_noise < float("inf"):
            raise ValueError(f"logit_noise: expected a finite number >= 0, got {logit_noise!r}")
        mismatch = check_mismatch(mismatch)
        if logit_noise > 0 and mismatch.active:
            raise ValueError("logit_noise, mismatch: give one of them (logit_noise=sigma is "
                             "mismatch=EngineMismatch('fresh', sigma))")
        self.mismatch = EngineMismatch("fresh", float(logit_noise)) if logit_noise > 0 \
            else mismatch
        self.logit_noise = self.mismatch.scale if self.mismatch.mode == "fresh" else 0.0
        self.precision = precision
        self.dtype = PRECISIONS[precision]
        self.device = model.embed.device if device is None else torch.device(device)
        self.model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        if precision == "fp8_w8a8":
            round_activations(self.model)
        if selection_noise > 0:
            for block in self.model.blocks:
                if hasattr(block.mlp, "selection_bias"):
                    bias = torch.randn(block.mlp.selection_bias.shape, generator=generator,
                                       dtype=torch.float64, device=generator.device) \
                        * selection_noise
                    block.mlp.selection_bias.copy_(bias.to(self.dtype))
        self.sync(model)

    @property
    def config(self):
        """The model's :class:`~tokenmdp.model.ModelConfig`."""
        return self.model.config

    @torch.no_grad()
    def sync(self, model: MoETransformer) -> None:
        """Copy the trainer's weights into the engine, cast to (and rounded in) its precision.

        Parameters
        ----------
        model : MoETransformer
            The trainer's model, of the engine's configuration (its parameters are read, never
            changed).
        """
        source = dict(model.named_parameters())
        for name, p in self.model.named_parameters():
            w = source[name].detach().to(device=self.device, dtype=self.dtype)
            p.copy_(engine_weight(w, self.precision))

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: int,
                 generator: torch.Generator, temperature: float = 1.0, use_cache: bool = True,
                 groups: Sequence[int] | torch.Tensor | None = None,
                 prompt_index: Sequence[int] | torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> TokenBatch:
        """Sample one response per prompt; stop at ``eos_id`` (kept) or ``max_new_tokens``.

        Parameters
        ----------
        prompts : sequences of token ids, each non-empty
            One prompt per sequence to generate.
        max_new_tokens : int
            Longest response; a response that reaches it without EOS is truncated.
        eos_id : int
            The token that ends a response (kept as its last token).
        generator : torch.Generator
            The only source of randomness (on the engine's device): the samples and, with
            ``"fresh"`` mismatch, the noise.
        temperature : float
            Logits are divided by it; ``behavior_logprob`` is the log-prob under that tempered
            (and, with a mismatch mode, perturbed) distribution: the one actually sampled from.
        use_cache : bool
            Decode with a KV cache (default) or recompute the whole prefix at every step.
        groups, prompt_index : optional, ``[S]``
            Stored in the batch (defaults: each sequence its own group; ``groups``).
        dtype : torch.dtype
            Dtype of the batch's float fields.

        Returns
        -------
        TokenBatch
            Padded, one sequence per row, with ``behavior_logprob`` and
            ``token_extras[ENGINE_ROUTING]`` ``[R, C, L, K]`` (``-1`` on padding and on the last
            token of every sequence, which is never routed).
        """
        self._check_generate(prompts, max_new_tokens, eos_id, generator, temperature)
        cfg, dev = self.model.config, self.device
        B = len(prompts)
        plen_B = torch.tensor([len(p) for p in prompts], device=dev)
        P, T = int(plen_B.max()), int(plen_B.max()) + max_new_tokens
        cols_T = torch.arange(T, device=dev)
        rows_B = torch.arange(B, device=dev)
        tokens_BT = torch.zeros(B, T, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            tokens_BT[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        routing_BTLK = torch.full((B, T, cfg.routed_layers, cfg.top_k), -1, dtype=torch.long,
                                  device=dev)
        logp_BT = torch.zeros(B, T, dtype=torch.float32, device=dev)
        length_B = plen_B.clone()
        done_B = torch.zeros(B, dtype=torch.bool, device=dev)
        cache = KVCache(cfg, B, T, device=dev, dtype=self.dtype) if use_cache else None

        # Prefill: every prompt token is fed (and routed) once.
        valid_BP = cols_T[:P] < plen_B[:, None]
        causal_PT = cols_T[None, :T if use_cache else P] <= cols_T[:P, None]
        out = self.model.forward_tokens(tokens_BT[:, :P], cols_T[:P].expand(B, P),
                                        causal_PT.expand(B, 1, P, -1), valid_BP, cache=cache,
                                        cache_cols_RC=cols_T[:P].expand(B, P), aux=False)
        routing_BTLK[:, :P] = torch.where(valid_BP[..., None, None], out.experts_RCLK, -1)
        next_logits_BV = out.logits_RCV[rows_B, plen_B - 1]
        keys_B = None   # the deterministic mismatch modes' key of each row's context
        if self.mismatch.deterministic:
            keys_B = key_start(self.mismatch.seed, B, device=dev)
            for c in range(P):
                keys_B = torch.where(c < plen_B, key_step(keys_B, tokens_BT[:, c]), keys_B)

        for step in range(max_new_tokens):
            # the engine mismatch mode: fresh noise per step, or a function of the context
            next_logits_BV = perturb_logits(next_logits_BV, self.mismatch, keys_N=keys_B,
                                            generator=generator)
            lp_BV = torch.log_softmax(next_logits_BV.float() / temperature, dim=-1)
            y_B = torch.multinomial(lp_BV.exp(), 1, generator=generator).squeeze(1)
            # written with torch.where, not boolean indexing: the writes need no host sync (a
            # step still syncs once per routed layer, in the MoE dispatch, and at the stop test)
            active_B = ~done_B
            at_B = length_B.clamp(max=T - 1)
            tokens_BT[rows_B, at_B] = torch.where(active_B, y_B, tokens_BT[rows_B, at_B])
            logp_BT[rows_B, at_B] = torch.where(active_B, lp_BV.gather(1, y_B[:, None])[:, 0],
                                                logp_BT[rows_B, at_B])
            length_B = length_B + active_B.long()
            done_B = done_B | (active_B & (y_B == eos_id))
            if keys_B is not None:
                keys_B = key_step(keys_B, y_B)
            if bool(done_B.all()) or step == max_new_tokens - 1:
                break  # the last sampled tokens are never fed, hence never routed
            # Feed the newest token of every row (finished rows too; their results are unused).
            col_B = length_B - 1
            if use_cache:
                mask_B11T = (cols_T[None, :] <= col_B[:, None])[:, None, None]
                out = self.model.forward_tokens(tokens_BT[rows_B, col_B][:, None], col_B[:, None],
                                                mask_B11T, ~done_B[:, None], cache=cache,
                                                cache_cols_RC=col_B[:, None], aux=False)
                experts_BLK, next_logits_BV = out.experts_RCLK[:, 0], out.logits_RCV[:, 0]
            else:
                n = int(length_B.max())
                causal_1nn = (cols_T[None, :n] <= cols_T[:n, None])[None, None]
                out = self.model.forward_tokens(tokens_BT[:, :n], cols_T[:n].expand(B, n),
                                                causal_1nn.expand(B, 1, n, n),
                                                cols_T[:n] < length_B[:, None], aux=False)
                experts_BLK, next_logits_BV = (out.experts_RCLK[rows_B, col_B],
                                               out.logits_RCV[rows_B, col_B])
            fed_B = ~done_B
            routing_BTLK[rows_B, col_B] = torch.where(fed_B[:, None, None], experts_BLK,
                                                      routing_BTLK[rows_B, col_B])
        return self._to_batch(tokens_BT, plen_B, length_B, logp_BT, routing_BTLK, groups,
                              prompt_index, dtype)

    def generate_tree(self, prompts: Sequence[Sequence[int]], schedule, *, max_new_tokens: int,
                      eos_id: int, generator: torch.Generator, temperature: float = 1.0,
                      **kwargs) -> TreeRollout:
        """Sample one response tree per prompt: a shared prefix generated once, then forked,
        every fork reusing its prefix's KV cache (:func:`~tokenmdp.rl.tree_rollout.generate_tree`:
        the schedules, ``groups``, ``prompt_index``, ``dtype`` and what it returns).

        Parameters
        ----------
        prompts : sequences of token ids, each non-empty
            One tree per prompt.
        schedule : FixedForks, EntropyForks or str
            E.g. ``"fixed:4x2,8x2"`` (fork into 2 after 4 and after 8 tokens: 4 leaves).
        max_new_tokens, eos_id, generator, temperature
            As :meth:`generate`.
        **kwargs
            ``groups``, ``prompt_index``, ``dtype`` (per tree).

        Returns
        -------
        TreeRollout
            The expanded batch (one sequence per leaf, ``token_extras["tree_node"]``), the trees,
            per-node entropies and the token counts.
        """
        return generate_tree(self, prompts, schedule, max_new_tokens=max_new_tokens,
                             eos_id=eos_id, generator=generator, temperature=temperature,
                             **kwargs)

    @torch.no_grad()
    def next_token_logprobs(self, batch: TokenBatch, *, temperature: float = 1.0,
                            generator: torch.Generator | None = None) -> torch.Tensor:
        """``log mu(. | context)`` ``[R, C, V]`` at every response token of ``batch``: the
        distribution the engine samples each token from, by one forward pass over the whole
        batch (any layout; 0 elsewhere).

        For the deterministic mismatch modes this is ``mu`` itself (the distributions
        :meth:`generate` sampled from, up to the engine's non-batch-invariant rounding; its own
        routing). For ``"fresh"`` each row is one new draw of the noise, distributed as the
        draw :meth:`generate` made (``generator`` required).

        Parameters
        ----------
        batch : TokenBatch
            Any layout; every loss token needs a prompt token before it.
        temperature : float, default 1.0
            The sampling temperature.
        generator : torch.Generator, optional
            Source of ``"fresh"``'s noise.

        Returns
        -------
        Tensor ``[R, C, V]``
            Float32 log-probs at the response tokens, 0 elsewhere.
        """
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not temperature > 0:
            raise ValueError(f"temperature: expected a number > 0, got {temperature!r}")
        batch = batch.to(self.device)
        lp_RCV = self.model.next_token_logprobs(batch).float()   # 0 off the response tokens
        R, C, V = lp_RCV.shape
        keys_RC = None
        if self.mismatch.deterministic:   # each token's context: its sequence's tokens before it
            keys_RC = torch.empty(R, C, dtype=torch.long, device=self.device)
            start_R = key_start(self.mismatch.seed, R, device=self.device)
            h_R = start_R
            for c in range(C):
                h_R = torch.where(batch.position[:, c] == 0, start_R, h_R)
                keys_RC[:, c] = h_R
                h_R = key_step(h_R, batch.tokens[:, c])
            keys_RC = keys_RC.reshape(-1)
        out = perturb_logits(lp_RCV.reshape(R * C, V), self.mismatch, keys_N=keys_RC,
                             generator=generator).reshape(R, C, V)
        out = torch.log_softmax(out.float() / temperature, dim=-1)
        return out * batch.response_mask[..., None]

    def _to_batch(self, tokens_BT, plen_B, length_B, logp_BT, routing_BTLK, groups, prompt_index,
                  dtype) -> TokenBatch:
        B, C = tokens_BT.shape[0], int(length_B.max())
        cols_C = torch.arange(C, device=self.device)
        real_BC = cols_C < length_B[:, None]
        response_BC = real_BC & (cols_C >= plen_B[:, None])
        seq_id = torch.where(real_BC, torch.arange(B, device=self.device)[:, None], -1)
        group = (torch.arange(B, device=self.device) if groups is None
                 else torch.as_tensor(groups, dtype=torch.long, device=self.device).clone())
        pidx = group.clone() if prompt_index is None else torch.as_tensor(
            prompt_index, dtype=torch.long, device=self.device).clone()
        ones = response_BC.to(dtype)
        routing = torch.where(real_BC[..., None, None], routing_BTLK[:, :C], -1)
        return TokenBatch(
            tokens=torch.where(real_BC, tokens_BT[:, :C], 0), sequence_id=seq_id,
            position=torch.where(real_BC, cols_C, 0), loss_mask=response_BC, advantage=ones,
            loss_weight=ones.clone(), reward=torch.zeros(B, dtype=dtype, device=self.device),
            group=group, length=length_B - plen_B, prompt_index=pidx,
            behavior_logprob=torch.where(response_BC, logp_BT[:, :C], 0.0).to(dtype),
            token_extras={ENGINE_ROUTING: routing})

    def _check_generate(self, prompts, max_new_tokens, eos_id, generator, temperature) -> None:
        V = self.model.config.vocab_size
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: expected a non-empty list of non-empty token sequences")
        if any(min(p) < 0 or max(p) >= V for p in prompts):
            raise ValueError(f"prompts: token ids must lie in [0, {V})")
        for name, value, low in (("max_new_tokens", max_new_tokens, 1), ("eos_id", eos_id, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")
        if eos_id >= V:
            raise ValueError(f"eos_id: must be < vocab_size={V}, got {eos_id}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != self.device.type or (
                self.device.index is not None and generator.device.index is not None
                and generator.device.index != self.device.index):
            raise ValueError(f"generator: lives on {generator.device.type} but the engine samples "
                             f"on {self.device}; pass torch.Generator(device={str(self.device)!r})")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not temperature > 0:
            raise ValueError(f"temperature: expected a number > 0, got {temperature!r}")
