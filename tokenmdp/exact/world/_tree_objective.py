"""``J`` and ``∇J`` by one backward pass of values down the prefix tree (not part of the public API).

:func:`~tokenmdp.exact.objective` and :func:`~tokenmdp.exact.gradient` run here. No tensor the
size of the enumeration is built but the reward table itself: with ``π_k`` the next-token
distributions of the depth-``k`` states (``[P, b^k, V]``, EOS last) and ``R_k`` the rewards of the
responses that end after ``k`` tokens (``[P, b^k]``; ``R_L`` the truncated ones),

* values, from the leaves up: ``V_L = R_L``, ``Q_k = [V_{k+1} (as [P, b^k, b]), R_k]``,
  ``V_k = Σ_a π_k Q_k``, and ``J = Σ_x D(x) V_0(x)``;
* visitation, from the root down: ``d_0 = D``, ``d_{k+1} = d_k π_k[..., :b]``;
* the gradient in the logits ``z`` of a softmax policy, ``∂J/∂z_k = d_k π_k (Q_k − V_k)`` (the
  policy gradient theorem on the tree; Sutton et al. 2000), or, in the log-probabilities of a
  policy seen only through its protocol, ``∂J/∂ log π_k = d_k π_k Q_k``.

Both are wrapped in one autograd function, so ``objective`` stays differentiable (first order)
while its backward pass is this closed form instead of autograd through every response. The
gradient of a :class:`~tokenmdp.exact.TabularPolicy` is written level by level, in place, into
the buffer that becomes ``table.grad``: the state order of the table is the order of the levels.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import PrefixPolicy, TabularPolicy


def reward_blocks(mdp: TokenMDP) -> list[torch.Tensor]:
    """Views ``[P, b^k]`` of the reward table: EOS after ``k`` tokens (``k < L``), truncated (L)."""
    P, b, L = mdp.num_prompts, mdp.branching, mdp.max_len
    table = mdp.rewards.view(P, mdp.responses_per_prompt)
    out, start = [], 0
    for k in range(L + 1):
        out.append(table[:, start:start + b ** k])
        start += b ** k
    return out


def fresh_buffer(*shape: int) -> torch.Tensor:
    """An uninitialized float64 tensor, its memory from numpy's allocator: numpy asks the kernel
    for transparent huge pages on large arrays and torch's CPU allocator does not (unless
    ``THP_MEM_ALLOC_ENABLE=1``), so writing a fresh 100 MB buffer takes about 500 page faults
    instead of 25,000 (on a virtual machine, where faults are dear, about twice as fast)."""
    return torch.from_numpy(np.empty(shape, dtype=np.float64))


def workspace(mdp: TokenMDP, name: str, numel: int) -> torch.Tensor:
    """A float64 buffer of ``numel`` entries kept on ``mdp`` between calls (scratch only: its
    content never leaves the function that fills it), so that repeated calls fault no pages."""
    cache = mdp.__dict__.setdefault("_workspaces", {})
    buf = cache.get(name)
    if buf is None or buf.numel() < numel:
        buf = cache[name] = fresh_buffer(numel)
    return buf[:numel]


def _level_probs(mdp: TokenMDP, kind: str, levels) -> list[torch.Tensor]:
    """``π_k`` ``[P, b^k, V]`` in one workspace: ``exp`` of log-probabilities, or the softmax of
    logits with the row max subtracted (in place; on rows of a few dozen entries about twice as
    fast as ``torch.softmax`` on one thread)."""
    P, V = mdp.num_prompts, mdp.vocab_size
    buf = workspace(mdp, "probs", mdp.num_states * V)
    out, start = [], 0
    with torch.no_grad():
        for k, x in enumerate(levels):
            shape = (P, mdp.level_size(k), V)
            e = buf[start:start + x.numel()].view(shape)
            start += x.numel()
            x = x.reshape(shape)
            if kind == "logprobs":
                torch.exp(x, out=e)
            else:
                torch.sub(x, x.amax(-1, keepdim=True), out=e)
                e.exp_()
                e.div_(e.sum(-1, keepdim=True))
            out.append(e)
    return out


def _tree_pass(mdp: TokenMDP, probs: list[torch.Tensor], out: list[torch.Tensor] | None,
               centered: bool) -> torch.Tensor:
    """``J``; with ``out`` (one ``[P, b^k, V]`` buffer per depth) also fill ``out[k]`` with
    ``d_k π_k (Q_k − V_k)`` (``centered``) or ``d_k π_k Q_k``."""
    P, b, L = mdp.num_prompts, mdp.branching, mdp.max_len
    blocks = reward_blocks(mdp)
    visits = None
    if out is not None:
        visits = [mdp.prompt_probs[:, None]]
        for k in range(L - 1):
            visits.append((visits[k][..., None] * probs[k][..., :b]).reshape(P, b ** (k + 1)))
    else:
        scratch = workspace(mdp, "q", P * b ** (L - 1) * (b + 1))
    value = blocks[L]
    for k in range(L - 1, -1, -1):
        n = b ** k
        pi = probs[k]
        q = out[k] if out is not None else scratch[:pi.numel()].view(pi.shape)
        torch.mul(pi[..., :b], value.view(P, n, b), out=q[..., :b])
        torch.mul(pi[..., b], blocks[k], out=q[..., b])    # π Q
        value = q.sum(-1)                                  # V_k
        if out is not None:
            if centered:
                q.addcmul_(pi, value[..., None], value=-1.0)   # π (Q − V)
            q.mul_(visits[k][..., None])
    return (mdp.prompt_probs * value[:, 0]).sum()


class _TreeObjective(torch.autograd.Function):
    """``J`` from the policy's tabular logits, level logits or level log-probabilities.

    ``eager``: the gradient buffers are filled in the forward pass (one pass for ``J`` and
    ``∇J``: :func:`~tokenmdp.exact.gradient`); otherwise the forward pass computes ``J`` alone and
    the backward pass, if any, runs the whole pass again on the saved inputs
    (:func:`~tokenmdp.exact.objective`, which is mostly evaluated, not differentiated)."""

    @staticmethod
    def forward(ctx, mdp: TokenMDP, kind: str, eager: bool, *inputs: torch.Tensor
                ) -> torch.Tensor:
        ctx.mdp, ctx.kind = mdp, kind
        if not eager or not any(ctx.needs_input_grad[3:]):
            ctx.save_for_backward(*inputs)
            ctx.grads = None
            return _tree_pass(mdp, _level_probs(mdp, kind, _levels(mdp, kind, inputs)), None,
                              centered=True)
        value, ctx.grads = _value_and_grads(mdp, kind, inputs)
        return value

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            grads = _value_and_grads(ctx.mdp, ctx.kind, ctx.saved_tensors)[1]
        scale = float(grad_output)
        return (None, None, None, *(g.mul_(scale) if scale != 1.0 else g for g in grads))


def _levels(mdp: TokenMDP, kind: str, inputs) -> list[torch.Tensor]:
    offs = mdp.level_offsets
    return (list(inputs) if kind != "table" else
            [inputs[0][offs[k]:offs[k + 1]] for k in range(mdp.max_len)])


def _value_and_grads(mdp: TokenMDP, kind: str, inputs) -> tuple[torch.Tensor, tuple]:
    """``J`` and ``∂J/∂input`` for each input (one pass, the gradients in fresh buffers)."""
    P, V, offs = mdp.num_prompts, mdp.vocab_size, mdp.level_offsets
    probs = _level_probs(mdp, kind, _levels(mdp, kind, inputs))
    grad = fresh_buffer(mdp.num_states * V)
    out = [grad[offs[k] * V:offs[k + 1] * V].view(P, mdp.level_size(k), V)
           for k in range(mdp.max_len)]
    value = _tree_pass(mdp, probs, out, centered=kind != "logprobs")
    if kind == "table":
        return value, (grad.view_as(inputs[0]),)
    return value, tuple(g.view_as(x) for g, x in zip(out, inputs))


def tree_objective(mdp: TokenMDP, policy: nn.Module, state_logprobs, *,
                   eager: bool = False) -> torch.Tensor:
    """``J`` of ``policy`` (a differentiable float64 scalar); ``state_logprobs`` is the generic
    path's per-depth log-probabilities (a callable of ``(mdp, policy)``); ``eager``: compute the
    gradient with the value (see :class:`_TreeObjective`)."""
    if type(policy) is TabularPolicy:
        return _TreeObjective.apply(mdp, "table", eager, policy.table)
    if isinstance(policy, PrefixPolicy):
        return _TreeObjective.apply(mdp, "logits", eager,
                                    *[policy.level_logits(k) for k in range(mdp.max_len)])
    return _TreeObjective.apply(mdp, "logprobs", eager, *state_logprobs(mdp, policy))
