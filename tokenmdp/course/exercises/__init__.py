"""The tutorials' exercises, checked against the exact answer: ``tokenmdp.check(name, value)``.

The front door: :func:`check`, :func:`names`, :func:`get`, :func:`expected`,
:class:`Exercise` and :class:`Prediction` (a "Predict first" question's checked form) from
:mod:`~tokenmdp.course.exercises.registry`, with every exercise registered, and the estimators
of tutorials 6 and 10 (:func:`tr06_estimator`, :func:`tr10_prorl`).

Floors, top to bottom::

    p01_05
    t01_05, t06, t07, t08, t09, t10, t11
    registry

* :mod:`~tokenmdp.course.exercises.registry` — :class:`Exercise`, registration, the named
  tolerances, :func:`check` (imports nothing of tokenmdp);
* ``t01_05``, ``t06``, ... ``t11`` — each tutorial's exercises: its setup and how the package
  computes each answer, registered on import;
* ``p01_05`` — the predictions of tutorials 1–5, on their exercises' setups.

It may import the course's setups, the exact world and the estimators; nothing imports it but
the package's ``tokenmdp.check`` (loaded on first use) and the tutorials.
"""

# importing a tutorial's module registers its exercises; tutorial 6's come first in names()
from tokenmdp.course.exercises import t06  # noqa: F401, I001
from tokenmdp.course.exercises import t01_05, t07, t08, t09, t10, t11  # noqa: F401
from tokenmdp.course.exercises import p01_05  # noqa: F401
from tokenmdp.course.exercises.registry import (
    KINDS,
    SHOW_ANSWERS_ENV,
    Exercise,
    Prediction,
    Unsolved,
    UnsolvedError,
    check,
    expected,
    get,
    names,
    unsolved,
)
from tokenmdp.course.exercises.t06 import tr06_estimator
from tokenmdp.course.exercises.t10 import tr10_prorl

__all__ = ["KINDS", "SHOW_ANSWERS_ENV", "Exercise", "Prediction", "Unsolved", "UnsolvedError", "check",
           "expected", "get", "names", "tr06_estimator", "tr10_prorl", "unsolved"]
