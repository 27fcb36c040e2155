"""Sampling responses from a policy on an exact token MDP (for Monte Carlo checks)."""

from __future__ import annotations

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import PrefixPolicy, check_policy

__all__ = ["sample"]


@torch.no_grad()
def sample(mdp: TokenMDP, policy: PrefixPolicy, n: int, *, generator: torch.Generator,
           group_size: int = 1) -> TokenBatch:
    """Sample ``n`` responses, in groups of ``group_size`` sharing a prompt ``x ~ D``.

    Tokens are drawn depth by depth for all unfinished responses at once (no loop over
    sequences). ``behavior_logprob`` records ``log pi(y_t | s_t)`` of each drawn token; ``reward``
    is looked up in the MDP's reward table; group ``g`` holds sequences
    ``g * group_size .. (g + 1) * group_size - 1``.

    Parameters
    ----------
    mdp : TokenMDP
    policy : PrefixPolicy
        The sampling (behaviour) policy.
    n : int
        Number of responses, a positive multiple of ``group_size``.
    generator : torch.Generator
        The only source of randomness.
    group_size : int, default 1
        Responses per prompt draw.

    Returns
    -------
    TokenBatch
        ``n`` sequences with ``behavior_logprob``, ``reward`` and ``group`` set.
    """
    check_policy(mdp, policy)
    if not isinstance(policy, PrefixPolicy):
        raise TypeError(f"policy: sample() needs a PrefixPolicy, got {type(policy).__name__}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size: must be >= 1, got {group_size}")
    if n < 1 or n % group_size:
        raise ValueError(f"n: must be a positive multiple of group_size={group_size}, got {n}")
    num_groups = n // group_size
    group_prompt = torch.multinomial(mdp.prompt_probs, num_groups, replacement=True,
                                     generator=generator)
    prompt_index = group_prompt.repeat_interleave(group_size)
    L, eos = mdp.max_len, mdp.eos
    responses = torch.full((n, L), eos, dtype=torch.long)
    logprobs = torch.zeros(n, L, dtype=torch.float64)
    lengths = torch.full((n,), L, dtype=torch.long)
    active = torch.ones(n, dtype=torch.bool)
    for t in range(L):
        idx = active.nonzero(as_tuple=True)[0]
        if idx.numel() == 0:
            break
        lp = torch.log_softmax(policy.logits(prompt_index[idx], responses[idx, :t]), dim=-1)
        tok = torch.multinomial(lp.exp(), 1, generator=generator)[:, 0]
        responses[idx, t] = tok
        logprobs[idx, t] = lp.gather(1, tok[:, None])[:, 0]
        done = idx[tok == eos]
        lengths[done] = t + 1
        active[done] = False
    return mdp.make_batch(prompt_index, responses, lengths, behavior_logprob=logprobs,
                          group=torch.arange(num_groups).repeat_interleave(group_size))
