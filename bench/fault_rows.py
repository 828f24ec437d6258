"""The rows of fault pass four (docs/faults.md), shared by bench/fault_pass4.py: each row a
function of a scratch folder returning (held, what was seen). Rows of the job's fate compare the
job bare with the job under `diagnose`; rows of bad input want one line and a non-zero exit."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
SYSTEM_PY = "/usr/bin/python3"  # another interpreter, without traindx installed
OURS = re.compile(rb"(^|\n)Traceback|internal error|a bug of traindx|(^|\n)traindx: ")


@dataclasses.dataclass
class Row:
    rid: str
    cls: str
    command: str
    expected: str
    fn: Callable[[Ctx], tuple[bool, str]]


ROWS: list[Row] = []


def row(rid: str, cls: str, command: str, expected: str) -> Callable[[Callable], Callable]:
    def add(fn: Callable[[Ctx], tuple[bool, str]]) -> Callable:
        ROWS.append(Row(rid, cls, command, expected, fn))
        return fn

    return add


class Ctx:
    """A scratch folder and the shell the rows run in ($PY, $DX, $ROOT set)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.runs = 0  # run folders made by same()

    def path(self, *names: str) -> str:
        return os.path.join(self.folder, *names)

    def write(self, name: str, text: str, mode: int | None = None) -> str:
        path = self.path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if mode is not None:
            os.chmod(path, mode)
        return path

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINDX_")}
        env.update(
            PY=PY,
            DX=os.path.join(os.path.dirname(PY), "diagnose"),
            ROOT=ROOT,
            OMP_NUM_THREADS="1",
            PYTHONPATH="",
        )
        env.pop("PYTHONPATH")
        if os.environ.get("FAULT_BASE"):  # replay another checkout's code (see fault_pass4.py)
            env["PYTHONPATH"] = os.environ["FAULT_BASE"]
        env.update(extra or {})
        return env

    def sh(
        self, script: str, env: dict[str, str] | None = None, timeout: float = 180, stdin: bytes | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            ["bash", "-c", script],
            cwd=self.folder,
            env=self.env(env),
            input=stdin if stdin is not None else b"",
            capture_output=True,
            timeout=timeout,
        )

    def same(
        self,
        job: str,
        pre: str = "",
        flags: str = "--quiet",
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        check: Callable[[], str] | None = None,
        out_file: str | None = None,
        digits: bool = True,
    ) -> tuple[bool, str]:
        """The job bare, then under diagnose: exit code, stdout bytes, stderr (ours may only
        follow the job's), and what `check` (run after each) says of the job's files."""
        seen = []
        self.runs += 1
        run = self.path("run" if self.runs == 1 else f"run{self.runs}")
        for arm in ("bare", "dx"):
            wrap = "" if arm == "bare" else f"$DX {flags} --run-dir {shlex.quote(run)} -- "
            proc = self.sh(f"{pre}{wrap}{job}", env=env, stdin=stdin)
            out = proc.stdout
            if out_file:
                with open(self.path(out_file), "rb") as f:
                    out = f.read()
            if not digits:
                out = re.sub(rb"[0-9][0-9.:-]*", b"0", out)
            seen.append((proc.returncode, out, proc.stderr, check() if check else ""))
        (rc0, out0, err0, files0), (rc1, out1, err1, files1) = seen
        problems = []
        if rc0 != rc1:
            problems.append(f"exit {rc1}, bare {rc0}")
        if out0 != out1:
            problems.append(f"stdout differs: {out1[:120]!r} vs bare {out0[:120]!r}")
        if not err1.startswith(err0):
            problems.append(f"stderr differs: {err1[:240]!r} vs bare {err0[:160]!r}")
        elif OURS.search(err1[len(err0) :]):
            problems.append(f"ours: {OURS.search(err1[len(err0) :])!r} in {err1[len(err0) :][-300:]!r}")
        if files0 != files1:
            problems.append(f"files: {files1} vs bare {files0}")
        return not problems, "; ".join(problems) or f"exit {rc1} as bare, bytes and files as bare"

    def one_line(
        self, script: str, env: dict[str, str] | None = None, timeout: float = 120
    ) -> tuple[bool, str]:
        """Bad input: a non-zero exit and one line on stderr, no traceback."""
        proc = self.sh(script, env=env, timeout=timeout)
        lines = [x for x in proc.stderr.decode(errors="replace").splitlines() if x.strip()]
        said = " | ".join(lines)[-300:]
        held = proc.returncode != 0 and len(lines) == 1 and not OURS.search(proc.stderr)
        return held, f"exit {proc.returncode}, {len(lines)} line(s): {said}"

    def run_dir(self, name: str = "done") -> str:
        """A small finished run of a second-long plain-Python job with two steps."""
        self.write("stepper.py", STEPPER)
        proc = self.sh(
            f"$DX --quiet --no-pyspy --step-marker __main__:train_step --run-dir {name} -- $PY stepper.py"
        )
        assert proc.returncode == 0, proc.stderr[-500:]
        return self.path(name)


# a job with optimizer steps and no torch: the shim's step marker on a plain function
STEPPER = """
import time
def train_step(i):
    time.sleep(0.05)
    return i
for i in range(6):
    train_step(i)
    print(f"step {i} loss {1.0 / (i + 1):.3f}", flush=True)
"""


def tree(folder: str) -> str:
    """Names, modes and sizes under a folder (links as links): what a job or a user would see."""
    out = []
    for base, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(base, name)
            st = os.lstat(p)
            out.append(
                f"{os.path.relpath(p, folder)}:{oct(st.st_mode)}:{st.st_size if not os.path.isdir(p) else ''}"
            )
    return ",".join(out)


import fault_rows_input  # noqa: E402,F401  (registers the rows)
import fault_rows_job  # noqa: E402,F401

ROWS.sort(key=lambda r: r.rid)
