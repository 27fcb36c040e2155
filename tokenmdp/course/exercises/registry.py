"""The tutorials' exercises, checked against the exact answer: ``tokenmdp.check(name, value)``.

Each exercise has a fixed setup (the course's MDP of :func:`tokenmdp.course.setups.copy_task`, a
policy step, an estimator), and its expected value is *computed* by the package from that setup
when it is first checked — an exact ``J``, a first-order gap, a clip fraction — never written
down. :func:`check` compares an answer with it under the exercise's named tolerance and raises
an ``AssertionError`` naming the quantity and the given value and saying *what* is wrong — a
sign, a factor 2, the complement of a share, the order of magnitude or a coarse relative error —
with a short hint, never the answer itself: typing in a printed answer would pass every check
unsolved. A teacher sets ``TOKENMDP_SHOW_ANSWERS=1`` (:data:`SHOW_ANSWERS_ENV`) to see the
exact values in the messages.

A *prediction* (:class:`Prediction`) is the checked form of a tutorial's "Predict first"
question: the student records one of a few options (``"above"``/``"below"``, a sign, a choice)
before computing, and :func:`check` compares it with the option that the package's exact
computation makes true — the option is computed from the setup too, never written down.

>>> from tokenmdp import exercises
>>> exercises.names()[:1]
('tr06_first_order_gap',)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import os
from collections.abc import Callable

__all__ = ["KINDS", "SHOW_ANSWERS_ENV", "Exercise", "Prediction", "Unsolved", "UnsolvedError", "check",
           "expected", "get", "names", "unsolved"]

SHOW_ANSWERS_ENV = "TOKENMDP_SHOW_ANSWERS"
"""Environment variable: ``1`` (teacher mode) adds the exact answer to a failed check's message."""

#: Two exact float64 computations of one quantity by different routes (sums in another order).
EXACT_TOL = 1e-10
#: A probability or share computed exactly (different summation orders, a ratio of two sums).
SHARE_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One exercise: what is asked, how the package computes the answer, how close is right.

    Parameters
    ----------
    name : str
        Registry name, ``tr<NN>_<what>`` (tutorial number first).
    quantity : str
        The quantity in words, as the error message names it.
    compute : callable
        ``compute() -> float``: the expected value from the exercise's fixed setup (float64).
    tolerance : float
        Absolute tolerance of a right answer.
    tolerance_name : str
        The name of the tolerance constant (shown in messages).
    hint : str
        One or two sentences pointing at the formula, shown when the answer is wrong.
    """

    name: str
    quantity: str
    compute: Callable[[], float]
    tolerance: float
    tolerance_name: str
    hint: str


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A "Predict first" question: which of a few options is true, checked like an exercise.

    Parameters
    ----------
    name : str
        Registry name, ``tr<NN>_predict_<what>`` (tutorial number first).
    question : str
        The question in words, as the messages name it.
    options : tuple of str
        The possible answers (lower case, at least two), e.g. ``("above", "below")``.
    compute : callable
        ``compute() -> str``: the true option, from an exact computation on the exercise's
        fixed setup (the same setup as the tutorial's cell).
    hint : str
        The idea that decides the question, shown when the prediction is wrong.
    """

    name: str
    question: str
    options: tuple[str, ...]
    compute: Callable[[], str]
    hint: str


#: The kinds :func:`names` lists: a number checked against an exact value, or a prediction.
KINDS = ("value", "prediction")
_EXERCISES: dict[str, Exercise | Prediction] = {}


def _exercise(name: str, *, quantity: str, tolerance: float, tolerance_name: str, hint: str):
    def register(compute: Callable[[], float]) -> Callable[[], float]:
        _EXERCISES[name] = Exercise(name, quantity, compute, tolerance, tolerance_name, hint)
        return compute
    return register


def _nearest_option(value: float, candidates: dict[str, float], *, log: bool = False) -> str:
    """The option whose candidate is nearest to ``value`` (on a log scale with ``log``)."""
    return min(candidates, key=lambda o: abs(math.log(value / candidates[o]) if log
                                             else value - candidates[o]))


def _prediction(name: str, *, question: str, options: tuple[str, ...], hint: str):
    if len(options) < 2 or len(set(options)) != len(options) or \
            any(o != o.strip().lower() or not o for o in options):
        raise ValueError(f"options: two or more distinct lower-case words, got {options!r}")

    def register(compute: Callable[[], str]) -> Callable[[], str]:
        _EXERCISES[name] = Prediction(name, question, tuple(options), compute, hint)
        return compute
    return register


# ---------------------------------------------------------------------- lookup and check
def names(kind: str | None = None) -> tuple[str, ...]:
    """Every registered exercise name, in tutorial order.

    Parameters
    ----------
    kind : {None, "value", "prediction"}, default None
        Only the exercises whose answer is a number (``"value"``), only the predictions
        (``"prediction"``), or both (None).

    Returns
    -------
    tuple of str

    Raises
    ------
    ValueError
        An unknown ``kind``.
    """
    if kind is None:
        return tuple(_EXERCISES)
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)} or None, got {kind!r}")
    wanted = Exercise if kind == "value" else Prediction
    return tuple(name for name, item in _EXERCISES.items() if isinstance(item, wanted))


def get(name: str) -> Exercise | Prediction:
    """The :class:`Exercise` or :class:`Prediction` ``name``.

    Parameters
    ----------
    name : str
        An exercise name (:func:`tokenmdp.course.exercises.names`).

    Returns
    -------
    Exercise or Prediction

    Raises
    ------
    ValueError
        An unknown name, with a "did you mean".
    TypeError
        ``name`` not a str.
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected an exercise name (str), got {type(name).__name__}")
    if name not in _EXERCISES:
        close = difflib.get_close_matches(name, _EXERCISES, n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"name: unknown exercise {name!r}{hint}; known: "
                         f"{', '.join(_EXERCISES)}")
    return _EXERCISES[name]


@functools.cache
def expected(name: str) -> float | str:
    """The exact answer of exercise ``name``, computed from its setup (cached per process).

    Parameters
    ----------
    name : str
        An exercise name (:func:`tokenmdp.course.exercises.names`).

    Returns
    -------
    float or str
        The value of an :class:`Exercise`; the true option of a :class:`Prediction`.

    Raises
    ------
    RuntimeError
        A prediction whose computation returned none of its options (a defect of the setup).
    """
    item = get(name)
    if isinstance(item, Prediction):
        option = item.compute()
        if option not in item.options:
            raise RuntimeError(f"{name}: the computation returned {option!r}, not one of "
                               f"{item.options}")
        return option
    return float(item.compute())


class UnsolvedError(RuntimeError):
    """A cell used an exercise's answer that is still the student edition's stub."""


class Unsolved:
    """The student edition's stub of an exercise's answer (:func:`unsolved`).

    :func:`check` reports it as a wrong answer with the exercise's hint; any other use — a
    comparison, arithmetic, ``float()``, an attribute, an index, a call — raises
    :class:`UnsolvedError` naming the exercise to solve first, instead of an empty
    ``AssertionError`` or a NaN carried through a later cell.

    Parameters
    ----------
    exercise : str
        The exercise whose solution defines the name.
    name : str
        The variable the stub stands for.
    """

    __slots__ = ("exercise", "name")

    def __init__(self, exercise: str, name: str) -> None:
        object.__setattr__(self, "exercise", exercise)
        object.__setattr__(self, "name", name)

    def _refuse(self, *_args, **_kwargs):
        raise UnsolvedError(f"{self.name} is still the stub of exercise {self.exercise}: "
                            f"solve that exercise first (its Solution cell above), then run "
                            f"this cell again")

    def __getattr__(self, attribute: str):
        if attribute.startswith("_"):   # Python's and IPython's probes: no such attribute
            raise AttributeError(attribute)
        self._refuse()

    def __repr__(self) -> str:
        return f"<unsolved: {self.name} of exercise {self.exercise}>"

    __setattr__ = __call__ = __getitem__ = __iter__ = __len__ = __contains__ = _refuse
    __bool__ = __float__ = __int__ = __index__ = __complex__ = __round__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _refuse
    __neg__ = __pos__ = __abs__ = __add__ = __radd__ = __sub__ = __rsub__ = _refuse
    __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __pow__ = __rpow__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __matmul__ = __rmatmul__ = _refuse
    __format__ = __array__ = _refuse
    __hash__ = None


def unsolved(exercise: str, name: str = "answer") -> Unsolved:
    """The stub a student edition assigns to ``name``, whose solution is exercise ``exercise``.

    Parameters
    ----------
    exercise : str
        The exercise (:func:`names`).
    name : str, default "answer"
        The variable, for the message.

    Returns
    -------
    Unsolved
        Refused by :func:`check` (a wrong answer, with the hint) and by every other use
        (:class:`UnsolvedError` naming the exercise).
    """
    return Unsolved(exercise, name)


def _as_number(value) -> float:
    """``value`` as a float: a real number, a NumPy scalar or a one-element tensor/array (a
    student edition's :class:`Unsolved` stub: NaN, a wrong answer)."""
    if isinstance(value, Unsolved):
        return math.nan
    if isinstance(value, bool) or value is None or isinstance(value, str):
        raise TypeError(f"value: expected a number, got {type(value).__name__} {value!r}")
    if isinstance(value, numbers.Real):
        return float(value)
    size = getattr(value, "size", None)
    size = size() if callable(size) else size        # torch .size() is a method, NumPy's is not
    numel = getattr(value, "numel", None)
    count = numel() if callable(numel) else (size if isinstance(size, int) else None)
    if count == 1 and hasattr(value, "item"):
        item = value.item()
        if isinstance(item, numbers.Real) and not isinstance(item, bool):
            return float(item)
    raise TypeError(f"value: expected a number (or a one-element tensor), got "
                    f"{type(value).__name__}")


def _near(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol


def _diagnosis(given: float, want: float, tol: float) -> str:
    """What is wrong with ``given``, in words that do not give ``want`` away: a common slip (a
    flipped sign, a factor 2, the complement of a share), else the sign, the order of magnitude
    or a coarse band of the relative error (no direction inside a factor 3, so that the message
    cannot be followed to the answer)."""
    if not math.isfinite(given):
        return (" Your value is not a finite number (if it is the student edition's stub, "
                "replace it by your solution).")
    if want != 0 and _near(given, -want, tol):
        return " Your value has the right size and the wrong sign."
    if want != 0 and (_near(given, 2 * want, tol) or _near(2 * given, want, tol)):
        return " Your value is off by a factor 2."
    if 0 <= want <= 1 and _near(given, 1 - want, tol):
        return " Your value is the complement (1 − p) of the answer."
    if abs(want) <= tol:
        return " The answer is zero to within the tolerance."
    if given == 0:
        return " The answer is not zero."
    if (given > 0) != (want > 0):
        return " Your value has the wrong sign (and another size)."
    ratio = abs(given / want)
    if ratio >= 3 or ratio <= 1 / 3:
        power = abs(math.log10(ratio))
        size = f"about 10^{round(power)} times" if power >= 1 else "3 to 10 times"
        return f" Your value is {size} too {'large' if ratio > 1 else 'small'}."
    error = abs(ratio - 1)
    band = ("within 1%" if error <= 0.01 else "within 10%" if error <= 0.1
            else "the right order of magnitude, but more than 10% off")
    return f" Your value is {band} of the answer."


def check(name: str, value) -> None:
    """Check an exercise's answer against the exact value the package computes.

    Parameters
    ----------
    name : str
        The exercise (:func:`tokenmdp.course.exercises.names`), e.g. ``"tr06_first_order_gap"``.
    value : float, int, NumPy scalar, one-element tensor or str
        Your answer: a number, or for a prediction (``tr<NN>_predict_*``) one of its options
        (case and surrounding spaces do not matter).

    Raises
    ------
    AssertionError
        When ``|value − expected| > tolerance``: the message names the quantity, the given value,
        the tolerance, what is wrong (a sign, a factor, the order of magnitude, a coarse relative
        error) and a hint; the expected value only in teacher mode
        (``TOKENMDP_SHOW_ANSWERS=1``). For a prediction: when the option is not the true one
        (the message names the question, your option and the hint).
    ValueError
        An unknown ``name`` (with a "did you mean"), or a prediction that is none of the
        question's options (the message lists them).
    TypeError
        ``name`` not a str, or ``value`` not a number (for a prediction: not a str).
    """
    exercise = get(name)
    if isinstance(exercise, Prediction):
        _check_prediction(exercise, value)
        return
    given = _as_number(value)
    want = expected(name)
    if math.isfinite(given) and _near(given, want, exercise.tolerance):
        print(f"{name}: right — {exercise.quantity} = {want:.10g} "
              f"(yours {given:.10g}, within {exercise.tolerance_name} = {exercise.tolerance:g})")
        return
    answer = (f" Answer (teacher mode, {SHOW_ANSWERS_ENV}=1): {want:.10g}."
              if os.environ.get(SHOW_ANSWERS_ENV, "") == "1" else "")
    raise AssertionError(
        f"{name}: not yet. {exercise.quantity}: got {given:.10g} (tolerance "
        f"{exercise.tolerance_name} = {exercise.tolerance:g})."
        f"{_diagnosis(given, want, exercise.tolerance)} Hint: {exercise.hint}{answer}")


def _check_prediction(prediction: Prediction, value) -> None:
    """:func:`check` for a :class:`Prediction`: ``value`` one of its options, the true one."""
    name, options = prediction.name, prediction.options
    listed = " or ".join(repr(o) for o in options)
    if isinstance(value, Unsolved):
        raise AssertionError(f"{name}: not yet. {prediction.question} Record your prediction "
                             f"({listed}) before you compute. Hint: {prediction.hint}")
    if not isinstance(value, str):
        raise TypeError(f"value: a prediction is one of {listed} (a str), got "
                        f"{type(value).__name__}")
    given = value.strip().lower()
    if given not in options:
        raise ValueError(f"value: {value!r} is not an option of {name}; choose {listed}")
    want = expected(name)
    if given == want:
        print(f"{name}: right — {prediction.question} {want!r}")
        return
    answer = (f" Answer (teacher mode, {SHOW_ANSWERS_ENV}=1): {want!r}."
              if os.environ.get(SHOW_ANSWERS_ENV, "") == "1" else "")
    raise AssertionError(f"{name}: not yet. {prediction.question} You predicted {given!r}; the "
                         f"exact computation disagrees. Hint: {prediction.hint}{answer}")
