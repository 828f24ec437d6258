"""A file the job writes to itself, read back by the output relay (profiler/tee.py)."""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable

TAIL_S = 0.02  # how often the relay reads a file the job writes to itself (tail_from): the
# log lines' times (a step time read from the log) within 20 ms of the job's writes


def tail_from(fd: int) -> tuple[int, int] | None:
    """(a descriptor reading the same file, the offset the job's bytes start at) where diagnose's
    fd is a regular file, else None. The job is then given that file itself, as bare: seekable,
    appending where the caller appends (`>> log`), its write errors its own (a full disk fails its
    own write); the relay reads back what it wrote for log.txt and the live judgement. A terminal
    keeps its pseudo-terminal and a pipe, socket or device its pipe: what is written there cannot
    be read back, so those bytes must pass through the relay."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        appends = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND
        offset = st.st_size if appends else os.lseek(fd, 0, os.SEEK_CUR)
        reader = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)  # a write-only file: no
    except OSError:
        return None
    try:
        again = os.fstat(reader)
    except OSError:
        again = None
    if again is None or (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
        os.close(reader)
        return None
    return reader, offset


def channel(fd: int, tails: dict[str, int], pipe: Callable[[int], tuple[int, int]]) -> tuple[int, int]:
    """(read end, the job's end) for what the job writes to fd: the file itself where fd is one
    (its read end and offset added to `tails`), else `pipe(fd)`."""
    tail = tail_from(fd)
    if tail is None:
        return pipe(fd)
    tails[str(tail[0])] = tail[1]
    return tail[0], os.dup(fd)
