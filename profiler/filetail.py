"""The job's output channels (profiler/tee.py): a file the job writes to itself, read back by the
output relay; a pseudo-terminal where diagnose's stream is a terminal; else a pipe."""

from __future__ import annotations

import fcntl
import os
import stat
import termios
import tty
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


PIPE_BYTES = 1 << 20  # the job's pipe: a relay held up for a moment never blocks its prints


def _pipe() -> tuple[int, int]:
    """A pipe of PIPE_BYTES where the system allows it (Linux's default is 64 KiB: a job that
    prints fast would wait in its print whenever the relay or diagnose is briefly busy, a wait
    that is traindx's, not the job's)."""
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:
        pass  # over /proc/sys/fs/pipe-max-size: the default size stays
    return r, w


def channel_for(fd: int) -> tuple[int, int]:
    """(read end, the job's end) for what the job writes to fd: a pipe, or where diagnose's fd
    is a terminal, a pseudo-terminal of its size in raw mode. The job then sees a terminal as it
    would bare (isatty: colours, progress bars, line-buffered prints) and its bytes come through
    unchanged (raw: no newline turned into CR LF)."""
    if os.isatty(fd):
        try:
            master, slave = os.openpty()
        except OSError:
            return _pipe()
        try:
            tty.setraw(slave)
            size = fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
        except (OSError, termios.error):
            pass  # the defaults: still a terminal
        return master, slave
    return _pipe()


def same_sink(a: int, b: int) -> bool:
    """Whether descriptors a and b write into the same pipe or file (a caller's `2>&1` into a
    pipe or a file; a terminal is left out: there stderr stays told apart for the notes)."""
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    kind = stat.S_IFMT(sa.st_mode)
    if kind not in (stat.S_IFIFO, stat.S_IFREG):
        return False
    return (sa.st_dev, sa.st_ino, kind) == (sb.st_dev, sb.st_ino, stat.S_IFMT(sb.st_mode))
