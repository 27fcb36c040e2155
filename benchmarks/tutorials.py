"""CPU time of each tutorial, as a student's kernel spends it: seconds and the ratio to tutorial 1.

Each tutorial is executed top to bottom in a fresh Jupyter kernel (as the test suite and the
documentation build do), with one extra last cell that prints the kernel's own CPU time
(``os.times()``: user + system of every thread of the kernel process from its start, imports
included, plus those of any child process it waited for). CPU seconds, unlike wall seconds, do not
count the time the kernel waited for a loaded machine; the ratio to tutorial 1, run in the same
process, carries over to another machine. ``--budget`` is the course's limit (60 s of CPU on the
reference two-core machine); tutorials over it are marked.

    OMP_NUM_THREADS=1 python benchmarks/tutorials.py            # every tutorial
    OMP_NUM_THREADS=1 python benchmarks/tutorials.py 01 09      # tutorial 1 (the baseline) and 9

The last line is JSON: ``{"cpu_s": {stem: seconds}, "wall_s": {...}, "ratio_to_01": {...},
"over_budget": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
MARK = "TUTORIAL-CPU-SECONDS "
#: The course's limit per tutorial, CPU seconds at one thread on the two-core reference machine.
BUDGET_CPU_S = 60.0


def cpu_seconds(path: Path, timeout: float = 600.0) -> tuple[float, float]:
    """``(kernel CPU seconds, wall seconds)`` of one execution of the tutorial at ``path``.

    Parameters
    ----------
    path : Path
        A jupytext percent script.
    timeout : float, default 600
        Per-cell timeout (a hung kernel, not a speed target).

    Returns
    -------
    tuple of float
    """
    import jupytext
    import nbclient
    import nbformat

    notebook = jupytext.read(path, fmt="py:percent")
    notebook.cells.append(nbformat.v4.new_code_cell(
        f"import os as _os\n_t = _os.times()\n"
        f"print({MARK!r} + repr(_t.user + _t.system + _t.children_user + _t.children_system))"))
    client = nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    wall = time.perf_counter() - start
    text = "".join(out.get("text", "") for out in notebook.cells[-1].get("outputs", []))
    line = next(line for line in text.splitlines() if line.startswith(MARK))
    return float(line[len(MARK):]), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("numbers", nargs="*", help="tutorial numbers (default: all); 01 is always "
                                                   "run first, as the baseline of the ratio")
    parser.add_argument("--budget", type=float, default=BUDGET_CPU_S,
                        help="CPU seconds a tutorial may take (default %(default)s)")
    args = parser.parse_args(argv)
    sources = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
    wanted = {n.zfill(2) for n in args.numbers} | {"01"} if args.numbers else None
    chosen = [p for p in sources if wanted is None or p.name[:2] in wanted]
    unknown = (wanted or set()) - {p.name[:2] for p in chosen}
    if unknown:
        print(f"numbers: no tutorial {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} CPUs")
    print(f"{'tutorial':<58} {'CPU s':>7} {'wall s':>7} {'× 01':>6}")
    cpu, wall = {}, {}
    for path in chosen:
        cpu[path.stem], wall[path.stem] = cpu_seconds(path)
        base = cpu[chosen[0].stem]
        flag = "  over budget" if cpu[path.stem] > args.budget else ""
        print(f"{path.stem:<58} {cpu[path.stem]:7.1f} {wall[path.stem]:7.1f} "
              f"{cpu[path.stem] / base:6.1f}{flag}", flush=True)
    base = cpu[chosen[0].stem]
    over = [stem for stem, s in cpu.items() if s > args.budget]
    print(json.dumps({"cpu_s": cpu, "wall_s": wall,
                      "ratio_to_01": {stem: s / base for stem, s in cpu.items()},
                      "over_budget": over, "budget_cpu_s": args.budget}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
