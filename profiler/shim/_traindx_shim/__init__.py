"""The in-process half of traindx: records step boundaries, compiles, GC pauses and allocator
stats of one rank into `$TRAINDX_RUN_DIR/events/<rank>.jsonl`.

Only the standard library is imported here; torch, cutlass, triton and megatron are hooked when
(and if) the job imports them, through `importhooks`. Any exception inside a hook is caught and
written as a `shim_error` event: the job always runs on.
"""
import os
import signal
import sys
import threading
import time

from . import importhooks
from .writer import EventWriter

_state = {"writer": None}
LAUNCHER_MARKERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
CLAIM_VAR = "TRAINDX_RANK_PID"


def get_writer():
    return _state["writer"]


def emit(type_, **fields):
    w = _state["writer"]
    if w is not None:
        w.emit(type_, **fields)


def report_error(where, exc):
    emit("shim_error", where=where, error=repr(exc))


def guarded(where):
    """Decorator: a hook that raises records a shim_error instead of breaking the job."""
    def wrap(fn):
        def inner(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                report_error(where, exc)
        inner.__name__ = getattr(fn, "__name__", "hook")
        return inner
    return wrap


def _is_launcher():
    argv = " ".join(sys.argv)
    return any(m in argv for m in LAUNCHER_MARKERS) or (
        sys.argv and os.path.basename(sys.argv[0]) == "torchrun")


def _claim_rank():
    """True in the one process per rank that records; its children (DataLoader workers,
    spawned helpers) inherit the claim and stay silent."""
    owner = os.environ.get(CLAIM_VAR)
    if owner and owner != str(os.getpid()):
        return False
    os.environ[CLAIM_VAR] = str(os.getpid())
    return True


def _install_sigterm_flush():
    # Python's default SIGTERM kills without atexit; flush first, then die the default way.
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum, frame):
        w = _state["writer"]
        if w is not None:
            w.emit("signal", signal="SIGTERM")
            w.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def activate():
    run_dir = os.environ["TRAINDX_RUN_DIR"]
    if _is_launcher() or not _claim_rank():
        return
    rank = os.environ.get("RANK", "0")
    events_dir = os.path.join(run_dir, "events")
    os.makedirs(events_dir, exist_ok=True)
    _state["writer"] = EventWriter(os.path.join(events_dir, f"{rank}.jsonl"), rank)
    emit("process_start", pid=os.getpid(), ppid=os.getppid(), rank=rank,
         local_rank=os.environ.get("LOCAL_RANK"), world_size=os.environ.get("WORLD_SIZE"),
         argv=sys.argv, python=sys.version.split()[0], main_thread=threading.get_ident())
    _install_sigterm_flush()
    from . import gcstats, steps, compiles, torchcalls, torchprof, datasites

    gcstats.install()
    steps.register()
    compiles.register()
    torchcalls.register()
    torchprof.register()
    datasites.register()
    importhooks.install()
