"""Issue 17: the metrics of the step's data alone (the training–inference KL, the correction's
diagnostics) are computed once per (batch, estimator) and cached with the step constants; a
later call returns the same values as a fresh batch, copies a caller may change, and an in-place
change of the batch's log-probs recomputes them."""

import pytest
import torch

from tests.estimators.fused.test_fused_loss import fixture
from tokenmdp import estimators as E
from tokenmdp.testing.strategies import token_batches


def _fresh(batch):
    """The same batch as a new object (no constants cached for it)."""
    return batch.replace(loss_weight=batch.loss_weight.clone())


def _metrics(step, est, lp):
    return E.loss(lp, step, est)[1]


def _assert_equal(got, expected):
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), (key, got[key], expected[key])


@pytest.mark.parametrize("name", ["reinforce", "grpo_mis", "gspo_geo_mis", "dapo_trl_mis"])
def test_cached_step_metrics_equal_a_fresh_computation(name):
    est = E.get(name)
    step = E.prepare(fixture(3), est, max_len=8)
    lp = step.old_logprob + 0.2 * torch.randn(step.tokens.shape, dtype=step.dtype,
                                              generator=torch.Generator().manual_seed(0))
    first = _metrics(step, est, lp)
    assert "train_infer_kl_k3" in first and "is_ess" in first
    for value in first.values():   # a caller changing its metrics changes no later call's
        value.add_(100.0)
    _assert_equal(_metrics(step, est, lp), _metrics(_fresh(step), est, lp))
    step.behavior_logprob.sub_(0.3)   # in place: the cached metrics are recomputed
    _assert_equal(_metrics(step, est, lp), _metrics(_fresh(step), est, lp))


def test_cached_step_metrics_on_hypothesis_batches():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None)
    @given(token_batches(with_logprobs=True), st.sampled_from(E.names()))
    def check(batch, name):
        est = E.get(name)
        step = E.prepare(batch, est, max_len=8)
        lp = step.old_logprob - 0.1
        _metrics(step, est, lp)
        _assert_equal(_metrics(step, est, lp), _metrics(_fresh(step), est, lp))
    check()
