"""The job's process tree in /proc: for py-spy when the shim is off (`--no-shim`).

With the shim on, training processes announce themselves (see shim/_traindx_shim/roles.py) and
nothing here is needed. Without it, the only evidence is each process's environment at start:
Python processes whose environment names a rank (roles.RANK_ENV) are sampled, or, when none
does, the top-most Python process: a `torch.multiprocessing.spawn` job is then sampled in its
parent only. No program name is looked at.
"""

import os
from typing import Any

from traindx.profiler.shim._traindx_shim.roles import is_multiprocessing_child, rank_from_env


def _read(path: str, mode: str = "r") -> Any:
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        if not stat:
            continue
        # comm may contain spaces and parentheses: ppid follows the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def cmdline(pid: int) -> list[str]:
    raw = _read(f"/proc/{pid}/cmdline", "rb")
    return [] if not raw else [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def environ(pid: int) -> dict[str, str]:
    raw = _read(f"/proc/{pid}/environ", "rb")
    env = {}
    for item in (raw or b"").split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def is_python(pid: int) -> bool:
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False
    return exe.startswith("python") or exe.startswith("pypy")


def rank_processes(root_pid: int) -> dict[int, str | None]:
    """{pid: rank or None} of the Python processes under root_pid to sample without the shim:
    the top-most Python process on each branch whose environment names a rank (its own
    children are DataLoader workers and the like), else the top-most Python processes."""
    children = children_map()
    found: dict[int, str | None] = {}
    topmost: list[int] = []
    stack = [(root_pid, False)]
    while stack:
        pid, below_python = stack.pop()
        python = is_python(pid)
        if python and not is_multiprocessing_child(cmdline(pid)):
            rank, _ = rank_from_env(environ(pid))
            if rank is not None:
                found[pid] = rank
                continue
            if not below_python:
                topmost.append(pid)
        stack.extend((child, below_python or python) for child in children.get(pid, []))
    return found or dict.fromkeys(topmost)
