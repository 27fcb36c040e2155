"""Long-answer tasks: the trace against numpy's cumulative sum, the exact reward, the lengths,
the held-out split, the registration the trainer looks tasks up in."""

import subprocess
import sys

import numpy as np
import pytest

from tokenmdp.rl.config import TrainConfig, check_config
from tokenmdp.rl.tasks import (
    LENGTHS,
    LONG_TASKS,
    TASKS,
    CharTokenizer,
    Example,
    RunningSum,
    get_task,
    running_sum_trace,
)

TOK = CharTokenizer()
EOS = CharTokenizer.EOS


def test_trace_against_numpy_cumsum():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 64, 200):
        digits = rng.integers(0, 10, size=n)
        expected = "".join(str(s) for s in np.cumsum(digits) % 10)
        assert running_sum_trace("".join(map(str, digits))) == expected
    assert running_sum_trace("3141") == "3489"      # by hand: 3, 3+1, 4+4, 8+1
    assert running_sum_trace("99") == "98"          # 9, 18 mod 10
    for bad in ("", "12a", "1 2", "٣"):             # "٣": an Arabic-Indic digit, not ASCII
        with pytest.raises(ValueError, match="digits"):
            running_sum_trace(bad)


def test_exact_reward():
    task = RunningSum(length=4)
    ex = Example("3141=", "3489")
    assert task.reward(ex, TOK.encode("3489") + [EOS]) == 1.0
    assert task.reward(ex, TOK.encode("3489")) == 0.0              # truncated: no EOS
    assert task.reward(ex, TOK.encode("3480") + [EOS]) == 0.0      # last digit wrong
    assert task.reward(ex, TOK.encode("348") + [EOS]) == 0.0       # one digit short
    assert task.reward(ex, TOK.encode("34890") + [EOS]) == 0.0     # one digit too many
    rng = np.random.default_rng(1)
    for _ in range(20):   # every drawn example: its answer is numpy's trace of its prompt
        ex = task.draw(rng)
        digits = np.array([int(c) for c in ex.prompt[:-1]])
        assert ex.answer == "".join(str(s) for s in np.cumsum(digits) % 10)
        assert task.reward(ex, TOK.encode(ex.answer) + [EOS]) == 1.0


def test_lengths_of_the_registered_tasks():
    assert set(LONG_TASKS) <= set(TASKS)
    assert min(n for n in LENGTHS if n >= 64) == 64
    for n in LENGTHS:
        task = get_task(f"running_sum_{n}")
        assert task.name == f"running_sum_{n}" and task.length == n
        for ex in task.sample(5, np.random.default_rng(n)):
            assert len(ex.prompt) == task.max_prompt_len() == n + 1
            assert len(TOK.encode(ex.answer) + [EOS]) == n + 1
    long = get_task("running_sum_64")
    assert len(long.draw(np.random.default_rng(0)).answer) + 1 >= 64


def test_held_out_split_is_disjoint_from_training():
    for n in (8, 64):
        task = get_task(f"running_sum_{n}")
        split = task.eval_split(50, seed=3)
        assert split == task.eval_split(50, seed=3)
        prompts = {ex.prompt for ex in split}
        assert len(prompts) == 50
        train = task.sample(500, np.random.default_rng(0), exclude=frozenset(prompts))
        assert not prompts & {ex.prompt for ex in train}


def test_bad_options_and_the_trainer_accepts_the_task():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="length"):
            RunningSum(length=bad)
    with pytest.raises(ValueError, match="tokenizer"):
        RunningSum(CharTokenizer("0123456789+"))
    check_config(TrainConfig(task="running_sum_64", max_new_tokens=66))
    # importing the long tasks' module first gives every task as well
    code = "import tokenmdp.rl.tasks.running_sum; from tokenmdp.rl.tasks import TASKS; print(len(TASKS))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == len(TASKS)
