"""tokenmdp: the estimator theory of RL for language models, exact and runnable.

Layers, bottom to top (lower layers never import upper ones):

* :mod:`tokenmdp.batch` (the one batch type, :class:`TokenBatch`), :mod:`tokenmdp.packing`,
  :mod:`tokenmdp.distributed`, :mod:`tokenmdp.interop`;
* :mod:`tokenmdp.estimators` — every estimator as a composition of pure functions of tensors;
* :mod:`tokenmdp.exact` — an enumerable token MDP, its true objective and gradient, and the
  exact bias and variance of any estimator;
* :mod:`tokenmdp.model` (the tiny MoE transformer with routing record/replay) and
  :mod:`tokenmdp.rl` (the rollout engine with its own numerics, routing replay R2/R3) — the
  trainer world;
* :mod:`tokenmdp.testing` (hypothesis strategies and invariance checks), :mod:`tokenmdp.plots`
  and the command line :mod:`tokenmdp.cli`;
* :mod:`tokenmdp.notebook` (the tutorials' helpers) and :mod:`tokenmdp.exercises` (their
  exercises; ``tokenmdp.check(name, value)``, loaded on first use).

Shape-suffix legend used in tensor names where a shape is not obvious:

* ``_RC``  rows x row capacity of a :class:`TokenBatch` (every per-token tensor);
* ``_S``   one entry per sequence (indexed by ``sequence_id``);
* ``_N``   a flat list of items (states, sequences of an enumeration, ...);
* ``_V``   one entry per vocabulary token;
* ``_P``   one entry per prompt.
"""

from tokenmdp.batch import TokenBatch

__version__ = "0.1.0"
__all__ = ["TokenBatch", "__version__", "check"]


def __getattr__(name: str):
    # ``tokenmdp.check`` (the tutorials' exercise checker) is loaded on first use, so that
    # ``import tokenmdp`` stays light and the lower layers never import the upper ones.
    if name == "check":
        from tokenmdp.exercises import check

        return check
    raise AttributeError(f"module 'tokenmdp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"check"})
