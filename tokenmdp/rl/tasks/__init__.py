"""Verifiable tasks for the trainer world: a character tokenizer and exact rewards.

The front door of the tasks: ``from tokenmdp.rl.tasks import get_task``.

Floors, top to bottom::

    catalog
    arithmetic, running_sum
    base

* :mod:`~tokenmdp.rl.tasks.base` — :class:`CharTokenizer`, :class:`Example`, :class:`Task`;
* :mod:`~tokenmdp.rl.tasks.arithmetic` — addition, sorting, count-the-a's (short answers);
* :mod:`~tokenmdp.rl.tasks.running_sum` — long answers of ``L`` tokens (``running_sum_L``);
* :mod:`~tokenmdp.rl.tasks.catalog` — :data:`TASKS` by name and :func:`get_task`.

It imports only numpy; nothing else of tokenmdp.
"""

from tokenmdp.rl.tasks.arithmetic import ARITHMETIC_TASKS, Addition, CountA, Sorting
from tokenmdp.rl.tasks.base import CharTokenizer, Example, Task
from tokenmdp.rl.tasks.catalog import TASKS, get_task
from tokenmdp.rl.tasks.running_sum import LENGTHS, LONG_TASKS, RunningSum, running_sum_trace

__all__ = ["ARITHMETIC_TASKS", "TASKS", "Addition", "CharTokenizer", "CountA", "Example", "LENGTHS",
           "LONG_TASKS", "RunningSum", "Sorting", "Task", "get_task", "running_sum_trace"]
