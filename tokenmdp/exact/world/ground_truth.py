"""Ground truth on an exact token MDP: ``J``, ``∇J``, sequence probabilities, values, KL, entropy.

Everything is computed level by level down the prefix tree (one batched softmax per depth, no
Python loop over sequences) in float64, and is differentiable in the policy's parameters:

* forward: ``log P(s_{k+1} = s_k . a) = log P(s_k) + log pi(a | s_k)`` gives the log-probability of
  every prefix and every terminal response;
* backward: ``V(s) = sum_a pi(a|s) Q(s, a)``, ``Q(s, a) = R(x, y)`` when ``a`` ends the response
  (EOS, or the ``L``-th token), else ``V(s . a)``.

``J(theta) = sum_x D(x) sum_y pi_theta(y|x) R(x, y)`` (docs: Concepts › The exact world).

Any module with ``token_logprobs(batch)`` / ``next_token_logprobs(batch)`` can be analysed; prefix
policies (:mod:`tokenmdp.exact.world.policies`) take a fast path through ``level_logits``, other policies
(the MoE transformer) are evaluated once on the full enumeration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmdp.exact.world._tree_objective import tree_objective
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import PrefixPolicy, check_policy

__all__ = ["state_logprobs", "sequence_logprobs", "sequence_probs", "objective", "gradient",
           "flat_grad", "state_visitation", "values", "ValueTables", "token_entropy",
           "sequence_kl", "surrogate"]


def state_logprobs(mdp: TokenMDP, policy: nn.Module) -> list[torch.Tensor]:
    """``log pi(· | s)`` at every state, one tensor ``[P, b^k, V]`` per depth ``k`` from 0 to ``L-1``.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp`` (a prefix policy, or any module with
        ``next_token_logprobs(batch)``).

    Returns
    -------
    list of Tensor
        ``L`` tensors, the one of depth ``k`` of shape ``[P, b^k, V]`` (prefixes in code order).
    """
    check_policy(mdp, policy)
    P, V = mdp.num_prompts, mdp.vocab_size
    if isinstance(policy, PrefixPolicy):
        return [torch.log_softmax(policy.level_logits(k), dim=-1).view(P, mdp.level_size(k), V)
                for k in range(mdp.max_len)]
    # Generic policy: each state s at depth k is the last prefix of the terminal "s + EOS", so one
    # forward pass over those terminals gives the distribution at every state.
    batch = mdp.enumerate()
    lp_RCV = policy.next_token_logprobs(batch)
    last_col = batch.sequence_lengths_total() - 1                      # [N] EOS position
    at_last = lp_RCV[torch.arange(batch.num_rows), last_col]           # [N, V]
    per_prompt = at_last.view(P, mdp.responses_per_prompt, V)
    out, start = [], 0
    for k in range(mdp.max_len):  # the EOS-terminated block of depth k, in code order
        n = mdp.level_size(k)
        out.append(per_prompt[:, start:start + n])
        start += n
    return out


def _forward(mdp: TokenMDP, levels: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefix log-probs per depth ``[P, b^k]`` (``k = 0 .. L``) and terminal log-probs ``[N]``."""
    P, b, eos = mdp.num_prompts, mdp.branching, mdp.eos
    logp = levels[0].new_zeros(P, 1)
    prefixes, blocks = [logp], []
    for k, lp in enumerate(levels):                      # lp: [P, b^k, V]
        blocks.append(logp + lp[..., eos])               # EOS after k tokens
        logp = (logp[..., None] + lp[..., :b]).reshape(P, b ** (k + 1))
        prefixes.append(logp)
    blocks.append(logp)                                  # truncated after L tokens
    return prefixes, torch.cat(blocks, dim=1).reshape(-1)


def sequence_logprobs(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """``log pi(y | x)`` of every response, ``[N]`` in :meth:`TokenMDP.enumerate` order.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.

    Returns
    -------
    Tensor ``[N]``
        Float64, differentiable in the policy's parameters.
    """
    return _forward(mdp, state_logprobs(mdp, policy))[1]


def sequence_probs(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """``pi(y | x)`` of every response, ``[N]``; sums to 1 for each prompt.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.

    Returns
    -------
    Tensor ``[N]``
        Float64, in :meth:`TokenMDP.enumerate` order.
    """
    return sequence_logprobs(mdp, policy).exp()


def objective(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """``J = sum_x D(x) sum_y pi(y|x) R(x, y)`` as a differentiable float64 scalar.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP (its prompt distribution ``D`` and rewards ``R``).
    policy : nn.Module
        A float64 policy of ``mdp``.

    Returns
    -------
    Tensor
        The scalar ``J``, computed by a backward pass of values down the prefix tree; its
        gradient (first order) is the closed form ``∂J/∂z = d^π π (Q^π − V^π)`` in the logits,
        so no tensor of the enumeration's size but the reward table is built
        (``tokenmdp.exact.world._tree_objective``).
    """
    check_policy(mdp, policy)
    return tree_objective(mdp, policy, state_logprobs)


def flat_grad(output: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``d output / d theta`` as one flat float64 vector in ``module.parameters()`` order.

    Parameters that do not influence ``output`` get zeros.

    Parameters
    ----------
    output : Tensor
        A scalar computed from ``module``'s parameters (with its autograd graph).
    module : nn.Module
        The module whose parameters the gradient is taken in.

    Returns
    -------
    Tensor ``[num_params]``
        The gradient, parameter by parameter, flattened.
    """
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad(output, params, allow_unused=True)
    if len(params) == 1 and grads[0] is not None:
        return grads[0].reshape(-1)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                      for p, g in zip(params, grads)])


def gradient(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """The true policy gradient ``∇J`` as one flat vector in ``policy.parameters()`` order.

    Works inside ``torch.no_grad()`` too (it enables grad for its own computation).

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.

    Returns
    -------
    Tensor ``[num_params]``
        ``∇J``, float64.
    """
    check_policy(mdp, policy)
    with torch.enable_grad():
        return flat_grad(tree_objective(mdp, policy, state_logprobs, eager=True), policy)


def state_visitation(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """``d^pi(s) = D(x) P_pi(reach s | x)`` for every state, ``[num_states]`` in state-id order.

    Summed over states it is the expected response length ``E|y|`` (one action per state visited).

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.

    Returns
    -------
    Tensor ``[num_states]``
        ``d^pi``, float64 (unnormalized: it sums to ``E|y|``).
    """
    prefixes, _ = _forward(mdp, state_logprobs(mdp, policy))
    d = [mdp.prompt_probs[:, None] * lp.exp() for lp in prefixes[:mdp.max_len]]
    return torch.cat([x.reshape(-1) for x in d])


@dataclass(frozen=True)
class ValueTables:
    """``V^pi`` ``[num_states]``, ``Q^pi`` and ``A^pi = Q - V`` ``[num_states, V]``, in state-id order.

    Values condition on the prompt (they are ``E[R | s]``), so ``V`` at the root of prompt ``x``
    is ``J_x``.

    Parameters
    ----------
    V : Tensor ``[num_states]``
        ``V^pi(s) = sum_a pi(a|s) Q^pi(s, a)``.
    Q : Tensor ``[num_states, V]``
        ``Q^pi(s, a)``: the reward when ``a`` ends the response, else ``V^pi(s . a)``.
    """

    V: torch.Tensor
    Q: torch.Tensor

    @property
    def A(self) -> torch.Tensor:
        """``A^pi = Q - V``, ``[num_states, V]``."""
        return self.Q - self.V[:, None]


def _q_tables(mdp: TokenMDP, levels: list[torch.Tensor]) -> list[torch.Tensor]:
    """Backward recursion: ``Q`` per depth ``[P, b^k, V]``."""
    P, b, L = mdp.num_prompts, mdp.branching, mdp.max_len
    rewards = mdp.rewards.view(P, mdp.responses_per_prompt)
    starts = [0]
    for k in range(L + 1):
        starts.append(starts[-1] + b ** k)
    block = [rewards[:, starts[k]:starts[k + 1]] for k in range(L + 1)]  # EOS after k; L: trunc
    q_levels: list[torch.Tensor] = [None] * L  # type: ignore[list-item]
    next_value = block[L]                                   # value of depth-L prefixes (truncated)
    for k in range(L - 1, -1, -1):
        q = torch.cat([next_value.reshape(P, b ** k, b), block[k][..., None]], dim=-1)
        q_levels[k] = q
        next_value = (levels[k].exp() * q).sum(-1)
    return q_levels


def values(mdp: TokenMDP, policy: nn.Module) -> ValueTables:
    """``V^pi``, ``Q^pi`` (and ``A^pi``) of every state by backward recursion over the prefix tree.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.

    Returns
    -------
    ValueTables
        ``V``, ``Q`` and ``A``, in state-id order (differentiable in the policy's parameters).
    """
    levels = state_logprobs(mdp, policy)
    q_levels = _q_tables(mdp, levels)
    Q = torch.cat([q.reshape(-1, mdp.vocab_size) for q in q_levels])
    V = torch.cat([(lp.exp() * q).sum(-1).reshape(-1) for lp, q in zip(levels, q_levels)])
    return ValueTables(V=V, Q=Q)


def token_entropy(mdp: TokenMDP, policy: nn.Module, *, reduction: str = "mean") -> torch.Tensor:
    """Token entropy ``H(pi(.|s))`` under the visitation distribution ``d^pi``.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        A float64 policy of ``mdp``.
    reduction : {"mean", "sum"}
        ``"mean"``: the per-token average ``sum_s d(s) H(s) / sum_s d(s)`` (what a trainer logs as
        token entropy); ``"sum"``: ``sum_s d(s) H(s)``, the expected entropy of a whole response.

    Returns
    -------
    Tensor
        The float64 scalar, in nats.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    levels = state_logprobs(mdp, policy)
    prefixes, _ = _forward(mdp, levels)
    total = levels[0].new_zeros(())
    mass = levels[0].new_zeros(())
    for k, lp in enumerate(levels):
        d = mdp.prompt_probs[:, None] * prefixes[k].exp()
        total = total + (d * -(lp.exp() * lp).sum(-1)).sum()
        mass = mass + d.sum()
    return total / mass if reduction == "mean" else total


def sequence_kl(mdp: TokenMDP, p: nn.Module, q: nn.Module) -> torch.Tensor:
    """``KL(p || q) = sum_x D(x) sum_y p(y|x) (log p(y|x) - log q(y|x))``, exactly.

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    p, q : nn.Module
        Float64 policies of ``mdp``.

    Returns
    -------
    Tensor
        The float64 scalar ``KL(p || q) >= 0``, in nats (differentiable in both).
    """
    lp = sequence_logprobs(mdp, p)
    lq = sequence_logprobs(mdp, q)
    w = mdp.prompt_probs[mdp.terminal_prompt_index]
    return (w * lp.exp() * (lp - lq)).sum()


def surrogate(mdp: TokenMDP, policy: nn.Module, behavior: nn.Module) -> torch.Tensor:
    """The trust-region (CPI) surrogate ``L_mu(pi) = J(mu) + sum_s d^mu(s) sum_a pi(a|s) A^mu(s, a)``.

    Kakade & Langford (2002); Schulman et al. (2015, TRPO, arXiv 1502.05477, Eq. 3), here
    undiscounted with a finite horizon and ``d^mu`` the unnormalized state visitation. It matches
    ``J`` to first order at ``pi = mu``: ``L_mu(mu) = J(mu)`` and ``∇L_mu(pi)|_{pi=mu} = ∇J(mu)``.
    Differentiable in ``policy``; every behaviour quantity is detached (it is a constant of the
    surrogate).

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    policy : nn.Module
        ``pi``, a float64 policy of ``mdp``.
    behavior : nn.Module
        ``mu``, the policy the surrogate is taken around.

    Returns
    -------
    Tensor
        The float64 scalar ``L_mu(pi)``.
    """
    with torch.no_grad():
        tables = values(mdp, behavior)
        d_mu = state_visitation(mdp, behavior)
        j_mu = objective(mdp, behavior)
    pi = torch.cat([lp.exp().reshape(-1, mdp.vocab_size)
                    for lp in state_logprobs(mdp, policy)])
    return j_mu + (d_mu[:, None] * pi * tables.A).sum()
