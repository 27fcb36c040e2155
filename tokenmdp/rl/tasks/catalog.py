"""Every task of the trainer world by name: :data:`TASKS` and :func:`get_task`."""

from __future__ import annotations

from tokenmdp.rl.tasks.arithmetic import ARITHMETIC_TASKS
from tokenmdp.rl.tasks.base import Task
from tokenmdp.rl.tasks.running_sum import LONG_TASKS

__all__ = ["TASKS", "get_task"]

TASKS = {**ARITHMETIC_TASKS, **LONG_TASKS}
"""Task name → constructor with the default options: the short-answer tasks of
:mod:`~tokenmdp.rl.tasks.arithmetic`, then the long-answer ones of
:mod:`~tokenmdp.rl.tasks.running_sum`."""


def get_task(name: str) -> Task:
    """The task ``name`` with its default options; ``ValueError`` listing the names otherwise.

    Parameters
    ----------
    name : str
        A key of :data:`TASKS`: addition, sorting, count or running_sum_L.

    Returns
    -------
    Task
        A new instance with the default tokenizer and options.
    """
    if name not in TASKS:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]()
