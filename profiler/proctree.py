"""The job's process tree in /proc: for py-spy when the shim is off (`--no-shim`), and which of
its processes were stopped (StopWatch, always).

With the shim on, training processes announce themselves (see shim/_traindx_shim/roles.py) and
nothing here is needed. Without it, the only evidence is each process's environment at start:
Python processes whose environment names a rank (roles.RANK_ENV) are sampled, or, when none
does, the top-most Python process: a `torch.multiprocessing.spawn` job is then sampled in its
parent only. No program name is looked at.
"""

import os
import threading
import time
from typing import Any

from traindx.common import atomic
from traindx.profiler.shim._traindx_shim.roles import is_multiprocessing_child, rank_from_env


def _read(path: str, mode: str = "r") -> Any:
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


HELPER_NICE = 5  # traindx's helpers yield a contended core to the job (weight ~3:1), never starve


def lower_priority(pid: int = 0, own_session: bool = False) -> None:
    """A helper process (or, by its native id, a thread of diagnose) runs at HELPER_NICE: where
    the job and the helpers compete for cores (a loaded machine, a few cores), the job wins.
    own_session: the helper leads a session of its own, which the kernel's autogroup (on by
    default on desktop and many cloud kernels) makes a scheduling group of its own, where a
    process's nice counts only against its group: the group's nice is set too. Best effort:
    where it is not allowed, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, max(HELPER_NICE, os.getpriority(os.PRIO_PROCESS, pid)))
    except (OSError, AttributeError):
        pass
    if own_session and pid:
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(HELPER_NICE))
        except OSError:
            pass


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) of a process so far, its reaped children's included
    (/proc/<pid>/stat; a zombie not yet reaped still has them); None when it is gone."""
    raw = _read(f"/proc/{pid}/stat")
    if not raw:
        return None
    try:
        fields = raw[raw.rindex(")") + 2 :].split()
        ticks = sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
        return ticks / float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError):
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


# -- stopped processes ---------------------------------------------------------------------------
MIN_STOP_S = 0.5  # a shorter stop is within the watch's own resolution
STOPPED_FILE = "stopped.json"  # in the run folder, while the job runs


def state(pid: int) -> str | None:
    """The process's state letter (/proc/<pid>/stat: R, S, D, T stopped by a signal, t traced,
    Z ...), or None when it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0] if fields else None


def descendants(root: int) -> list[int]:
    """root and every process under it."""
    children = children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


class StopWatch:
    """Which processes of the job were stopped (state T: SIGSTOP, SIGTSTP; a debugger's stop is
    `t` and is not counted) and when: a thread of diagnose reading /proc every POLL_S (the tree
    every TREE_S). `stops`: [{pid, start_ns, end_ns, seconds}] of stops of at least MIN_STOP_S:
    start and end are the first and last polls that saw it stopped (inside the stop: a step
    they overlap was stopped), `seconds` its length estimated (one poll longer on average). A
    stopped process runs nothing, so it cannot say so itself."""

    POLL_S = 0.1
    TREE_S = 2.0

    def __init__(self, root: int, path: str | None = None) -> None:
        self.root = root
        self.path = path  # STOPPED_FILE of the run folder: the stops so far, for the live judge
        self.stops: list[dict[str, Any]] = []
        self._seen: dict[int, list[int]] = {}  # pid -> [first, last] poll that saw it stopped
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="traindx-stopwatch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        pids: list[int] = [self.root]
        next_tree = 0.0
        while not self._done.wait(self.POLL_S):
            try:
                if time.monotonic() >= next_tree:
                    pids = descendants(self.root)
                    next_tree = time.monotonic() + self.TREE_S
                self.poll(pids)
            except Exception:
                pass  # evidence only: never diagnose's problem

    def poll(self, pids: list[int]) -> None:
        now = time.time_ns()
        for pid in pids:
            if state(pid) == "T":
                if pid not in self._seen:
                    self._seen[pid] = [now, now]
                    self._write()
                self._seen[pid][1] = now
            elif pid in self._seen:
                self._close(pid)
                self._write()

    def _write(self) -> None:
        """The stops so far (an open one up to its last poll) into STOPPED_FILE."""
        if self.path is None:
            return
        open_now = [{"pid": p, "start_ns": a, "end_ns": b, "open": True} for p, (a, b) in self._seen.items()]
        try:
            atomic.write_json(self.path, self.stops + open_now)
        except (OSError, ValueError):
            pass  # the live judge then sees the stop at the end, in the manifest

    def _close(self, pid: int) -> None:
        first, last = self._seen.pop(pid)
        seconds = (last - first) / 1e9 + self.POLL_S
        if seconds >= MIN_STOP_S:
            self.stops.append({"pid": pid, "start_ns": first, "end_ns": last, "seconds": round(seconds, 2)})

    def stop(self) -> list[dict[str, Any]]:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        for pid in list(self._seen):
            self._close(pid)
        return self.stops
