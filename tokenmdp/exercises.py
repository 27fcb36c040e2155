"""The tutorials' exercises, checked against the exact answer: ``tokenmdp.check(name, value)``.

Each exercise has a fixed setup (the course's MDP of :func:`tokenmdp.notebook.copy_task`, a
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

import torch

from tokenmdp.estimators import GSPO, Aggregation, Estimator, LeaveOneOut, Surrogate
from tokenmdp.exact import gradient, moments, objective, surrogate
from tokenmdp.notebook import copy_task, ppo_clip_fraction, step_along

__all__ = ["Exercise", "check", "expected", "get", "names", "tr06_estimator"]

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


# ---------------------------------------------------------------------- tutorial 6
#: Tutorial 6's step: ``π = π_old + s u/‖u‖``, ``u = ∇J(π_old)``, for the first-order gap.
TR06_GAP_STEP = 2.0
#: Tutorial 6's stale step for the clip fraction and GSPO's band.
TR06_STALE_STEP = 0.5
#: PPO's clip range in tutorial 6's clip-fraction exercise.
TR06_EPS = 0.2
#: GSPO's band ``[1 − 3e-4, 1 + 4e-4]`` (arXiv 2507.18071).
TR06_GSPO_EPS_LOW, TR06_GSPO_EPS_HIGH = 3e-4, 4e-4


def _tr06_pair(step: float):
    mdp, old = copy_task()
    return mdp, step_along(old, gradient(mdp, old), step), old


@_exercise("tr06_first_order_gap",
           quantity="the first-order gap J(π) − L_{π_old}(π) at one step of length 2 along "
                    "∇J(π_old) (tutorial 6, exercise 1)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="By the performance-difference lemma J(π) − L(π) = Σ_s (d^π(s) − d^{π_old}(s)) "
                "Σ_a π(a|s) A^{π_old}(s, a): only the state visitation differs.")
def _tr06_first_order_gap() -> float:
    mdp, pi, old = _tr06_pair(TR06_GAP_STEP)
    with torch.no_grad():
        return float(objective(mdp, pi) - surrogate(mdp, pi, old))


@_exercise("tr06_clip_fraction",
           quantity="the exact pooled clip fraction of PPO (ε = 0.2, G = 2, Â = R_1 − R_2) one "
                    "step of length 0.5 from π_old, data from π_old (tutorial 6, exercise 2)",
           tolerance=SHARE_TOL, tolerance_name="SHARE_TOL",
           hint="Clipped means M_t = 0: Â > 0 and r > 1 + ε, or Â < 0 and r < 1 − ε. Pool "
                "E[#clipped tokens] / E[#tokens] over every pair of responses (y_1, y_2).")
def _tr06_clip_fraction() -> float:
    mdp, pi, old = _tr06_pair(TR06_STALE_STEP)
    return ppo_clip_fraction(mdp, pi, old, eps_low=TR06_EPS, eps_high=TR06_EPS)


def tr06_estimator(surrogate_part: Surrogate) -> Estimator:
    """Tutorial 6's estimator with ``surrogate_part``: leave-one-out advantage (``G = 2``:
    ``Â_1 = R_1 − R_2``), sequence-mean of token sums (loss weight ``1/S``), no correction.

    Parameters
    ----------
    surrogate_part : Surrogate
        The part under study (``PPOClip``, ``CISPO``, ``GSPO``, ...).

    Returns
    -------
    Estimator
    """
    return Estimator(surrogate=surrogate_part, advantage=LeaveOneOut(),
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@_exercise("tr06_gspo_cosine",
           quantity="the cosine between GSPO's expected gradient (band [1 − 3e-4, 1 + 4e-4], "
                    "G = 2, Â = R_1 − R_2, loss weight 1/S) and ∇J, one step of length 0.5 from "
                    "π_old, data from π_old (tutorial 6, exercise 3)",
           tolerance=EXACT_TOL, tolerance_name="EXACT_TOL",
           hint="Almost every sequence ratio s_i has left the band; the sequences whose gradient "
                "survives are those that moved against their advantage. Compute "
                "moments(..., behavior=π_old).cosine with the GSPO surrogate.")
def _tr06_gspo_cosine() -> float:
    mdp, pi, old = _tr06_pair(TR06_STALE_STEP)
    gspo = GSPO(eps_low=TR06_GSPO_EPS_LOW, eps_high=TR06_GSPO_EPS_HIGH)
    return moments(mdp, pi, tr06_estimator(gspo), group_size=2, behavior=old,
                   method="enumeration").cosine


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
        An exercise name (:func:`tokenmdp.exercises.names`).

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
        An exercise name (:func:`tokenmdp.exercises.names`).

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
        The exercise (:func:`tokenmdp.exercises.names`), e.g. ``"tr06_first_order_gap"``.
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


# ---------------------------------------------------------------------- tutorials 1-5 and 7-10
# Registered by their own modules (their setups repeat the tutorials'); imported last, since they
# use ``_exercise`` and the tolerances above.
from tokenmdp import _exercises_01_05, _exercises_07, _exercises_08, _exercises_09, _exercises_10  # noqa: E402,F401,E501
