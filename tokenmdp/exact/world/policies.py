"""Policies over an exact token MDP: torch modules in float64 with one protocol.

Every policy gives

* ``token_logprobs(batch) -> [R, C]``: ``log pi(y_t | x, y_<t)`` of each response token, aligned
  with ``batch.tokens`` (0 on prompt tokens and padding);
* ``next_token_logprobs(batch) -> [R, C, V]``: the full next-token distribution from which each
  response token was drawn (for entropy and KL; 0 off response tokens).

The policies here are *prefix policies*: they define ``logits(prompt_index, prefix) -> [N, V]``
for a batch of states that share a depth ``k`` (``prefix`` is ``[N, k]``), and
``level_logits(k)`` for all states at depth ``k`` at once, which the exact recursions in
:mod:`tokenmdp.exact.world.ground_truth` walk level by level.

* :class:`TabularPolicy` — one free logit vector per state (the softmax tabular policy);
* :class:`LogLinearPolicy` — ``logit(s, a) = w · phi(s, a)`` with shared weights over one-hot
  features of (token), (prompt, token), (previous token, token), (depth, token) and
  the count of the token in the prefix;
* :class:`NeuralPolicy` — a small MLP over embeddings of the prompt, the depth, the previous token
  and the bag of prefix tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.exact.world.mdp import TokenMDP

__all__ = ["PrefixPolicy", "TabularPolicy", "LogLinearPolicy", "NeuralPolicy", "check_policy"]


def check_number(name: str, value, *, minimum: float = 0.0, strict: bool = False) -> float:
    """``value`` as a float, or ``ValueError`` naming ``name`` unless it is a finite real
    ``>= minimum`` (``> minimum`` with ``strict``): NaN and infinities are never taken."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
            isinstance(value, torch.Tensor) and value.numel() == 1):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    x = float(value)
    if not math.isfinite(x) or x < minimum or (strict and x == minimum):
        raise ValueError(f"{name}: must be a finite number {'>' if strict else '>='} {minimum:g}, "
                         f"got {x}")
    return x


def _check_generator(generator: torch.Generator) -> None:
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")


def check_policy(mdp: TokenMDP, policy: nn.Module, *, name: str = "policy") -> None:
    """Raise unless ``policy`` is a float64 policy built for ``mdp`` (or an identical MDP).

    Parameters
    ----------
    mdp : TokenMDP
        The MDP the policy is about to be used with.
    policy : nn.Module
        The module to check (``token_logprobs(batch)``, float64 parameters).
    name : str, default ``"policy"``
        The argument's name in the error messages.

    Raises
    ------
    TypeError
        If ``policy`` lacks the policy protocol or has non-float64 floating-point parameters.
    ValueError
        If it was built for an MDP of another vocabulary, length or prompt set.
    """
    if not callable(getattr(policy, "token_logprobs", None)):
        raise TypeError(f"{name}: expected a policy with token_logprobs(batch), got "
                        f"{type(policy).__name__}")
    for pname, p in policy.named_parameters():
        if p.dtype.is_floating_point and p.dtype != torch.float64:
            raise TypeError(f"{name}: parameter {pname!r} is {p.dtype}; the exact code needs "
                            "float64 (build the policy in float64, or call .double())")
    other = getattr(policy, "mdp", None)
    if other is None:
        return
    if other is not mdp and (other.vocab_size, other.max_len, other.prompts) != (
            mdp.vocab_size, mdp.max_len, mdp.prompts):
        raise ValueError(f"{name}: built for another MDP ({other!r}), used with {mdp!r}")


class PrefixPolicy(nn.Module):
    """Base class of policies defined by ``logits(prompt_index, prefix)``.

    Subclasses implement :meth:`logits`; :meth:`level_logits` may be overridden for speed.

    Parameters
    ----------
    mdp : TokenMDP
        The MDP whose states the policy is defined on.
    """

    def __init__(self, mdp: TokenMDP) -> None:
        super().__init__()
        if not isinstance(mdp, TokenMDP):
            raise TypeError(f"mdp: expected a TokenMDP, got {type(mdp).__name__}")
        self.mdp = mdp

    def logits(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, V]`` at the states given by prompt index ``[N]`` and prefix ``[N, k]``.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
            The prompt of each state.
        prefix : LongTensor ``[N, k]``
            The response tokens so far of each state (all at depth ``k``).

        Returns
        -------
        Tensor ``[N, V]``
            Float64 logits (differentiable in the policy's parameters).
        """
        raise NotImplementedError

    def level_logits(self, k: int) -> torch.Tensor:
        """Logits ``[P * b^k, V]`` of every state at depth ``k``, in global state order.

        Parameters
        ----------
        k : int
            The depth, ``0 <= k < L``.

        Returns
        -------
        Tensor ``[P * b^k, V]``
            Float64 logits; row ``i`` is the state ``mdp.level_offsets[k] + i``.
        """
        return self.logits(*self.mdp.level_prefixes(k))

    def _register_prompt_last(self) -> None:
        # each prompt's last token, the "previous token" at depth 0 (a buffer: moves with .to())
        self.register_buffer("prompt_last", torch.tensor([p[-1] for p in self.mdp.prompts]),
                             persistent=False)

    def _previous_token(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        # LongTensor [N]: the prefix's last token, or the prompt's last at depth 0
        return prefix[:, -1] if prefix.shape[1] > 0 else self.prompt_last[prompt_index]

    def next_token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Float64 ``[R, C, V]``: ``log pi(. | x, y_<t)`` at each response token, 0 elsewhere.

        Parameters
        ----------
        batch : TokenBatch
            A batch of this MDP's prompts and responses.

        Returns
        -------
        Tensor ``[R, C, V]``
            The next-token log-probabilities of each response token's state.
        """
        self.mdp.check_batch(batch)
        rpos = batch.response_position
        pidx_RC = batch.to_tokens(batch.prompt_index)
        out = torch.zeros(*batch.tokens.shape, self.mdp.vocab_size, dtype=torch.float64,
                          device=batch.device)
        for t in range(self.mdp.max_len):  # loop over depths (<= L), never over sequences
            rows, cols = (rpos == t).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            # the t response tokens before (rows, cols) lie just left of it in the same row
            prefix = batch.tokens[rows[:, None], cols[:, None] - t + torch.arange(t)]
            logits = self.logits(pidx_RC[rows, cols], prefix)
            out = out.index_put((rows, cols), torch.log_softmax(logits, dim=-1))
        return out

    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Float64 ``[R, C]``: ``log pi(y_t | x, y_<t)`` of each response token, 0 elsewhere.

        Parameters
        ----------
        batch : TokenBatch
            A batch of this MDP's prompts and responses.

        Returns
        -------
        Tensor ``[R, C]``
            The log-probability of each response token.
        """
        lp = self.next_token_logprobs(batch)
        return lp.gather(-1, batch.tokens[..., None]).squeeze(-1) * batch.response_mask


class TabularPolicy(PrefixPolicy):
    """The softmax tabular policy: one free logit vector per state.

    Parameters
    ----------
    mdp : TokenMDP
    generator : torch.Generator
        Source of the initial logits ``N(0, init_std^2)``.
    init_std : float
        Standard deviation of the initial logits (0 gives the uniform policy).
    """

    def __init__(self, mdp: TokenMDP, *, generator: torch.Generator, init_std: float = 1.0) -> None:
        super().__init__(mdp)
        _check_generator(generator)
        init_std = check_number("init_std", init_std)
        table = torch.randn(mdp.num_states, mdp.vocab_size, generator=generator,
                            dtype=torch.float64).mul_(init_std)
        self.table = nn.Parameter(table)

    def logits(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """The table's rows at the given states.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
            The prompt of each state.
        prefix : LongTensor ``[N, k]``
            The response tokens so far of each state (all at depth ``k``).

        Returns
        -------
        Tensor ``[N, V]``
            Float64 logits.
        """
        return self.table[self.mdp.state_index(prompt_index, prefix)]

    def level_logits(self, k: int) -> torch.Tensor:
        """The table's rows of depth ``k`` (one slice, no indexing).

        Parameters
        ----------
        k : int
            The depth, ``0 <= k < L``.

        Returns
        -------
        Tensor ``[P * b^k, V]``
            Float64 logits, in global state order.
        """
        offs = self.mdp.level_offsets
        return self.table[offs[k]:offs[k + 1]]


class LogLinearPolicy(PrefixPolicy):
    """``logit(s, a) = w · phi(s, a)`` with weights shared across states.

    ``phi`` is the concatenation of one-hot features of ``a``, ``(prompt, a)``,
    ``(previous token, a)`` (the previous token is the prompt's last token at depth 0),
    ``(depth, a)``, and the count of ``a`` among the prefix tokens; so
    ``logit = b[a] + W_x[x, a] + W_prev[prev, a] + W_t[t, a] + c[a] * count_a(prefix)``.

    Parameters
    ----------
    mdp : TokenMDP
    generator : torch.Generator
        Source of the initial weights ``N(0, init_std^2)``.
    init_std : float
    """

    def __init__(self, mdp: TokenMDP, *, generator: torch.Generator, init_std: float = 0.5) -> None:
        super().__init__(mdp)
        _check_generator(generator)
        init_std = check_number("init_std", init_std)
        V, P, L = mdp.vocab_size, mdp.num_prompts, mdp.max_len

        def init(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator,
                                            dtype=torch.float64) * init_std)

        self.bias = init(V)
        self.w_prompt = init(P, V)
        self.w_prev = init(V, V)
        self.w_depth = init(L, V)
        self.w_count = init(V)
        self._register_prompt_last()

    def logits(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """``w · phi(s, a)`` for every token ``a`` at the given states.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
            The prompt of each state.
        prefix : LongTensor ``[N, k]``
            The response tokens so far of each state (all at depth ``k``).

        Returns
        -------
        Tensor ``[N, V]``
            Float64 logits.
        """
        k = prefix.shape[1]
        prev = self._previous_token(prompt_index, prefix)
        counts = torch.nn.functional.one_hot(prefix, self.mdp.vocab_size).sum(1)  # [N, V]
        return (self.bias + self.w_prompt[prompt_index] + self.w_prev[prev] + self.w_depth[k]
                + self.w_count * counts.to(torch.float64))


class NeuralPolicy(PrefixPolicy):
    """A small MLP policy: ``logits = W_2 tanh(W_1 h + b_1) + b_2`` with
    ``h = E_x[x] + E_t[t] + E_prev[prev] + mean_j E_tok[y_j]``.

    Parameters
    ----------
    mdp : TokenMDP
    generator : torch.Generator
        Source of every initial weight.
    hidden : int
        Width of the embeddings and of the hidden layer.
    """

    def __init__(self, mdp: TokenMDP, *, generator: torch.Generator, hidden: int = 16) -> None:
        super().__init__(mdp)
        _check_generator(generator)
        if hidden < 1:
            raise ValueError(f"hidden: must be >= 1, got {hidden}")
        V, P, L, H = mdp.vocab_size, mdp.num_prompts, mdp.max_len, hidden

        def init(*shape: int, fan_in: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator, dtype=torch.float64)
                                / fan_in ** 0.5)

        self.emb_prompt = init(P, H, fan_in=1)
        self.emb_depth = init(L, H, fan_in=1)
        self.emb_prev = init(V, H, fan_in=1)
        self.emb_token = init(V, H, fan_in=1)
        self.w1 = init(H, H, fan_in=H)
        self.b1 = nn.Parameter(torch.zeros(H, dtype=torch.float64))
        self.w2 = init(H, V, fan_in=H)
        self.b2 = nn.Parameter(torch.zeros(V, dtype=torch.float64))
        self._register_prompt_last()

    def logits(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """The MLP's output at the given states.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
            The prompt of each state.
        prefix : LongTensor ``[N, k]``
            The response tokens so far of each state (all at depth ``k``).

        Returns
        -------
        Tensor ``[N, V]``
            Float64 logits.
        """
        k = prefix.shape[1]
        prev = self._previous_token(prompt_index, prefix)
        h = self.emb_prompt[prompt_index] + self.emb_depth[k] + self.emb_prev[prev]
        if k > 0:
            h = h + self.emb_token[prefix].mean(1)
        return torch.tanh(h @ self.w1 + self.b1) @ self.w2 + self.b2
