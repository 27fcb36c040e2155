"""tokenmdp.course.tutorials.t05, tutorial 5's helpers: the printed rows against the batch fields' closed
forms (A = 1 and w = 1/N for SFT; A = R − group mean and w = 1/S for MiniRL), packing that keeps
every sampled sequence, window means of the evaluation table recomputed by hand, the binomial
standard error against the enumerated binomial, and a figure with titles and labelled axes."""

import math

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.course.tutorials import t05
from tokenmdp.packing import pack_first_fit_decreasing
from tokenmdp.rl.config import TrainConfig
from tokenmdp.rl.rollout import RolloutEngine
from tokenmdp.rl.run_setup import build_model
from tokenmdp.rl.tasks import Example, get_task
from tokenmdp.rl.trainer import SFT_ESTIMATOR

EXACT_TOL = 1e-12  # two float64 computations of the same quantity
PRINT_TOL = 5e-4   # a value printed with 3 decimals, against the exact one

TASK = get_task("addition")
TOK = TASK.tokenizer
EXAMPLES = [Example("1+2=", "3"), Example("5+5=", "10"), Example("4+5=", "9")]


def _batches():
    """Section 1's two batches for EXAMPLES, prepared (on-policy: every log-prob 0)."""
    sft = TokenBatch.from_sequences([TOK.encode(ex.prompt) for ex in EXAMPLES],
                                    [TOK.encode(ex.answer) + [TOK.EOS] for ex in EXAMPLES],
                                    rewards=[1.0] * len(EXAMPLES))
    rl_examples, rl_responses = t05.hand_written_groups(TOK, EXAMPLES)
    rl = TokenBatch.from_sequences(
        [TOK.encode(ex.prompt) for ex in rl_examples], rl_responses,
        rewards=[TASK.reward(ex, r) for ex, r in zip(rl_examples, rl_responses)],
        groups=[i for i in range(len(EXAMPLES)) for _ in range(3)])
    zeros = torch.zeros(rl.tokens.shape, dtype=torch.float64)
    rl = rl.replace(old_logprob=zeros, behavior_logprob=zeros.clone())
    return sft, rl


def _rows(text):
    """(seq, text, R, advantages, weights) of each sequence line of a fields_table."""
    rows = []
    for line in text.splitlines()[2:]:
        seq, seq_text, reward, *values = line.split()
        adv = [float(v) for v in values if v[0] in "+-"]
        w = [float(v) for v in values if v[0] not in "+-"]
        rows.append((int(seq), seq_text, float(reward), adv, w))
    return rows


def test_hand_written_groups_are_right_wrong_and_longer_wrong():
    rl_examples, rl_responses = t05.hand_written_groups(TOK, EXAMPLES)
    assert rl_examples == [ex for ex in EXAMPLES for _ in range(3)]
    assert [TOK.decode(r) for r in rl_responses] == ["3", "4", "60", "10", "11", "130",
                                                     "9", "0", "20"]
    assert all(r[-1] == TOK.EOS for r in rl_responses)
    rewards = [TASK.reward(ex, r) for ex, r in zip(rl_examples, rl_responses)]
    assert rewards == [1.0, 0.0, 0.0] * 3
    with pytest.raises(ValueError, match="examples"):
        t05.hand_written_groups(TOK, [Example("1+2=", "")])


def test_batch_summary_names_each_example_and_counts_the_loss_tokens():
    sft, rl = _batches()
    lines = t05.batch_summary(EXAMPLES, sft, rl).splitlines()
    assert [line.split(" -> ") for line in lines[:3]] == [
        [f"{ex.prompt!r:>9}", repr(ex.answer)] for ex in EXAMPLES]
    n_sft = sum(len(ex.answer) + 1 for ex in EXAMPLES)                   # answer tokens and EOS
    n_rl = sum(len(a) + 1 for a in ["3", "4", "60", "10", "11", "130", "9", "0", "20"])
    assert lines[3] == f"SFT batch: 3 sequences, {n_sft} loss tokens"
    assert lines[4].startswith(f"RL batch:  9 sequences, {n_rl} loss tokens, rewards [1.0, 0.0")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_fields_table_rows_are_the_closed_forms_of_sft_and_minirl(packed):
    sft, rl = _batches()
    if packed:  # a layout change: the rows, in sequence order, must not change
        sft, rl = pack_first_fit_decreasing(sft, 12), pack_first_fit_decreasing(rl, 12)
    sft = estimators.prepare(sft, SFT_ESTIMATOR)
    rl = estimators.prepare(rl, estimators.get("minirl"), max_len=4)
    sft_rows = _rows(t05.fields_table(sft, TOK, "SFT"))
    n = sum(len(ex.answer) + 1 for ex in EXAMPLES)
    assert [r[0] for r in sft_rows] == [0, 1, 2]
    for (_, text, reward, adv, w), ex in zip(sft_rows, EXAMPLES):
        assert text == ex.prompt + ex.answer + "·" and reward == 1.0
        assert adv == [1.0] * (len(ex.answer) + 1)
        assert np.allclose(w, 1 / n, atol=PRINT_TOL, rtol=0)
    rewards = np.array([1.0, 0.0, 0.0] * 3)
    advantage = rewards - rewards.reshape(3, 3).mean(1).repeat(3)     # A = R − group mean
    answers = ["3", "4", "60", "10", "11", "130", "9", "0", "20"]
    rl_rows = _rows(t05.fields_table(rl, TOK, "RL"))
    for s, (seq, text, reward, adv, w) in enumerate(rl_rows):
        assert seq == s and text == EXAMPLES[s // 3].prompt + answers[s] + "·"
        assert reward == rewards[s] and len(adv) == len(w) == len(answers[s]) + 1
        assert np.allclose(adv, advantage[s], atol=PRINT_TOL, rtol=0)
        assert np.allclose(w, 1 / 9, atol=PRINT_TOL, rtol=0)                # w = 1/S


def test_packed_rollouts_keep_every_sequence_of_the_engines_samples():
    model = build_model(TrainConfig(seed=0, d_model=16, n_layers=1, n_heads=2, n_experts=2,
                                    top_k=1, expert_hidden=16), TOK.vocab_size)
    prompts = [TOK.encode(ex.prompt) for ex in TASK.sample(6, np.random.default_rng(1))]
    capacity = 2 * (TASK.max_prompt_len() + 4)  # room for two sequences per row
    engine = RolloutEngine(model, precision="fp32")
    packed = t05.packed_rollouts(engine, prompts, max_new_tokens=4, eos_id=TOK.EOS,
                                 capacity=capacity, seed=3)
    plain = engine.generate(prompts, max_new_tokens=4, eos_id=TOK.EOS,
                            generator=torch.Generator().manual_seed(3))
    assert packed.num_sequences == len(prompts) and packed.tokens.shape[1] <= capacity
    assert packed.tokens.shape[0] < plain.tokens.shape[0]        # rows are shared: it packed

    def per_sequence(batch, field):
        return [field[batch.sequence_id == s].tolist() for s in range(batch.num_sequences)]

    assert per_sequence(packed, packed.tokens) == per_sequence(plain, plain.tokens)
    assert per_sequence(packed, packed.behavior_logprob) == per_sequence(plain,
                                                                         plain.behavior_logprob)


def _run(steps, eval_at, **fields):
    """Metric rows written by hand: `fields` maps a key to a function of the step."""
    return [{"step": k, **{key: f(k) for key, f in fields.items()},
             **({"eval_accuracy": 0.1 + 0.1 * k} if k in eval_at else {})} for k in range(steps)]


def test_run_summary_reports_steps_time_and_the_largest_ratio_deviation():
    sft = _run(4, (), time_s=lambda k: 0.25)
    rl = _run(3, (2,), time_s=lambda k: 0.5, r_max=lambda k: 1 + 1e-3 * k,
              r_min=lambda k: 1 - 3e-3 * (k == 1), clip_fraction=lambda k: 0.0,
              reward=lambda k: 1 / 3)
    lines = t05.run_summary(sft, rl).splitlines()
    assert lines[0] == "SFT: 4 steps in 1.0 s; RL: 3 steps in 1.5 s"
    assert lines[1] == "an RL row: " + str({**rl[-1], "reward": 0.3333, "r_max": 1.002,
                                            "eval_accuracy": 0.3})
    assert lines[2].startswith("one mini-batch per step: max |r − 1| over the run 3.0e-03, ")
    with pytest.raises(ValueError, match="rl_rows"):
        t05.run_summary(sft, [])


@pytest.mark.parametrize("p, n", [(0.0, 10), (0.3, 7), (0.52, 200), (1.0, 3)])
def test_binomial_se_is_the_standard_deviation_of_an_enumerated_binomial_fraction(p, n):
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    mean = sum(q * k / n for k, q in enumerate(pmf))
    var = sum(q * (k / n - mean) ** 2 for k, q in enumerate(pmf))
    assert abs(t05.binomial_se(p, n) - math.sqrt(var)) < EXACT_TOL


@pytest.mark.parametrize("p, n, name", [(1.5, 10, "p"), (-0.1, 10, "p"), (0.5, 0, "n")])
def test_binomial_se_names_a_bad_argument(p, n, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        t05.binomial_se(p, n)


def test_evaluation_table_means_the_steps_since_the_previous_evaluation():
    rewards = [0.1, 0.4, 0.7, 0.2, 0.9, 0.5]
    k1 = [-2e-4, 1e-4, 4e-4, 3e-4, -5e-4, 1e-4]
    rl = _run(6, (2, 5), reward=lambda k: rewards[k], train_infer_kl_k1=lambda k: k1[k],
              train_infer_kl_k3=lambda k: 1e-4 * (k + 1), routing_mismatch=lambda k: 0.001 * k)
    sft = _run(4, (1, 3))
    lines = t05.evaluation_table({"SFT": sft, "RL": rl}, 50).splitlines()
    assert lines[0].split() == ["run", "step", "mean", "train", "reward", "held-out", "accuracy",
                                "KL", "k1", "KL", "k3", "mismatch"]
    assert [line.split()[:3] for line in lines[1:3]] == [["SFT", "2", "(demonstrations)"],
                                                        ["SFT", "4", "(demonstrations)"]]
    assert all(len(line.split()) == 6 for line in lines[1:3])               # no KL columns
    for line, window, step in zip(lines[3:], (slice(0, 3), slice(3, 6)), (2, 5)):
        name, shown_step, reward, acc, _, se, kl1, kl3, mismatch = line.split()
        acc_exact = 0.1 + 0.1 * step
        assert (name, int(shown_step)) == ("RL", step + 1)
        assert abs(float(reward) - np.mean(rewards[window])) < PRINT_TOL
        assert abs(float(acc) - acc_exact) < PRINT_TOL
        assert abs(float(se) - math.sqrt(acc_exact * (1 - acc_exact) / 50)) < PRINT_TOL
        assert math.isclose(float(kl1), np.mean(k1[window]), rel_tol=5e-3)
        k3 = np.mean([1e-4 * (k + 1) for k in range(6)][window])
        assert math.isclose(float(kl3), k3, rel_tol=5e-3)
        assert abs(float(mismatch) - np.mean([0.001 * k for k in range(6)][window])) < PRINT_TOL
    assert len(lines) == 5


def test_training_curves_returns_three_titled_labelled_panels():
    sft = _run(4, (1, 3))
    rl = _run(3, (2,), reward=lambda k: 0.1 * k, train_infer_kl_k1=lambda k: -1e-4 * k,
              train_infer_kl_k3=lambda k: 1e-4 * k)
    fig = t05.training_curves(sft, rl, 50)
    try:
        assert len(fig.axes) == 3
        for ax in fig.axes:
            assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
            assert ax.get_legend() is not None
        k1_line = fig.axes[2].get_lines()[0]
        assert list(k1_line.get_xdata()) == [5, 6, 7]                   # continues SFT's 4 steps
        assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["SFT", "MiniRL"]
    finally:
        plt.close(fig)
