"""The tutorials' exercises, checked against the exact answer: ``tokenmdp.check(name, value)``.

Each exercise has a fixed setup (the course's MDP of :func:`tokenmdp.course.setups.copy_task`, a
policy step, an estimator), and its expected value is *computed* by the package from that setup
when it is first checked — an exact ``J``, a first-order gap, a clip fraction — never written
down. :func:`check` compares an answer with it under the exercise's named tolerance and raises
an ``AssertionError`` naming the quantity, the expected and the given value, with a short hint
(and a note when the answer is off by a sign or a factor 2).

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
from collections.abc import Callable

__all__ = ["Exercise", "check", "expected", "get", "names"]

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


_EXERCISES: dict[str, Exercise] = {}


def _exercise(name: str, *, quantity: str, tolerance: float, tolerance_name: str, hint: str):
    def register(compute: Callable[[], float]) -> Callable[[], float]:
        _EXERCISES[name] = Exercise(name, quantity, compute, tolerance, tolerance_name, hint)
        return compute
    return register


# ---------------------------------------------------------------------- lookup and check
def names() -> tuple[str, ...]:
    """Every registered exercise name, in tutorial order.

    Returns
    -------
    tuple of str
    """
    return tuple(_EXERCISES)


def get(name: str) -> Exercise:
    """The :class:`Exercise` ``name``.

    Parameters
    ----------
    name : str
        An exercise name (:func:`tokenmdp.course.exercises.names`).

    Returns
    -------
    Exercise

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
def expected(name: str) -> float:
    """The exact answer of exercise ``name``, computed from its setup (cached per process).

    Parameters
    ----------
    name : str
        An exercise name (:func:`tokenmdp.course.exercises.names`).

    Returns
    -------
    float
    """
    return float(get(name).compute())


def _as_number(value) -> float:
    """``value`` as a float: a real number, a NumPy scalar or a one-element tensor/array."""
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
    """A note for the common slips: a flipped sign, a factor 2, the complement of a share."""
    if want != 0 and _near(given, -want, tol):
        return " Your value has the right size and the wrong sign."
    if want != 0 and (_near(given, 2 * want, tol) or _near(2 * given, want, tol)):
        return " Your value is off by a factor 2."
    if 0 <= want <= 1 and _near(given, 1 - want, tol):
        return " Your value is the complement (1 − p) of the answer."
    return ""


def check(name: str, value) -> None:
    """Check an exercise's answer against the exact value the package computes.

    Parameters
    ----------
    name : str
        The exercise (:func:`tokenmdp.course.exercises.names`), e.g. ``"tr06_first_order_gap"``.
    value : float, int, NumPy scalar or one-element tensor
        Your answer.

    Raises
    ------
    AssertionError
        When ``|value − expected| > tolerance``: the message names the quantity, the expected
        and the given value, the tolerance and a hint.
    ValueError
        An unknown ``name`` (with a "did you mean").
    TypeError
        ``name`` not a str, or ``value`` not a number.
    """
    exercise = get(name)
    given = _as_number(value)
    want = expected(name)
    if math.isfinite(given) and _near(given, want, exercise.tolerance):
        print(f"{name}: right — {exercise.quantity} = {want:.10g} "
              f"(yours {given:.10g}, within {exercise.tolerance_name} = {exercise.tolerance:g})")
        return
    raise AssertionError(
        f"{name}: not yet. {exercise.quantity}: expected {want:.10g}, got {given:.10g} "
        f"(difference {given - want:+.3g}, tolerance {exercise.tolerance_name} = "
        f"{exercise.tolerance:g}).{_diagnosis(given, want, exercise.tolerance)} "
        f"Hint: {exercise.hint}")
