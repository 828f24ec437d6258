"""How much CPU the training process got, and how busy the machine was, per step.

One `cpu` event at each step end (the training thread), with the deltas since the previous one:
  proc_cpu_s    CPU seconds of this process, all its threads (time.process_time)
  thread_cpu_s  CPU seconds of the training thread itself (time.thread_time)
  thread_runq_s seconds the training thread was runnable but waited for a core (the kernel's
                run-queue delay, /proc/self/task/<tid>/schedstat; Linux only): time a loaded
                machine added to the step that no code of the job spent
  sys_idle_s    core-seconds the whole machine was idle (/proc/stat idle + iowait), Linux only
  sys_total_s   core-seconds the machine had (/proc/stat, all states)
  sys_span_s    the wall seconds those cover: the machine is read at most every
                STAT_INTERVAL_NS, so on short steps a reading spans the steps since the last one
                (the steps between carry no sys_* fields)
  running       runnable tasks on the machine at the step end (/proc/loadavg; the training
                thread that reads it is one of them)
  cores         cores this process may run on (sched_getaffinity), once, on the first event
The DataLoader's own CPU seconds ride on its `data` span (spans.py).

One `cpu_threads` event at the end of steps 0 and 1 (the later one is the settled picture: the
intra-op pool and the DataLoader workers exist by then) says how many threads compete for how
many cores: intra_op_threads / inter_op_threads (torch.get_num_threads /
get_num_interop_threads), process_threads (this process, /proc/self/status), affinity_cores
(sched_getaffinity), cgroup_quota_cores (cgroup v2 cpu.max or v1 cfs quota / period; None: no
quota), cpu_count, thread_env (OMP/MKL/OpenBLAS/... *_NUM_THREADS as set), dataloader_workers
([{pid, threads}] of the live DataLoader iterators' worker processes), children ([{pid, name,
threads}] of every child process: compile workers too) and load1 (/proc/loadavg). Together they say how many
cores were really free to the job (a prediction that adds worker processes needs that); a
read of /proc/stat and /proc/loadavg is 15-50 µs, so sys_* and running come at most every
STAT_INTERVAL_NS (every step of steps longer than that), each reading spanning the steps since
the last one (sys_span_s: the wall seconds it covers).
"""

from __future__ import annotations

import os
import threading
import time

from . import emit, roles, schema, selfcost

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

CPU_THREADS = schema.CPU_THREADS
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "TORCH_NUM_THREADS",
)
THREAD_SNAPSHOT_STEPS = (0, 1)
dataloader_iterators: dict[
    int, Any
] = {}  # id -> weakref of each DataLoader iterator seen (spans.py fills it)
_TICK: list[Any] = [None]
_prev: dict[Any, Any] = {}
_cores_sent = [False]


def _proc_stat() -> tuple[float, float, int | None] | None:
    """(idle core-seconds, total core-seconds since boot, runnable tasks now), or None off
    Linux. Only the first line of /proc/stat is read (on a many-core host the file is long:
    a line per core and the interrupt counts), the runnable count from /proc/loadavg."""
    try:
        if _TICK[0] is None:
            _TICK[0] = float(os.sysconf("SC_CLK_TCK"))
        # held open, read with one pread each: an open and a close per step cost as much again
        # (~60 + 35 µs on the 2-core VM, against ~20 + 5 µs)
        first = os.pread(_held("/proc/stat"), 512, 0).split(b"\n", 1)[0].decode("ascii", "replace")
        load = os.pread(_held("/proc/loadavg"), 256, 0).decode("ascii", "replace").split()
    except (OSError, ValueError, AttributeError):
        return None
    if not first.startswith("cpu "):
        return None
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    ticks = [int(v) for v in first.split()[1:9]]
    running = int(load[3].split("/")[0]) if len(load) > 3 and "/" in load[3] else None
    return (ticks[3] + ticks[4]) / _TICK[0], sum(ticks) / _TICK[0], running


_held_fds: dict[str, int] = {}


def _held(path: str) -> int:
    """A machine-wide /proc file, opened once per process (a forked child keeps the same file)."""
    fd = _held_fds.get(path)
    if fd is None:
        fd = _held_fds[path] = roles.open_high(path, os.O_RDONLY)
    return fd


def _snapshot(machine: bool = True) -> dict[str, Any]:
    return {
        "proc": time.process_time(),
        "thread": time.thread_time(),
        "tid": threading.get_ident(),
        "stat": _proc_stat() if machine else None,
        "runq": runqueue_ns(),
    }


_machine: dict[str, Any] = {"stat": None, "t": None, "read_ns": 0}  # the last machine-wide reading, its time
STAT_INTERVAL_NS = 100_000_000  # machine-wide reads: at most 10 a second (every step of longer steps)
_clock = time.monotonic_ns


_schedstat: dict[
    tuple[int, int], Any
] = {}  # (pid, native thread id) -> its open schedstat (one pread a step)


def runqueue_ns() -> tuple[int, int] | None:
    """(on-CPU ns, run-queue wait ns) of the calling thread so far (/proc/self/task/<tid>/
    schedstat), or None off Linux or where the kernel keeps no schedstat."""
    try:
        tid = threading.get_native_id()
        fd = _schedstat.get((os.getpid(), tid))  # a forked child's thread opens its own
        if fd is None:
            fd = _schedstat[(os.getpid(), tid)] = roles.open_high(
                f"/proc/self/task/{tid}/schedstat", os.O_RDONLY
            )
        fields = os.pread(fd, 128, 0).split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def emit_step(step: int, own: dict[str, Any] | None = None) -> None:
    """The CPU evidence of the step that just ended; the first call only takes the snapshot the
    next one is measured from (so a step's deltas never include start-up). own: the shim's own
    cost in the step (selfcost.step_fields)."""
    # the machine-wide reads (/proc/stat and /proc/loadavg: the costliest part, 15-50 µs) at
    # most every STAT_INTERVAL_NS (x stat_every once the shim sheds work, selfcost.py): a
    # reading then spans the steps since the last one (sys_span_s), and their cost is bounded
    # per second, not paid per step
    mono = _clock()
    interval = STAT_INTERVAL_NS * selfcost.shed_state["stat_every"]
    due = _machine["stat"] is None or mono - _machine["read_ns"] >= interval
    now = _snapshot(machine=due)
    prev = dict(_prev)
    _prev.clear()
    _prev.update(now)
    last, last_t = _machine["stat"], _machine["t"]
    if now["stat"]:
        _machine.update(stat=now["stat"], t=mono / 1e9, read_ns=mono)
    if not prev:
        return
    fields = {"proc_cpu_s": now["proc"] - prev["proc"], **(own or {})}
    if now["tid"] == prev["tid"]:  # a retro step begin may be taken on another thread
        fields["thread_cpu_s"] = now["thread"] - prev["thread"]
        if now["runq"] and prev["runq"]:
            fields["thread_runq_s"] = (now["runq"][1] - prev["runq"][1]) / 1e9
    if now["stat"] and last:
        fields.update(
            sys_idle_s=now["stat"][0] - last[0],
            sys_total_s=now["stat"][1] - last[1],
            sys_span_s=_machine["t"] - last_t,  # the wall seconds the reading covers
            running=now["stat"][2],
        )
    if not _cores_sent[0]:
        _cores_sent[0] = True
        try:
            fields["cores"] = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            fields["cores"] = os.cpu_count()
    emit(schema.CPU, step=step, **fields)


def _threads_of(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _children() -> list[dict[str, Any]]:
    out = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    pids = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children", "rb") as f:
                pids += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
    for pid in pids[:256]:
        try:
            with open(f"/proc/{pid}/comm", "rb") as f:
                name = f.read().decode("utf-8", "replace").strip()
        except OSError:
            name = None
        out.append({"pid": pid, "name": name, "threads": _threads_of(pid)})
    return out


def _cgroup_quota_cores() -> float | None:
    """Cores the cgroup lets this process use (quota / period), None without a quota."""
    try:
        with open("/sys/fs/cgroup/cpu.max", "rb") as f:
            quota, period = f.read().decode().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "rb") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "rb") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def emit_threads(step: int, torch: Any) -> None:
    """The `cpu_threads` picture (see the module docstring), at the end of the first steps."""
    if step not in THREAD_SNAPSHOT_STEPS:
        return
    fields: dict[str, Any] = {
        "step": step,
        "cpu_count": os.cpu_count(),
        "process_threads": _threads_of("self"),
        "cgroup_quota_cores": _cgroup_quota_cores(),
        "thread_env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
    }
    try:
        fields["affinity_cores"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        fields["affinity_cores"] = None
    if torch is not None:
        try:
            fields["intra_op_threads"] = torch.get_num_threads()
            fields["inter_op_threads"] = torch.get_num_interop_threads()
        except Exception:
            pass
    workers = []
    for ref in list(dataloader_iterators.values()):
        it = ref()
        for w in (getattr(it, "_workers", None) or ()) if it is not None else ():
            pid = getattr(w, "pid", None)
            if pid is not None and (w.is_alive() if hasattr(w, "is_alive") else True):
                workers.append({"pid": pid, "threads": _threads_of(pid)})
    fields["dataloader_workers"] = workers
    fields["children"] = _children()
    try:
        with open("/proc/loadavg", "rb") as f:
            fields["load1"] = float(f.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        fields["load1"] = None
    emit(CPU_THREADS, **fields)
