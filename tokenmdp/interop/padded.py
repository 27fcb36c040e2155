"""Conversions between :class:`~tokenmdp.batch.TokenBatch` and other batch formats.

* Hugging Face-style padded dicts: :func:`to_hf` and :func:`from_hf`;
* plain lists of token lists: :func:`from_token_lists`.

The Hugging Face layout carries three tensors of shape ``[S, L]``, one sequence per row:

* ``input_ids`` -- the tokens, ``pad_token_id`` on padding;
* ``attention_mask`` -- 1 on real tokens, 0 on padding (right padding on output; any contiguous
  run of ones, so left padding too, on input);
* ``labels`` -- the token id where ``loss_mask`` is set, -100 elsewhere. As in
  ``transformers``' causal language models, ``labels[s, t]`` is the target *at* position ``t``
  (the model shifts it internally), exactly the alignment of ``loss_mask`` and ``logprobs``.

So it carries ``tokens``, the sequence boundaries (hence ``sequence_id`` and ``position``) and
``loss_mask``. Everything else is passed separately, under the keyword names of :func:`from_hf`:
``length`` (the prompt / response split, which ``labels`` cannot always tell: a response may
have unmasked tokens), the per-sequence ``reward``, ``group``, ``prompt_index``, the per-token
``advantage``, ``loss_weight``, ``behavior_logprob``, ``old_logprob``, ``ref_logprob`` and
``token_extras``, all in the same padded ``[S, L, ...]`` layout as ``input_ids``. Hence
``from_hf(**hf, **fields)`` with ``hf, fields = to_hf(batch)`` is lossless: it equals
``padded_layout(batch)`` in every field (integer fields come back as int64).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.packing import padded_layout, relayout
from tokenmdp.placement import place_padded

__all__ = ["IGNORE_INDEX", "from_hf", "from_token_lists", "to_hf"]

IGNORE_INDEX = -100
"""Label of a token without loss in the Hugging Face convention (``CrossEntropyLoss``)."""

_OPTIONAL_TOKEN_FLOATS = ("behavior_logprob", "old_logprob", "ref_logprob")


def to_hf(batch: TokenBatch, *, pad_token_id: int = 0,
          capacity: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Hugging Face-style padded tensors of a batch, plus the fields they do not carry.

    Parameters
    ----------
    batch : TokenBatch
        Any layout.
    pad_token_id : int
        Token id written on padding of ``input_ids``.
    capacity : int, optional
        Padded width ``L`` (default: the longest sequence).

    Returns
    -------
    hf : dict
        ``input_ids``, ``attention_mask``, ``labels``: LongTensors ``[S, L]``, row ``s`` holds
        sequence ``s``, right padding.
    fields : dict
        ``length``, ``reward``, ``group``, ``prompt_index`` (``[S]``); ``advantage``,
        ``loss_weight`` and those of ``behavior_logprob``, ``old_logprob``, ``ref_logprob`` that
        are set (``[S, L]``, 0 on padding); ``token_extras`` (a dict of ``[S, L, ...]``).
    """
    padded = padded_layout(batch, capacity)
    real = padded.sequence_id >= 0
    tokens = padded.tokens.long()
    hf = {"input_ids": torch.where(real, tokens, torch.full_like(tokens, pad_token_id)),
          "attention_mask": real.long(),
          "labels": torch.where(padded.loss_mask, tokens, torch.full_like(tokens, IGNORE_INDEX))}
    fields: dict[str, object] = {name: getattr(padded, name) for name in
                                 ("length", "reward", "group", "prompt_index", "advantage",
                                  "loss_weight")}
    fields.update({name: getattr(padded, name) for name in _OPTIONAL_TOKEN_FLOATS
                   if getattr(padded, name) is not None})
    fields["token_extras"] = dict(padded.token_extras)
    return hf, fields


def _tensor(name: str, value: object, shape: tuple[int, ...], device: torch.device,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    t = torch.as_tensor(value, device=device, dtype=dtype)
    if tuple(t.shape[: len(shape)]) != shape:
        raise ValueError(f"{name}: expected shape {shape}..., got {tuple(t.shape)}")
    return t


def from_hf(input_ids: object, attention_mask: object = None, labels: object = None, *,
            length: object = None, reward: object = None, group: object = None,
            prompt_index: object = None, advantage: object = None, loss_weight: object = None,
            behavior_logprob: object = None, old_logprob: object = None,
            ref_logprob: object = None, token_extras: Mapping[str, object] | None = None,
            dtype: torch.dtype | None = None) -> TokenBatch:
    """A padded :class:`TokenBatch` (row ``s`` = sequence ``s``, right padding, capacity ``L``)
    from Hugging Face-style tensors.

    Parameters
    ----------
    input_ids : integer ``[S, L]``
        Token ids; values on padding are ignored.
    attention_mask : ``[S, L]`` of 0/1, optional
        Real tokens of each row, one contiguous run (right or left padding). Default: all real.
    labels : integer ``[S, L]``, optional
        ``input_ids`` on loss tokens, -100 elsewhere (and on all padding). Default: loss on
        every response token.
    length : integer ``[S]``, optional
        Response tokens per sequence. Default: from the first labelled token to the end (0
        without labels).
    reward, group, prompt_index : ``[S]``, optional
        Defaults 0, ``arange(S)``, ``group``.
    advantage, loss_weight : float ``[S, L]``, optional
        Same layout as ``input_ids``. Default: 1 on loss tokens, 0 elsewhere.
    behavior_logprob, old_logprob, ref_logprob : float ``[S, L]``, optional
        Per-token log-probs of the sampler, the old policy and the reference, same layout as
        ``input_ids``.
    token_extras : mapping of str to ``[S, L, ...]``, optional
        Further per-token data (e.g. routing traces), moved with the tokens by packing.
    dtype : torch.dtype, optional
        Float dtype of the defaults and of float fields given as lists (default: that of the
        first float field given as a tensor, else float64). Tensors are never cast.

    Returns
    -------
    TokenBatch
        One row per sequence, the real tokens moved to the left of each row (right padding).

    Raises
    ------
    ValueError
        Naming the argument: wrong shape, an empty row, a non-contiguous ``attention_mask``,
        ``labels`` that differ from ``input_ids`` or are set on padding.
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input_ids: expected an integer tensor [S, L], got shape "
                         f"{tuple(ids.shape)} and dtype {ids.dtype}")
    ids = ids.long()
    num_seq, width = ids.shape
    device = ids.device
    real = (torch.ones_like(ids, dtype=torch.bool) if attention_mask is None
            else _tensor("attention_mask", attention_mask, (num_seq, width), device) != 0)
    n_tokens = real.sum(1)
    if bool((n_tokens == 0).any()):
        raise ValueError(f"attention_mask: row {int(torch.argmin(n_tokens))} has no real token")
    start = real.long().argmax(1)                    # first real column of each row
    col = torch.arange(width, device=device)
    position = col - start[:, None]
    if bool((real != ((position >= 0) & (position < n_tokens[:, None]))).any()):
        raise ValueError("attention_mask: the real tokens of a row must be one contiguous run")

    if labels is None:
        loss_mask = None
    else:
        lab = _tensor("labels", labels, (num_seq, width), device).long()
        loss_mask = lab != IGNORE_INDEX
        if bool((loss_mask & ~real).any()):
            raise ValueError(f"labels: must be {IGNORE_INDEX} on padding")
        if bool((loss_mask & (lab != ids)).any()):
            raise ValueError(f"labels: must equal input_ids or be {IGNORE_INDEX}")
    if length is not None:
        response = _tensor("length", length, (num_seq,), device).long()
    elif loss_mask is not None:
        first_loss = torch.where(loss_mask, position, torch.full_like(position, width)).amin(1)
        response = (n_tokens - first_loss).clamp(min=0)
    else:
        response = torch.zeros(num_seq, dtype=torch.long, device=device)
    if loss_mask is None:
        loss_mask = real & (position >= (n_tokens - response)[:, None])

    given = [v for v in (advantage, loss_weight, behavior_logprob, old_logprob, ref_logprob,
                         reward) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if dtype is None:      # float tensors keep their dtype; the rest (lists, integer rewards,
        # defaults) take this one
        dtype = given[0].dtype if given else torch.float64

    def per_token(name: str, value: object, default: torch.Tensor | None) -> torch.Tensor | None:
        if value is None:
            return default
        t = _tensor(name, value, (num_seq, width), device,
                    None if isinstance(value, torch.Tensor) else dtype)
        return torch.where(real, t, torch.zeros_like(t))    # padding values are not data

    group_S = (torch.arange(num_seq, device=device) if group is None
               else _tensor("group", group, (num_seq,), device))
    batch = TokenBatch(
        tokens=torch.where(real, ids, torch.zeros_like(ids)),
        sequence_id=torch.where(real, torch.arange(num_seq, device=device)[:, None], -1),
        position=torch.where(real, position, 0), loss_mask=loss_mask,
        advantage=per_token("advantage", advantage, loss_mask.to(dtype)),
        loss_weight=per_token("loss_weight", loss_weight, loss_mask.to(dtype)),
        behavior_logprob=per_token("behavior_logprob", behavior_logprob, None),
        old_logprob=per_token("old_logprob", old_logprob, None),
        ref_logprob=per_token("ref_logprob", ref_logprob, None),
        reward=(torch.zeros(num_seq, dtype=dtype, device=device) if reward is None
                else _tensor("reward", reward, (num_seq,), device,
                             None if isinstance(reward, torch.Tensor)
                             and reward.is_floating_point() else dtype)),
        group=group_S, length=response,
        prompt_index=(group_S.clone() if prompt_index is None
                      else _tensor("prompt_index", prompt_index, (num_seq,), device)),
        token_extras={k: _tensor(f"token_extras[{k!r}]", v, (num_seq, width), device)
                      for k, v in (token_extras or {}).items()})
    return padded_layout(batch, capacity=width)       # left padding -> right padding


def from_token_lists(token_lists: Sequence[Sequence[int]], *,
                     response_lengths: Sequence[int] | None = None,
                     loss_masks: Sequence[Sequence[bool]] | None = None,
                     rewards: object = None, groups: object = None, prompt_index: object = None,
                     capacity: int | None = None, dtype: torch.dtype = torch.float64,
                     device: torch.device | str | None = None) -> TokenBatch:
    """A padded :class:`TokenBatch` from whole sequences given as lists of token ids.

    Parameters
    ----------
    token_lists : sequence of sequences of int
        Sequence ``s`` (prompt and response together), at least one token each.
    response_lengths : sequence of int, optional
        Response tokens of each sequence (its last ones). Default: from the first loss token of
        ``loss_masks`` to the end, or, without ``loss_masks``, every token but the first
        (pretraining: each token is predicted from the ones before it).
    loss_masks : sequence of sequences of bool, optional
        Per token, whether it gets loss; only response tokens may. Default: every response
        token.
    rewards, groups, prompt_index : ``[S]``, optional
        Defaults 0, ``arange(S)``, ``groups``.
    capacity : int, optional
        Row capacity (default: the longest sequence).
    dtype, device
        Float dtype and device of the batch.

    Returns
    -------
    TokenBatch
        One sequence per row, with ``advantage`` and ``loss_weight`` 1 on loss tokens.
    """
    n_S = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    if bool((n_S == 0).any()):
        raise ValueError(f"token_lists[{int(torch.argmin(n_S))}]: a sequence needs a token")
    tokens_N = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    seq_N = torch.repeat_interleave(torch.arange(len(n_S)), n_S)
    pos_N = torch.arange(tokens_N.numel()) - (torch.cumsum(n_S, 0) - n_S)[seq_N]
    if loss_masks is not None:
        if [len(m) for m in loss_masks] != n_S.tolist():
            raise ValueError("loss_masks: need one flag per token of each sequence")
        mask_N = torch.tensor(list(itertools.chain.from_iterable(loss_masks)), dtype=torch.bool)
    if response_lengths is not None:
        resp_S = _tensor("response_lengths", response_lengths, (len(n_S),), n_S.device).long()
    elif loss_masks is not None:
        first = torch.full_like(n_S, -1).scatter_reduce(
            0, seq_N, torch.where(mask_N, pos_N, n_S[seq_N]), "amin", include_self=False)
        resp_S = n_S - first
    else:
        resp_S = n_S - 1
    if bool(((resp_S < 0) | (resp_S > n_S)).any()):
        raise ValueError("response_lengths: each must lie in [0, number of tokens]")
    if loss_masks is None:
        mask_N = pos_N >= (n_S - resp_S)[seq_N]
    # A flat row holding every sequence, then the padded layout (one scatter per field).
    float_N = mask_N.to(dtype)
    group_S = torch.arange(len(n_S)) if groups is None else torch.as_tensor(groups).long()
    flat = TokenBatch(
        tokens=tokens_N[None], sequence_id=seq_N[None], position=pos_N[None],
        loss_mask=mask_N[None], advantage=float_N[None], loss_weight=float_N[None].clone(),
        reward=(torch.zeros(len(n_S), dtype=dtype) if rewards is None
                else torch.as_tensor(rewards, dtype=dtype)),
        group=group_S, length=resp_S,
        prompt_index=group_S.clone() if prompt_index is None else torch.as_tensor(prompt_index))
    padded = relayout(flat, *place_padded(n_S, capacity))
    return padded if device is None else padded.to(device=device)
