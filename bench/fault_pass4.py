"""Fault pass four (issue 48): replay every row of docs/faults.md on this checkout and print
held/failed per row.

    .venv/bin/python bench/fault_pass4.py            # every row (about 5 minutes on 2 cores)
    .venv/bin/python bench/fault_pass4.py A03 C07    # some rows
    .venv/bin/python bench/fault_pass4.py --list     # the table's rows, run nothing
    FAULT_BASE=DIR .venv/bin/python bench/fault_pass4.py   # another checkout's code, laid out
        as an installed package in DIR/traindx (how docs/faults.md's "on main" column was made)

Each row runs for real in a scratch folder: the job bare, then the same job under `diagnose`
(the job's exit code, stdout bytes, stderr as a prefix of ours, its files), or a command given
bad input (one line on stderr, a non-zero exit, no traceback, nothing of the user's changed).
Rows live in bench/fault_rows.py; exit 1 when a row failed."""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fault_rows import ROWS, Ctx  # noqa: E402


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for r in ROWS:
            print(f"{r.rid}\t{r.cls}\t{r.command}\t{r.expected}")
        return 0
    chosen = [r for r in ROWS if not argv or r.rid in argv]
    failed = 0
    for r in chosen:
        with tempfile.TemporaryDirectory(prefix=f"fp4-{r.rid}-") as folder:
            started = time.monotonic()
            try:
                held, said = r.fn(Ctx(folder))
            except Exception as exc:  # a row's own harness failure counts as failed, named
                held, said = False, f"harness: {type(exc).__name__}: {exc}"
            took = time.monotonic() - started
        failed += not held
        print(f"{r.rid:4} {'held  ' if held else 'FAILED'} {took:5.1f}s  {said}", flush=True)
    print(f"{len(chosen) - failed} held, {failed} failed of {len(chosen)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
