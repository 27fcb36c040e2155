"""Routing replay, exactly: the MoE transformer as the policy of an enumerable token MDP, evaluated
under a fixed routing.

The trainer's :class:`~tokenmdp.model.MoETransformer` implements the exact world's policy protocol,
so on a tiny :class:`~tokenmdp.exact.TokenMDP` everything about routing replay can be computed
exactly (float64, every response enumerated):

* :func:`moe_policy` — a small float64 MoE policy of an MDP (top-2 of 4 experts by default);
* :func:`engine_model` — the rollout engine's copy of it (its precision, its router-score noise;
  ``"fp64"``: float64 compute, only the expert *selection* differs);
* :func:`enumeration_routing` — the routing a model uses on every enumerated response
  (``[R, C, L, K]``, aligned with :meth:`TokenMDP.enumerate`);
* :class:`RoutedPolicy` — a float64 model with its routing fixed to a trace (or free), as a prefix
  policy: ``J``, ``∇J``, KLs and the exact :func:`~tokenmdp.exact.moments` of any estimator apply;
* :class:`EnginePolicy` — the behaviour policy ``μ`` of an engine in any numerics, tabulated in
  float64 (no parameters);
* :func:`expected_flip_fraction` — the exact share of (token, layer) records two routings disagree
  on, in responses sampled by a policy (the trainer's ``routing_mismatch``, large-batch limit).

:mod:`tokenmdp.rl.replay_bias` builds on these: ``π_old``, the engine and both records in one
world, R2 and R3 as one-line swaps, and the exact bias of each replay.

A policy under a fixed routing is a policy of *states*: the distribution at state ``s`` (prompt and
response prefix) is read from the one enumerated response ``s + EOS``, and the routing it uses is
that row's record of the prefix tokens. Routing records of a deterministic model are a function of
the prefix, so every row that shares a prefix holds the same record.

Replay substitutes the expert *selection* and keeps the gates' softmax over the current router
scores (:mod:`tokenmdp.model.moe`): with ``K >= 2`` the router keeps a gradient, with ``K = 1``
none.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tokenmdp.exact import TokenMDP, sequence_probs
from tokenmdp.exact.world.policies import PrefixPolicy
from tokenmdp.model import ModelConfig, MoETransformer, RoutingTrace
from tokenmdp.rl.engine_numerics import PRECISIONS
from tokenmdp.rl.mismatch import routing_mismatch_counts
from tokenmdp.rl.rollout import RolloutEngine

__all__ = ["EnginePolicy", "RoutedPolicy", "engine_model", "enumeration_routing",
           "expected_flip_fraction", "moe_policy"]

#: Engine precisions: the rollout engine's (:data:`~tokenmdp.rl.rollout.PRECISIONS`) and ``fp64``.
ENGINE_PRECISIONS = ("fp64", *PRECISIONS)


def moe_policy(mdp: TokenMDP, *, seed: int = 0, d_model: int = 8, n_layers: int = 2,
               n_heads: int = 2, n_experts: int = 4, top_k: int = 2, expert_hidden: int = 8,
               init_std: float = 0.3) -> MoETransformer:
    """A small float64 :class:`~tokenmdp.model.MoETransformer` over ``mdp``'s vocabulary.

    Parameters
    ----------
    mdp : TokenMDP
        The MDP (the model's vocabulary is ``mdp.vocab_size``).
    seed : int, default 0
        Seed of the initial weights.
    d_model, n_layers, n_heads, n_experts, top_k, expert_hidden : int
        The shape (:class:`~tokenmdp.model.ModelConfig`); top-2 of 4 experts by default.
    init_std : float, default 0.3
        Standard deviation of the initial weights (0.3 gives router scores of order 1, so some
        routing decisions are close and flip under small perturbations).

    Returns
    -------
    MoETransformer
        Float64, on the CPU, with ``model.mdp = mdp``.
    """
    if not isinstance(mdp, TokenMDP):
        raise TypeError(f"mdp: expected a TokenMDP, got {type(mdp).__name__}")
    cfg = ModelConfig(vocab_size=mdp.vocab_size, d_model=d_model, n_layers=n_layers,
                      n_heads=n_heads, n_experts=n_experts, top_k=top_k,
                      expert_hidden=expert_hidden, init_std=init_std, attention="sdpa")
    model = MoETransformer(cfg, generator=torch.Generator().manual_seed(seed),
                           dtype=torch.float64)
    model.mdp = mdp
    return model


def engine_model(model: MoETransformer, *, precision: str = "fp64", selection_noise: float = 0.0,
                 seed: int = 0) -> MoETransformer:
    """The rollout engine's copy of ``model``: its numerics and its router-score noise.

    For ``fp32``, ``bf16``, ``fp16``, ``fp8``, ``fp8_w8a8`` and ``fp4`` it is the model of a
    :class:`~tokenmdp.rl.rollout.RolloutEngine` (weights cast, fp8 rounded, compute in that
    dtype). ``fp64`` is a float64 copy with the same engine's selection bias: the engines then
    differ only in which experts they select.

    Parameters
    ----------
    model : MoETransformer
        The trainer's model at the rollout weights (not modified).
    precision : {"fp64", "fp32", "bf16", "fp16", "fp8", "fp8_w8a8", "fp4"}, default "fp64"
        The engine's numerics.
    selection_noise : float, default 0.0
        Standard deviation of the per-layer, per-expert bias added to the router scores for the
        top-K selection only (:class:`~tokenmdp.rl.rollout.RolloutEngine`).
    seed : int, default 0
        Seed of that bias.

    Returns
    -------
    MoETransformer
        A new model without gradients (``eval`` mode), ``mdp`` carried over when ``model`` has one.
    """
    if not isinstance(model, MoETransformer):
        raise TypeError(f"model: expected a MoETransformer, got {type(model).__name__}")
    if precision not in ENGINE_PRECISIONS:
        raise ValueError(f"precision: expected one of {list(ENGINE_PRECISIONS)}, got {precision!r}")
    engine = RolloutEngine(model, precision="fp32" if precision == "fp64" else precision,
                           selection_noise=selection_noise,
                           generator=torch.Generator().manual_seed(seed))
    if precision != "fp64":
        out = engine.model
    else:  # the engine's own bias draw, in a float64 copy of the weights
        out = copy.deepcopy(model).eval().requires_grad_(False)
        for mine, theirs in zip(out.blocks, engine.model.blocks):
            if hasattr(mine.mlp, "selection_bias"):
                mine.mlp.selection_bias.copy_(theirs.mlp.selection_bias.double())
    if getattr(model, "mdp", None) is not None:
        out.mdp = model.mdp
    return out


def enumeration_routing(mdp: TokenMDP, model: MoETransformer,
                        routing: torch.Tensor | None = None) -> torch.Tensor:
    """The routing ``model`` uses on :meth:`TokenMDP.enumerate` (``-1`` on padding).

    Parameters
    ----------
    mdp : TokenMDP
        The MDP whose responses are enumerated.
    model : MoETransformer
        Any dtype (an engine's model too).
    routing : LongTensor ``[R, C, L, K]``, optional
        A trace to replay (the result then equals it wherever it has records).

    Returns
    -------
    LongTensor ``[R, C, L, K]``
        The experts of every (token, layer), aligned with the enumeration.
    """
    with torch.no_grad():
        _, trace = model.token_logprobs(mdp.enumerate(), routing, record_routing=True)
    return trace.experts


def _eos_positions(mdp: TokenMDP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` ``[num_states]`` of the EOS token of ``s + EOS`` for every state ``s``, in
    state-id order: where the enumeration reads the distribution at ``s``."""
    enum = mdp.enumerate()
    state_RC = mdp.token_state_index(enum)
    at_eos = (enum.tokens == mdp.eos) & (state_RC >= 0)
    rows, cols = at_eos.nonzero(as_tuple=True)
    order = torch.argsort(state_RC[rows, cols])
    if order.numel() != mdp.num_states:
        raise RuntimeError("the enumeration does not end every state with EOS exactly once")
    return rows[order], cols[order]


def _check_routing(mdp: TokenMDP, model: MoETransformer, routing) -> torch.Tensor | None:
    if routing is None:
        return None
    experts = routing.experts if isinstance(routing, RoutingTrace) else routing
    shape = (mdp.num_sequences, mdp.enumerate().tokens.shape[1], model.config.routed_layers,
             model.config.top_k)
    if not isinstance(experts, torch.Tensor) or tuple(experts.shape) != shape:
        raise ValueError(f"routing: expected a trace of shape {shape} aligned with "
                         f"mdp.enumerate(), got {getattr(experts, 'shape', type(experts).__name__)}")
    return experts


# The policy protocol's reads of a policy tabulated as log-probs over every state (its
# ``_table()``, ``[num_states, V]``): RoutedPolicy and EnginePolicy share them.
def _tabulated_logits(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[N, V]`` at the given states (they are their own logits).

    Parameters
    ----------
    prompt_index : LongTensor ``[N]``
        The prompt of each state.
    prefix : LongTensor ``[N, k]``
        The response tokens so far of each state.

    Returns
    -------
    Tensor ``[N, V]``
        Float64 log-probs.
    """
    return self._table()[self.mdp.state_index(prompt_index, prefix)]

def _tabulated_level_logits(self, k: int) -> torch.Tensor:
    """Log-probs of every state at depth ``k``, in global state order.

    Parameters
    ----------
    k : int
        The depth, ``0 <= k < L``.

    Returns
    -------
    Tensor ``[P * b^k, V]``
        Float64 log-probs.
    """
    offs = self.mdp.level_offsets
    return self._table()[offs[k]:offs[k + 1]]


class RoutedPolicy(PrefixPolicy):
    """``π_θ`` of a float64 MoE model with its expert selection fixed to ``routing`` (or free).

    Differentiable in the model's parameters (the same parameters, in the same order, as
    ``model``'s): :func:`~tokenmdp.exact.gradient` of it is the gradient the replaying trainer
    follows. Replaying the routing the model would choose anyway gives the same numbers as the
    free model, bit for bit (:mod:`tokenmdp.model.moe`).

    Parameters
    ----------
    mdp : TokenMDP
        The MDP (``model``'s vocabulary must be ``mdp.vocab_size``).
    model : MoETransformer
        A float64 model (shared, not copied).
    routing : LongTensor ``[R, C, L, K]`` or RoutingTrace, optional
        The experts to replay, aligned with :meth:`TokenMDP.enumerate` (``-1``: routed by the
        model); ``None`` routes freely.
    """

    def __init__(self, mdp: TokenMDP, model: MoETransformer, routing=None) -> None:
        super().__init__(mdp)
        if not isinstance(model, MoETransformer):
            raise TypeError(f"model: expected a MoETransformer, got {type(model).__name__}")
        if model.embed.dtype != torch.float64:
            raise TypeError(f"model: the exact world needs float64 weights, got "
                            f"{model.embed.dtype} (use EnginePolicy for an engine's numerics)")
        if model.config.vocab_size != mdp.vocab_size:
            raise ValueError(f"model: vocab_size {model.config.vocab_size} differs from the "
                             f"MDP's {mdp.vocab_size}")
        self.model = model
        self.register_buffer("routing", _check_routing(mdp, model, routing), persistent=False)
        self._rows, self._cols = _eos_positions(mdp)

    def _table(self) -> torch.Tensor:
        lp_RCV = self.model.next_token_logprobs(self.mdp.enumerate(), self.routing)
        return lp_RCV[self._rows, self._cols]

    logits = _tabulated_logits
    level_logits = _tabulated_level_logits


class EnginePolicy(PrefixPolicy):
    """The behaviour policy ``μ`` of an engine's model in its own numerics, as a float64 table.

    The engine's next-token log-probs on the enumeration (one full forward pass, no KV cache) are
    cast to float64 and renormalized; the policy has no parameters.

    Parameters
    ----------
    mdp : TokenMDP
        The MDP.
    model : MoETransformer
        The engine's model (any dtype, e.g. from :func:`engine_model`).
    routing : LongTensor ``[R, C, L, K]`` or RoutingTrace, optional
        A routing to replay in it (default: its own).
    """

    def __init__(self, mdp: TokenMDP, model: MoETransformer, routing=None) -> None:
        super().__init__(mdp)
        if not isinstance(model, MoETransformer):
            raise TypeError(f"model: expected a MoETransformer, got {type(model).__name__}")
        routing = _check_routing(mdp, model, routing)
        rows, cols = _eos_positions(mdp)
        with torch.no_grad():
            lp_RCV = model.next_token_logprobs(mdp.enumerate(), routing)
            table = torch.log_softmax(lp_RCV[rows, cols].double(), dim=-1)
        self.register_buffer("table", table, persistent=False)

    def _table(self) -> torch.Tensor:
        return self.table

    logits = _tabulated_logits
    level_logits = _tabulated_level_logits


def expected_flip_fraction(mdp: TokenMDP, routing_a: torch.Tensor, routing_b: torch.Tensor,
                           behavior: nn.Module) -> float:
    """The share of (token, layer) records whose expert sets differ, in responses sampled by
    ``behavior``: ``Σ_y D(x) μ(y|x) n_diff(y) / Σ_y D(x) μ(y|x) n_rec(y)``.

    Records are those of every token but the last of each sequence (the engine never routes the
    last sampled token), prompt tokens included: the large-batch limit of the trainer's
    ``routing_mismatch`` (:func:`~tokenmdp.rl.mismatch.routing_mismatch_counts`).

    Parameters
    ----------
    mdp : TokenMDP
        The MDP.
    routing_a, routing_b : LongTensor ``[R, C, L, K]``
        Two records aligned with :meth:`TokenMDP.enumerate`.
    behavior : nn.Module
        The float64 policy that samples the responses.

    Returns
    -------
    float
        The fraction in ``[0, 1]`` (0 when nothing is recorded).
    """
    enum = mdp.enumerate()
    last_R = enum.sequence_lengths_total() - 1
    keep_RC = torch.arange(enum.tokens.shape[1])[None, :] < last_R[:, None]
    counts = []
    for r in range(mdp.num_sequences):  # small: one row at a time through the trainer's counter
        a = torch.where(keep_RC[r, :, None, None], routing_a[r], -1)[None]
        counts.append(routing_mismatch_counts(a, routing_b[r][None]))
    diff, rec = (torch.tensor(c, dtype=torch.float64) for c in zip(*counts))
    with torch.no_grad():
        w = mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, behavior)
    total = float(w @ rec)
    return float(w @ diff) / total if total > 0 else 0.0

