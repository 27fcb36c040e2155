"""The checked form of the tutorials' "Predict first" questions (``tr<NN>_predict_*``).

Each prediction's true option is computed here by another route than the package's (the
``PREDICT`` table, from each tutorial's ``answers_*.py``); the right option passes whatever its
case, every other option raises an ``AssertionError`` naming the prediction with its hint, and
bad input raises the right error. ``tests/course/test_tutorials.py`` checks that every *Predict*
of a tutorial's text is followed by the check of a prediction.
"""

from __future__ import annotations

import pytest

import tokenmdp
from tests.course.exercises.answers_01_05 import PREDICT_01_05
from tests.course.exercises.answers_07 import PREDICT_07
from tests.course.exercises.answers_08 import PREDICT_08
from tests.course.exercises.answers_09 import PREDICT_09
from tests.course.exercises.answers_10 import PREDICT_10
from tests.course.exercises.answers_11 import PREDICT_11
from tests.course.exercises.test_exercises import RIGHT, _gap_by_lemma
from tokenmdp.course import exercises
from tokenmdp.course.exercises.registry import _prediction

PREDICT_06 = {
    "tr06_predict_gap_sign": lambda: "above" if _gap_by_lemma() > 0 else "below",
    # the clip fraction by loops over pairs, the option within a factor √10 of it
    "tr06_predict_clip_share": lambda: next(
        option for option, share in (("0.5%", 0.005), ("5%", 0.05), ("50%", 0.5))
        if 10 ** -0.5 < RIGHT["tr06_clip_fraction"]() / share < 10 ** 0.5),
    # the cosine of E[ĝ] summed over every pair by autograd of the library's loss
    "tr06_predict_gspo_sign": lambda: "negative" if RIGHT["tr06_gspo_cosine"]() < 0 else "positive",
}
PREDICT = {**PREDICT_01_05, **PREDICT_06, **PREDICT_07, **PREDICT_08, **PREDICT_09, **PREDICT_10,
           **PREDICT_11}


def test_every_prediction_has_an_independent_answer_here():
    assert set(exercises.names("prediction")) == set(PREDICT)
    assert set(exercises.names()) == set(exercises.names("value")) | set(PREDICT)
    for name in PREDICT:
        assert name.startswith("tr") and "_predict_" in name, name
        assert isinstance(exercises.get(name), exercises.Prediction), name


@pytest.mark.parametrize("name", sorted(PREDICT))
def test_the_true_option_passes_in_any_case(name, capsys):
    prediction, want = exercises.get(name), PREDICT[name]()
    assert want in prediction.options and exercises.expected(name) == want
    for spelled in (want, want.upper(), f"  {want.capitalize()} "):
        tokenmdp.check(name, spelled)
        assert capsys.readouterr().out.startswith(f"{name}: right")


@pytest.mark.parametrize("name", sorted(PREDICT))
def test_every_other_option_raises_with_the_hint_and_teacher_mode_shows_the_answer(
        name, monkeypatch):
    prediction, want = exercises.get(name), PREDICT[name]()
    wrong = [option for option in prediction.options if option != want]
    assert wrong
    for option in wrong:
        with pytest.raises(AssertionError) as info:
            tokenmdp.check(name, option)
        message = str(info.value)
        assert name in message and prediction.question in message and "Hint:" in message
        assert f"You predicted {option!r}" in message and "teacher mode" not in message
    monkeypatch.setenv(exercises.SHOW_ANSWERS_ENV, "1")
    with pytest.raises(AssertionError, match=f"teacher mode.*{want!r}"):
        tokenmdp.check(name, wrong[0])


def test_bad_predictions_raise_naming_the_value_and_the_options():
    with pytest.raises(TypeError, match="value: a prediction is one of 'above' or 'below'"):
        tokenmdp.check("tr06_predict_gap_sign", -1.0)
    with pytest.raises(ValueError, match="'sideways' is not an option.*'above' or 'below'"):
        tokenmdp.check("tr06_predict_gap_sign", "sideways")
    stub = exercises.unsolved("tr06_predict_gap_sign", "gap_prediction")
    with pytest.raises(AssertionError, match="Record your prediction"):
        tokenmdp.check("tr06_predict_gap_sign", stub)


def test_names_by_kind_and_bad_kind():
    assert not set(exercises.names("value")) & set(exercises.names("prediction"))
    with pytest.raises(ValueError, match="kind"):
        exercises.names("choice")


@pytest.mark.parametrize("options", [("above",), ("above", "above"), ("Above", "below"), ("", "x")])
def test_a_prediction_needs_two_distinct_lower_case_options(options):
    with pytest.raises(ValueError, match="options"):
        _prediction("tr00_predict_bad", question="?", options=options, hint="")


def test_a_computation_outside_the_options_is_a_defect_not_an_answer(monkeypatch):
    from tokenmdp.course.exercises import registry
    bad = registry.Prediction("tr00_predict_broken", "Up or down?", ("up", "down"),
                              lambda: "sideways", "")
    monkeypatch.setitem(registry._EXERCISES, bad.name, bad)
    registry.expected.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="not one of"):
            exercises.expected(bad.name)
    finally:
        registry.expected.cache_clear()
