"""What the training thread runs, sampled with times on the shim's clock, for the ledger's `host`
line (traindx.derive.ledger.host_code): py-spy's recordings carry no sample times, so they cannot say
which samples fall between the training thread's measured calls; these can.

A daemon thread (`traindx-hostsample`) wakes up to TRAINDX_HOST_SAMPLE_HZ times a second (default
50; 0: off; slower where a sample costs more than CPU_SHARE of a core, below) while a step is in progress, takes the training thread's current frame
(sys._current_frames) and reduces it to one key, interned once:

  function, file, line  the innermost frame of the job's own code (outside site-packages and
                        the standard library; the leaf when every frame is a library's)
  via                   the library function that called that frame back when the job's code
                        is further up the stack too (a framework's callback dispatch), or None
  call                  what the stack ends in: the callee of the leaf frame's pending call
                        when it is a C function or a name the bytecode shows (`time.sleep`,
                        `numpy.load`, `f.read`), else the leaf frame's module.function
                        (`PIL.Image.save`); None for the job's own Python running

With each sample goes the training thread's run-queue wait so far (runq_us: µs the kernel kept
it runnable but off a core, /proc/self/task/<tid>/schedstat; Linux only): on a loaded machine a
thread preempted at a line stays at that line while it waits, so wall-clock samples alone would
charge the machine's load to whatever line a time slice happened to end in.

At each step end the samples so far go out as one `host_samples` event: t0 (ns), dt_us (µs
after t0), k (key ids), runq_us (where readable), tid, pid; new keys first, as `host_frame` events {id, pid, function,
file, line, call} (ids are per process).
The derive layer keeps the samples that fall inside the ledger's host intervals.

Cost: a round (the wake, taking the GIL from the training thread, the walk, the run-queue read)
costs 50-150 µs of CPU beside a busy training thread, most of it the wake and the GIL's
hand-offs: the sampler measures its rounds on its own thread clock and sleeps long enough that
they take at most CPU_SHARE of a core (0.2 %: ~20 µs of a 10 ms step), never less often than
selfcost.MIN_SAMPLE_HZ. A repeated stack costs one dict look-up for its key (`_fast`). A C call that holds the GIL delays the sample to its end (then the sample names what
runs next): such time is under-sampled, never misattributed to a measured line. The job's
frames are only read (no f_locals).
"""

from __future__ import annotations

import atexit
import bisect
import dis
import os
import sys
import sysconfig
import threading
import time
import types

from . import emit, report_error, roles, schema, selfcost

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from types import FrameType
    from typing import Any

HOST_FRAME = schema.HOST_FRAME
HOST_SAMPLES = schema.HOST_SAMPLES
RATE_HZ = float(os.environ.get("TRAINDX_HOST_SAMPLE_HZ") or 50)
MAX_BUFFERED = 100_000  # samples between two step ends (a long evaluation): later ones dropped
# the sampler's own CPU (its wake, taking the GIL, the stack walk, the run-queue read; it holds
# the GIL, so a job's thread that needs it waits): at most this share of a core, ~20 us of a
# 10 ms step. A round costs 50-150 us of CPU beside a busy training thread (bench/
# hostsample_cost.py; ~90 us on an H100 host), most of it the wake and the GIL's hand-offs,
# not the walk: at 50 Hz that was 0.3-0.7 % of the job's time
CPU_SHARE = 0.002
ROUNDS_KEPT = 9  # the rounds whose median cost sets the rate
MAX_KEYS = 5000  # distinct (function, line, call) keys; later ones share one
_STDLIB = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")}
    if p
)
_SHIM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_state: dict[str, Any] = {"thread": None, "pid": None, "tid": None, "running": False, "schedstat": None}
_buf: list[
    tuple[int, int, int | None]
] = []  # (t_ns, key id, run-queue wait ns or None), appended by the sampler only
_keys: dict[tuple[Any, ...], int] = {}  # key tuple -> id
_new_keys: list[int] = []  # ids not emitted yet
_library: dict[str, tuple[bool, str | None]] = {}  # filename -> (is library, module name)
_callee: dict[
    tuple[Any, int], tuple[str | None, bool]
] = {}  # (code, lasti) -> (callee name or None, resolved)
_instructions: dict[Any, Any] = {}  # code -> its instructions
_code_lib: dict[Any, bool] = {}  # code -> whether it is a library's
_fast: dict[tuple[Any, ...], int] = {}  # (leaf code, its lasti, own code, its lasti, via code) -> key id


def start(tid: int) -> None:
    """Sample thread `tid` from now on (called at step 0's begin and when the training thread
    changes); starts the sampler once per process."""
    _state["tid"] = tid
    _state["running"] = True
    _open_schedstat()
    if RATE_HZ <= 0 or (_state["thread"] is not None and _state["pid"] == os.getpid()):
        return
    _state["pid"] = os.getpid()
    _state["stop"] = False
    th = threading.Thread(target=_loop, name="traindx-hostsample", daemon=True)
    _state["thread"] = th
    roles.start_thread(th)
    atexit.register(_stop_thread)


def _stop_thread() -> None:
    """At exit, before the interpreter finalizes: end the sampler and wait for it, so that no
    thread of ours is mid-call when CPython stops the daemon threads."""
    th = _state["thread"]
    if th is None or _state["pid"] != os.getpid():
        return
    _state["stop"] = True
    th.join(timeout=1.0)


def _open_schedstat() -> None:
    """Keep the training thread's schedstat open (called on that thread): one pread a sample."""
    old, _state["schedstat"] = _state["schedstat"], None
    if old is not None:
        try:
            os.close(old)
        except OSError:
            pass
    try:
        _state["schedstat"] = roles.open_high(
            f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY
        )
    except (OSError, AttributeError):
        pass


def _runqueue_ns() -> int | None:
    fd = _state["schedstat"]
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None


def period_s(cost_ns: float, scale: float) -> float:
    """Seconds between samples: RATE_HZ (x the budget's scale), or slower where a sample costs
    more than CPU_SHARE of a core at that rate (cost_ns: a round's CPU, smoothed); never slower
    than MIN_SAMPLE_HZ, whatever a sample costs."""
    base = 1.0 / RATE_HZ / scale if scale > 0 else 1.0 / selfcost.MIN_SAMPLE_HZ
    return min(max(base, cost_ns / 1e9 / CPU_SHARE), max(base, 1.0 / selfcost.MIN_SAMPLE_HZ))


def _loop() -> None:
    frames = sys._current_frames
    now = time.time_ns
    shed = selfcost.shed_state  # above the budget the shim samples less (selfcost.py)
    ident = threading.get_ident()
    cost = 0.0  # a round's CPU ns: the wake, the GIL, the sample (the median of the last rounds)
    rounds: list[int] = []
    last = roles.report_cpu(ident, "traindx-hostsample")
    while not _state.get("stop"):
        time.sleep(period_s(cost, shed["sample_scale"]))
        tid = _state["tid"]
        if not _state["running"] or tid is None or len(_buf) >= MAX_BUFFERED:
            continue
        try:
            frame = frames().get(tid)
            if frame is None:
                continue
            t = now()
            _buf.append((t, _key_id(frame), _runqueue_ns()))
            del frame
        except Exception as exc:  # never again: one error, then the sampler stops
            report_error("host sampler", exc)
            return
        cpu = roles.report_cpu(ident, "traindx-hostsample")  # the round's CPU (selfcost.py)
        # the median: a round that met new code (its first key: a disassembly, ~0.5 ms) is
        # once per line, not the rate's steady cost
        rounds.append(cpu - last)
        del rounds[:-ROUNDS_KEPT]
        cost, last = sorted(rounds)[len(rounds) // 2], cpu


def _library_file(filename: str) -> tuple[bool, str | None]:
    """(is a library's file, its module name) - site-packages, the standard library, `<...>`."""
    got = _library.get(filename)
    if got is None:
        if filename.startswith("<"):
            got = (True, None)
        else:
            real = os.path.realpath(filename)
            parts = real.split(os.sep)
            module = None
            for marker in ("site-packages", "dist-packages"):
                if marker in parts:
                    module = parts[len(parts) - parts[::-1].index(marker) :]
                    break
            if module is None and real.startswith(_STDLIB):
                module = real[len(next(p for p in _STDLIB if real.startswith(p))) :].split(os.sep)
            if module is None and real.startswith(_SHIM_DIR):
                module = ["_traindx_shim", os.path.basename(real)]
            if module is not None:
                name = ".".join(module)
                name = name[:-3] if name.endswith(".py") else name
                name = name[: -len(".__init__")] if name.endswith(".__init__") else name
                got = (True, name)
            else:
                got = (False, None)
        _library[filename] = got
    return got


def _is_library(code: Any) -> bool:
    """Whether a code object is a library's (_library_file), cached by the code object: a
    sample asks this of every frame it walks."""
    got = _code_lib.get(code)
    if got is None:
        got = _code_lib[code] = _library_file(code.co_filename)[0]
    return got


def _key_id(leaf: FrameType) -> int:
    user = None
    frame: FrameType | None = leaf
    while frame is not None:
        if not _is_library(frame.f_code):
            user = frame
            break
        frame = frame.f_back
    own = user or leaf
    caller = _via_caller(user)
    # the same leaf instruction, the same line of the job's frame and the same callback
    # dispatch give the same key: one dict look-up, no line-table decode, no name built
    fast = (leaf.f_code, leaf.f_lasti, own.f_code, own.f_lasti, caller)
    got = _fast.get(fast)
    if got is not None:
        return got
    code = own.f_code
    key = (
        getattr(code, "co_qualname", code.co_name),
        code.co_filename,
        own.f_lineno or code.co_firstlineno,
        _call_of(leaf),
        _via_name(caller),
    )
    got = _keys.get(key)
    if got is None:
        if len(_keys) >= MAX_KEYS:
            key = ("(other)", "", 0, None, None)
            got = _keys.get(key)
        if got is None:
            got = _keys[key] = len(_keys)
            _new_keys.append(got)
    if len(_fast) < MAX_KEYS * 4:
        _fast[fast] = got
    return got


def _via(user: FrameType | None) -> str | None:
    """The library function that called the job's frame back, when the job's code is further up
    the stack too (a framework's callback or event dispatch calling the job's handler): its
    module.qualname; None for code the job's own loop calls."""
    return _via_name(_via_caller(user))


def _via_caller(user: FrameType | None) -> Any:
    """The code of the library frame that called the job's frame back (see _via), or None."""
    if user is None:
        return None
    caller = user.f_back
    while caller is not None and not _is_library(caller.f_code):
        caller = caller.f_back  # up through the job's own frames (a helper the callback calls)
    if caller is None:
        return None
    frame = caller.f_back
    while frame is not None:
        if not _is_library(frame.f_code):
            return caller.f_code
        frame = frame.f_back
    return None


def _via_name(code: Any) -> str | None:
    if code is None:
        return None
    module = _library_file(code.co_filename)[1]
    return f"{module}.{getattr(code, 'co_qualname', code.co_name)}" if module else None


def _call_of(leaf: FrameType) -> str | None:
    code = leaf.f_code
    cache_key = (code, leaf.f_lasti)
    got = _callee.get(cache_key)
    if got is None:
        got = _callee[cache_key] = _resolve(leaf) or (None, False)
    name, qualified = got
    is_lib, module = _library_file(code.co_filename)
    if is_lib and module and not qualified:
        # a library's frame: its own name says more than a local it calls (`fid.read`)
        return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
    return name


_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE")
_ATTRS = ("LOAD_ATTR", "LOAD_METHOD")


def _resolve(frame: FrameType) -> tuple[str, bool] | None:
    """The callee of the call the frame is in, when its bytecode names it: `time.sleep`,
    `numpy.load` (resolved through the frame's globals, modules and classes only), `f.read` (a
    local: the name as written), with whether it was resolved; None when the frame is not in a
    call."""
    try:
        code = frame.f_code
        ins = _instructions.get(code)
        if ins is None:
            ins = _instructions[code] = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
        # the instruction running: the last one at or before f_lasti (it may point into the
        # inline caches); 3.11 runs a C function from a specialised PRECALL: its CALL follows
        at = bisect.bisect_right([i.offset for i in ins], frame.f_lasti) - 1
        while 0 <= at < len(ins) - 1 and ins[at].opname in ("PRECALL", "KW_NAMES"):
            at += 1
        if at < 0 or not ins[at].opname.startswith("CALL") or ins[at].opname == "CALL_FUNCTION_EX":
            return None
        # walk back over the call's arguments by their net stack effect (3.11: the call's own
        # PRECALL and KW_NAMES first; a nested call's count in the sum)
        need, n = ins[at].arg or 0, at - 1
        while n >= 0 and ins[n].opname in ("PRECALL", "KW_NAMES"):
            n -= 1
        while need > 0 and n >= 0:
            i = ins[n]
            try:
                need -= dis.stack_effect(
                    i.opcode, i.arg if i.opcode >= dis.HAVE_ARGUMENT else None, jump=False
                )
            except ValueError:
                return None
            n -= 1
        attrs = []
        while n >= 0 and ins[n].opname in _ATTRS:
            attrs.insert(0, ins[n].argval)
            n -= 1
        if n < 0 or ins[n].opname not in _LOADS:
            return ("." + ".".join(attrs), False) if attrs else None
        head = ins[n].argval
        obj = (
            frame.f_globals.get(head, _MISSING) if ins[n].opname in ("LOAD_GLOBAL", "LOAD_NAME") else _MISSING
        )
        if obj is _MISSING and ins[n].opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            builtins = frame.f_builtins
            obj = builtins.get(head, _MISSING) if isinstance(builtins, dict) else _MISSING
        if obj is _MISSING:
            return ".".join([head] + attrs), False
        return _qualified(obj, head, attrs), True
    except Exception:
        return None


_MISSING = object()
_PUBLIC_MODULE = {"posix": "os", "nt": "os", "_io": "io"}  # the names users write


def _qualified(obj: Any, head: str, attrs: list[str]) -> str:
    """The qualified name of head.attrs..., looked up through modules and classes only (an
    attribute of any other object could run its code)."""
    names = [head]
    for attr in attrs:
        if not isinstance(obj, (types.ModuleType, type)):
            return ".".join(names + attrs[len(names) - 1 :])
        obj = getattr(obj, attr, _MISSING)
        names.append(attr)
        if obj is _MISSING:
            return ".".join(names)
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        module = _PUBLIC_MODULE.get(module, module)
        return f"{module}.{qualname}"
    return ".".join(names)


def flush(step: int) -> None:
    """The samples since the last flush (and the keys they use) as events; at each step end."""
    global _buf
    if not _buf and not _new_keys:
        return
    taken, _buf = _buf, []
    try:
        if _new_keys:
            n = len(_new_keys)  # the sampler may append meanwhile: those go out next time
            ids = set(_new_keys[:n])
            del _new_keys[:n]
            for key, kid in list(_keys.items()):
                if kid in ids:
                    emit(
                        HOST_FRAME,
                        id=kid,
                        pid=_state["pid"],
                        function=key[0],
                        file=key[1],
                        line=key[2],
                        call=key[3],
                        via=key[4],
                    )
        if taken:
            t0 = taken[0][0]
            fields = {}
            if all(q is not None for _, _, q in taken):
                fields["runq_us"] = [q // 1000 for _, _, q in taken if q is not None]
            emit(
                HOST_SAMPLES,
                step=step,
                t0=t0,
                tid=_state["tid"],
                pid=_state["pid"],
                dt_us=[(t - t0) // 1000 for t, _, _ in taken],
                k=[k for _, k, _ in taken],
                **fields,
            )
    except Exception as exc:
        report_error("host samples", exc)
