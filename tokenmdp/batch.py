"""The one batch type both worlds share: :class:`TokenBatch`.

A batch is a set of token sequences (prompt followed by response) laid out in a
``[R, C]`` grid of rows x row capacity. Layout is memory, never meaning: one sequence
per row (padded), several per row (packed) or one flat row all describe the same batch,
because every per-sequence quantity is reduced through ``sequence_id``.

Invariants checked at construction (a violation raises ``ValueError`` naming the field):

* every token tensor has the same shape ``[R, C]``; every per-sequence tensor has shape ``[S]``;
* ``sequence_id`` is ``-1`` on padding and in ``[0, S)`` elsewhere, every sequence id occurs;
* each sequence occupies one contiguous span of a single row with ``position`` 0, 1, 2, ...;
* the last ``length[s]`` tokens of sequence ``s`` are its response, the rest its prompt;
  ``loss_mask`` is only set on response tokens;
* every floating-point field is finite and all of them share one dtype.

The checks themselves are in ``tokenmdp._batch_validation``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tokenmdp._batch_validation import (
    SEQ_FLOAT_FIELDS,
    TOKEN_FLOAT_FIELDS,
    validate,
    validate_float_changes,
)

__all__ = ["TokenBatch"]

@dataclasses.dataclass(frozen=True, eq=False)
class TokenBatch:
    """Packed token sequences with their loss mask, advantages, log-probs and loss weights.

    Token fields have shape ``[R, C]`` (rows x row capacity); sequence fields have shape ``[S]``
    and are indexed by ``sequence_id``. Instances are immutable: use :meth:`replace` to derive
    a batch with some fields changed (validation runs again).

    Parameters
    ----------
    tokens : LongTensor ``[R, C]``
        Token ids; padding positions hold 0.
    sequence_id : LongTensor ``[R, C]``
        Sequence each token belongs to, ``-1`` for padding.
    position : LongTensor ``[R, C]``
        Position of the token inside its own sequence (prompt and response together); 0 on padding.
    loss_mask : BoolTensor ``[R, C]``
        True where the token is a sampled action that receives gradient.
    advantage : float ``[R, C]``
        Per-token weight ``A_{i,t}`` of the log-likelihood (1 for pretraining).
    loss_weight : float ``[R, C]``
        Aggregation coefficient of each token, decided once per optimizer step.
    reward : float ``[S]``
        Scalar reward of each sequence.
    group : LongTensor ``[S]``
        Group (one prompt's G responses) of each sequence.
    length : LongTensor ``[S]``
        Number of response tokens of each sequence (the last ``length`` tokens).
    prompt_index : LongTensor ``[S]``
        Index of the prompt the sequence answers (into the MDP's or task's prompt list).
    behavior_logprob, old_logprob, ref_logprob : float ``[R, C]`` or None
        ``log mu`` (sampling engine), ``log pi_old`` (training engine at the rollout weights) and
        ``log pi_ref`` (reference policy for KL) of each token, when known.
    token_extras : mapping of str to Tensor ``[R, C, ...]``
        Further per-token records (for example MoE routing traces) that travel with their tokens.
    """

    tokens: torch.Tensor
    sequence_id: torch.Tensor
    position: torch.Tensor
    loss_mask: torch.Tensor
    advantage: torch.Tensor
    loss_weight: torch.Tensor
    reward: torch.Tensor
    group: torch.Tensor
    length: torch.Tensor
    prompt_index: torch.Tensor
    behavior_logprob: torch.Tensor | None = None
    old_logprob: torch.Tensor | None = None
    ref_logprob: torch.Tensor | None = None
    token_extras: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        validate(self)
        object.__setattr__(self, "token_extras", dict(self.token_extras))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_sequences(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        *,
        rewards: Sequence[float] | torch.Tensor | None = None,
        groups: Sequence[int] | torch.Tensor | None = None,
        prompt_index: Sequence[int] | torch.Tensor | None = None,
        behavior_logprobs: Sequence[Sequence[float]] | None = None,
        capacity: int | None = None,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ) -> TokenBatch:
        """Build a padded batch, one (prompt, response) sequence per row.

        Parameters
        ----------
        prompts, responses : sequences of token-id sequences
            ``prompts[i] + responses[i]`` is sequence ``i``; response tokens get ``loss_mask``.
        rewards : optional, shape ``[S]``
            Sequence rewards (default 0).
        groups : optional, shape ``[S]``
            Group of each sequence (default: each sequence its own group).
        prompt_index : optional, shape ``[S]``
            Prompt index of each sequence (default: ``groups``).
        behavior_logprobs : optional
            Per sequence, the behaviour log-prob of each response token.
        capacity : int, optional
            Row capacity ``C`` (default: the longest sequence).
        dtype : torch.dtype
            Floating-point dtype of the float fields (default float64).
        device : optional
            Device of every tensor.

        Returns
        -------
        TokenBatch
            With ``advantage`` 1 and ``loss_weight`` 1 on response tokens (pretraining weights).
        """
        if len(prompts) != len(responses):
            raise ValueError(f"prompts and responses differ in length: {len(prompts)} vs "
                             f"{len(responses)}")
        num_seq = len(prompts)
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        longest = max((len(s) for s in seqs), default=0)
        if capacity is None:
            capacity = max(longest, 1)
        if capacity < longest:
            raise ValueError(f"capacity={capacity} is shorter than the longest sequence ({longest})")
        for i, s in enumerate(seqs):
            if len(s) == 0:
                raise ValueError(f"sequence {i} is empty (prompts[{i}] and responses[{i}])")
        tokens = torch.zeros(num_seq, capacity, dtype=torch.long)
        sequence_id = torch.full((num_seq, capacity), -1, dtype=torch.long)
        position = torch.zeros(num_seq, capacity, dtype=torch.long)
        loss_mask = torch.zeros(num_seq, capacity, dtype=torch.bool)
        behavior = None if behavior_logprobs is None else torch.zeros(num_seq, capacity, dtype=dtype)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            n = len(p) + len(r)
            ids = torch.as_tensor(seqs[i])
            if ids.dtype == torch.bool or (ids.is_floating_point() and
                                           bool((ids != ids.round()).any())) or ids.is_complex():
                raise ValueError(f"prompts[{i}], responses[{i}]: token ids must be integers, "
                                 f"got {seqs[i]!r:.60}")
            tokens[i, :n] = ids.long()
            sequence_id[i, :n] = i
            position[i, :n] = torch.arange(n)
            loss_mask[i, len(p):n] = True
            if behavior is not None:
                lp = torch.as_tensor(behavior_logprobs[i], dtype=dtype)
                if lp.shape != (len(r),):
                    raise ValueError(f"behavior_logprobs[{i}] has {lp.numel()} values for "
                                     f"{len(r)} response tokens")
                behavior[i, len(p):n] = lp
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
        def per_sequence(name: str, values, kind: torch.dtype) -> torch.Tensor:
            t = torch.as_tensor(values, dtype=kind).clone()
            if t.shape != (num_seq,):
                raise ValueError(f"{name}: expected {num_seq} values (one per sequence), got "
                                 f"shape {tuple(t.shape)}")
            return t

        reward = (torch.zeros(num_seq, dtype=dtype) if rewards is None
                  else per_sequence("rewards", rewards, dtype))
        group = (torch.arange(num_seq) if groups is None
                 else per_sequence("groups", groups, torch.long))
        pidx = group.clone() if prompt_index is None else per_sequence("prompt_index",
                                                                       prompt_index, torch.long)
        ones = loss_mask.to(dtype)
        batch = cls(tokens=tokens, sequence_id=sequence_id, position=position, loss_mask=loss_mask,
                    advantage=ones, loss_weight=ones.clone(), reward=reward, group=group,
                    length=lengths, prompt_index=pidx, behavior_logprob=behavior)
        return batch if device is None else batch.to(device=device)

    # ------------------------------------------------------------------ shape facts
    @property
    def num_rows(self) -> int:
        """``R``, the number of rows."""
        return self.tokens.shape[0]

    @property
    def capacity(self) -> int:
        """``C``, the row capacity."""
        return self.tokens.shape[1]

    @property
    def num_sequences(self) -> int:
        """``S``, the number of sequences."""
        return self.reward.shape[0]

    @property
    def num_loss_tokens(self) -> int:
        """Number of tokens with ``loss_mask`` set."""
        return int(self.loss_mask.sum())

    @property
    def num_real_tokens(self) -> int:
        """Number of non-padding tokens."""
        return int((self.sequence_id >= 0).sum())

    @property
    def device(self) -> torch.device:
        """Device of every tensor."""
        return self.tokens.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating-point dtype shared by every float field."""
        return self.advantage.dtype

    @property
    def is_padding(self) -> torch.Tensor:
        """Bool ``[R, C]``: True on padding positions."""
        return self.sequence_id < 0

    # ------------------------------------------------------------------ per-sequence reductions
    def sequence_sum(self, values_RC: torch.Tensor) -> torch.Tensor:
        """Sum per-token values over each sequence: ``out[s] = sum_{tokens of s} values``.

        Padding positions are ignored. Works for any layout (one ``index_add``, no loop).
        Differentiable in ``values_RC``.

        Parameters
        ----------
        values_RC : Tensor ``[R, C, ...]``
            Per-token values on this batch's grid (any trailing dimensions).

        Returns
        -------
        Tensor ``[S, ...]``
            The sum over each sequence's tokens, in ``values_RC``'s dtype.
        """
        if values_RC.shape[:2] != self.tokens.shape:
            raise ValueError(f"values_RC: shape {tuple(values_RC.shape)} does not start with the "
                             f"batch's [R, C] = {tuple(self.tokens.shape)}")
        real = self.sequence_id >= 0
        out = values_RC.new_zeros((self.num_sequences, *values_RC.shape[2:]))
        return out.index_add(0, self.sequence_id[real].long(), values_RC[real])

    def to_tokens(self, values_S: torch.Tensor) -> torch.Tensor:
        """Broadcast per-sequence values ``[S, ...]`` to ``[R, C, ...]`` (zero on padding).

        Parameters
        ----------
        values_S : Tensor ``[S, ...]``
            One value (or row of values) per sequence.

        Returns
        -------
        Tensor ``[R, C, ...]``
            ``values_S[sequence_id]`` on every real token, 0 on padding.
        """
        if values_S.shape[:1] != (self.num_sequences,):
            raise ValueError(f"values_S: expected leading dimension S = {self.num_sequences}, got "
                             f"shape {tuple(values_S.shape)}")
        real = self.sequence_id >= 0
        out = values_S.new_zeros((*self.tokens.shape, *values_S.shape[1:]))
        out[real] = values_S[self.sequence_id[real].long()]
        return out

    def sequence_lengths_total(self) -> torch.Tensor:
        """Long ``[S]``: number of tokens (prompt + response) of each sequence.

        Returns
        -------
        LongTensor ``[S]``
            Prompt plus response tokens of each sequence (the ``length`` field counts the
            response only).
        """
        real = self.sequence_id >= 0
        return torch.zeros(self.num_sequences, dtype=torch.long, device=self.device).index_add_(
            0, self.sequence_id[real].long(), torch.ones(int(real.sum()), dtype=torch.long,
                                                         device=self.device))

    @property
    def response_mask(self) -> torch.Tensor:
        """Bool ``[R, C]``: True on response tokens (the last ``length`` tokens of a sequence)."""
        prompt_len = self.sequence_lengths_total() - self.length
        return (self.sequence_id >= 0) & (self.position >= self.to_tokens(prompt_len))

    @property
    def response_position(self) -> torch.Tensor:
        """Long ``[R, C]``: index of a response token inside its response; -1 elsewhere."""
        prompt_len = self.sequence_lengths_total() - self.length
        rpos = self.position - self.to_tokens(prompt_len)
        return torch.where(self.response_mask, rpos, torch.full_like(rpos, -1))

    # ------------------------------------------------------------------ conversions
    def replace(self, **changes: Any) -> TokenBatch:
        """A new batch with some fields replaced (validated again).

        When only per-token float fields (advantage, loss weight, log-probs) or rewards change,
        only those are checked (shape, device, dtype, finiteness): the layout they sit on was
        validated when this batch was built, and is shared.

        Parameters
        ----------
        **changes : Tensor or None
            New values by field name (any field of the dataclass, e.g.
            ``advantage=A_RC, loss_weight=w_RC``); ``None`` clears an optional log-prob.

        Returns
        -------
        TokenBatch
            A new batch; this one is unchanged (tensors not replaced are shared).
        """
        if changes and set(changes) <= set(TOKEN_FLOAT_FIELDS + SEQ_FLOAT_FIELDS):
            validate_float_changes(self, changes)
            new = object.__new__(TokenBatch)
            for f in dataclasses.fields(self):
                object.__setattr__(new, f.name, changes.get(f.name, getattr(self, f.name)))
            object.__setattr__(new, "token_extras", dict(self.token_extras))
            return new
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> TokenBatch:
        """Move every tensor to ``device`` and cast the floating-point fields to ``dtype``.

        Parameters
        ----------
        device : torch.device or str, optional
            Target device of every tensor, ``token_extras`` included (default: stay).
        dtype : torch.dtype, optional
            Floating-point dtype of the float fields (default: keep); integer and bool fields
            keep theirs.

        Returns
        -------
        TokenBatch
            The moved (and cast) batch, validated again.
        """
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating-point dtype, got {dtype}")
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "token_extras":
                changes[f.name] = {k: t.to(device=device) for k, t in v.items()}
            elif v is None:
                continue
            elif f.name in TOKEN_FLOAT_FIELDS + SEQ_FLOAT_FIELDS:
                changes[f.name] = v.to(device=device, dtype=dtype)
            else:
                changes[f.name] = v.to(device=device)
        return dataclasses.replace(self, **changes)

    def sequences(self) -> list[tuple[list[int], list[int]]]:
        """The (prompt, response) token lists of every sequence, in ``sequence_id`` order.

        Returns
        -------
        list of (list of int, list of int)
            ``(prompt, response)`` token ids of sequence ``0 .. S-1``, whatever the layout.
        """
        real = self.sequence_id >= 0
        sid = self.sequence_id[real].tolist()
        pos = self.position[real].tolist()
        tok = self.tokens[real].tolist()
        seqs = [[0] * n for n in self.sequence_lengths_total().tolist()]
        for s, p, t in zip(sid, pos, tok):
            seqs[s][p] = t
        lengths = self.length.tolist()
        return [(seq[: len(seq) - n], seq[len(seq) - n:]) for seq, n in zip(seqs, lengths)]

    def __repr__(self) -> str:
        opt = [n for n in ("behavior_logprob", "old_logprob", "ref_logprob")
               if getattr(self, n) is not None]
        return (f"TokenBatch(R={self.num_rows}, C={self.capacity}, S={self.num_sequences}, "
                f"loss_tokens={self.num_loss_tokens}, dtype={self.dtype}, device={self.device}"
                + (f", with {', '.join(opt)}" if opt else "")
                + (f", extras={sorted(self.token_extras)}" if self.token_extras else "") + ")")
