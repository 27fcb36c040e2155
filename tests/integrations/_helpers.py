"""Random TokenBatches and the loss and gradient of an estimator on them (float64)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings

from tokenmdp.estimators import loss, prepare
from tokenmdp.testing import token_batches

EXACT = 1e-12
L_MAX = 4


def loss_and_grad(est, batch, lp):
    step = prepare(batch, est, max_len=L_MAX)
    value, _ = loss(lp, step, est)
    return value.detach(), torch.autograd.grad(value, lp)[0]


def logprobs(batch, seed: int = 0):
    """``log π_θ`` near ``log π_old``: ratios across every clip band used here."""
    g = torch.Generator().manual_seed(seed)
    noise = 0.6 * torch.randn(batch.old_logprob.shape, generator=g, dtype=torch.float64)
    return (batch.old_logprob + noise * batch.loss_mask).requires_grad_(True)


def assert_same_loss(a, b, batch, seed: int = 0):
    lp = logprobs(batch, seed)
    va, ga = loss_and_grad(a, batch, lp)
    vb, gb = loss_and_grad(b, batch, lp)
    assert abs(float(va - vb)) <= EXACT * max(1.0, abs(float(vb)))
    assert float((ga - gb).abs().max()) <= EXACT


def on_random_batches(test):
    """Run ``test(batch)`` on a few random float64 batches with every log-prob field."""
    return settings(max_examples=8, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])(
        given(token_batches(with_logprobs=True, max_response_len=L_MAX))(test))
