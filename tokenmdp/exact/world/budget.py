"""The memory budget of the exact world: refuse, from closed-form counts, before allocating.

Every exact computation enumerates something whose size is known in closed form before any
tensor exists: the ``P * sum_{k=0}^{L} b^k`` sequences of a :class:`~tokenmdp.exact.TokenMDP`,
the ``(P * C(n + G - 1, G))^B`` group draws of :func:`~tokenmdp.exact.moments`. :func:`check_budget`
compares an estimate of the memory such an enumeration needs with the budget and raises a
``ValueError`` naming the sizes, the count and the bytes, instead of letting the allocator fail
(or, worse, succeed slowly with swap).

The budget is :data:`DEFAULT_MEMORY_BUDGET` (2 GiB), overridden by the environment variable
``TOKENMDP_MEMORY_BUDGET`` (bytes, or a number with a ``K``/``M``/``G``/``T`` suffix, powers of
1024: ``TOKENMDP_MEMORY_BUDGET=16G tokenmdp exact ...``) and, for one call, by the
``memory_budget=`` argument of the functions that check it.
"""

from __future__ import annotations

import math
import numbers
import os

__all__ = ["DEFAULT_MEMORY_BUDGET", "BUDGET_ENV", "MAX_LOG2_SEQUENCES", "check_budget",
           "check_countable", "format_bytes", "magnitude", "memory_budget"]

DEFAULT_MEMORY_BUDGET = 2 * 1024 ** 3
"""Bytes an exact enumeration may need before it is refused (2 GiB)."""
BUDGET_ENV = "TOKENMDP_MEMORY_BUDGET"
"""Environment variable overriding :data:`DEFAULT_MEMORY_BUDGET`."""

_SUFFIXES = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}


def _parse(text: str, name: str) -> int:
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = _SUFFIXES.get(s[-1:], 1)
    number = s[:-1] if s[-1:] in _SUFFIXES else s
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value * scale < 1:
        raise ValueError(f"{name}: expected a number of bytes >= 1 (e.g. 8G), got {text!r}")
    return int(value * scale)


def memory_budget(override: int | float | str | None = None) -> int:
    """The budget in bytes: ``override`` when given, else ``$TOKENMDP_MEMORY_BUDGET``, else
    :data:`DEFAULT_MEMORY_BUDGET`.

    Parameters
    ----------
    override : int, float or str, optional
        A budget for one call: bytes (any real number >= 1, NumPy scalars included; a fraction
        is rounded down), or a string such as ``"512M"`` or ``"16G"`` (powers of 1024).

    Returns
    -------
    int
        The budget, a positive number of bytes.

    Raises
    ------
    ValueError
        ``memory_budget`` / ``TOKENMDP_MEMORY_BUDGET``: not a finite number of bytes >= 1.
    """
    if override is not None:
        if isinstance(override, str):
            return _parse(override, "memory_budget")
        if isinstance(override, bool) or not isinstance(override, numbers.Real) \
                or not math.isfinite(override) or override < 1:
            raise ValueError(f"memory_budget: expected a number of bytes >= 1, got "
                             f"{override!r}")
        return int(override)
    env = os.environ.get(BUDGET_ENV)
    return DEFAULT_MEMORY_BUDGET if env is None else _parse(env, BUDGET_ENV)


def format_bytes(n: int | float) -> str:
    """``n`` bytes as ``"1.5 GiB"`` (or ``"3.2e+25 bytes"`` beyond TiB).

    Parameters
    ----------
    n : int or float
        A number of bytes, ``>= 0``.

    Returns
    -------
    str
        Three significant digits and a binary unit (KiB to TiB); whole bytes below 1 KiB, and
        bytes in exponent notation from 1024 TiB on.
    """
    for unit, size in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2),
                       ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n < 1024 ** 5 else f"{magnitude(n)} bytes"
    return f"{int(n)} bytes"


def magnitude(n: int | float) -> str:
    """``n`` in three significant digits (``"3.2e+25"``), or ``"about 10^N"`` beyond float64.

    Parameters
    ----------
    n : int or float
        A count or a number of bytes, ``>= 1``.

    Returns
    -------
    str
        ``n`` with thousands separators below ``10^15``, else in exponent notation.
    """
    if n < 10 ** 15:
        return f"{int(n):,}"
    try:
        return f"{float(n):.3g}"
    except OverflowError:                       # an int past 1.8e308: its order of magnitude
        return f"about 10^{math.log10(n):.0f}"


_resolve = memory_budget


def check_budget(what: str, count: int, unit: str, bytes_needed: int, *,
                 memory_budget: int | float | str | None = None) -> None:
    """Raise ``ValueError`` when ``bytes_needed`` exceeds the budget.

    ``what`` names the sizes that set ``count`` (e.g. ``"vocab_size=1000, max_len=10"``),
    ``unit`` what is counted (``"sequences"``); the message adds the bytes, the budget and how
    to raise it.

    Parameters
    ----------
    what : str
        The sizes that set ``count``, as the message's opening.
    count : int
        How many items the enumeration has.
    unit : str
        What the items are (plural).
    bytes_needed : int
        The estimated memory of the enumeration.
    memory_budget : int, float or str, optional
        A budget for this call (see :func:`memory_budget`; default: the environment's or
        :data:`DEFAULT_MEMORY_BUDGET`).
    """
    budget = _resolve(memory_budget)
    if bytes_needed > budget:
        shown = magnitude(count)
        raise ValueError(f"{what}: {shown} {unit} would need about {format_bytes(bytes_needed)}, "
                         f"over the exact world's memory budget of {format_bytes(budget)} "
                         f"(raise it with {BUDGET_ENV}=... or memory_budget=)")


#: log2 of the largest count of sequences the budget check computes exactly; beyond it (about
#: 10^308 sequences) no budget could hold the enumeration, and the exact count of a length such
#: as 10^9 would take minutes to form.
MAX_LOG2_SEQUENCES = 1024


def check_countable(vocab_size: int, max_len: int, num_prompts: int) -> None:
    """Refuse, from logarithms alone, a token MDP whose sequence count is past ``2^1024``.

    Parameters
    ----------
    vocab_size, max_len, num_prompts : int
        ``V`` (EOS included), ``L`` and ``P`` of the MDP.

    Raises
    ------
    ValueError
        Naming the sizes and the order of magnitude of the count (and the lattice, which is
        exact at long lengths without enumerating).
    """
    b = vocab_size - 1
    log2_count = math.log2(num_prompts) + (math.log2(max_len + 1) if b == 1 else
                                           (max_len + 1) * math.log2(b) - math.log2(b - 1))
    if log2_count > MAX_LOG2_SEQUENCES:
        raise ValueError(f"vocab_size={vocab_size}, max_len={max_len}, {num_prompts} prompt(s): "
                         f"about 10^{log2_count * math.log10(2):.0f} sequences, over any memory "
                         "budget of the exact world (the lattice, tokenmdp.exact.lattice, is "
                         "exact at long lengths without enumerating)")
