"""Issue 16, the exact world at its edges: the memory budget refuses before allocating,
``moments(method="auto")`` says which method ran and seeds itself, and non-finite numbers are
refused wherever a finite one is meant."""

import os
import subprocess
import sys
import time

import pytest
import torch

from tokenmdp import estimators
from tokenmdp.exact import LogLinearPolicy, TabularPolicy, TokenMDP, inference_copy, moments, stale_copy
from tokenmdp.exact.world import rewards
from tokenmdp.exact.world.budget import BUDGET_ENV, DEFAULT_MEMORY_BUDGET, memory_budget
from tokenmdp.exact.world.mdp import enumeration_bytes

REFUSAL_SECONDS = 5.0
"""A refusal comes from closed-form counts: far below any allocation of the refused size."""


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmdp.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


@pytest.mark.parametrize("vocab, max_len", [(1000, 10), (3, 30), (40, 6)])
def test_oversized_world_refused_from_closed_form_count(vocab, max_len):
    b = vocab - 1
    count = sum(b ** k for k in range(max_len + 1))  # independent of the closed form
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="vocab_size") as err:
        TokenMDP(vocab, max_len, rewards.TokenCount(0))
    assert time.perf_counter() - t0 < REFUSAL_SECONDS
    text = str(err.value)
    assert "max_len" in text and "memory budget" in text
    assert (f"{count:,}" if count < 10 ** 15 else f"{float(count):.3g}") in text


def test_budget_is_documented_and_overridable(monkeypatch):
    need = enumeration_bytes(15, 1, 3)  # V=3, L=3: 1 + 2 + 4 + 8 sequences
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert memory_budget() == DEFAULT_MEMORY_BUDGET
    TokenMDP(3, 3, rewards.TokenCount(0))
    with pytest.raises(ValueError, match="15 sequences"):
        TokenMDP(3, 3, rewards.TokenCount(0), memory_budget=need - 1)
    TokenMDP(3, 3, rewards.TokenCount(0), memory_budget=need)
    monkeypatch.setenv(BUDGET_ENV, str(need - 1))
    with pytest.raises(ValueError, match="15 sequences"):
        TokenMDP(3, 3, rewards.TokenCount(0))
    monkeypatch.setenv(BUDGET_ENV, "1K")
    assert memory_budget() == 1024
    for bad in ("nan", "-3G", "lots"):
        monkeypatch.setenv(BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=BUDGET_ENV):
            memory_budget()
    with pytest.raises(ValueError, match="memory_budget"):
        memory_budget(float("inf"))


def test_cli_exact_oversized_world_one_line():
    t0 = time.perf_counter()
    proc = run_cli("exact", "--vocab", "1000", "--max-len", "10")
    assert_one_line_error(proc, "vocab_size=1000", "max_len=10", "bytes", "memory budget")
    assert time.perf_counter() - t0 < 60


def test_cli_budget_from_environment():
    proc = run_cli("exact", "--vocab", "3", "--max-len", "3", env={BUDGET_ENV: "100"})
    assert_one_line_error(proc, "memory budget of 100 bytes")


@pytest.fixture
def small():
    mdp = TokenMDP(3, 3, rewards.TokenCount(0))
    return mdp, TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", ["enumeration", "exchangeability", "exact"])
def test_oversized_exact_method_refused(small, method):
    # dapo's token mean reads the other samples' counts, so its types are (reward, count) pairs
    # and a group of 40 has too many multisets (rloo's types are its rewards alone: 4 types,
    # 26,398 multisets, exact at G = 40)
    mdp, policy = small
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="group_size=40") as err:
        moments(mdp, policy, estimators.get("dapo"), group_size=40, method=method)
    assert time.perf_counter() - t0 < REFUSAL_SECONDS
    assert "batches would need" in str(err.value)


def test_auto_names_the_method_and_seeds_itself(small):
    mdp, policy = small
    est = estimators.get("dapo")
    exact = moments(mdp, policy, est, group_size=2, method="auto")
    assert exact.method in ("enumeration", "exchangeability")
    a = moments(mdp, policy, est, group_size=40, method="auto", num_samples=64)
    b = moments(mdp, policy, est, group_size=40, method="auto", num_samples=64)
    assert a.method == "monte_carlo"
    assert torch.equal(a.mean, b.mean)  # the documented default seed: repeatable
    seeded = moments(mdp, policy, est, group_size=40, method="monte_carlo", num_samples=64,
                     generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.mean, seeded.mean)


def test_cli_compare_oversized_world_one_line(tmp_path):
    proc = run_cli("compare", "--vocab", "40", "--max-len", "6", "--out", str(tmp_path / "c"))
    assert_one_line_error(proc, "vocab_size=40", "max_len=6")


# ------------------------------------------------------------------ non-finite numbers (class 9)
NON_FINITE = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("build, name", [
    (lambda mdp, pi, x: stale_copy(mdp, pi, distance=x), "distance"),
    (lambda mdp, pi, x: stale_copy(mdp, pi, steps=1, lr=x), "lr"),
    (lambda mdp, pi, x: inference_copy(pi, noise_std=x, generator=torch.Generator()), "noise_std"),
    (lambda mdp, pi, x: inference_copy(pi, temperature=x), "temperature"),
    (lambda mdp, pi, x: TabularPolicy(mdp, generator=torch.Generator(), init_std=x), "init_std"),
    (lambda mdp, pi, x: LogLinearPolicy(mdp, generator=torch.Generator(), init_std=x),
     "init_std"),
])
def test_non_finite_numbers_rejected(small, build, name, bad):
    mdp, policy = small
    with pytest.raises(ValueError, match=f"^{name}: must be a finite number"):
        build(mdp, policy, bad)


def test_finite_edges_still_accepted(small):
    mdp, policy = small
    assert torch.equal(stale_copy(mdp, policy, distance=0).table, policy.table)
    uniform = TabularPolicy(mdp, generator=torch.Generator(), init_std=0)
    assert torch.equal(uniform.table, torch.zeros_like(uniform.table))


@pytest.mark.parametrize("option, name", [("--noise", "noise_std"),
                                          ("--stale-distance", "distance")])
def test_cli_compare_rejects_nan(tmp_path, option, name):
    proc = run_cli("compare", option, "nan", "--out", str(tmp_path / "c"))
    assert_one_line_error(proc, f"error: {name}: must be a finite number")
