"""An exception meant for the job that surfaces inside one of the shim's hooks is handed back.

CPython runs a pending signal handler at the main thread's next bytecode boundary. A signal that
arrives during a garbage collection finds that boundary in the first Python code the collection
runs: a gc callback of ours. What the handler raises there (KeyboardInterrupt, a SIGTERM handler's
SystemExit) leaves the callback, and CPython passes it to sys.unraisablehook and drops it; the same
holds for weakref and at-fork callbacks. The job would run on after its Ctrl-C or preemption.

No Python code is safe from this (the check runs at the first instruction of any function), so
the exception is not avoided but handed back: our unraisablehook takes an exception that left a
hook whose code is ours, and once the collection is over raises the same exception object in the
main thread. A short thread sends the main thread a real-time signal whose handler, installed for
that one delivery, restores the previous handler and raises it; a real signal, so that a main
thread blocked in a system call wakes as it would have. A delivery that lands in one of our hooks
again is handed back again. Anything else goes to the hook that was there before.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_MAX_TRIES = 50  # a delivery that keeps landing in our hooks ends up printed, as before
_previous: list[Any] = []
_pending: dict[int, tuple[BaseException, Any]] = {}  # signal -> (exception, handler it replaced)
_tries: dict[int, int] = {}  # id(exception) -> deliveries so far


def _ours(code: Any) -> bool:
    filename = getattr(code, "co_filename", "")
    return os.path.dirname(os.path.abspath(filename)) == _HERE if filename else False


def _hook_code(obj: Any) -> Any:
    return getattr(getattr(obj, "__func__", obj), "__code__", None)


def _raised_by_us(exc: BaseException) -> bool:
    """An Exception whose innermost frame is ours is a bug of ours; anything else (a handler's
    KeyboardInterrupt or SystemExit, or an exception from the job's own handler) is the job's."""
    if not isinstance(exc, Exception):
        return False
    tb = exc.__traceback__
    if tb is None:
        return True
    while tb.tb_next is not None:
        tb = tb.tb_next
    return _ours(tb.tb_frame.f_code)


def _free_signal() -> int | None:
    low, high = getattr(signal, "SIGRTMIN", 0), getattr(signal, "SIGRTMAX", 0)
    for signum in range(high, low - 1, -1) if low else ():
        if signum not in _pending and signal.getsignal(signum) in (signal.SIG_DFL, None):
            return signum
    return None


def _deliver(signum: int, frame: Any) -> None:
    exc, previous = _pending.pop(signum)
    signal.signal(signum, previous)
    raise exc.with_traceback(None)


def _hand_back(exc: BaseException) -> bool:
    if _thread.get_ident() != _main_ident[0] or sys.is_finalizing():
        return False
    tries = _tries.get(id(exc), 0)
    signum = _free_signal() if tries < _MAX_TRIES else None
    if signum is None:
        return False
    _tries[id(exc)] = tries + 1
    _pending[signum] = (exc, signal.signal(signum, _deliver))
    try:  # the thread runs once this one lets go of the GIL, after the collection
        _thread.start_new_thread(signal.pthread_kill, (_main_ident[0], signum))
    except RuntimeError:
        signal.signal(signum, _pending.pop(signum)[1])
        return False
    return True


def _unraisable(u: Any) -> None:
    exc = u.exc_value
    if exc is not None and _ours(_hook_code(u.object)):
        if _raised_by_us(exc):
            from . import report_error  # the package imports this module (a cycle at import)

            report_error("hook", exc)
            return
        if _hand_back(exc):
            return
    _previous[0](u)


_main_ident = [0]


def install() -> None:
    """In the main thread, at start-up (and again in a forked child, whose main thread it is)."""
    _main_ident[0] = _thread.get_ident()
    if not _previous:
        _previous.append(sys.unraisablehook)
        sys.unraisablehook = _unraisable
