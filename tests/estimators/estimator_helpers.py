"""Builders shared by the estimator tests: small hand-made batches in any layout."""

from __future__ import annotations

import torch

from tokenmdp.batch import TokenBatch

DTYPE = torch.float64


def make_batch(prompts, responses, *, rewards=None, groups=None, old=None, behavior=None,
               ref=None, capacity=None) -> TokenBatch:
    """A padded batch (one sequence per row) with per-response-token log-prob lists."""
    batch = TokenBatch.from_sequences(prompts, responses, rewards=rewards, groups=groups,
                                      capacity=capacity, dtype=DTYPE)
    fields = {}
    for name, values in (("old_logprob", old), ("behavior_logprob", behavior),
                         ("ref_logprob", ref)):
        if values is not None:
            fields[name] = response_values(batch, values)
    return batch.replace(**fields) if fields else batch


def response_values(batch: TokenBatch, per_sequence) -> torch.Tensor:
    """``[R, C]`` tensor holding ``per_sequence[s][t]`` at response token t of sequence s."""
    out = torch.zeros(batch.tokens.shape, dtype=DTYPE)
    rpos = batch.response_position
    sid = batch.sequence_id
    for s, values in enumerate(per_sequence):
        selected = (sid == s) & (rpos >= 0)
        out[selected] = torch.as_tensor(values, dtype=DTYPE)[rpos[selected]]
    return out


def repack(batch: TokenBatch, rows, capacity: int) -> TokenBatch:
    """The same sequences laid out in ``rows`` (lists of sequence ids, packed left to right)."""
    locations = {}  # (sequence, position) -> (row, col) in ``batch``
    for r, c in (batch.sequence_id >= 0).nonzero().tolist():
        locations[(int(batch.sequence_id[r, c]), int(batch.position[r, c]))] = (r, c)
    totals = batch.sequence_lengths_total().tolist()
    src_r = torch.zeros(len(rows), capacity, dtype=torch.long)
    src_c = torch.zeros(len(rows), capacity, dtype=torch.long)
    real = torch.zeros(len(rows), capacity, dtype=torch.bool)
    for new_r, seqs in enumerate(rows):
        col = 0
        for s in seqs:
            for p in range(totals[s]):
                src_r[new_r, col], src_c[new_r, col] = locations[(s, p)]
                real[new_r, col] = True
                col += 1
        assert col <= capacity, "capacity too small"

    def move(t, fill):
        if t is None:
            return None
        out = t[src_r, src_c]
        return torch.where(real, out, torch.full_like(out, fill))

    changes = {name: move(getattr(batch, name), 0)
               for name in ("tokens", "position", "loss_mask", "advantage", "loss_weight",
                            "behavior_logprob", "old_logprob", "ref_logprob")}
    changes["sequence_id"] = move(batch.sequence_id, -1)
    return batch.replace(**changes)


def split_rows(batch: TokenBatch, row_sets) -> list[TokenBatch]:
    """Micro-batches made of the given sets of rows, sequence ids renumbered locally."""
    parts = []
    for rows in row_sets:
        idx = torch.as_tensor(rows)
        sid = batch.sequence_id[idx]
        seqs = torch.unique(sid[sid >= 0])
        remap = torch.full((batch.num_sequences,), -1, dtype=torch.long)
        remap[seqs] = torch.arange(len(seqs))
        new_sid = torch.where(sid >= 0, remap[sid.clamp(min=0)], sid)
        fields = {name: (getattr(batch, name)[idx] if getattr(batch, name) is not None else None)
                  for name in ("tokens", "position", "loss_mask", "advantage", "loss_weight",
                               "behavior_logprob", "old_logprob", "ref_logprob")}
        per_seq = {name: getattr(batch, name)[seqs]
                   for name in ("reward", "group", "length", "prompt_index")}
        parts.append(TokenBatch(sequence_id=new_sid, **fields, **per_seq))
    return parts


def leaf_like(values_RC: torch.Tensor) -> torch.Tensor:
    """A float64 leaf copy that requires grad."""
    return values_RC.detach().clone().requires_grad_(True)


def per_token_values(batch: TokenBatch, values_RC: torch.Tensor) -> list[float]:
    """The loss-token values in (sequence, position) order, whatever the layout."""
    order = sorted(zip(batch.sequence_id[batch.loss_mask].tolist(),
                       batch.position[batch.loss_mask].tolist(),
                       values_RC[batch.loss_mask].tolist(), strict=True))
    return [v for _, _, v in order]


# ``log π_old - log μ`` per loss token of the two-sequence fixture of :func:`weighted_batch`.
LOG_W = [[0.5, -1.0, 1.2], [0.1, 0.2]]


def weighted_batch(rewards, *, packed_order=None) -> TokenBatch:
    """Two sequences (3 and 2 response tokens) with ``old_logprob`` and ``behavior_logprob``
    such that ``log(π_old/μ)`` is :data:`LOG_W`; padded, or packed into one row in the order
    ``packed_order`` (a list of the two sequence ids)."""
    old = [[-1.0, -2.0, -0.5], [-0.3, -0.7]]
    behavior = [[o - lw for o, lw in zip(os_, lws, strict=True)]
                for os_, lws in zip(old, LOG_W, strict=True)]
    batch = make_batch([[9], [8, 8]], [[1, 2, 3], [4, 5]], rewards=rewards, old=old,
                       behavior=behavior)
    return batch if packed_order is None else repack(batch, [packed_order], capacity=8)
