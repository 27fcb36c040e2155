"""Verifiable tasks for the trainer world: a character tokenizer and three exact rewards.

Every task draws examples ``(prompt, answer)`` of short strings from a ``numpy`` generator and
scores a response by an exact rule. A response counts as *correct* when its text before EOS
equals the answer and it ends with EOS (a truncated response is never correct).

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

Held-out evaluation: :meth:`Task.eval_split` draws a fixed set of distinct examples from
``eval_seed``; :meth:`Task.sample` draws training examples that are never in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["TASKS", "Addition", "CharTokenizer", "CountA", "Example", "Sorting", "Task",
           "get_task"]

#: Draws before :meth:`Task.sample` gives up finding a training example outside the eval split.
MAX_REJECTIONS = 10_000


class CharTokenizer:
    """Character-level tokenizer: ``PAD`` = 0, ``EOS`` = 1, then one id per character.

    ``encode`` maps characters to ids (no EOS added); ``decode`` maps ids back, stopping at the
    first EOS. ``decode(encode(s)) == s`` for every string over ``chars`` (the constructor
    argument, kept as ``self.chars``).

    Parameters
    ----------
    chars : str, default "0123456789+=>ab"
        The vocabulary's characters, distinct; character ``i`` gets id ``i + 2``.
    """

    PAD = 0
    EOS = 1

    def __init__(self, chars: str = "0123456789+=>ab") -> None:
        if len(set(chars)) != len(chars) or not chars:
            raise ValueError(f"chars: expected distinct characters, got {chars!r}")
        self.chars = chars
        self._ids = {c: i + 2 for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        """Number of token ids (PAD, EOS and the characters)."""
        return len(self.chars) + 2

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; raises ``ValueError`` on a character outside the vocabulary.

        Parameters
        ----------
        text : str
            Characters of the vocabulary.

        Returns
        -------
        list of int
            One id per character, no EOS.
        """
        try:
            return [self._ids[c] for c in text]
        except KeyError as err:
            raise ValueError(f"text: character {err.args[0]!r} is not in the vocabulary "
                             f"{self.chars!r}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` up to (not including) the first EOS; PAD is skipped.

        Parameters
        ----------
        ids : sequence of int
            Token ids (ints or integer scalars, e.g. a tensor's row).

        Returns
        -------
        str
            The decoded text.
        """
        out = []
        for i in ids:
            i = int(i)
            if i == self.EOS:
                break
            if i != self.PAD:
                out.append(self.chars[i - 2])
        return "".join(out)


@dataclasses.dataclass(frozen=True)
class Example:
    """One task instance: the prompt text and the correct answer text (without EOS).

    Parameters
    ----------
    prompt : str
        What the model is given, e.g. ``"12+7="``.
    answer : str
        The only correct response's text, e.g. ``"19"``.
    """

    prompt: str
    answer: str


class Task:
    """A verifiable task: draws examples and scores responses exactly.

    Subclasses implement :meth:`draw` (one random example) and :meth:`max_prompt_len`, and may
    override :meth:`reward`.

    Parameters
    ----------
    tokenizer : CharTokenizer, optional
        The tokenizer of prompts and responses (default: ``CharTokenizer()``).
    """

    name = "task"

    def __init__(self, tokenizer: CharTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or CharTokenizer()

    def draw(self, rng: np.random.Generator) -> Example:
        """One random example.

        Parameters
        ----------
        rng : numpy.random.Generator
            The source of randomness (the only one: the same state draws the same example).

        Returns
        -------
        Example
            The prompt and its answer.
        """
        raise NotImplementedError

    def is_correct(self, example: Example, response: Sequence[int]) -> bool:
        """True when ``response`` (token ids) is the answer followed by EOS.

        Parameters
        ----------
        example : Example
            The prompt's example.
        response : sequence of int
            The sampled token ids, EOS included when the response ended.

        Returns
        -------
        bool
            Whether it is the answer's text, then exactly one EOS, at the end.
        """
        ids = list(response)
        return bool(ids) and ids[-1] == CharTokenizer.EOS and \
            self.tokenizer.decode(ids) == example.answer and \
            ids.count(CharTokenizer.EOS) == 1

    def reward(self, example: Example, response: Sequence[int]) -> float:
        """Exact reward of ``response`` (token ids): 1 if correct, else 0.

        Parameters
        ----------
        example : Example
            The prompt's example.
        response : sequence of int
            The sampled token ids, EOS included when the response ended.

        Returns
        -------
        float
            The reward.
        """
        return float(self.is_correct(example, response))

    def max_prompt_len(self) -> int:
        """Upper bound on the prompt length in tokens.

        Returns
        -------
        int
            The longest prompt :meth:`draw` can return, in tokens.
        """
        raise NotImplementedError

    def eval_split(self, size: int, seed: int) -> list[Example]:
        """``size`` distinct examples drawn from ``seed``: the held-out evaluation set.

        Parameters
        ----------
        size : int
            Number of examples (distinct prompts).
        seed : int
            Seed of the draws (the same seed gives the same set).

        Returns
        -------
        list of Example
            The examples, in draw order; ``ValueError`` when the task has fewer distinct prompts
            than ``size`` (or they are too rare to find).
        """
        rng = np.random.default_rng(seed)
        seen: dict[str, Example] = {}
        for _ in range(MAX_REJECTIONS):
            if len(seen) == size:
                break
            ex = self.draw(rng)
            seen.setdefault(ex.prompt, ex)
        if len(seen) < size:
            raise ValueError(f"eval_size={size}: task {self.name!r} has fewer distinct prompts")
        return list(seen.values())

    def sample(self, n: int, rng: np.random.Generator, *, exclude: frozenset[str] = frozenset()
               ) -> list[Example]:
        """``n`` training examples from ``rng`` whose prompts are not in ``exclude``.

        Parameters
        ----------
        n : int
            Number of examples (repeats allowed).
        rng : numpy.random.Generator
            The source of randomness.
        exclude : frozenset of str, default frozenset()
            Prompts never drawn (the evaluation split's).

        Returns
        -------
        list of Example
            ``n`` examples; ``ValueError`` when ``MAX_REJECTIONS`` draws do not find them.
        """
        out = []
        for _ in range(MAX_REJECTIONS):
            if len(out) == n:
                return out
            ex = self.draw(rng)
            if ex.prompt not in exclude:
                out.append(ex)
        raise ValueError(f"task {self.name!r}: could not draw {n} examples outside the eval split")


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


TASKS = {"addition": Addition, "sorting": Sorting, "count": CountA}
"""Task name → class (default options)."""


def get_task(name: str) -> Task:
    """The task ``name`` with its default options; ``ValueError`` listing the names otherwise.

    Parameters
    ----------
    name : str
        A key of ``TASKS``: addition, sorting or count.

    Returns
    -------
    Task
        A new instance with the default tokenizer and options.
    """
    if name not in TASKS:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]()


# the long-answer tasks (their module imports this one's classes, then adds itself to TASKS)
import tokenmdp.rl.long_tasks  # noqa: E402, F401
