"""Which processes of a job are ranks, and which rank each is: the one definition that the shim
(in every Python process of the job), the launcher's py-spy manager and the run loader share.

A process is a *training process* once it shows training evidence: it joined a process group
(`torch.distributed.init_process_group`), built or stepped a torch optimizer, or ran a backward.
Launchers (torchrun's agent, `accelerate launch`, the parent of `torch.multiprocessing.spawn`,
a script that starts worker Pythons) never do, whatever they are called, so nothing here looks at
program names. A process's rank is what it learns, never its start order: the process group's
rank once it exists, else the rank its environment names.

Standard library only: this module runs inside the job.
"""

from __future__ import annotations  # annotations stay text: no typing at import in the job

import fcntl
import json
import os
import re
import stat  # loaded by os already: no cost in the job
from collections.abc import Mapping, Sequence  # already loaded by the interpreter: no cost

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

# Environment variables naming a process's global rank, most specific first. Under srun +
# torchrun SLURM_PROCID is the node, not the rank: RANK (set by torchrun) wins when present.
RANK_ENV = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
EVENTS_DIR = "events"
ANNOUNCE_DIR = "procs"  # procs/<pid>.json: a training process says so, for the py-spy manager
ANNOUNCE_BYTES = 1 << 20  # one announcement: ~200 bytes


SMALL_STACK_BYTES = 512 * 1024  # the shim's threads never recurse deeply
M_ARENA_MAX = -8  # glibc's mallopt parameter
_limited: list[bool] = []  # [whether the process has an address-space limit], once known


def _address_space_limited() -> bool:
    """Under `ulimit -v` each of the shim's threads would take a 64 MiB malloc arena and an
    8 MiB stack of the job's address space: a job that fits bare would not under diagnose. Once
    such a limit is seen, glibc keeps one arena for the process (mallopt M_ARENA_MAX=1, what
    MALLOC_ARENA_MAX=1 does; docs/overhead.md) and the shim's threads get small stacks."""
    if not _limited:
        try:
            import resource  # a small C module, only here

            soft = resource.getrlimit(resource.RLIMIT_AS)[0]
            _limited.append(soft != resource.RLIM_INFINITY)
        except (ImportError, OSError, ValueError):
            _limited.append(False)
        if _limited[0]:
            try:
                import ctypes  # ~0.4 MB of address space, only under a limit

                ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1)
            except (ImportError, OSError, AttributeError):
                pass  # not glibc: its allocator's own way
    return _limited[0]


OWN_THREADS: list[Any] = []  # the shim's own threads
# ident -> (name, CPU ns so far) of each of the shim's threads, written by the thread itself after
# each round of its work (report_cpu): the step end reads a dict instead of a clock per thread
OWN_CPU: dict[int, tuple[str, int]] = {}
if hasattr(os, "register_at_fork"):  # a forked child's threads are its own: none of these
    os.register_at_fork(after_in_child=OWN_CPU.clear)


def report_cpu(ident: int, name: str) -> int:
    """Called by one of the shim's threads on itself: its CPU time so far (one clock read),
    also returned."""
    import time  # loaded by the interpreter already: no cost

    ns = time.thread_time_ns()
    OWN_CPU[ident] = (name, ns)
    return ns


def start_thread(thread: Any) -> None:
    """Start one of the shim's own threads: under an address-space limit with a small stack and
    no malloc arena of its own (the job's threads keep the default stack)."""
    OWN_THREADS[:] = [t for t in OWN_THREADS if t.is_alive()] + [thread]
    if not _address_space_limited():
        thread.start()
        return
    import threading  # already imported by the caller

    previous = threading.stack_size(SMALL_STACK_BYTES)
    try:
        thread.start()
    finally:
        threading.stack_size(previous)


def own_dir(path: str) -> str:
    """A folder of the run folder, made if need be; a symbolic link there (planted while the
    job runs) is never written through: OSError (the callers skip that evidence)."""
    os.makedirs(path, exist_ok=True)
    if os.path.islink(path):
        raise OSError(40, "a symbolic link in the run folder is never followed", path)  # ELOOP
    return path


HIGH_FD = 100  # the shim's descriptors live at or above this number, never at the job's low ones


def open_high(path: str, flags: int, mode: int = 0o644) -> int:
    """os.open, its descriptor moved to >= HIGH_FD and close-on-exec: the lowest free number
    (3 in a job started with 0-2 only) stays the job's, so a job that writes its fd 3 (a
    caller's `3>file` it expects, or none) never writes into our evidence. Where the limit on
    open files is below HIGH_FD, at three quarters of it; the number os.open gave if even that
    is taken."""
    fd = os.open(path, flags | os.O_CLOEXEC, mode)
    for floor in (HIGH_FD, _floor_under_limit()):
        try:
            high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)
        except OSError:  # EINVAL: the floor is past the limit (`ulimit -n 64`); EMFILE
            continue
        os.close(fd)
        return high
    return fd


def _floor_under_limit() -> int:
    """Where the limit on open files is below HIGH_FD: three quarters of it (48 of 64), still
    far above the numbers a job uses on its own."""
    try:
        soft = os.sysconf("SC_OPEN_MAX")
    except (OSError, ValueError):
        return 3
    return max(3, soft * 3 // 4)


def open_new_text(path: str, append: bool = False) -> Any:
    """A file of the run folder opened for writing, never through a symbolic link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    return os.fdopen(open_high(path, flags), "a" if append else "w", encoding="utf-8")


def open_exclusive_text(path: str) -> Any:
    """A new file of the run folder (FileExistsError when it exists: open(path, "x")), high."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    return os.fdopen(open_high(path, flags), "w", encoding="utf-8")


def rank_from_env(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(rank, variable) from an environment mapping, or (None, None)."""
    for name in RANK_ENV:
        value = (env.get(name) or "").strip()
        if value.isdigit():
            return value, name
    return None, None


def is_multiprocessing_child(orig_argv: Sequence[str]) -> bool:
    """A Python that multiprocessing started with spawn or forkserver (a DataLoader worker, a
    torch.multiprocessing.spawn rank, the resource tracker, the fork server): only training
    evidence tells these apart, so they write nothing until they show it."""
    return "--multiprocessing-fork" in orig_argv or any(
        a.startswith("from multiprocessing.") for a in orig_argv
    )


def events_file(pid: int, attempt: int = 0) -> str:
    return f"p{pid}.jsonl" if not attempt else f"p{pid}.{attempt}.jsonl"


def parse_process_file(name: str, suffix: str) -> int | None:
    """pid of a per-process file name 'p<pid>[.<n>]<suffix>', else None (a rank-named file)."""
    if not name.endswith(suffix) or not name.startswith("p"):
        return None
    stem = name[1 : len(name) - len(suffix)].split(".")[0]
    return int(stem) if stem.isdigit() else None


_UNSAFE = re.compile(r"[^A-Za-z0-9._@+-]")


def safe_label(text: str) -> str:
    """A label (a rank, a node) as a path component: a rank comes from the job or a received
    folder and names files (pyspy/<label>-...), so only letters, digits and '._@+-', never a
    leading dot ('.', '..', a hidden file), at most 64 characters; anything else becomes '_'."""
    return _UNSAFE.sub("_", text).lstrip(".")[:64] or "_"


def rank_labels(processes: list[dict[str, Any]]) -> dict[Any, str]:
    """{pid: label} for training processes given as dicts {pid, rank (str or None), start}.

    A rank that is not known is taken as "0" (a job without a process group is one rank).
    Several processes with one rank (a restarted rank, two single-process trainings) are kept
    apart, never merged: the one with a known rank and the earliest start keeps the plain label,
    the others get '<rank>-p<pid>'. The order is deterministic: (rank unknown, start, pid).
    """
    labels, taken = {}, set()
    ordered = sorted(processes, key=lambda p: (p.get("rank") is None, p.get("start") or 0, p["pid"]))
    for p in ordered:
        rank = safe_label(str(p["rank"])) if p.get("rank") is not None else "0"
        label = rank if rank not in taken else f"{rank}-p{p['pid']}"
        taken.add(label)
        labels[p["pid"]] = label
    return labels


def read_announcements(run_dir: str) -> list[dict[str, Any]]:
    """The procs/<pid>.json files: [{pid, rank, start, ...}] (unreadable ones skipped)."""
    folder = os.path.join(run_dir, ANNOUNCE_DIR)
    out = []
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:  # a folder read after the fact may be received: no link followed, no FIFO waited on
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with open(fd, encoding="utf-8", closefd=True) as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                entry = json.loads(f.read(ANNOUNCE_BYTES))
            int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
        out.append(entry)
    return out


def announced_ranks(run_dir: str) -> dict[str, int]:
    """{label: pid} of the training processes that announced themselves in run_dir."""
    procs = [
        {"pid": int(p["pid"]), "rank": p.get("rank"), "start": p.get("start")}
        for p in read_announcements(run_dir)
    ]
    return {label: pid for pid, label in rank_labels(procs).items()}
