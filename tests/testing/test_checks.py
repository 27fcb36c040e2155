"""Tests of the checkers themselves: they catch layout- and split-dependent losses and models,
report hand-worked differences, and reject bad input naming the argument."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from hypothesis import Phase, settings

from tokenmdp import estimators as est_lib
from tokenmdp import testing
from tokenmdp.batch import TokenBatch
from tokenmdp.exact import TokenMDP
from tokenmdp.exact.world.rewards import RandomTable

EXACT = 1e-12             # hand-worked values in float64
TOKEN_MEAN = est_lib.Estimator(surrogate=est_lib.Reinforce(), aggregation=est_lib.Aggregation.TOKEN_MEAN)
PREPARE = testing.estimator_prepare(TOKEN_MEAN)
LOSS = testing.estimator_loss(TOKEN_MEAN)
PADDED, FLAT = testing.Layout("padded"), testing.Layout("flat")
NO_SHRINK = "tokenmdp-tests-no-shrink"
settings.register_profile(NO_SHRINK, phases=[Phase.explicit, Phase.generate], database=None)


def _batch() -> TokenBatch:
    """Two sequences of one group: prompt (0,), responses (1,) and (2, 2, 2); rewards 1, 1."""
    return TokenBatch.from_sequences([[0], [0]], [[1], [2, 2, 2]], rewards=[1.0, 1.0],
                                     groups=[0, 0])


def _free_logit_model():
    """``log pi(y) = w[y]`` with ``w = (0, 0.5, 1)``: a free parameter per token."""
    w = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    return (lambda b: torch.where(b.sequence_id >= 0, w[b.tokens], 0.0)), [w]


def test_hand_worked_report_of_the_mean_of_micro_batch_means():
    # Token mean over the step: L = -(w1 + 3 w2) / 4 = -0.875, dL/dw = (0, -1/4, -3/4).
    # Mean of the two micro-batch means: -(w1/1 + 3 w2/3) / 2 = -0.75, dL/dw = (0, -1/2, -1/2).
    model, params = _free_logit_model()
    report = testing.check_micro_batch_invariance(
        testing.per_micro_batch_token_mean(TOKEN_MEAN), _batch(), [testing.MicroBatchSplit(2)],
        prepare=PREPARE, model=model, parameters=params, average_micro_batches=True)
    assert report.reference_loss == pytest.approx(-0.875, abs=EXACT)
    assert report.gradient_scale == pytest.approx(0.75, abs=EXACT)
    assert report.loss_difference == pytest.approx(0.125, abs=EXACT)
    assert report.gradient_difference == pytest.approx(0.25, abs=EXACT)
    assert report.loss_tolerance == pytest.approx(testing.FLOAT64_ATOL + testing.FLOAT64_RTOL * 0.875)
    assert report.num_cases == 1 and "num_micro_batches=2" in report.worst_case
    assert not report.ok
    with pytest.raises(AssertionError, match="num_micro_batches=2"):
        report.assert_ok()


def test_a_loss_that_reads_the_column_fails_the_layout_check():
    def by_column(logprobs_RC, batch):   # weights tokens by where they sit in the row
        column = torch.arange(batch.capacity, dtype=batch.dtype).expand_as(logprobs_RC)
        return -(column * logprobs_RC)[batch.loss_mask].sum()
    assert testing.check_layout_invariance(by_column, _batch(), [PADDED]).ok  # same layout
    report = testing.check_layout_invariance(by_column, _batch(), [PADDED, FLAT])
    assert not report.ok and "flat" in report.worst_case
    with pytest.raises(AssertionError):
        testing.check_layout_invariance(by_column, _batch(), [FLAT], raise_on_failure=True)


def test_a_model_that_reads_the_column_fails_the_layout_check():
    # Logits per (column, token), starting uniform: the same loss in every layout at the start,
    # but the gradient lands on other parameters once the tokens move to other columns.
    w = torch.zeros(8, 3, dtype=torch.float64, requires_grad=True)

    def column_model(batch):
        column = torch.arange(batch.capacity).expand_as(batch.tokens)
        return torch.log_softmax(w, -1)[column, batch.tokens]
    report = testing.check_layout_invariance(LOSS, _batch(), [FLAT], prepare=PREPARE,
                                             model=column_model, parameters=[w])
    assert report.loss_difference == pytest.approx(0.0, abs=EXACT)
    assert report.gradient_difference > report.gradient_tolerance


def test_preparing_each_micro_batch_on_its_own_counts_fails():
    # The wrong protocol: prepare inside the per-micro-batch loss (local counts).
    def local(logprobs_RC, batch):
        return LOSS(logprobs_RC, PREPARE(batch))
    split = [testing.MicroBatchSplit(2)]
    assert testing.check_micro_batch_invariance(LOSS, _batch(), split, prepare=PREPARE).ok
    assert not testing.check_micro_batch_invariance(local, _batch(), split).ok


def test_a_loss_without_loss_tokens_reports_a_zero_gradient():
    batch = _batch()
    batch = batch.replace(loss_mask=torch.zeros_like(batch.loss_mask))
    report = testing.check_layout_invariance(LOSS, batch, [FLAT], prepare=PREPARE)
    assert report.ok and report.gradient_scale == 0.0 and report.reference_loss == 0.0


def test_token_table_is_a_normalized_policy_of_prompt_position_and_previous_token():
    batch = testing.Layout("first_fit_decreasing", 3)(_batch())
    table = testing.TokenTable.for_batch(batch, seed=3)
    got = table(batch).detach()
    logits = table.logits_PTVV.detach()
    for r, c in (batch.sequence_id >= 0).nonzero().tolist():     # a plain loop as reference
        s, p = int(batch.sequence_id[r, c]), int(batch.position[r, c])
        prev = int(batch.tokens[r, c - 1]) if p > 0 else table.vocab_size
        row = logits[int(batch.prompt_index[s]), p, prev]
        want = row[int(batch.tokens[r, c])] - torch.logsumexp(row, 0)
        assert float(got[r, c]) == pytest.approx(float(want), abs=EXACT)
    assert float(got[batch.sequence_id < 0].abs().sum()) == 0.0


def test_the_exact_tabular_policy_is_used_when_an_mdp_is_given():
    mdp = TokenMDP(3, 2, RandomTable(0), prompts=[(0,)])
    batch = mdp.enumerate()     # every response once, one group (the prompt), rewards in [0, 1)
    report = testing.check_layout_invariance(LOSS, batch, [FLAT], prepare=PREPARE, mdp=mdp)
    assert report.ok and report.gradient_scale > 0
    with pytest.raises(TypeError, match="float64"):
        testing.check_layout_invariance(LOSS, batch.to(dtype=torch.float32), [FLAT], mdp=mdp)


def test_default_tolerances():
    assert testing.default_tolerances(torch.float64) == (testing.FLOAT64_RTOL, testing.FLOAT64_ATOL)
    assert testing.default_tolerances(torch.float32) == (testing.FLOAT32_RTOL, testing.FLOAT32_ATOL)
    with pytest.raises(TypeError, match="dtype"):
        testing.default_tolerances(torch.float16)


@pytest.mark.parametrize(("kwargs", "error", "argument"), [
    ({"loss_fn": "loss"}, TypeError, "loss_fn"),
    ({"batch": [1, 2]}, TypeError, "batch"),
    ({"cases": []}, ValueError, "layout_fns"),
    ({"cases": FLAT}, TypeError, "layout_fns"),
    ({"cases": [1]}, TypeError, "layout_fns"),
    ({"cases": [lambda b: "x"]}, TypeError, "layout_fn"),
    ({"prepare": 3}, TypeError, "prepare"),
    ({"rtol": -1.0}, ValueError, "rtol"),
    ({"atol": math.nan}, ValueError, "atol"),
    ({"model": lambda b: b.advantage}, TypeError, "parameters"),
    ({"model": 5, "parameters": []}, TypeError, "model"),
    ({"model": lambda b: b.advantage, "parameters": [torch.zeros(2)]}, ValueError, "parameters"),
    ({"mdp": "mdp"}, TypeError, "mdp"),
    ({"raise_on_failure": 1}, TypeError, "raise_on_failure"),
    ({"loss_fn": lambda lp, b: lp}, TypeError, "loss_fn"),
])
def test_bad_input_raises_naming_the_argument(kwargs, error, argument):
    args = {"loss_fn": LOSS, "batch": _batch(), "cases": [FLAT]}
    args.update(kwargs)
    with pytest.raises(error, match=argument):
        testing.check_layout_invariance(args.pop("loss_fn"), args.pop("batch"), args.pop("cases"),
                                        **args)


@pytest.mark.parametrize(("splits", "error"), [
    ([lambda b: b], TypeError),
    ([lambda b: []], TypeError),
    ([lambda b: [b, b]], ValueError),
])
def test_bad_splits_raise_naming_the_argument(splits, error):
    with pytest.raises(error, match="splits"):
        testing.check_micro_batch_invariance(LOSS, _batch(), splits)


def test_bad_factory_arguments():
    with pytest.raises(TypeError, match="estimator"):
        testing.estimator_loss("grpo")
    with pytest.raises(TypeError, match="estimator"):
        testing.estimator_prepare("grpo")
    with pytest.raises(TypeError, match="estimator"):
        testing.per_micro_batch_token_mean("grpo")
    with pytest.raises(ValueError, match="num_prompts"):
        testing.TokenTable(0, 1, 2, generator=torch.Generator())
    with pytest.raises(TypeError, match="generator"):
        testing.TokenTable(1, 1, 2, generator=0)
    with pytest.raises(TypeError, match="average_micro_batches"):
        testing.check_micro_batch_invariance(LOSS, _batch(), [testing.MicroBatchSplit(1)],
                                             average_micro_batches="yes")


def test_the_module_docstring_example_runs_and_catches_its_bug():
    # The example's loss normalizes each micro-batch by its own tokens: the check must fail.
    doc = testing.__doc__
    code = doc[doc.index("    import torch"):doc.index("The second check fails")]
    namespace: dict = {}
    previous = settings.get_current_profile_name()
    settings.load_profile(NO_SHRINK)        # the example sets no phases: skip the slow shrinking
    try:
        exec(compile(textwrap.dedent(code), "tokenmdp.testing docstring", "exec"), namespace)
        with pytest.raises(AssertionError, match="invariance violated in MicroBatchSplit"):
            namespace["test_my_loss"]()
    finally:
        settings.load_profile(previous)
