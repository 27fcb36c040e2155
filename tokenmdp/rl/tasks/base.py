"""What every verifiable task of the trainer world is: a character tokenizer, an example, a task.

A task draws examples ``(prompt, answer)`` of short strings from a ``numpy`` generator and scores
a response by an exact rule. A response counts as *correct* when its text before EOS equals the
answer and it ends with EOS (a truncated response is never correct).

Held-out evaluation: :meth:`Task.eval_split` draws a fixed set of distinct examples from
``eval_seed``; :meth:`Task.sample` draws training examples that are never in it. The tasks
themselves are in :mod:`~tokenmdp.rl.tasks.arithmetic` and :mod:`~tokenmdp.rl.tasks.running_sum`,
by name in :mod:`~tokenmdp.rl.tasks.catalog`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["CharTokenizer", "Example", "Task"]

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
