"""Python's stacks of a job that dies by a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE,
SIGILL): `faults/p<pid>.txt`, written by the standard library's faulthandler from inside the
signal handler, so a crash in C++ (a `std::terminate` at teardown, a segfault in an extension)
still leaves which Python line each thread was on. The file stays empty unless the process
crashes; analyzers/run/steps.py quotes it beside the job's exit status.

A job that enabled faulthandler itself (PYTHONFAULTHANDLER, -X faulthandler, its own call)
keeps its own: it already prints the same to its stderr, which log.txt holds.
"""

from __future__ import annotations

import faulthandler
import os

from . import roles

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

FAULTS_DIR = "faults"
_state: dict[str, Any] = {"file": None, "pid": None}


def fault_file(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, FAULTS_DIR, f"p{pid}.txt")


def install(run_dir: str) -> None:
    """Dump every thread's stack into this process's fault file on a fatal signal: at start in
    the process that imported the shim, else once it trains (a DataLoader worker gets no file; a
    forked rank replaces the handler it inherited, which wrote into its parent's file)."""
    if _state["pid"] == os.getpid():
        return
    if faulthandler.is_enabled() and _state["pid"] is None:
        return  # the job's own
    try:
        roles.own_dir(os.path.join(run_dir, FAULTS_DIR))
        # kept open for the process's life: the handler writes to its descriptor
        f = roles.open_new_text(fault_file(run_dir, os.getpid()), append=True)
        faulthandler.enable(file=f, all_threads=True)
        _state["file"], _state["pid"] = f, os.getpid()
    except (OSError, RuntimeError, ValueError):
        pass  # no stacks on a crash; nothing else changes


def after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, until it shows it trains) does not write into its
    parent's fault file: the handler it inherited is turned off, as it would be without us."""
    if _state["pid"] is not None and _state["pid"] != os.getpid():
        try:
            faulthandler.disable()
        except RuntimeError:
            pass
        _state["file"], _state["pid"] = None, None
