"""The exact χ² divergence between two policies of an enumerable MDP, per token or per response.

``χ²(p ‖ q) = E_q[(p/q)²] − 1 = Var_q[p/q]`` is the price of importance sampling from ``q`` for
``p``: it multiplies the second moment of an importance-weighted estimate, and ``sqrt(χ²)``
bounds the bias of ignoring the weights (Cauchy–Schwarz). With ``p = π_old`` and ``q = μ`` these
are the exact values that the trainer's ``is_chi2`` / ``is_seq_chi2`` metrics estimate
(:mod:`tokenmdp.estimators.corrections.diagnostics`).

* ``level="sequence"``: ``Σ_x D(x) (Σ_y p(y|x)²/q(y|x))^G − 1`` — whole responses (``G = 1``),
  or the joint weight ``Π_i W_i`` of a group of ``G`` responses to one prompt;
* ``level="token"``: ``Σ_s d^q(s) χ²_s / Σ_s d^q(s)``, ``χ²_s = Σ_a p(a|s)²/q(a|s) − 1`` — the
  per-state divergence averaged over the states ``q`` visits (``d^q`` the unnormalized
  visitation): the large-batch limit of the pooled token estimate ``Σ_t (w_t² − 1) / #tokens``
  from responses drawn from ``q``.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmdp.exact.world.ground_truth import sequence_logprobs, state_logprobs, state_visitation
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import check_policy

__all__ = ["chi_square"]

LEVELS = ("sequence", "token")


def chi_square(mdp: TokenMDP, target: nn.Module, behavior: nn.Module, *,
               level: str = "sequence", group_size: int = 1) -> torch.Tensor:
    """``χ²(target ‖ behavior)`` of whole responses or per token (see the module docstring).

    Parameters
    ----------
    mdp : TokenMDP
        The exact token MDP.
    target : nn.Module
        ``p``, the policy the weights correct towards (``π_old``), float64.
    behavior : nn.Module
        ``q``, the sampler (``μ``), float64; it must give every response ``target`` gives
        positive probability a positive probability (softmax policies always do).
    level : {"sequence", "token"}
        Whole responses or single tokens.
    group_size : int, default 1
        ``G``: the divergence of the joint weight of ``G`` responses to one prompt
        (sequence level only).

    Returns
    -------
    Tensor ``[]``
        Float64, ``>= 0``.
    """
    check_policy(mdp, target, name="target")
    check_policy(mdp, behavior, name="behavior")
    if level not in LEVELS:
        raise ValueError(f"level: expected one of {', '.join(LEVELS)}, got {level!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    if level == "token" and group_size != 1:
        raise ValueError("group_size: only the sequence level has groups")
    with torch.no_grad():
        if level == "sequence":
            second_N = (2 * sequence_logprobs(mdp, target) - sequence_logprobs(mdp, behavior)).exp()
            per_prompt = torch.zeros(mdp.num_prompts, dtype=torch.float64).index_add(
                0, mdp.terminal_prompt_index, second_N)           # Σ_y p²/q, one per prompt
            return (mdp.prompt_probs * per_prompt ** group_size).sum() - 1.0
        per_state = torch.cat([
            (2 * lp - lq).exp().sum(-1).reshape(-1) - 1.0
            for lp, lq in zip(state_logprobs(mdp, target), state_logprobs(mdp, behavior))])
        d = state_visitation(mdp, behavior)
        return (d * per_state).sum() / d.sum()
