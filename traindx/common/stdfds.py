"""stdin, stdout or stderr closed by diagnose's caller (`diagnose ... >&-`, a daemon's cron).

A closed one would be the number the next file diagnose opens takes (the run folder's lock, a
log): the job's bytes meant for stdout would land there. The first thing diagnose does is to
put /dev/null on each closed one (CLOSED remembers which), and the job starts with them closed
again, as it would bare.

A reader that went away (`diagnose ... | head -1`) is met by quiet_if_reader_left at the end."""

from __future__ import annotations

import os
import sys

CLOSED: list[int] = []


def hold_closed() -> list[int]:
    """/dev/null on each of 0, 1, 2 that is closed; the list of those (also in CLOSED)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            got = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if got != fd:
                os.dup2(got, fd)
                os.close(got)
            CLOSED.append(fd)
    return list(CLOSED)


def close_again() -> None:
    """In the job's process before its exec (preexec_fn): close what the caller had closed."""
    for fd in CLOSED:
        try:
            os.close(fd)
        except OSError:
            pass


def null_on(fds: tuple[int, ...]) -> None:
    """In the job's process before its exec: /dev/null at each of these numbers (inheritable)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd != null:
            os.dup2(null, fd)
    if null not in fds:
        os.close(null)


def quiet_if_reader_left() -> None:
    """At a command's end, when diagnose is the program: /dev/null on stdout or stderr if its
    reader went away (EPIPE), so the interpreter's exit flush of what is still buffered neither
    prints "Exception ignored ... BrokenPipeError" nor exits 120. The command keeps its own exit
    code (the job's, passed through; 0 for a made analysis), as ripgrep does, not a SIGPIPE
    death as git's: the run folder and its files are complete, only the reader stopped reading.
    Done at the end, never at the failed write: the relay still needs EPIPE on fd 1 to end the
    job's writes as they would end bare."""
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        raw = getattr(stream, "raw", stream)  # under termsafe.SafeStream, the buffered stream
        try:
            if raw is not None:
                raw.flush()
        except BrokenPipeError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except (OSError, ValueError):
            pass
