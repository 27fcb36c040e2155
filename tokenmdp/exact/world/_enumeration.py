"""The enumeration of a :class:`~tokenmdp.exact.TokenMDP` and batches of its sequences
(not part of the public API).

The bodies of the :class:`~tokenmdp.exact.TokenMDP` members that walk its terminals or build
:class:`~tokenmdp.batch.TokenBatch` objects on them: the canonical terminal layout (prompt,
EOS-padded response, length of every full response), the reward table
(:attr:`~tokenmdp.exact.TokenMDP.rewards`, each value checked), and
:meth:`~tokenmdp.exact.TokenMDP.make_batch` (a padded batch of responses, rewards looked up),
:meth:`~tokenmdp.exact.TokenMDP.check_batch` (is a batch made of this MDP's (prompt, response)
pairs, in float64) and :meth:`~tokenmdp.exact.TokenMDP.token_state_index` (the state each
response token was drawn in). The members, documented there, call these; the counts and the
state and terminal indexing they use stay in :mod:`tokenmdp.exact.world.mdp`. Each function
takes the MDP as its first argument and reads its attributes; this module stands a floor below
:mod:`~tokenmdp.exact.world.mdp` and does not import it.
"""

from __future__ import annotations

import torch

from tokenmdp.batch import TokenBatch


def prefix_digits(out: torch.Tensor, branching: int, k: int) -> torch.Tensor:
    """Fill ``out`` ``[..., b^k, >=k]`` with the base-``b`` digits of codes ``0 .. b^k - 1`` (most
    significant first) in its first ``k`` columns: digit ``j`` of code ``c`` is
    ``(c // b^(k-1-j)) % b``, i.e. ``arange(b)`` each repeated ``b^(k-1-j)`` times, tiled
    ``b^j`` times, written by one broadcast copy per column (no integer division)."""
    b = branching
    digits = torch.arange(b, dtype=out.dtype)
    lead = out.shape[:-2]
    for j in range(k):
        out[..., j].view(*lead, b ** j, b, b ** (k - 1 - j)).copy_(digits[:, None])
    return out


def terminal_layout(mdp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``TokenMDP._terminal_layout``: prompt index ``[N]``, EOS-padded responses ``[N, L]`` and
    response lengths ``[N]`` of every terminal, in canonical order."""
    b, L, P = mdp.branching, mdp.max_len, mdp.num_prompts
    n = mdp.responses_per_prompt
    resp = torch.empty(P, n, L, dtype=torch.long)
    lengths = torch.empty(n, dtype=torch.long)
    start = 0
    for k in range(L + 1):
        m = b ** k
        block = resp[:, start:start + m]
        prefix_digits(block, b, k)
        block[..., k:] = mdp.eos
        lengths[start:start + m] = k + 1 if k < L else L
        start += m
    return (torch.arange(P).repeat_interleave(n), resp.view(P * n, L),
            lengths.repeat(P) if P > 1 else lengths)


def reward_table(mdp) -> torch.Tensor:
    """See :attr:`TokenMDP.rewards <tokenmdp.exact.TokenMDP.rewards>`: ``R(x, y)`` of every
    terminal, from the reward's ``on_prefix_tree`` or ``vectorized`` form when it offers one,
    each value checked to be a finite number."""
    tree = getattr(mdp.reward_fn, "on_prefix_tree", None)
    vectorized = getattr(mdp.reward_fn, "vectorized", None)
    if tree is not None:
        values = torch.as_tensor(tree(mdp.prompts, mdp.vocab_size, mdp.max_len),
                                 dtype=torch.float64)
    elif vectorized is not None:
        pidx, resp, lengths = mdp._terminal_layout
        values = torch.as_tensor(
            vectorized(mdp.prompts, pidx, resp, lengths, eos=mdp.eos), dtype=torch.float64)
    else:
        pidx, resp, lengths = mdp._terminal_layout
        rows = resp.tolist()
        values = torch.tensor(
            [_call_reward(mdp, mdp.prompts[p], tuple(r[:n]))
             for p, r, n in zip(pidx.tolist(), rows, lengths.tolist())], dtype=torch.float64)
    if values.shape != (mdp.num_sequences,):
        form = "on_prefix_tree" if tree is not None else "vectorized"
        raise ValueError(f"reward: {form} form returned shape {tuple(values.shape)}, "
                         f"expected ({mdp.num_sequences},)")
    # a finite sum means finite values (the fast check: torch.isfinite is slow on CPU floats);
    # a sum that overflows is checked value by value
    if not bool(torch.isfinite(values.sum())) and not bool(torch.isfinite(values).all()):
        bad = ~torch.isfinite(values)
        pidx, resp, lengths = mdp._terminal_layout
        i = int(bad.nonzero()[0])
        raise ValueError(f"reward: returned a non-finite value {float(values[i])} for "
                         f"prompt {mdp.prompts[int(pidx[i])]}, response "
                         f"{tuple(resp[i, :int(lengths[i])].tolist())}")
    return values


def _call_reward(mdp, prompt: tuple, response: tuple) -> float:
    """The MDP's reward of one (prompt, response), as a float (a clear error if it is not one)."""
    value = mdp.reward_fn(prompt, response)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"reward: returned {value!r:.40} ({type(value).__name__}), not a "
                         f"number, for prompt {prompt}, response {response}") from None


def make_batch(mdp, prompt_index: torch.Tensor, responses: torch.Tensor,
               lengths: torch.Tensor, *, behavior_logprob: torch.Tensor | None = None,
               group: torch.Tensor | None = None) -> TokenBatch:
    """See :meth:`TokenMDP.make_batch <tokenmdp.exact.TokenMDP.make_batch>`."""
    plen = torch.tensor([len(p) for p in mdp.prompts], dtype=torch.long)
    max_plen = int(plen.max())
    n = prompt_index.shape[0]
    cap = max_plen + mdp.max_len
    prompt_tok = torch.zeros(mdp.num_prompts, max_plen, dtype=torch.long)
    for i, p in enumerate(mdp.prompts):
        prompt_tok[i, :len(p)] = torch.tensor(p)
    my_plen = plen[prompt_index]                          # [N]
    total = my_plen + lengths                             # [N]
    col = torch.arange(cap)[None, :]                      # [1, C]
    in_prompt = col < my_plen[:, None]
    in_resp = (col >= my_plen[:, None]) & (col < total[:, None])
    tokens = torch.zeros(n, cap, dtype=torch.long)
    tokens[:, :max_plen] = torch.where(in_prompt[:, :max_plen], prompt_tok[prompt_index], 0)
    rcol = (col - my_plen[:, None]).clamp(0, mdp.max_len - 1).expand(n, cap)
    tokens = torch.where(in_resp, responses[:, :mdp.max_len].gather(1, rcol), tokens)
    real = col < total[:, None]
    sequence_id = torch.where(real, torch.arange(n)[:, None], -1)
    position = torch.where(real, col, 0)
    ones = in_resp.to(torch.float64)
    behavior = None
    if behavior_logprob is not None:
        behavior = torch.where(in_resp, behavior_logprob.gather(1, rcol), 0.0)
    reward = mdp.rewards[mdp.terminal_index(prompt_index, responses, lengths)]
    return TokenBatch(tokens=tokens, sequence_id=sequence_id, position=position,
                      loss_mask=in_resp, advantage=ones, loss_weight=ones.clone(),
                      reward=reward, group=(prompt_index if group is None else group).clone(),
                      length=lengths.clone(), prompt_index=prompt_index.clone(),
                      behavior_logprob=behavior)


def token_state_index(mdp, batch: TokenBatch) -> torch.Tensor:
    """See :meth:`TokenMDP.token_state_index <tokenmdp.exact.TokenMDP.token_state_index>`."""
    mdp.check_batch(batch)
    rpos = batch.response_position
    pidx_RC = batch.to_tokens(batch.prompt_index)
    out = torch.full_like(rpos, -1)
    for t in range(mdp.max_len):  # loop over depths, never over sequences
        rows, cols = (rpos == t).nonzero(as_tuple=True)
        prefix = batch.tokens[rows[:, None], cols[:, None] - t + torch.arange(t)]
        out[rows, cols] = mdp.state_index(pidx_RC[rows, cols], prefix)
    return out


def check_batch(mdp, batch: TokenBatch, *, name: str = "batch") -> None:
    """See :meth:`TokenMDP.check_batch <tokenmdp.exact.TokenMDP.check_batch>`."""
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"{name}: expected a TokenBatch, got {type(batch).__name__}")
    if batch.dtype != torch.float64:
        raise TypeError(f"{name}: float fields are {batch.dtype}; the exact code needs "
                        "float64 (use batch.to(dtype=torch.float64))")
    if batch.num_sequences == 0:
        return
    if int(batch.prompt_index.max()) >= mdp.num_prompts:
        raise ValueError(f"{name}: prompt_index out of range for an MDP with "
                         f"{mdp.num_prompts} prompts")
    if int(batch.length.max()) > mdp.max_len:
        raise ValueError(f"{name}: a response is longer than max_len={mdp.max_len}")
    if int(batch.tokens.max()) >= mdp.vocab_size:
        raise ValueError(f"{name}: token ids outside the vocabulary [0, {mdp.vocab_size})")
    rpos = batch.response_position
    last = batch.to_tokens(batch.length - 1)
    inner = (rpos >= 0) & (rpos < last)
    if bool((batch.tokens[inner] == mdp.eos).any()):
        raise ValueError(f"{name}: EOS inside a response (responses end at EOS)")
    short = batch.to_tokens((batch.length < mdp.max_len).long()).bool()
    final = (rpos >= 0) & (rpos == last)
    if bool((batch.tokens[final & short] != mdp.eos).any()):
        raise ValueError(f"{name}: a response shorter than max_len does not end with EOS")
    plen = torch.tensor([len(p) for p in mdp.prompts], dtype=torch.long,
                        device=batch.device)
    expected = plen[batch.prompt_index] + batch.length
    if bool((batch.sequence_lengths_total() != expected).any()):
        raise ValueError(f"{name}: prompt lengths do not match the MDP's prompts")
