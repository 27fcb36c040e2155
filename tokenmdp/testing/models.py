"""The models an invariance check differentiates through: :class:`TokenTable` by default.

A check of :mod:`tokenmdp.testing.checks` needs log-probs ``[R, C]`` of a batch's tokens that
depend on parameters. :class:`TokenTable` is the default (a free logit vector per prompt,
position and previous token: it depends on a token's own sequence only, never on the layout);
with an MDP the exact :class:`~tokenmdp.exact.TabularPolicy`; otherwise the user's model and
parameters. :class:`TokenTable` is re-exported by :mod:`tokenmdp.testing.checks` and
:mod:`tokenmdp.testing`.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.exact import TabularPolicy, TokenMDP

__all__ = ["TokenTable"]


class TokenTable(nn.Module):
    """A tabular "policy" over tokens: a free logit vector per (prompt, position, previous token).

    ``log pi(y_t | ...) = log_softmax(logits[prompt_index, position, previous token])[y_t]``,
    where the previous token of a sequence's first token is the start symbol ``V``. It depends
    only on a token's own sequence, never on the layout, and every parameter the batch touches
    gets a gradient, so it is the default model of the checks (an embedding-style table, like
    the exact :class:`~tokenmdp.exact.TabularPolicy` but needing no MDP).

    Parameters
    ----------
    num_prompts, num_positions, vocab_size : int
        Table sizes; token ids, positions and prompt indices must lie below them.
    generator : torch.Generator
        Source of the initial logits ``N(0, init_std^2)``.
    dtype : torch.dtype
        Dtype of the table (that of the batches it will score).
    init_std : float, default 1.0
        Standard deviation of the initial logits.
    """

    def __init__(self, num_prompts: int, num_positions: int, vocab_size: int, *,
                 generator: torch.Generator, dtype: torch.dtype = torch.float64,
                 init_std: float = 1.0) -> None:
        super().__init__()
        for name, value in (("num_prompts", num_prompts), ("num_positions", num_positions),
                            ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
        table = torch.randn(num_prompts, num_positions, vocab_size + 1, vocab_size,
                            generator=generator, dtype=torch.float64) * init_std
        self.logits_PTVV = nn.Parameter(table.to(dtype))
        self.vocab_size = vocab_size

    @classmethod
    def for_batch(cls, batch: TokenBatch, *, seed: int = 0, init_std: float = 1.0) -> TokenTable:
        """A table just large enough for ``batch`` (and for any re-layout or part of it).

        Parameters
        ----------
        batch : TokenBatch
            The batch to score; its prompt indices, positions and token ids size the table.
        seed : int, default 0
            Seed of the initial logits.
        init_std : float, default 1.0
            Standard deviation of the initial logits.

        Returns
        -------
        TokenTable
            In ``batch.dtype``.
        """
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
        prompts = int(batch.prompt_index.max()) + 1 if batch.num_sequences else 1
        return cls(prompts, int(batch.position.max()) + 1, max(int(batch.tokens.max()) + 1, 2),
                   generator=torch.Generator().manual_seed(seed), dtype=batch.dtype,
                   init_std=init_std)

    def forward(self, batch: TokenBatch) -> torch.Tensor:
        """``[R, C]`` log-probs of every real token (0 on padding), in the table's dtype.

        Parameters
        ----------
        batch : TokenBatch
            Any layout of sequences the table covers (:meth:`for_batch`).

        Returns
        -------
        Tensor ``[R, C]``
            ``log pi(y_t | prompt, position, previous token)``, differentiable in the table.
        """
        real = batch.sequence_id >= 0
        previous = torch.full_like(batch.tokens, self.vocab_size)
        previous[:, 1:] = batch.tokens[:, :-1]
        previous = torch.where(real & (batch.position > 0), previous, self.vocab_size)
        prompt_RC = batch.to_tokens(batch.prompt_index)
        logits = self.logits_PTVV[prompt_RC, batch.position, previous]       # [R, C, V]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, batch.tokens[..., None])[..., 0]
        return torch.where(real, logprobs, torch.zeros_like(logprobs))


def _resolve_model(model, parameters, mdp, batch, seed):
    """``(batch -> logprobs_RC, [parameters])`` of a check's ``model=``, ``parameters=`` and
    ``mdp=`` arguments (the default :class:`TokenTable`, seeded by ``seed``, when none)."""
    if mdp is not None and not isinstance(mdp, TokenMDP):
        raise TypeError(f"mdp: expected a TokenMDP, got {type(mdp).__name__}")
    if model is None:
        model = (TokenTable.for_batch(batch, seed=seed) if mdp is None else
                 TabularPolicy(mdp, generator=torch.Generator().manual_seed(seed)))
    fn = getattr(model, "token_logprobs", None) or model
    if not callable(fn):
        raise TypeError(f"model: expected a callable batch -> logprobs_RC or an object with "
                        f"token_logprobs(batch), got {type(model).__name__}")
    if parameters is None:
        if not isinstance(model, nn.Module):
            raise TypeError("parameters: required when model is not a torch.nn.Module")
        parameters = model.parameters()
    params = list(parameters)
    if not params or not all(isinstance(p, torch.Tensor) and p.requires_grad for p in params):
        raise ValueError("parameters: expected at least one tensor, each with requires_grad=True")
    return fn, params
