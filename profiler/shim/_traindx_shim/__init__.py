"""The in-process half of traindx: records step boundaries, compiles, GC pauses and allocator
stats of one process into `$TRAINDX_RUN_DIR/events/p<pid>.jsonl`.

Every Python process of the job runs this (launchers, ranks, workers): each writes its own file,
so no two processes ever append to one. A process announces itself as a training process (in
`procs/<pid>.json`, which the launcher's py-spy manager watches) when it shows training evidence;
its rank is recorded when it becomes known (see `roles`). Multiprocessing children stay silent
until they show such evidence, so DataLoader workers write nothing.

Only the standard library is imported here; torch, cutlass, triton and megatron are hooked when
(and if) the job imports them, through `importhooks`. Any exception inside a hook is caught and
written as a `shim_error` event: the job always runs on. No signal handler is installed: the job's
signal disposition is its own (the writer's short flush interval bounds what a kill loses).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from . import importhooks, roles, schema
from .writer import EventWriter, load_redactor, redacted_argv

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_state: dict[str, Any] = {
    "redactor": None,
    "writer": None,
    "run_dir": None,
    "rank": None,
    "rank_source": None,
    "world_size": None,
    "training_pid": None,
    "evidence": None,
    "start": None,
}
_announce_lock = threading.Lock()


def get_writer() -> EventWriter | None:
    return _state["writer"]


def emit(type_: str, **fields: Any) -> None:
    w = _state["writer"]
    if w is not None:
        w.emit(type_, **fields)


def report_error(where: str, exc: BaseException) -> None:
    redactor = _state["redactor"]  # an exception's text may quote a URL or an argument
    error = repr(exc)
    emit(schema.SHIM_ERROR, where=where, error=redactor.line(error) if redactor else error)


def guarded(where: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: a hook that raises records a shim_error instead of breaking the job."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                report_error(where, exc)

        inner.__name__ = getattr(fn, "__name__", "hook")
        return inner

    return wrap


def passes_for(wrapper: Callable[..., Any], fn: Any) -> Callable[..., Any]:
    """`wrapper` shows `fn`'s name, doc and module; inspect.signature (Lightning, accelerate)
    follows __wrapped__ to the original."""
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:
            setattr(wrapper, attr, getattr(fn, attr))
        except Exception:
            pass
    return wrapper


def is_training() -> bool:
    return _state["training_pid"] == os.getpid()


def _undecodable_paths() -> bool:
    """Some of this process's paths are bytes that are not UTF-8 (kept by the interpreter as
    lone surrogates). A UTF-8 path undecoded under a C locale is written as its UTF-8 text
    (writer.utf8_paths) and found as under UTF-8; these are not: py-spy cannot read such a file
    name, so its stacks lose the job's own files, and the report says so (analyzers/verdict)."""
    try:
        paths = [os.getcwd(), *sys.argv[:1], *sys.path]
    except OSError:
        paths = [*sys.argv[:1], *sys.path]
    for path in paths:
        try:
            str(path).encode("utf-8", "surrogateescape").decode("utf-8")
        except UnicodeError:
            return True
    return False


def _start_writer(deferred: bool) -> None:
    events_dir = roles.own_dir(os.path.join(_state["run_dir"], roles.EVENTS_DIR))
    rank, source = roles.rank_from_env(os.environ)
    writer = EventWriter(events_dir, deferred=deferred)
    writer.rank = rank or "0"
    _state.update(
        writer=writer,
        rank=rank,
        rank_source=source,
        world_size=os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS"),
        start=time.time_ns(),
    )
    writer.tick_hooks.append(_poll_process_group)
    if _state["redactor"] is None:  # once per process (a forked rank inherits it)
        _state["redactor"] = load_redactor(os.environ, sys.argv)
    writer.emit(
        schema.PROCESS_START,
        pid=os.getpid(),
        ppid=os.getppid(),
        rank=rank,
        rank_source=source,
        local_rank=os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID"),
        world_size=_state["world_size"],
        argv=redacted_argv(_state["redactor"], sys.argv),
        python=sys.version.split()[0],
        undecodable_paths=_undecodable_paths(),
        main_thread=threading.main_thread().ident,
        multiprocessing_child=deferred,
        t=_state["start"],
    )


def _announce() -> None:
    """procs/<pid>.json: this pid trains (the py-spy manager starts its recorders on it)."""
    folder = roles.own_dir(os.path.join(_state["run_dir"], roles.ANNOUNCE_DIR))
    pid = os.getpid()
    w = _state["writer"]
    entry = {
        "pid": pid,
        "ppid": os.getppid(),
        "rank": _state["rank"],
        "rank_source": _state["rank_source"],
        "world_size": _state["world_size"],
        "evidence": _state["evidence"],
        "start": _state["start"],
        "t": time.time_ns(),
        "events": os.path.relpath(w.path, _state["run_dir"]) if w and w.path else None,
    }
    # a file of this thread's own: two threads announcing at once (the writer thread's process-
    # group poll and the job's init_process_group) would otherwise write one file over the other
    tmp = os.path.join(folder, f".{pid}.{threading.get_ident()}.json.tmp")
    with roles.open_new_text(tmp) as f:
        json.dump(entry, f)
    os.replace(tmp, os.path.join(folder, f"{pid}.json"))


def training_evidence(kind: str) -> None:
    """This process trains (kind: 'init_process_group', 'optimizer', 'optimizer_step',
    'backward', ...). The first call per process announces it; later calls cost one compare."""
    if _state["training_pid"] == os.getpid():
        return
    with _announce_lock:
        if _state["training_pid"] == os.getpid():
            return
        w = _state["writer"]
        if w is None:
            return
        if w.pid != os.getpid():  # a forked child that trains (fork-started ranks)
            _start_writer(deferred=False)
            w = _state["writer"]
            mp_util = sys.modules.get("multiprocessing.util")
            if mp_util is not None:  # its exit is os._exit after multiprocessing's finalizers
                try:
                    mp_util.Finalize(None, w.flush, exitpriority=0)
                except Exception:
                    pass
        _state["training_pid"] = os.getpid()
        _state["evidence"] = kind
        w.undefer()
        from . import faults

        faults.install(_state["run_dir"])
        if _state["rank_source"] != "process_group":  # the job may have set RANK since start
            rank, source = roles.rank_from_env(os.environ)
            if rank is not None and rank != _state["rank"]:
                _set_rank(rank, source, os.environ.get("WORLD_SIZE"))
        w.emit(schema.TRAINING, evidence=kind, rank=_state["rank"])
        try:
            _announce()
        except OSError as exc:
            report_error("announce training process", exc)


def _set_rank(rank: int | str, source: str | None, world_size: str | int | None) -> None:
    _state.update(
        rank=str(rank),
        rank_source=source,
        world_size=str(world_size) if world_size is not None else _state["world_size"],
    )
    w = _state["writer"]
    if w is not None:
        w.rank = str(rank)
    emit(schema.RANK_KNOWN, rank=str(rank), source=source, world_size=_state["world_size"])


def rank_known(rank: int | str, world_size: int | str | None, source: str = "process_group") -> None:
    """The process group told this process its rank (it wins over any environment variable)."""
    if _state["writer"] is None or _state["writer"].pid != os.getpid():
        training_evidence("init_process_group")  # a forked child: a writer of its own first
    with _announce_lock:  # one announcement at a time: the newest rank is the one on disk
        if _state["rank_source"] == source and _state["rank"] == str(rank):
            return
        _set_rank(rank, source, world_size)
        if is_training():
            try:
                _announce()
            except OSError as exc:
                report_error("announce rank", exc)


def _poll_process_group() -> None:
    """From the writer thread: a process group made by a path our wrapper missed (a library that
    imported init_process_group by name before the hook) still reveals the rank."""
    if _state["rank_source"] == "process_group":
        return
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    training_evidence("init_process_group")
    rank_known(dist.get_rank(), dist.get_world_size())


def _after_fork_in_child() -> None:
    global _announce_lock
    _announce_lock = threading.Lock()
    from . import faults

    faults.after_fork_in_child()
    from . import handback

    handback.install()  # the forking thread is the child's main thread


def activate() -> None:
    _state["run_dir"] = os.environ["TRAINDX_RUN_DIR"]
    _start_writer(deferred=roles.is_multiprocessing_child(getattr(sys, "orig_argv", sys.argv)))
    os.register_at_fork(after_in_child=_after_fork_in_child)
    from . import (
        compiles,
        datasites,
        faults,
        gcstats,
        handback,
        procrole,
        selfcost,
        steps,
        torchcalls,
        torchprof,
    )

    handback.install()  # before any hook: a signal's exception that lands in one reaches the job
    if not _state["writer"].deferred:  # a possible DataLoader worker: once it trains
        faults.install(_state["run_dir"])

    gcstats.install()
    selfcost.register()  # what the shim cost this process, at its exit
    procrole.register()
    steps.register()
    compiles.register()
    torchcalls.register()
    torchprof.register()
    from . import hooktime, math_patches, nograd_feeds, paramuse, runtime_patches, spans

    spans.register()  # time ledger spans
    paramuse.register()  # gradients nobody updates, optimizer steps per backward
    hooktime.register()  # the job's hooks and callbacks inside the step
    nograd_feeds.register()  # does training read a no-grad phase's rows (a rollout)
    from . import gputime

    gputime.register()  # GPU busy/idle per step (CUDA events at the measured boundaries)
    runtime_patches.register()  # --fix runtime patches, max_seqlen origin tracer
    math_patches.register()  # --fix math patches (fp32 matmul precision, cuDNN benchmark)
    from . import ladder_patches

    ladder_patches.register()  # --fix's ladder of global switches (fixing/plan/ladder.py)
    from . import switches

    switches.register()  # settings that tax every op (anomaly mode, debug variables, ...)
    datasites.register()
    importhooks.install()
