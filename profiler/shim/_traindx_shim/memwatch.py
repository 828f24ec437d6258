"""Memory over time: the process's resident memory at every step end, and where it is held once
it keeps growing.

One `mem` event at each step end of the training process:
  rss_bytes        resident set size (/proc/self/statm: one read of a few bytes)
  heap_bytes       bytes malloc has handed out (glibc's mallinfo2), the host's growth signal
  dev_alloc_bytes  torch.cuda.memory_allocated() (from the `alloc` stats, GPU only: on steps
  dev_reserved_bytes  with an allocator reading, at most every stepwork.ALLOC_INTERVAL_NS)
and, on the first step end and every LIMIT_EVERY steps after, what memory is left:
  host_available_bytes  MemAvailable (/proc/meminfo)
  cgroup_limit_bytes / cgroup_usage_bytes  memory.max / memory.current (cgroup v2; v1's
                        memory.limit_in_bytes / usage_in_bytes); None: no limit
  dev_total_bytes       the device's memory (torch.cuda.mem_get_info, once)

The hunt (rare, one per process): once host or device memory has grown on each of the last
GROW_STEPS step ends by more than GROW_MIN_BYTES in all, the shim takes a census of the tensors
that hold an autograd graph (gc.get_objects: tensors with a grad_fn) and starts tracemalloc (and,
on a GPU, the caching allocator's history); HUNT_GAP steps later it takes the census again and
writes a `mem_held` event: the containers (a list, a dict, a deque) and variables that hold more
of those tensors than before (by name: the frame's local or the module's global, with its file,
function and the frame's line), the variables of the job's frames on the stack whose tensor's
autograd graph gained nodes (a running sum `total += loss`, counted up to GRAPH_MAX_NODES), where
the new tensors were made (tracemalloc's traceback), the Python allocation sites that grew most
in between (tracemalloc), and on a GPU the lines whose allocator blocks survive (torch.cuda.memory._snapshot). Its own cost is in `cost_s`; the steps
in between are `perturbed` (tracemalloc slows every allocation). The judgement is the analyzer's
(traindx.analyzers.memory.memory): this only records.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import tracemalloc
import weakref

from . import emit, frames, report_error, roles, schema

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

LIMIT_EVERY = 32  # steps between reads of /proc/meminfo and the cgroup's limit
GROW_STEPS = 6  # step ends looked at: memory grew on all but one of them
GROW_MIN_BYTES = 4 << 20  # ... by this much in all (host or device)
GROW_STEADY_MIN_BYTES = 16 << 10  # ... or on every one of them, by this much in all
GROW_STEADY_STEP_BYTES = 2 << 10  # ... and at least this much on each
HUNT_FROM_STEP = 4  # the warm-up's allocations (the allocator's cache, optimizer state) come first
HUNT_GAP = 3  # steps between the two censuses
HUNT_MAX_TENSORS = 200_000  # a census stops counting beyond this many graph-holding tensors
GRAPH_MAX_NODES = 50_000  # a variable's graph is counted up to this many autograd nodes
TRACE_FRAMES = 10
TOP = 8
_SHIM_DIR = os.path.dirname(os.path.abspath(__file__))
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_state: dict[str, Any] = {
    "statm": None,
    "history": [],  # (step, heap or rss) of the last GROW_STEPS + 1 step ends
    "dev_history": [],  # (step, dev_alloc) of the last GROW_STEPS + 1 allocator readings
    "hunt": None,  # {"step": n, "census": {...}, "t": cost so far, "device": bool}
    "hunted": False,
    "dev_total": None,
    # steps whose growth is traindx's own (a torch.profiler window's buffers): [first, last]
    "ours": None,
}


def ours_from(step: int) -> None:
    """From this step on, memory grows by traindx's own doing (until ours_until)."""
    _state["ours"] = [step, 1 << 62]


def ours_until(step: int) -> None:
    """traindx's own growth ends with this step: the growth check starts again after it."""
    if _state["ours"] is not None:
        _state["ours"][1] = step


def rss_bytes() -> int | None:
    fd = _state["statm"]
    try:
        if fd is None:
            fd = _state["statm"] = roles.open_high("/proc/self/statm", os.O_RDONLY)
        return int(os.pread(fd, 64, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def heap_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2: in-use chunks of every
    arena plus mmapped chunks; ~16 us). Unlike RSS it does not hide a leak in pages the heap had
    freed and reuses, nor move when malloc trims; None off glibc."""
    fn = _state.get("mallinfo", False)
    if fn is False:
        fn = _state["mallinfo"] = _mallinfo2()
    if fn is None:
        return None
    try:
        info = fn()
        return int(info.uordblks + info.hblkhd)
    except Exception:
        return None


def _mallinfo2() -> Any:
    try:
        import ctypes  # lazily: only a training process at its first step end needs it (torch imported it)

        class MallInfo2(ctypes.Structure):
            _fields_ = [
                (name, ctypes.c_size_t)
                for name in (
                    "arena",
                    "ordblks",
                    "smblks",
                    "hblks",
                    "hblkhd",
                    "usmblks",
                    "fsmblks",
                    "uordblks",
                    "fordblks",
                    "keepcost",
                )
            ]

        fn = ctypes.CDLL(None).mallinfo2
        fn.restype = MallInfo2
        fn.argtypes = []
        return fn
    except (OSError, AttributeError, ImportError):
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    try:
        value = int(text)
    except ValueError:
        return None  # "max": no limit
    return value if value < (1 << 60) else None  # v1's "no limit" is a huge number


def host_limits() -> dict[str, Any]:
    """MemAvailable and the cgroup's limit and usage (None where there is none)."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    out["host_available_bytes"] = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        if os.path.exists(usage):
            out["cgroup_limit_bytes"] = _read_int(limit)
            out["cgroup_usage_bytes"] = _read_int(usage)
            break
    return out


def emit_step(step: int, torch: Any, dev: dict[str, Any] | None) -> None:
    """The step's memory; a hunt begun, or finished, when memory keeps growing."""
    fields: dict[str, Any] = {"rss_bytes": rss_bytes(), "heap_bytes": heap_bytes()}
    dev_alloc = None
    if dev:
        dev_alloc = dev.get("allocated_bytes_all_current")
        fields["dev_alloc_bytes"] = dev_alloc
        fields["dev_reserved_bytes"] = dev.get("reserved_bytes_all_current")
    first = not _state["history"]
    if first or step % LIMIT_EVERY == 0:
        fields.update(host_limits())
    if dev and _state["dev_total"] is None:  # once, at the first allocator reading
        try:
            _state["dev_total"] = int(torch.cuda.mem_get_info()[1])
            fields["dev_total_bytes"] = _state["dev_total"]
        except Exception:
            _state["dev_total"] = 0
    emit(schema.MEM, step=step, **fields)
    history, readings = _state["history"], _state["dev_history"]
    ours = _state["ours"]
    if ours is not None and ours[0] <= step <= ours[1]:
        history.clear()  # the growth check starts again after the steps our profiler grew
        readings.clear()
        return
    history.append((step, fields["heap_bytes"] or fields["rss_bytes"] or 0))
    del history[: -(GROW_STEPS + 1)]
    if dev_alloc is not None:  # the allocator is read on a clock (stepwork.emit_alloc)
        readings.append((step, dev_alloc))
        del readings[: -(GROW_STEPS + 1)]
    hunt = _state["hunt"]
    if hunt is not None:
        if step >= hunt["step"] + HUNT_GAP:
            _finish(step, torch, hunt)
    elif not _state["hunted"] and step >= HUNT_FROM_STEP:
        for series, device in ((history, False), (readings, True)):
            # most steps grew by less than either test's least: no lists built for them
            if len(series) <= GROW_STEPS or series[-1][1] - series[0][1] < GROW_STEADY_MIN_BYTES:
                continue
            if _keeps_growing([h[1] for h in series]):
                _begin(step, torch, device=device)
                break


def _keeps_growing(values: list[int]) -> bool:
    """Grew on nearly every step by a lot, or on every step by a little (the heap's in-use bytes
    are exact: a few kB kept per step, a loss with its graph nodes, rise on every step)."""
    steps = [b - a for a, b in zip(values, values[1:])]
    grew = values[-1] - values[0]
    return (sum(d > 0 for d in steps) >= GROW_STEPS - 1 and grew >= GROW_MIN_BYTES) or (
        min(steps) >= GROW_STEADY_STEP_BYTES and grew >= GROW_STEADY_MIN_BYTES
    )


def _census(torch: Any) -> dict[int, Any]:
    """{id: tensor} of the tensors alive now that hold an autograd graph. Whether a type is a
    tensor type is asked once per type (its MRO, not isinstance: a module's __getattr__ for
    __class__ is never called)."""
    out: dict[int, Any] = {}
    tensor_type = torch.Tensor
    is_tensor: dict[type, bool] = {}
    for obj in gc.get_objects():
        kind = type(obj)
        known = is_tensor.get(kind)
        if known is None:
            known = is_tensor[kind] = tensor_type in kind.__mro__
        if known and obj.grad_fn is not None:
            out[id(obj)] = obj
            if len(out) >= HUNT_MAX_TENSORS:
                break
    return out


def _refs(census: dict[int, Any]) -> dict[int, Any]:
    """The census as weak references: an id seen again later is the same tensor only while its
    reference is alive (a new tensor often gets a freed one's address)."""
    out = {}
    for key, t in census.items():
        try:
            out[key] = weakref.ref(t)
        except TypeError:
            pass
    return out


def _begin(step: int, torch: Any, device: bool) -> None:
    t0 = time.perf_counter()
    _state["hunted"] = True
    try:
        census = _refs(_census(torch))
        graphs = _variable_graphs(torch)
        if not tracemalloc.is_tracing():
            tracemalloc.start(TRACE_FRAMES)
        if device:
            _device_history(torch, True)
    except Exception as exc:
        report_error("memory hunt", exc)
        return
    cost = time.perf_counter() - t0
    _state["hunt"] = {"step": step, "census": census, "graphs": graphs, "cost": cost, "device": device}
    emit(schema.MEM_HUNT, step=step, grew="device" if device else "host", cost_s=round(cost, 6))


def _finish(step: int, torch: Any, hunt: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    _state["hunt"] = None
    fields: dict[str, Any] = {}
    try:
        alive = _census(torch)
        before = hunt["census"]
        new = {i: t for i, t in alive.items() if i not in before or before[i]() is not t}
        t1 = time.perf_counter()
        fields["graph_tensors"] = len(alive)
        fields["graph_tensors_before"] = len(before)
        fields["new_graph_tensors"] = len(new)
        del alive
        fields["holders"] = _holders(new) + _grown_graphs(hunt.get("graphs") or {}, _variable_graphs(torch))
        del new
        t2 = time.perf_counter()
        if not fields["holders"]:  # what else the steps kept: the Python allocations that survive
            fields["sites"] = _grown_sites()
        fields["times_s"] = [round(t1 - t0, 4), round(t2 - t1, 4), round(time.perf_counter() - t2, 4)]
        if hunt["device"]:
            fields["device_sites"] = device_sites(_device_snapshot(torch))
    except Exception as exc:
        report_error("memory hunt", exc)
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        if hunt["device"]:
            _device_history(torch, False)
    cost = hunt["cost"] + time.perf_counter() - t0
    emit(
        schema.MEM_HELD,
        step=step,
        since_step=hunt["step"],
        grew="device" if hunt["device"] else "host",
        cost_s=round(cost, 6),
        **fields,
    )


def _where(tb: Any) -> dict[str, Any] | None:
    """The innermost frame of a traceback (innermost last) in the job's own file; else in a
    framework's; else the innermost."""
    if not tb:
        return None
    chosen = None
    for test in (frames.is_library_path, frames.is_library_file):
        for fr in reversed(tb):
            if not test(fr.filename):
                chosen = fr
                break
        if chosen is not None:
            break
    chosen = chosen or tb[-1]
    return {"file": chosen.filename, "line": chosen.lineno}


_CONTAINERS = ("list", "dict", "set", "deque", "OrderedDict", "defaultdict")


def _members(container: Any) -> list[Any]:
    return list(container.values()) if isinstance(container, dict) else list(container)


def _owners(containers: list[Any]) -> dict[int, dict[str, Any]]:
    """{id(container): the variable that holds it}: a frame's local (name, file, function, the
    frame's line now), a module's global, or an object's attribute. One scan of the heap."""
    wanted = {id(c): c for c in containers}
    modules = {id(getattr(m, "__dict__", None)): m for m in list(sys.modules.values())}
    out = _stack_owners(wanted)
    for ref in gc.get_referrers(*containers):
        if type(ref).__name__ == "frame":
            code = ref.f_code
            if code.co_filename == __file__:
                continue
            items = list(ref.f_locals.items())
            where = {
                "scope": "local",
                "file": code.co_filename,
                "function": code.co_name,
                "first_line": code.co_firstlineno,
                "line": ref.f_lineno,
            }
        elif isinstance(ref, dict):
            items = list(ref.items())
            mod = modules.get(id(ref))
            where = (
                {"scope": "global", "file": getattr(mod, "__file__", None)}
                if mod is not None
                else {"scope": "attribute"}
            )
        else:
            continue
        for name, value in items:
            if id(value) in wanted and isinstance(name, str) and id(value) not in out:
                out[id(value)] = {"name": name, **where}
    return out


def _stack_owners(wanted: dict[int, Any]) -> dict[int, dict[str, Any]]:
    """The owners among the locals (and `self`'s attributes) of the job's frames on this
    thread's stack. Since Python 3.11 a running function's locals live outside any object the
    collector sees (gc.get_referrers finds no frame for them, at most a stale f_locals dict
    with no name of its frame): a list local to the training loop is found only here."""
    out: dict[int, dict[str, Any]] = {}
    for frame, where in _job_frames(sys._getframe(1)):
        if frame.f_locals is frame.f_globals:
            continue  # a module's code: its globals are the collector's to find
        for name, value, scope in _frame_variables(frame, "local"):
            if id(value) in wanted and isinstance(name, str) and id(value) not in out:
                out[id(value)] = {"name": name, "scope": scope, **where}
    return out


def _job_frames(frame: Any) -> Any:
    """(frame, where it is: file, function, first line, line) of the job's frames from `frame`
    outwards (traindx's and libraries' left out)."""
    while frame is not None:
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(_SHIM_DIR) and not frames.is_library_path(path):
            yield (
                frame,
                {
                    "file": path,
                    "function": code.co_name,
                    "first_line": code.co_firstlineno,
                    "line": frame.f_lineno,
                },
            )
        frame = frame.f_back


def _frame_variables(frame: Any, scope: str) -> list[tuple[Any, Any, str]]:
    """(name, value, scope) of a frame's variables, and `self`'s attributes ("attribute")."""
    items = [(name, value, scope) for name, value in list(frame.f_locals.items())]
    owner = frame.f_locals.get("self")
    if owner is not None and isinstance(getattr(owner, "__dict__", None), dict):
        items += [(name, value, "attribute") for name, value in list(vars(owner).items())]
    return items


def _holders(new: dict[int, Any]) -> list[dict[str, Any]]:
    """The containers holding two or more of the new graph-holding tensors, with the variable
    that holds each and what the tensors are (their grad_fn, shape, bytes)."""
    if not new:
        return []
    refs = gc.get_referrers(*new.values())
    held = []
    for ref in refs:
        if type(ref).__name__ not in _CONTAINERS or ref is new:
            continue
        mine = [m for m in _members(ref) if id(m) in new]
        if len(mine) >= 2:
            held.append((ref, mine))
    held.sort(key=lambda kv: -len(kv[1]))
    held = held[:TOP]
    owners = _owners([c for c, _ in held]) if held else {}
    out = []
    for container, mine in held:
        last = mine[-1]
        out.append(
            {
                "kind": type(container).__name__,
                "size": len(container),
                "new": len(mine),
                "nbytes": sum(_nbytes(t) for t in mine),
                "grad_fn": type(last.grad_fn).__name__,
                "shape": list(last.shape),
                "owner": owners.get(id(container)),
            }
        )
    return out


def _graph_nodes(fn: Any) -> int:
    """The autograd nodes reachable from `fn` (up to GRAPH_MAX_NODES)."""
    seen = {id(fn)}
    todo = [fn]
    while todo and len(seen) < GRAPH_MAX_NODES:
        for nxt, _ in todo.pop().next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                todo.append(nxt)
    return len(seen)


def _variable_graphs(torch: Any) -> dict[tuple[Any, ...], dict[str, Any]]:
    """{(file, function, first line, name): the variable's graph} for the variables of the job's
    frames on the stack now (its locals, a module's globals, `self`'s attributes) that hold a
    tensor with an autograd graph: a running sum `total += loss` is one tensor whose graph grows
    by a step's graph every step, which no container census sees."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    tensor_type = torch.Tensor
    seen: set[int] = set()
    for frame, where in _job_frames(sys._getframe(1)):
        path = where["file"]
        scope = "global" if frame.f_locals is frame.f_globals else "local"
        items = [(name, v, kind, where) for name, v, kind in _frame_variables(frame, scope)]
        if scope == "local" and id(frame.f_globals) not in seen:  # the function's module's globals
            seen.add(id(frame.f_globals))
            module = {"file": path, "function": "<module>", "first_line": 1, "line": None}
            items += [(name, v, "global", module) for name, v in list(frame.f_globals.items())]
        for name, value, kind, at in items:
            # a tensor by its type's MRO (isinstance may ask a proxy's __getattr__ for __class__)
            if tensor_type in type(value).__mro__ and value.grad_fn is not None and isinstance(name, str):
                key = (at["file"], at["function"], at["first_line"], name)
                if key not in out:
                    out[key] = {
                        "nodes": _graph_nodes(value.grad_fn),
                        "grad_fn": type(value.grad_fn).__name__,
                        "shape": list(value.shape),
                        "owner": {"name": name, "scope": kind, **at},
                    }
    return out


def _grown_graphs(
    before: dict[tuple[Any, ...], Any], after: dict[tuple[Any, ...], Any]
) -> list[dict[str, Any]]:
    """The variables whose tensor's graph grew between the two censuses (as `_holders`' entries:
    `size` the graph's nodes now, `new` the nodes it gained)."""
    out = []
    for key, now in after.items():
        then = before.get(key)
        if then is None or now["nodes"] - then["nodes"] < 2:
            continue
        out.append(
            {
                "kind": "graph",
                "size": now["nodes"],
                "new": now["nodes"] - then["nodes"],
                "nbytes": 0,
                "grad_fn": now["grad_fn"],
                "shape": now["shape"],
                "owner": now["owner"],
            }
        )
    return out


def _nbytes(t: Any) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return 0


def _grown_sites() -> list[dict[str, Any]]:
    """The allocation sites whose memory, allocated since the hunt began, is still alive (top by
    size; each named by its innermost frame in the job's code)."""
    if not tracemalloc.is_tracing():
        return []
    stats = tracemalloc.take_snapshot().statistics("traceback")
    out = []
    for st in stats[: TOP * 8]:
        if any(fr.filename.startswith(_SHIM_DIR) for fr in st.traceback):
            continue
        where = _where(st.traceback)
        if where is None or frames.is_library_file(where["file"]):
            continue
        out.append({**where, "size": st.size, "count": st.count})
        if len(out) >= TOP:
            break
    return out


def _device_history(torch: Any, on: bool) -> None:
    try:
        record = torch.cuda.memory._record_memory_history
        if on:
            record(max_entries=100_000)
        else:
            record(enabled=None)
    except Exception as exc:
        report_error("memory history", exc)


def _device_snapshot(torch: Any) -> Any:
    try:
        return torch.cuda.memory._snapshot()
    except Exception as exc:
        report_error("memory snapshot", exc)
        return None


def device_sites(snapshot: Any) -> list[dict[str, Any]]:
    """The lines whose caching-allocator blocks are still allocated at the snapshot, among the
    blocks recorded since the history began (a block with frames), top by bytes: each block
    named by its innermost frame in the job's code."""
    if not isinstance(snapshot, dict):
        return []
    sites: dict[tuple[Any, Any], list[int]] = {}
    for seg in snapshot.get("segments") or []:
        for block in seg.get("blocks") or []:
            if block.get("state") != "active_allocated" or not block.get("frames"):
                continue
            py = [fr for fr in block["frames"] if str(fr.get("filename") or "").endswith(".py")]
            chosen = None
            for test in (frames.is_library_path, frames.is_library_file):
                chosen = next((fr for fr in py if not test(str(fr["filename"]))), None)  # innermost first
                if chosen is not None:
                    break
            chosen = chosen or (py[0] if py else None)
            if chosen is None:
                continue
            key = (chosen.get("filename"), chosen.get("line"))
            entry = sites.setdefault(key, [0, 0])
            entry[0] += int(block.get("requested_size") or block.get("size") or 0)
            entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:TOP]
    return [{"file": f, "line": ln, "size": size, "count": n} for (f, ln), (size, n) in ranked]
