"""Shared Hypothesis cases for the tests of :mod:`tokenmdp.testing`: a step, its estimator and a
model whose log-probs the step's old / behaviour / reference log-probs lie close to.

With log-probs drawn independently of the model, almost every ratio ``pi/pi_old`` would sit far
outside the clip ranges (GSPO clips at 3e-4) and most gradients would vanish, making the
gradient half of the checks vacuous. So the old log-probs are the model's own plus noise of a
drawn scale (0: exactly on-policy), and behaviour and reference log-probs the old ones plus noise.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from tokenmdp import testing
from tokenmdp.batch import TokenBatch

#: response-length bound of the drawn batches, the L_max passed to prepare (Dr. GRPO needs it)
MAX_RESPONSE_LEN = 4
NOISE_SCALES = (0.0, 1e-3, 0.1, 1.0)


def aligned_logprobs(batch: TokenBatch, model, *, old_noise: float, other_noise: float,
                     seed: int) -> TokenBatch:
    """``batch`` with old = model log-probs + noise; behaviour, reference = old + noise."""
    gen = torch.Generator().manual_seed(seed)
    response = batch.response_mask
    with torch.no_grad():
        current = model(batch).to(torch.float64)

    def noisy(base: torch.Tensor, scale: float) -> torch.Tensor:
        noise = torch.randn(base.shape, generator=gen, dtype=torch.float64) * scale
        return torch.where(response, base + noise, torch.zeros_like(base))

    old = noisy(current, old_noise)
    return batch.replace(old_logprob=old.to(batch.dtype),
                         behavior_logprob=noisy(old, other_noise).to(batch.dtype),
                         ref_logprob=noisy(old, other_noise).to(batch.dtype))


@st.composite
def steps(draw, *, dtype: torch.dtype = torch.float64, estimators=None):
    """``(batch, estimator, model)`` for the invariance checks."""
    batch = draw(testing.token_batches(dtype=dtype, with_logprobs=True,
                                       max_response_len=MAX_RESPONSE_LEN))
    est = draw(estimators if estimators is not None else testing.estimators())
    model = testing.TokenTable.for_batch(batch, seed=draw(st.integers(0, 2**16)))
    batch = aligned_logprobs(batch, model, old_noise=draw(st.sampled_from(NOISE_SCALES)),
                             other_noise=draw(st.sampled_from(NOISE_SCALES)),
                             seed=draw(st.integers(0, 2**16)))
    return batch, est, model
