"""Shared Hypothesis cases for the tree invariance tests: a tree step, its model, and old /
behaviour / reference log-probs near the model's own, one value per node.

As in :mod:`tests.testing.cases`, log-probs drawn independently of the model would clip almost
every ratio and make the gradient half of the checks vacuous, so the old log-probs are the
model's (computed through the packed tree, hence one value per node) plus per-node noise of a
drawn scale (0: exactly on-policy), behaviour and reference the old ones plus noise.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from tokenmdp import testing
from tokenmdp.batch import TokenBatch
from tokenmdp.tree_training import packed_tree_logprobs
from tokenmdp.trees import TREE_NODE

#: response-length bound passed to prepare as L_max (Dr. GRPO needs it); trees are shallower
MAX_LEN = 16
NOISE_SCALES = (0.0, 1e-3, 0.1)


def aligned_tree_logprobs(batch: TokenBatch, model, *, noise: float, seed: int) -> TokenBatch:
    """``batch`` with old = the model's log-probs + per-node noise; behaviour, reference = old
    + per-node noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        current = packed_tree_logprobs(model, batch).to(torch.float64)
    node = batch.token_extras[TREE_NODE].clamp(min=0)
    num = int(node.max()) + 1
    response = batch.response_mask

    def noisy(base: torch.Tensor) -> torch.Tensor:
        shift = torch.randn(num, generator=gen, dtype=torch.float64) * noise
        return torch.where(response, base + shift[node], 0.0)

    old = noisy(current)
    return batch.replace(old_logprob=old.to(batch.dtype),
                         behavior_logprob=noisy(old).to(batch.dtype),
                         ref_logprob=noisy(old).to(batch.dtype))


@st.composite
def tree_steps(draw, *, noise_scales: tuple[float, ...] = NOISE_SCALES, **batch_kwargs):
    """``(batch, model)``: a tree batch with aligned log-probs and its MoE model."""
    batch = draw(testing.tree_batches(**batch_kwargs))
    model = testing.tree_check_model(batch, seed=draw(st.integers(0, 2**16)))
    batch = aligned_tree_logprobs(batch, model, noise=draw(st.sampled_from(noise_scales)),
                                  seed=draw(st.integers(0, 2**16)))
    return batch, model
