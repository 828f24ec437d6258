"""Measured intervals of the training thread(s), for the time ledger (derive/ledger.py).

One `span` event per call: {"type": "span", "cat": ..., "start": ns, "t": end ns, "tid": thread
ident} and, for rare calls (checkpoints, file writes), the caller in the job's code. Categories:

  data        the DataLoader iterator's __next__ (the step waits for its batch)
  backward    torch.autograd.backward (Tensor.backward goes through it); under DDP with
              grads_ready: when the last of the model's parameter gradients was accumulated on
              this rank (its own backward compute ended; the rest of the span waits for the
              gradients' all-reduce, i.e. for the other ranks) and grad_sync: whether a DDP
              forward before it asked for the gradients' all-reduce (DDP decides at its forward:
              one under no_sync() or without grad skips the reducer's buckets in this backward)
  optimizer   torch's global optimizer pre/post hooks (every torch optimizer)
  closure     the closure an optimizer step calls (Lightning's training_step, LBFGS): the
              ledger books the forward and backward inside it as fwd/bwd, the rest as host
  forward     the outermost nn.Module call of the training thread (steps.py's module-call
              wrapper emits it; `grad: false` for one under no_grad)
  io          torch.save, torch.distributed.checkpoint save/async_save/save_state_dict
  sync        host-device syncs on CUDA tensors (torch.cuda.synchronize, Tensor.item/.tolist/.cpu);
              installed only once CUDA is initialised: on CPU there is no device to wait for
  collective  blocking torch.distributed collectives (async_op=False) with op, group (process
              group name) and seq (per-group call counter: the same number on every rank of
              the group); blocking send/recv with op, group and peer; non-blocking
              isend/irecv (batch_isend_irecv and torch.distributed.pipelining call them) once
              their Work's wait() returns: a recv spans that wait (where the rank blocks), with
              `issue` ([start, end] ns of the irecv call: the receive was posted then); a send
              spans the isend call (its data left then), with
              `wait` ([start, end] ns of its wait); both with `nonblocking: true` and bytes
  ddp         not a span: one `ddp` event per DistributedDataParallel model built (its gradient
              all-reduces run in C++ inside backward, where no Python wrapper sees them: the
              straggler analysis then treats each backward as the ranks' meeting point, split at
              the backward span's grads_ready)
  gc          garbage collections of at least GC_SPAN_MIN_NS (shorter ones stay aggregated per
              step in gcstats: a gen-0 pass every few ms is not worth an event each), with
              generation and cpu (seconds of the training thread's CPU time inside the collection)
The data span carries cpu (the training thread's CPU seconds inside __next__) and runq (its
run-queue wait there, Linux schedstat), so that its off-CPU part (a storage wait) is known.

Clock: time.time_ns(), the axis of every other shim event. Cost per wrapped call: two clock reads,
one thread-ident read and one deque append (bench/span_overhead.py measures it). Wrappers never
add a sync, never swallow the job's exceptions and step aside while torch.compile traces them.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

from . import cpustat, emit, importhooks, passes_for, report_error, selfcost
from .frames import first_user_frame, framework_chain, is_library_path

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

GC_SPAN_MIN_NS = int(float(os.environ.get("TRAINDX_GC_SPAN_MIN_MS") or 1.0) * 1e6)
SYNC_SPAN_MIN_NS = 20_000  # a 5 µs .item() on an idle GPU is noise; a waiting one is not
MAX_RARE_CALLERS = 2000  # stack walks for io spans; later ones are timed without a caller
_now = time.time_ns
_ident = threading.get_ident
_thread_cpu = time.thread_time_ns
_state: dict[str, Any] = {"torch": None, "sync_installed": False, "callers": 0, "compiling": None}
_opt_start: dict[Any, Any] = {}


def _span(cat: str, start: int, end: int, **extra: Any) -> None:
    emit("span", cat=cat, start=start, t=end, tid=_ident(), **extra)


def _compiling() -> bool:
    """True while torch.compile traces the caller: a wrapper must then be invisible (no clock
    reads that would break the graph)."""
    check = _state["compiling"]
    try:
        return bool(check and check())
    except Exception:
        return False


def _timed(
    cat: str, fn: Callable[..., Any], with_caller: bool = False, label: str | None = None
) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return fn(*args, **kwargs)
        entered = _now()
        cpu = _thread_cpu() if with_caller else 0
        runq = cpustat.runqueue_ns() if with_caller else None
        start = _now()
        try:
            return fn(*args, **kwargs)
        finally:
            end = _now()
            try:
                extra: dict[str, Any] = {}
                if with_caller and _state["callers"] < MAX_RARE_CALLERS:
                    _state["callers"] += 1
                    extra["caller"] = first_user_frame()
                    extra["call"] = label
                    chain = (
                        framework_chain()
                        if extra["caller"] and is_library_path(extra["caller"]["file"])
                        else None
                    )
                    if chain:  # a framework's callback wrote it: the job's line and the objects between
                        extra["via"] = chain
                    # the calling thread's CPU seconds in it: a write that waits on the disk
                    # can move to a thread, the serialization (CPU, the GIL) cannot
                    extra["cpu"] = (_thread_cpu() - cpu) / 1e9
                    after = cpustat.runqueue_ns() if runq is not None else None
                    if after is not None:  # runnable, off a core: a loaded machine's, not the disk's
                        extra["runq"] = (after[1] - runq[1]) / 1e9  # type: ignore[index]  # runq: set with after
                _span(cat, start, end, **extra)
                selfcost.add(cat, _now() - entered - (end - start))
            except Exception as exc:
                report_error(f"span {cat}", exc)

    return passes_for(wrapper, fn)


def _timed_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The backward span, with grads_ready when a DDP model's gradients were stamped in it."""

    def backward(*args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return fn(*args, **kwargs)
        _grads[0] = 0
        start = _now()
        try:
            return fn(*args, **kwargs)
        finally:
            end = _now()
            try:
                ready = _grads[0]
                extra: dict[str, Any] = {"grads_ready": ready} if start <= ready <= end else {}
                if _sync[0] is not None:  # a DDP model was built: did this backward all-reduce?
                    extra["grad_sync"] = _sync[0]
                    _sync[0] = False
                _span("backward", start, end, **extra)
                selfcost.add("backward", _now() - end)
            except Exception as exc:
                report_error("span backward", exc)

    return passes_for(backward, fn)


_grads = [0]  # the clock at the last parameter gradient accumulated (DDP models only)
# None until a DDP model is built; then whether a DDP forward since the last backward prepared
# its reducer (the gradients' all-reduce runs in the next backward)
_sync: list[bool | None] = [None]


def _grad_ready(_param: Any) -> None:
    _grads[0] = _now()


def _stamp_grads(ddp: Any) -> None:
    """A clock read after each of a DDP model's parameter gradients is accumulated (one list
    store a parameter a backward): the last stamp of a backward is where this rank's own
    compute ended and its wait for the all-reduce (the other ranks) began."""
    module = getattr(ddp, "module", None)
    if module is None:
        return
    for param in module.parameters():
        if param.requires_grad and hasattr(param, "register_post_accumulate_grad_hook"):
            param.register_post_accumulate_grad_hook(_grad_ready)


# -- the DataLoader ----------------------------------------------------------------------------
def _on_dataloader(module: Any) -> None:
    cls = module._BaseDataLoaderIter
    original = cls.__next__

    iterators = cpustat.dataloader_iterators

    def __next__(self: Any) -> Any:
        entered = _now()
        if id(self) not in iterators:  # its workers, for the cpu_threads picture
            _remember(iterators, self)
        # the run-queue reads (~8 µs each) are the first evidence shed above the budget
        queued = cpustat.runqueue_ns() if selfcost.shed_state["data_runq"] else None
        cpu = _thread_cpu()
        start = _now()
        try:
            return original(self)
        finally:
            end = _now()
            try:
                # cpu: the training thread's own CPU seconds in it (loading in-process is CPU
                # work there; waiting for a worker's batch is not); runq: seconds it was runnable
                # but waited for a core. The rest of the span the thread was off the CPU
                # (sleeping, blocked on storage or on a worker's queue): the savings model
                # parallelises that part over workers and the CPU part only over free cores
                extra: dict[str, Any] = {}
                after = cpustat.runqueue_ns() if queued else None
                if after:
                    extra["runq"] = (after[1] - queued[1]) / 1e9  # type: ignore[index]  # queued: set with after
                _span("data", start, end, cpu=(_thread_cpu() - cpu) / 1e9, **extra)
                selfcost.add("data", _now() - entered - (end - start))
            except Exception as exc:
                report_error("span data", exc)

    __next__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__next__ = __next__


def _remember(iterators: dict[int, Any], it: object) -> None:
    try:
        key = id(it)
        forget = lambda _ref, key=key: iterators.pop(key, None)
        iterators[key] = weakref.ref(it, forget)
    except TypeError:
        pass


# -- torch: backward, optimizer, torch.save, syncs -----------------------------------------------
def _opt_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    _opt_start[_ident()] = _now()


def _opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    end = _now()
    start = _opt_start.pop(_ident(), None)
    if start is not None:
        _span("optimizer", start, end)
    if not _state["sync_installed"]:
        _maybe_install_sync()
    selfcost.add("optimizer", _now() - end)


def _wrap_closure(optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """A pre hook: the step's closure (positional or `closure=`) timed as a `closure` span."""
    if _compiling():
        return None
    try:
        if "closure" in kwargs:
            closure = kwargs["closure"]
            if callable(closure) and not getattr(closure, "__traindx_closure__", False):
                kwargs = dict(kwargs, closure=_timed_closure(closure))
                return args, kwargs
        elif args and callable(args[0]) and not getattr(args[0], "__traindx_closure__", False):
            return (_timed_closure(args[0]),) + tuple(args[1:]), kwargs
    except Exception as exc:
        report_error("optimizer closure hook", exc)
    return None


def _timed_closure(closure: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*a: Any, **k: Any) -> Any:
        start = _now()
        try:
            return closure(*a, **k)
        finally:
            try:
                _span("closure", start, _now())
            except Exception as exc:
                report_error("span closure", exc)

    timed.__traindx_closure__ = True  # type: ignore[attr-defined]
    timed.__wrapped__ = closure  # type: ignore[attr-defined]
    return timed


def _on_torch(torch: Any) -> None:
    _state["torch"] = torch
    compiler = getattr(torch, "compiler", None)
    # is_dynamo_compiling is a flag read (~20 ns); is_compiling also asks the exporter (~0.5 µs)
    _state["compiling"] = getattr(compiler, "is_dynamo_compiling", None) or getattr(
        compiler, "is_compiling", None
    )
    torch.autograd.backward = _timed_backward(torch.autograd.backward)
    torch.save = _timed("io", torch.save, with_caller=True, label="torch.save")
    # torch is imported here only once the job has imported it: the shim never imports it first
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_guard(_opt_pre, "optimizer pre hook"))
    register_optimizer_step_pre_hook(_wrap_closure)
    register_optimizer_step_post_hook(_guard(_opt_post, "optimizer post hook"))


def _guard(fn: Callable[..., Any], where: str) -> Callable[..., None]:
    def hook(*args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            report_error(where, exc)

    return hook


def _maybe_install_sync() -> None:
    """Sync wrappers only where a device queue exists: checked after each optimizer step until
    the job has initialised CUDA itself (never initialising it here)."""
    torch = _state["torch"]
    if torch is None or not torch.cuda.is_initialized():
        return
    _state["sync_installed"] = True
    torch.cuda.synchronize = _timed("sync", torch.cuda.synchronize)
    Tensor = torch.Tensor
    for name in ("item", "tolist", "cpu"):
        original = getattr(Tensor, name)
        setattr(Tensor, name, _cuda_only_sync(original))


def _cuda_only_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return original(self, *args, **kwargs)
        try:
            on_device = self.is_cuda
        except Exception:
            on_device = False
        if not on_device:
            return original(self, *args, **kwargs)
        start = _now()
        try:
            return original(self, *args, **kwargs)
        finally:
            end = _now()
            if end - start >= SYNC_SPAN_MIN_NS:
                try:
                    _span("sync", start, end)
                except Exception as exc:
                    report_error("span sync", exc)

    method.__wrapped__ = original  # type: ignore[attr-defined]
    method.__name__ = getattr(original, "__name__", "method")
    method.__doc__ = getattr(original, "__doc__", None)
    return method


# -- torch.distributed ---------------------------------------------------------------------------
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
)
POINT_TO_POINT = ("send", "recv")
# Every rank of a group calls its collectives in the same order, so (group, seq) names one
# collective on all ranks without any clock: a per-process counter per group, counted at the
# outermost wrapped call (all_gather_object calls all_gather inside; that inner call is the same
# on every rank, but counting it once keeps seq equal to the job's own calls).
_seq: dict[Any, Any] = {}
_depth = threading.local()


def _group_name(dist: Any, group: Any) -> str:
    try:
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        return str(group.group_name)
    except Exception:
        return "default"


_backends: dict[Any, Any] = {}


def _backend(dist: Any, group: Any, name: str) -> str:
    """The group's backend ('gloo', 'nccl', ...), once per group: whether a blocking call waits
    for the other ranks (gloo) or only enqueues (nccl) decides if its span can align clocks."""
    if name not in _backends:
        try:
            _backends[name] = str(dist.get_backend(group))
        except Exception:
            _backends[name] = None
    return _backends[name]


def _peer(args: Any, kwargs: Any) -> int | None:
    peer = kwargs.get("dst", kwargs.get("src", kwargs.get("group_dst", kwargs.get("group_src"))))
    if peer is None and len(args) > 1:
        peer = args[1]
    return peer if isinstance(peer, int) else None


def _blocking_only(
    dist: Any, name: str, fn: Callable[..., Any], point_to_point: bool = False
) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op") or _compiling() or getattr(_depth, "n", 0):
            return fn(*args, **kwargs)
        start = _now()
        _depth.n = 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n = 0
            end = _now()
            try:
                group = _group_name(dist, kwargs.get("group"))
                extra: dict[str, Any] = {
                    "op": name,
                    "group": group,
                    "backend": _backend(dist, kwargs.get("group"), group),
                }
                if point_to_point:
                    extra["peer"] = _peer(args, kwargs)
                else:
                    seq = _seq[group] = _seq.get(group, -1) + 1
                    extra["seq"] = seq
                _span("collective", start, end, **extra)
            except Exception as exc:
                report_error("span collective", exc)

    collective.__wrapped__ = fn  # type: ignore[attr-defined]
    collective.__name__ = getattr(fn, "__name__", "collective")
    collective.__doc__ = getattr(fn, "__doc__", None)
    return collective


def _on_distributed(module: ModuleType) -> None:
    for names, p2p in ((COLLECTIVES, False), (POINT_TO_POINT, True)):
        for name in names:
            fn = getattr(module, name, None)
            if callable(fn):
                setattr(module, name, _blocking_only(module, name, fn, point_to_point=p2p))
    c10d = getattr(module, "distributed_c10d", None)
    for name, op in (("isend", "send"), ("irecv", "recv")):
        original = getattr(module, name, None)
        if original is None or c10d is None or getattr(c10d, name, None) is not original:
            continue
        # the same wrapper in both namespaces: P2POp and batch_isend_irecv compare an op
        # against distributed_c10d's own isend/irecv (`op is isend`)
        wrapped = _nonblocking(module, op, original)
        setattr(module, name, wrapped)
        setattr(c10d, name, wrapped)


# -- non-blocking point-to-point: isend/irecv and their Work's wait ---------------------------------
# An isend/irecv returns a Work; the rank blocks only in that Work's wait(). Work.wait is wrapped
# (on the class, once the job first calls isend/irecv: nothing for jobs that never do) and looks
# the Work up among the pending ones: one dict lookup for any other Work.
_pending: dict[int, tuple[Any, ...]] = {}
MAX_PENDING = 100_000  # Works never waited on (a job that polls is_completed): forgotten past this


def _nonblocking(dist: Any, op: str, fn: Any) -> Callable[..., Any]:
    def p2p(*args: Any, **kwargs: Any) -> Any:
        # inside a wrapped blocking send/recv (torch's send calls isend and waits): that span is its
        if getattr(_depth, "n", 0) or _compiling():
            return fn(*args, **kwargs)
        start = _now()
        work = fn(*args, **kwargs)
        end = _now()
        if work is not None:
            try:
                _remember_p2p(dist, op, work, start, end, args, kwargs)
            except Exception as exc:
                report_error("span isend/irecv", exc)
        return work

    p2p.__wrapped__ = fn  # type: ignore[attr-defined]
    p2p.__name__ = getattr(fn, "__name__", "p2p")
    p2p.__doc__ = getattr(fn, "__doc__", None)
    return p2p


def _remember_p2p(dist: Any, op: str, work: Any, start: int, end: int, args: Any, kwargs: Any) -> None:
    if not _state.get("wait_installed"):
        _install_wait(type(work))
    group = kwargs.get("group")
    peer = _peer(args, kwargs)
    local = kwargs.get("group_dst", kwargs.get("group_src"))
    if isinstance(local, int) and group is not None and kwargs.get("dst", kwargs.get("src")) is None:
        peer = int(dist.get_global_rank(group, local))  # the library passes the group's rank
    tensor = args[0] if args else kwargs.get("tensor")
    nbytes = int(tensor.numel() * tensor.element_size()) if tensor is not None else None
    if len(_pending) >= MAX_PENDING:
        _pending.clear()
    _pending[id(work)] = (work, op, peer, nbytes, start, end, _group_name(dist, group))


def _install_wait(cls: Any) -> None:
    _state["wait_installed"] = True
    original = cls.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        entry = _pending.pop(id(self), None) if _pending else None
        if entry is None or entry[0] is not self:
            return original(self, *args, **kwargs)
        start = _now()
        try:
            return original(self, *args, **kwargs)
        finally:
            end = _now()
            try:
                _, op, peer, nbytes, issued, issue_end, group = entry
                extra: dict[str, Any] = {"op": op, "group": group, "peer": peer, "bytes": nbytes}
                if op == "recv":
                    _span("collective", start, end, nonblocking=True, issue=[issued, issue_end], **extra)
                else:
                    _span("collective", issued, issue_end, nonblocking=True, wait=[start, end], **extra)
            except Exception as exc:
                report_error("span wait", exc)

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    wait.__doc__ = getattr(original, "__doc__", None)
    cls.wait = wait


def _on_checkpoint(module: ModuleType) -> None:
    for name in ("save", "save_state_dict", "async_save"):
        fn = getattr(module, name, None)
        if callable(fn):
            setattr(
                module, name, _timed("io", fn, with_caller=True, label=f"torch.distributed.checkpoint.{name}")
            )


def _on_ddp(module: ModuleType) -> None:
    cls = module.DistributedDataParallel
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            pg = getattr(self, "process_group", None)
            emit("ddp", t=_now(), group=str(getattr(pg, "group_name", "") or "default"))
            _stamp_grads(self)
        except Exception as exc:
            report_error("ddp event", exc)

    cls.__init__ = passes_for(__init__, original)
    _watch_ddp_forward(cls, getattr(module, "torch", None) or _state["torch"])


def _watch_ddp_forward(cls: Any, torch: Any) -> None:
    """Whether each DDP forward asks for its gradients' all-reduce: the reducer is prepared at the
    forward when grad is enabled and no no_sync() holds (require_backward_grad_sync), and then
    all-reduces every bucket in the backward that follows. One attribute read a forward."""
    original = cls.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if torch is not None and torch.is_grad_enabled() and not _compiling():
                _sync[0] = bool(_sync[0]) or bool(getattr(self, "require_backward_grad_sync", True))
        except Exception as exc:
            report_error("ddp forward", exc)
        return original(self, *args, **kwargs)

    cls.forward = passes_for(forward, original)


# -- GC ------------------------------------------------------------------------------------------
_gc_start: dict[Any, Any] = {}


def _gc_callback(phase: str, info: dict[str, Any]) -> None:
    # the thread's CPU clock beside the wall clock (one clock_gettime, well under a µs; a
    # schedstat pread at every gen-0 pass would cost more): a collection holds the GIL and never
    # sleeps, so its wall time less its CPU time is the time it waited for a core
    if phase == "start":
        _gc_start[0] = (_now(), _thread_cpu())
        return
    start = _gc_start.pop(0, None)
    if start is None:
        return
    end = _now()
    if end - start[0] >= GC_SPAN_MIN_NS:
        _span("gc", start[0], end, generation=info.get("generation"), cpu=(_thread_cpu() - start[1]) / 1e9)


def register() -> None:
    importhooks.on_import("torch", _on_torch)
    importhooks.on_import("torch.utils.data.dataloader", _on_dataloader)
    importhooks.on_import("torch.distributed", _on_distributed)
    importhooks.on_import("torch.distributed.checkpoint", _on_checkpoint)
    importhooks.on_import("torch.nn.parallel.distributed", _on_ddp)
    gc.callbacks.append(_gc_callback)
