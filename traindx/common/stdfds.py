"""stdin, stdout or stderr closed by diagnose's caller (`diagnose ... >&-`, a daemon's cron).

A closed one would be the number the next file diagnose opens takes (the run folder's lock, a
log): the job's bytes meant for stdout would land there. The first thing diagnose does is to
put /dev/null on each closed one (CLOSED remembers which), and the job starts with them closed
again, as it would bare."""

from __future__ import annotations

import os

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
