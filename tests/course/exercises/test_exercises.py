"""tokenmdp.check: every exercise's right answer (computed here by another route) passes, plausible
wrong answers raise an AssertionError naming the exercise, expected and given values; bad input
raises the right error; ``import tokenmdp`` stays light."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import tokenmdp
from tests.course.exercises.answers_01_05 import RIGHT_01_05, WRONG_01_05
from tests.course.exercises.answers_07 import RIGHT_07, WRONG_07
from tests.course.exercises.answers_08 import RIGHT_08, WRONG_08
from tests.course.exercises.answers_09 import RIGHT_09, WRONG_09
from tests.course.exercises.answers_10 import RIGHT_10, WRONG_10
from tests.course.exercises.answers_11 import RIGHT_11, WRONG_11
from tokenmdp.batch import TokenBatch
from tokenmdp.course import exercises
from tokenmdp.course.exercises import t06
from tokenmdp.course.setups import copy_task, step_along
from tokenmdp.estimators import GSPO, PPOClip, TokenRatio, loss, prepare
from tokenmdp.exact import (
    first_order_path,
    flat_grad,
    gradient,
    objective,
    sequence_probs,
    state_logprobs,
    state_visitation,
    surrogate,
    values,
)
from tokenmdp.exact.lab.moments import moments

INDEPENDENT_TOL = 1e-10  # the test's own float64 route against the package's (sums reordered)


def _pair(step):
    mdp, old = copy_task()
    return mdp, step_along(old, gradient(mdp, old), step), old


# ---------------------------------------------------------------------- independent answers
def _gap_by_lemma():
    # J(π) − L(π) = Σ_s (d^π − d^{π_old})(s) Σ_a π(a|s) A^{π_old}(s, a): no objective/surrogate
    mdp, pi, old = _pair(t06.TR06_GAP_STEP)
    with torch.no_grad():
        probs = torch.cat([lp.exp().reshape(-1, mdp.vocab_size)
                           for lp in state_logprobs(mdp, pi)])
        change = state_visitation(mdp, pi) - state_visitation(mdp, old)
        return float((change[:, None] * probs * values(mdp, old).A).sum())


def _gap_wrong_answers():
    mdp, pi, old = _pair(t06.TR06_GAP_STEP)
    with torch.no_grad():
        j, j_old, l_pi = float(objective(mdp, pi)), float(objective(mdp, old)), \
            float(surrogate(mdp, pi, old))
    return {"sign flipped (L − J)": l_pi - j, "true improvement J(π) − J(π_old)": j - j_old,
            "surrogate improvement L − J(π_old)": l_pi - j_old}


def _clip_fraction_by_loops(eps_low=t06.TR06_EPS, eps_high=t06.TR06_EPS):
    # every ordered pair (y_1, y_2) of one prompt, token by token, in Python floats
    mdp, pi, old = _pair(t06.TR06_STALE_STEP)
    enum = mdp.enumerate()
    with torch.no_grad():
        lp_pi, lp_old = pi.token_logprobs(enum), old.token_logprobs(enum)
        q = sequence_probs(mdp, old).tolist()
    rewards, prompt = mdp.rewards.tolist(), mdp.terminal_prompt_index.tolist()
    ratios = [[math.exp(float(lp_pi[i, c] - lp_old[i, c]))
               for c in range(enum.tokens.shape[1]) if enum.loss_mask[i, c]]
              for i in range(len(rewards))]
    clipped = tokens = 0.0
    for i, j in itertools.product(range(len(rewards)), repeat=2):
        if prompt[i] != prompt[j]:
            continue
        p = float(mdp.prompt_probs[prompt[i]]) * q[i] * q[j]
        a = rewards[i] - rewards[j]
        n_clip = sum((a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
                     for r in ratios[i])
        clipped += p * n_clip
        tokens += p * len(ratios[i])
    return clipped / tokens


def _cosine_by_pairs(surrogate_part):
    # E[ĝ] as Σ over ordered pairs of D(x) π_old(y_1) π_old(y_2) ĝ(y_1, y_2), each ĝ by autograd
    # of the library's loss on a two-sequence batch (not moments / StepGradients)
    mdp, pi, old = _pair(t06.TR06_STALE_STEP)
    est = exercises.tr06_estimator(surrogate_part)
    responses, q = mdp.responses(), sequence_probs(mdp, old).detach().tolist()
    mean = torch.zeros_like(gradient(mdp, pi))
    for i, j in itertools.product(range(len(responses)), repeat=2):
        (xi, yi), (xj, yj) = responses[i], responses[j]
        if xi != xj:
            continue
        x = mdp.prompts.index(xi)
        batch = TokenBatch.from_sequences([list(xi), list(xj)], [list(yi), list(yj)],
                                          rewards=[float(mdp.rewards[i]), float(mdp.rewards[j])],
                                          groups=[0, 0], prompt_index=[x, x],
                                          dtype=torch.float64)
        with torch.no_grad():
            batch = batch.replace(old_logprob=old.token_logprobs(batch))
        batch = prepare(batch, est)
        g = -flat_grad(loss(pi.token_logprobs(batch), batch, est)[0], pi)
        mean += float(mdp.prompt_probs[x]) * q[i] * q[j] * g
    grad = gradient(mdp, pi)
    return float(mean @ grad / (mean.norm() * grad.norm()))


def _gspo_wrong_answers():
    mdp, pi, old = _pair(t06.TR06_STALE_STEP)
    right = exercises.expected("tr06_gspo_cosine")
    token_is = moments(mdp, pi, exercises.tr06_estimator(TokenRatio()), group_size=2,
                       behavior=old, method="enumeration").cosine
    return {"sign flipped": -right, "token IS's cosine": token_is, "on-policy cosine 1": 1.0}


RIGHT = {
    "tr06_first_order_gap": _gap_by_lemma,
    "tr06_clip_fraction": _clip_fraction_by_loops,
    "tr06_gspo_cosine": lambda: _cosine_by_pairs(
        GSPO(eps_low=t06.TR06_GSPO_EPS_LOW, eps_high=t06.TR06_GSPO_EPS_HIGH)),
}
WRONG = {
    "tr06_first_order_gap": _gap_wrong_answers,
    "tr06_clip_fraction": lambda: {
        "clip-higher ε_high = 0.28": _clip_fraction_by_loops(eps_high=0.28),
        "on-policy (nothing clipped)": 0.0, "factor 2": 2 * _clip_fraction_by_loops()},
    "tr06_gspo_cosine": _gspo_wrong_answers,
}
RIGHT.update(RIGHT_01_05)   # tutorials 1-5: tests/course/exercises/answers_01_05.py
WRONG.update(WRONG_01_05)
RIGHT.update(RIGHT_08)      # tutorial 8: tests/course/exercises/answers_08.py
WRONG.update(WRONG_08)
RIGHT.update(RIGHT_07)      # tutorial 7: tests/course/exercises/answers_07.py
WRONG.update(WRONG_07)
RIGHT.update(RIGHT_09)      # tutorial 9: tests/course/exercises/answers_09.py
WRONG.update(WRONG_09)
RIGHT.update(RIGHT_10)      # tutorial 10: tests/course/exercises/answers_10.py
WRONG.update(WRONG_10)
RIGHT.update(RIGHT_11)      # tutorial 11: tests/course/exercises/answers_11.py
WRONG.update(WRONG_11)


def test_every_registered_exercise_has_a_right_and_a_wrong_answer_here():
    # the predictions (tr<NN>_predict_*) have their own table: test_predictions.py
    assert set(exercises.names("value")) == set(RIGHT) == set(WRONG)
    assert len(exercises.names("value")) >= 3


@pytest.mark.parametrize("name", sorted(RIGHT))
def test_the_right_answer_passes(name, capsys):
    answer = RIGHT[name]()
    assert abs(answer - exercises.expected(name)) < INDEPENDENT_TOL
    tokenmdp.check(name, answer)
    assert capsys.readouterr().out.startswith(f"{name}: right")


@pytest.mark.parametrize("name", sorted(WRONG))
def test_plausible_wrong_answers_raise_naming_the_quantity(name):
    exercise, want = exercises.get(name), exercises.expected(name)
    for label, wrong in WRONG[name]().items():
        assert abs(wrong - want) > 1e3 * exercise.tolerance, label   # really a different value
        with pytest.raises(AssertionError) as info:
            tokenmdp.check(name, wrong)
        message = str(info.value)
        assert name in message and exercise.quantity in message, label
        assert f"got {wrong:.10g}" in message and "Hint:" in message, label
        assert "Your value" in message or "The answer is" in message, label      # what is wrong
        for digits in (3, 4, 6, 10):      # never the answer (issue 30): typing it in would pass
            assert f"{want:.{digits}g}" not in message.replace(f"{wrong:.10g}", ""), (label, digits)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_teacher_mode_shows_the_answer(name, monkeypatch):
    monkeypatch.setenv(exercises.SHOW_ANSWERS_ENV, "1")
    want = exercises.expected(name)
    wrong = next(iter(WRONG[name]().values()))
    with pytest.raises(AssertionError, match="teacher mode") as info:
        tokenmdp.check(name, wrong)
    assert f"{want:.10g}" in str(info.value)


@pytest.mark.parametrize(("given", "want", "words"), [
    (float("nan"), 0.3, "not a finite number"), (-0.3, 0.3, "wrong sign"),
    (0.6, 0.3, "factor 2"), (0.7, 0.3, "complement"), (0.2, 0.0, "answer is zero"),
    (0.0, 0.3, "not zero"), (-1.0, 0.3, "wrong sign (and another size)"),
    (30.0, 0.3, "about 10^2 times too large"), (0.0031, 0.3, "about 10^2 times too small"),
    (1.0, 0.3, "3 to 10 times too large"), (0.302, 0.3, "within 1%"),
    (0.32, 0.3, "within 10%"), (0.45, 0.3, "more than 10% off"),
])
def test_the_diagnosis_says_what_is_wrong_without_the_answer(given, want, words):
    from tokenmdp.course.exercises.registry import _diagnosis
    message = _diagnosis(given, want, 1e-9)
    assert words in message and "0.3" not in message.replace(repr(given), "")


def test_the_first_order_gap_is_also_the_paths_gap():
    # a third route: first_order_path's gap at the same step (objective − surrogate)
    mdp, old = copy_task()
    (point,) = first_order_path(mdp, old, gradient(mdp, old), [t06.TR06_GAP_STEP])
    assert abs(point.gap - exercises.expected("tr06_first_order_gap")) < INDEPENDENT_TOL


def test_ppo_clip_fraction_matches_the_loops_with_clip_higher_too():
    mdp, pi, old = _pair(t06.TR06_STALE_STEP)
    from tokenmdp.course.setups import ppo_clip_fraction
    assert abs(ppo_clip_fraction(mdp, pi, old, eps_low=0.2, eps_high=0.28)
               - _clip_fraction_by_loops(eps_high=0.28)) < INDEPENDENT_TOL
    assert PPOClip(eps_low=0.2, eps_high=0.28).eps_high == 0.28


def test_slips_get_a_specific_note():
    want = exercises.expected("tr06_first_order_gap")
    with pytest.raises(AssertionError, match="wrong sign"):
        tokenmdp.check("tr06_first_order_gap", -want)
    with pytest.raises(AssertionError, match="factor 2"):
        tokenmdp.check("tr06_first_order_gap", 2 * want)
    share = exercises.expected("tr06_clip_fraction")
    with pytest.raises(AssertionError, match="complement"):
        tokenmdp.check("tr06_clip_fraction", 1 - share)


@pytest.mark.parametrize("value", [np.float64, np.float32,
                                   lambda v: torch.tensor(v, dtype=torch.float64),
                                   lambda v: torch.tensor([v], dtype=torch.float64),
                                   lambda v: np.array([v]), int],
                         ids=["np.float64", "np.float32", "0-d tensor", "1-element tensor",
                              "1-element array", "int"])
def test_numeric_types_are_accepted(value, capsys):
    # the answer in other numeric types; int(gap) = 0 is a wrong answer, not a type error
    want = exercises.expected("tr06_clip_fraction")
    if value is int:
        with pytest.raises(AssertionError, match="tr06_clip_fraction"):
            tokenmdp.check("tr06_clip_fraction", int(want))
        return
    given = value(want)
    if value is np.float32:  # float32 rounding is far above the tolerance: a wrong answer
        with pytest.raises(AssertionError):
            tokenmdp.check("tr06_clip_fraction", given)
        return
    tokenmdp.check("tr06_clip_fraction", given)
    assert "right" in capsys.readouterr().out


def test_unknown_names_raise_value_error_with_a_suggestion():
    with pytest.raises(ValueError, match="did you mean tr06_clip_fraction"):
        tokenmdp.check("tr06_clip_fractoin", 0.1)
    with pytest.raises(ValueError, match="unknown exercise"):
        tokenmdp.check("no such thing", 0.1)


@pytest.mark.parametrize("value", ["0.05", None, True, [0.05], torch.tensor([0.05, 0.05]),
                                   np.array([0.1, 0.2]), object()])
def test_non_numeric_values_raise_type_error(value):
    with pytest.raises(TypeError, match="value"):
        tokenmdp.check("tr06_clip_fraction", value)


def test_non_string_name_raises_type_error():
    with pytest.raises(TypeError, match="name"):
        tokenmdp.check(6, 0.1)


def test_nan_and_infinity_are_wrong_answers():
    for value in (math.nan, math.inf):
        with pytest.raises(AssertionError, match="tr06_gspo_cosine"):
            tokenmdp.check("tr06_gspo_cosine", value)


def test_check_is_exported_lazily():
    assert "check" in tokenmdp.__all__ and tokenmdp.check is exercises.check
    code = ("import sys, tokenmdp; assert 'tokenmdp.course.exercises.registry' not in sys.modules; "
            "assert 'tokenmdp.exact' not in sys.modules; tokenmdp.check; "
            "assert 'tokenmdp.course.exercises.registry' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no_such_name"):
        tokenmdp.no_such_name  # noqa: B018


def test_no_hint_is_the_solution_call():
    """Issue 30: a hint names the idea; one that spells out the package call (``moments(...)
    .cosine``, ``sample(...)``) is the solution."""
    import re
    calls = re.compile(r"\b(moments|sample|gradient|objective|kl_penalty_moments|kl_gradients|"
                       r"chi_square|prepare|loss|train_exact|ppo_clip_fraction|state_visitation|"
                       r"state_logprobs)\(")
    for name in exercises.names():
        assert not calls.search(exercises.get(name).hint), (name, exercises.get(name).hint)
