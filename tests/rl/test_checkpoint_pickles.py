"""Issue 33, gap 5: checkpoints are loaded with ``weights_only=True``, everywhere.

A checkpoint is a pickle; loaded with ``weights_only=False`` it runs whatever code its author
put in it. A checkpoint whose ``config`` entry unpickles to ``os.mkdir(<folder>)`` must be
refused by ``--resume`` and by ``--init`` in one line naming the file, and the folder must not
appear. Every ``torch.load`` in the package is also checked to pass ``weights_only=True``.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

import tokenmdp
from tokenmdp.rl.checkpoint import CHECKPOINT, DIGEST_KEY, load_checkpoint

from ._cli import TINY_ARGS, one_line_error, run_cli


class _Payload:
    """Unpickles to a call of ``os.mkdir(folder)``: code run by loading the file."""

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)

    def __reduce__(self):
        return os.mkdir, (self.folder,)


@pytest.fixture(scope="module")
def run_with_payload(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "R"
    proc = run_cli("sft", *TINY_ARGS, "--steps", "1", "--out-dir", out)
    assert proc.returncode == 0, proc.stderr
    state = torch.load(out / CHECKPOINT, weights_only=True)
    state.pop(DIGEST_KEY)
    marker = out.parent / "code-ran"
    state["config"] = _Payload(marker)           # no digest: the file is otherwise accepted
    torch.save(state, out / CHECKPOINT)
    return out, marker


def test_a_checkpoint_carrying_code_is_refused_by_resume_and_init(run_with_payload):
    run, marker = run_with_payload
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "2", "--out-dir", run,
                                  "--resume"))
    assert f"resume: {run / CHECKPOINT}" in line and "not a readable PyTorch checkpoint" in line
    line = one_line_error(run_cli("train", *TINY_ARGS, "--steps", "1", "--init",
                                  run / CHECKPOINT, "--out-dir", run.parent / "T"))
    assert f"init: {run / CHECKPOINT}" in line
    for option in ("init", "resume"):
        with pytest.raises(ValueError, match="not a readable PyTorch checkpoint"):
            load_checkpoint(run / CHECKPOINT, option=option)
    assert not marker.exists()                    # the payload never ran
    torch.load(run / CHECKPOINT, weights_only=False)   # what an unsafe load would have done
    assert marker.is_dir()
    marker.rmdir()


def test_every_torch_load_in_the_package_passes_weights_only_true():
    root = Path(tokenmdp.__file__).parent
    calls = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "load" and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "torch":
                flag = {k.arg: k.value for k in node.keywords}.get("weights_only")
                ok = isinstance(flag, ast.Constant) and flag.value is True
                calls.append((str(path.relative_to(root)), node.lineno, ok))
    assert calls, "no torch.load found: the check would be vacuous"
    assert all(ok for *_, ok in calls), calls
