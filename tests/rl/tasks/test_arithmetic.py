"""Tasks: the tokenizer round trip, exact rewards worked by hand, held-out splits."""

import numpy as np
import pytest

from tokenmdp.rl.tasks import Addition, CharTokenizer, CountA, Example, Sorting, get_task

TOK = CharTokenizer()
EOS = CharTokenizer.EOS


def test_tokenizer_round_trip_and_ids():
    for text in ("12+7=", "3142>", "abaab=", "", "0123456789+=>ab"):
        assert TOK.decode(TOK.encode(text)) == text
    # PAD = 0, EOS = 1, then the characters in order: "0" -> 2, "9" -> 11, "+" -> 12
    assert TOK.encode("09+") == [2, 11, 12]
    assert TOK.vocab_size == 17
    # decode stops at the first EOS and skips padding
    assert TOK.decode([2, 0, 3, EOS, 4]) == "01"
    with pytest.raises(ValueError, match="'x'"):
        TOK.encode("1x")


def test_addition_reward_hand_worked():
    task = Addition()
    ex = Example("12+7=", "19")
    assert task.reward(ex, TOK.encode("19") + [EOS]) == 1.0
    assert task.reward(ex, TOK.encode("19")) == 0.0            # truncated: no EOS
    assert task.reward(ex, TOK.encode("18") + [EOS]) == 0.0
    assert task.reward(ex, TOK.encode("190") + [EOS]) == 0.0
    rng = np.random.default_rng(0)
    for _ in range(50):  # every drawn example is arithmetic that checks out
        ex = task.draw(rng)
        a, b = ex.prompt[:-1].split("+")
        assert int(ex.answer) == int(a) + int(b) and ex.prompt.endswith("=")


def test_sorting_reward_hand_worked():
    task = Sorting()
    ex = Example("3142>", "1234")
    assert task.reward(ex, TOK.encode("1234") + [EOS]) == 1.0
    assert task.reward(ex, TOK.encode("4321") + [EOS]) == 0.0
    ex = task.draw(np.random.default_rng(3))
    assert ex.answer == "".join(sorted(ex.prompt[:-1]))


def test_count_reward_penalizes_every_extra_character():
    task = CountA(length_penalty=0.1)
    ex = Example("abaab=", "3")
    assert task.reward(ex, TOK.encode("3") + [EOS]) == 1.0      # 2 tokens, correct
    assert task.reward(ex, TOK.encode("2") + [EOS]) == 0.0      # 2 tokens, wrong
    # 5 tokens "333a" + EOS: wrong and 3 extra characters -> -0.3
    assert task.reward(ex, TOK.encode("333a") + [EOS]) == pytest.approx(-0.3)
    assert task.reward(ex, TOK.encode("3")) == 0.0              # truncated, 1 token: no penalty
    # wrong answers are longer: no response of more than 2 tokens is correct
    assert not task.is_correct(ex, TOK.encode("03") + [EOS])


def test_eval_split_is_seeded_distinct_and_held_out():
    for name in ("addition", "sorting", "count"):
        task = get_task(name)
        split = task.eval_split(16, seed=5)
        assert split == task.eval_split(16, seed=5)
        prompts = {ex.prompt for ex in split}
        assert len(prompts) == 16
        train = task.sample(200, np.random.default_rng(0), exclude=frozenset(prompts))
        assert not prompts & {ex.prompt for ex in train}
    with pytest.raises(ValueError, match="task"):
        get_task("chess")
