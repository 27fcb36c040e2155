"""Issue 32, the exact world's memory budget at its edges: budgets below a byte, NumPy sizes,
and lengths whose sequence count no budget holds, refused from logarithms at once."""

import time

import numpy as np
import pytest

from tokenmdp.exact import TokenMDP
from tokenmdp.exact.world.budget import BUDGET_ENV, format_bytes, magnitude, memory_budget
from tokenmdp.exact.world.rewards import TokenCount

#: A refusal is computed from closed forms: far below this, whatever the length.
QUICK_S = 5.0


@pytest.mark.parametrize("bad", [0.5, 0, -1, float("nan"), float("inf"), True, "0.5", "0.0005K"])
def test_a_budget_below_one_byte_is_refused(bad, monkeypatch):
    with pytest.raises(ValueError, match="bytes >= 1"):
        memory_budget(bad)
    if isinstance(bad, str):
        monkeypatch.setenv(BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=f"{BUDGET_ENV}: expected a number of bytes >= 1"):
            memory_budget()


def test_numpy_and_fractional_budgets_are_read_as_bytes():
    assert memory_budget(np.int64(2 ** 20)) == 2 ** 20
    assert memory_budget(np.float64(1536.9)) == 1536          # rounded down, as documented
    assert memory_budget(1.0) == 1 and memory_budget("1K") == 1024 and memory_budget("2M") == 2 ** 21


@pytest.mark.parametrize(("text", "size"), [
    ("1K", 1024), ("3k", 3 * 1024), ("512M", 512 * 1024 ** 2), ("512MiB", 512 * 1024 ** 2),
    ("1.5G", 3 * 1024 ** 3 // 2), ("16GB", 16 * 1024 ** 3), ("2T", 2 * 1024 ** 4), ("4096", 4096)])
def test_the_suffixes_are_powers_of_1024(text, size, monkeypatch):
    """Issue 33, gap 5: K, M, G, T are 1024, 1024², 1024³, 1024⁴ (not 1000), with or without
    ``B`` / ``iB``, in either case; the same read from the environment; the default is 2 GiB."""
    assert memory_budget(text) == size
    monkeypatch.setenv(BUDGET_ENV, text)
    assert memory_budget() == size
    monkeypatch.delenv(BUDGET_ENV)
    assert memory_budget() == 2 * 1024 ** 3


@pytest.mark.parametrize("max_len", [1000, 2000, 10 ** 9])
def test_a_length_past_any_budget_is_refused_at_once(max_len):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"max_len={max_len}, 1 prompt.s.: .*sequences.*, over"):
        TokenMDP(3, max_len, TokenCount(0))
    assert time.perf_counter() - start < QUICK_S


def test_huge_counts_are_printed_without_overflow():
    assert magnitude(2 ** 60) == "1.15e+18" and magnitude(12345) == "12,345"
    assert magnitude(2 ** 1100) == f"about 10^{round(1100 * np.log10(2))}"
    assert format_bytes(2 ** 1100).endswith(" bytes") and "10^" in format_bytes(2 ** 1100)
