"""Three short-answer verifiable tasks with exact rewards: addition, sorting, counting.

* :class:`Addition` — ``"12+7="`` → ``"19"``; reward 1 if correct, else 0.
* :class:`Sorting` — ``"3142>"`` → ``"1234"`` (the digits in ascending order); reward 1 if
  correct, else 0.
* :class:`CountA` — ``"abaab="`` → ``"3"`` (how many ``a``), reward
  ``1[correct] - length_penalty * (extra characters beyond the answer's length)``.
  **Wrong answers are longer than right ones by construction**: the answer is one digit, so the
  only correct response has 2 tokens (digit, EOS) and every response longer than that is wrong
  and also pays the per-character penalty. A model that "rambles" is wrong and long, so how an
  estimator aggregates over tokens (token-mean vs sequence-mean) shows up in the response
  length it drifts to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmdp.rl.tasks.base import CharTokenizer, Example, Task

__all__ = ["ARITHMETIC_TASKS", "Addition", "CountA", "Sorting"]

class Addition(Task):
    """``"a+b="`` → ``"a+b"`` in decimal, each operand with 1 to ``max_digits`` digits.

    Parameters
    ----------
    tokenizer : CharTokenizer, optional
        Default: ``CharTokenizer()``.
    max_digits : int, default 2
        Most digits of each operand (each is uniform below ``10^k`` for a uniform ``k`` in
        ``1..max_digits``).
    """

    name = "addition"

    def __init__(self, tokenizer: CharTokenizer | None = None, *, max_digits: int = 2) -> None:
        super().__init__(tokenizer)
        self.max_digits = max_digits

    def draw(self, rng: np.random.Generator) -> Example:
        """Two operands, each uniform below ``10^k`` for a uniform ``k`` in ``1..max_digits``.

        Parameters
        ----------
        rng : numpy.random.Generator
            The source of randomness.

        Returns
        -------
        Example
            ``"a+b="`` and the decimal sum.
        """
        a, b = (int(rng.integers(0, 10 ** int(rng.integers(1, self.max_digits + 1))))
                for _ in range(2))
        return Example(f"{a}+{b}=", str(a + b))

    def max_prompt_len(self) -> int:
        """Two operands of ``max_digits``, ``+`` and ``=``.

        Returns
        -------
        int
            ``2 max_digits + 2``.
        """
        return 2 * self.max_digits + 2


class Sorting(Task):
    """``"3142>"`` → ``"1234"``: ``min_len`` to ``max_len`` digits, sorted ascending.

    Parameters
    ----------
    tokenizer : CharTokenizer, optional
        Default: ``CharTokenizer()``.
    min_len, max_len : int, default 2 and 4
        Fewest and most digits of a prompt (the length is drawn uniformly).
    """

    name = "sorting"

    def __init__(self, tokenizer: CharTokenizer | None = None, *, min_len: int = 2,
                 max_len: int = 4) -> None:
        super().__init__(tokenizer)
        self.min_len, self.max_len = min_len, max_len

    def draw(self, rng: np.random.Generator) -> Example:
        """A uniform length, then uniform digits (repeats allowed).

        Parameters
        ----------
        rng : numpy.random.Generator
            The source of randomness.

        Returns
        -------
        Example
            The digits followed by ``>``, and the digits sorted.
        """
        digits = rng.integers(0, 10, size=int(rng.integers(self.min_len, self.max_len + 1)))
        return Example("".join(map(str, digits)) + ">", "".join(map(str, sorted(digits))))

    def max_prompt_len(self) -> int:
        """``max_len`` digits and ``>``.

        Returns
        -------
        int
            ``max_len + 1``.
        """
        return self.max_len + 1


class CountA(Task):
    """``"abaab="`` → ``"3"``: count the ``a`` in 1 to ``max_len`` (≤ 9) letters of {a, b}.

    Reward ``1[correct] - length_penalty * max(0, n - 2)`` for a response of ``n`` tokens: the
    correct response has 2 tokens (digit, EOS), so every longer response is wrong *and*
    penalized per extra character (see the module docstring).

    Parameters
    ----------
    tokenizer : CharTokenizer, optional
        Default: ``CharTokenizer()``.
    max_len : int, default 6
        Most letters of a prompt, at most 9 (the length is drawn uniformly from 1).
    length_penalty : float, default 0.05
        Reward subtracted per response token beyond the correct response's two.
    """

    name = "count"

    def __init__(self, tokenizer: CharTokenizer | None = None, *, max_len: int = 6,
                 length_penalty: float = 0.05) -> None:
        super().__init__(tokenizer)
        if not 1 <= max_len <= 9:
            raise ValueError(f"max_len: must be in [1, 9] (one-digit answers), got {max_len}")
        self.max_len, self.length_penalty = max_len, length_penalty

    def draw(self, rng: np.random.Generator) -> Example:
        """A uniform length, then uniform letters ``a`` / ``b``.

        Parameters
        ----------
        rng : numpy.random.Generator
            The source of randomness.

        Returns
        -------
        Example
            The letters followed by ``=``, and the number of ``a`` as one digit.
        """
        letters = rng.choice(np.array(["a", "b"]), size=int(rng.integers(1, self.max_len + 1)))
        text = "".join(letters.tolist())
        return Example(text + "=", str(text.count("a")))

    def reward(self, example: Example, response: Sequence[int]) -> float:
        """``1[correct] - length_penalty * max(0, n - 2)`` for a response of ``n`` tokens.

        Parameters
        ----------
        example : Example
            The prompt's example.
        response : sequence of int
            The sampled token ids, EOS included when the response ended.

        Returns
        -------
        float
            The reward (negative for a long wrong response).
        """
        extra = max(0, len(response) - (len(example.answer) + 1))
        return float(self.is_correct(example, response)) - self.length_penalty * extra

    def max_prompt_len(self) -> int:
        """``max_len`` letters and ``=``.

        Returns
        -------
        int
            ``max_len + 1``.
        """
        return self.max_len + 1


ARITHMETIC_TASKS = {"addition": Addition, "sorting": Sorting, "count": CountA}
"""Task name → class (default options)."""
