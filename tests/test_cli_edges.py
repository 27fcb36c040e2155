"""Issue 32, the command line at its edges, through the real entry point: a closed pipe, a seed
out of range, an empty output folder, sizes no budget holds, tutorial sources that are not text
or not files: each one line (exit 2, no traceback) or a quiet stop, nothing half written."""

import subprocess
import sys

import pytest

from tests.rl._cli import one_line_error, run_cli
from tokenmdp.rl.run_state import INTERRUPTED_STATUS  # noqa: F401  (the CLI imports it too)


@pytest.mark.parametrize("command", [["estimators"], ["exact", "--max-len", "2"],
                                     ["tutorials"]])
def test_a_closed_pipe_ends_the_command_quietly(command):
    # `tokenmdp estimators | true`: the reader exits before reading; the writer's first full
    # write raises BrokenPipeError, which must not become a traceback
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-m', 'tokenmdp.cli', "
            f"*{command!r}], stdout=subprocess.PIPE, stderr=subprocess.PIPE); p.stdout.close(); "
            "err = p.stderr.read().decode(); p.wait(); print(p.returncode); print(err)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout
    status, _, stderr = out.partition("\n")
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert int(status) in (0, 141)     # 141: the pipe closed before the output was written


@pytest.mark.parametrize("args, message", [
    (("--seed", str(2 ** 70)), "--seed: must be in [0, 9223372036854775806], got"),
    (("--seed", "-1"), "--seed: must be in [0,"),
    (("--out", ""), "--out: empty; name a folder"),
    (("--samples", "1"), "--samples: must be >= 2, got 1"),
    (("--group-size", "1000000"), "sampled batches would need about 122 GiB, over the exact "
                                  "world's memory budget"),
    (("--samples", str(10 ** 12), "--method", "monte_carlo"),
     "1,000,000,000,000 sampled batches would need about 131 TiB"),
])
def test_compare_refuses_what_it_cannot_do_in_one_line(tmp_path, args, message):
    line = one_line_error(run_cli("compare", *args, cwd=tmp_path))
    assert message in line, line
    assert not list(tmp_path.iterdir())          # nothing written


def test_exact_at_a_length_past_any_budget_is_refused_at_once(tmp_path):
    for max_len in ("2000", str(10 ** 9)):
        line = one_line_error(run_cli("exact", "--max-len", max_len, timeout=60))
        assert "sequences, over any memory budget of the exact world" in line, line


def test_tutorial_sources_that_are_not_readable_scripts_are_named(tmp_path):
    folder = tmp_path / "dir"
    (folder / "01_x.py").mkdir(parents=True)
    line = one_line_error(run_cli("tutorials", "--source", folder))
    assert f"--source: {folder / '01_x.py'} is not a file" in line
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "01_x.py").write_bytes(b"# %%\n\xff\xfe not utf-8\n")
    for args in (("tutorials", "--source", binary),
                 ("tutorials", "--source", binary, "--student", tmp_path / "out")):
        line = one_line_error(run_cli(*args))
        assert f"--source: {binary / '01_x.py'} is not UTF-8 text (byte 0xff at offset 5)" in line
    assert not (tmp_path / "out").exists()
