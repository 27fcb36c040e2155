"""Long-answer verifiable tasks for the trainer world: a program trace of ``L`` tokens.

The tasks of :mod:`~tokenmdp.rl.tasks.arithmetic` answer in at most a few tokens, where the per-token
mismatch between the rollout engine ``mu`` and the trainer's ``pi_old`` has no room to
accumulate: a sequence-level ratio ``prod_t pi_old / mu`` over 4 tokens stays within a few
percent of 1. :class:`RunningSum` answers in exactly ``length`` digits (then EOS), so the
response length is a dial of its own.

* :class:`RunningSum` — the trace of the program ``s = 0; for d in digits: s = (s + d) % 10;
  print(s)``: ``"3141="`` → ``"3489"``. Reward 1 if the whole trace is right and ends with EOS,
  else 0 (the exact rule of :meth:`~tokenmdp.rl.tasks.base.Task.is_correct`). Each answer digit depends
  on the previous one and on the prompt digit a fixed distance back, so a tiny transformer can
  learn it, but one wrong digit makes every later one wrong too: exact-match accuracy is roughly
  the per-token accuracy to the power ``length``.

The registered names (:data:`LONG_TASKS`, in :data:`tokenmdp.rl.tasks.TASKS`) are
``running_sum_L`` for ``L`` in :data:`LENGTHS`; the held-out split and the training draws are
those of :class:`~tokenmdp.rl.tasks.base.Task` (``10^L`` distinct prompts, so they never run out).
"""

from __future__ import annotations

import functools

import numpy as np

from tokenmdp.rl.tasks.base import CharTokenizer, Example, Task

__all__ = ["LENGTHS", "LONG_TASKS", "RunningSum", "running_sum_trace"]

LENGTHS = (8, 16, 32, 64, 128)
"""Trace lengths registered as tasks (``running_sum_<L>``)."""


def running_sum_trace(digits: str) -> str:
    """The running sums modulo 10 of ``digits``, one digit per input digit.

    Parameters
    ----------
    digits : str
        Decimal digits, e.g. ``"3141"``.

    Returns
    -------
    str
        ``s_1 s_2 ... s_n`` with ``s_j = (d_1 + ... + d_j) mod 10``, e.g. ``"3489"``.
    """
    if not digits.isdigit() or not digits.isascii():
        raise ValueError(f"digits: expected a non-empty string of decimal digits, got {digits!r}")
    out, s = [], 0
    for d in digits:
        s = (s + int(d)) % 10
        out.append(str(s))
    return "".join(out)


class RunningSum(Task):
    """``L`` digits and ``=`` → their running sums modulo 10 (``L`` digits, then EOS).

    Parameters
    ----------
    tokenizer : CharTokenizer, optional
        Default: ``CharTokenizer()`` (it has the digits and ``=``).
    length : int, default 64
        Digits of every prompt, hence of every answer (the correct response has ``length + 1``
        tokens, EOS included).
    """

    name = "running_sum"

    def __init__(self, tokenizer: CharTokenizer | None = None, *, length: int = 64) -> None:
        super().__init__(tokenizer)
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length: expected an int >= 1, got {length!r}")
        missing = set("0123456789=") - set(self.tokenizer.chars)
        if missing:
            raise ValueError(f"tokenizer: lacks the characters {''.join(sorted(missing))!r}")
        self.length = length
        self.name = f"running_sum_{length}"

    def draw(self, rng: np.random.Generator) -> Example:
        """``length`` uniform digits.

        Parameters
        ----------
        rng : numpy.random.Generator
            The source of randomness.

        Returns
        -------
        Example
            The digits followed by ``=``, and their trace (:func:`running_sum_trace`).
        """
        digits = "".join(map(str, rng.integers(0, 10, size=self.length).tolist()))
        return Example(digits + "=", running_sum_trace(digits))

    def max_prompt_len(self) -> int:
        """``length`` digits and ``=``.

        Returns
        -------
        int
            ``length + 1``.
        """
        return self.length + 1


LONG_TASKS = {f"running_sum_{n}": functools.partial(RunningSum, length=n) for n in LENGTHS}
"""Task name → constructor with the default options (in :data:`~tokenmdp.rl.tasks.TASKS`)."""
