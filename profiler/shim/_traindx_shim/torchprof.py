"""A short torch.profiler window, driven from the step boundaries: host-device syncs, time in the
DataLoader, kernel gaps, collectives. Written per rank as `trace/<rank>.json.gz` (Perfetto and
chrome://tracing open it as is).

TRAINDX_TORCH_PROFILE: unset = the default window; "off" = none; "N" = N steps from step
DEFAULT_START; "A-B" = steps A to B. The default window stands down when steps are long
(with_stack traces every Python call; a long step is usually a Python-heavy one, such as a JIT
compile, where the trace would cost seconds and grow to gigabytes); an explicit window does not.
TRAINDX_TORCH_PROFILE_MAX_STEP_S sets that limit (default 5 s).

The window is bounded in time and in bytes. What it costs the job is the profiler's start, the
profiled steps' excess over the median step before the window, the stop (kineto collects its
events) and the export (JSON written, then gzipped). Every step boundary inside the window
projects the stop and export from what the profiled steps cost so far and ends the window early
when the total would pass the budget; after the stop, the trace is exported only while the time
spent stays within the budget and the file within TRAINDX_TORCH_PROFILE_MAX_MB (default 20 MB per
rank), else it stands down: no trace, and the `torch_profile` event says why (`stood_down`) with
every number. A window (default or explicit) that stood down for its cost is tried once more,
one step, without Python stacks (`stacks` in its events): most of a launch-bound step's trace is
its stacks. The budget is one median step (at least TRAINDX_TORCH_PROFILE_MIN_BUDGET_S, 1 s:
kineto cannot start in less) for the default window; an explicit --torch-profile window, which the
user asked for, may cost up to max(30 s, 5 median steps); TRAINDX_TORCH_PROFILE_BUDGET_S sets it.
The profiled steps are named in that event (first_step..last_step), so step statistics and --fix
comparisons leave them out. The default window profiles a steady step: while the step before it
compiled or autotuned kernels it waits (up to MAX_POSTPONE steps, then stands down), because a
Triton autotune launches thousands of benchmark kernels whose collection alone costs seconds.
"""

from __future__ import annotations

import atexit
import collections
import gzip
import os
import statistics
import sys
import time

from . import compiles, control, emit, get_writer, importhooks, memwatch, report_error, roles, schema, steps

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

# a job that profiles itself keeps its profiler: kineto runs one at a time
JOB_PROFILER_FLAGS = ("--profile", "--use-pytorch-profiler", "--torch-profile", "--profiler")
DEFAULT_START = 3
DEFAULT_STEPS = 2
MAX_POSTPONE = 8  # steps the default window waits for one without compiles or autotunes
LONG_STEP_S = float(os.environ.get("TRAINDX_TORCH_PROFILE_MAX_STEP_S") or 5.0)
MAX_BYTES = int(float(os.environ.get("TRAINDX_TORCH_PROFILE_MAX_MB") or 20) * 1e6)
MIN_BUDGET_S = float(os.environ.get("TRAINDX_TORCH_PROFILE_MIN_BUDGET_S") or 1.0)
EXPLICIT_BUDGET_S, EXPLICIT_BUDGET_STEPS = 30.0, 5
# stop + export cost about this many times the profiled steps' excess (kineto's per-event
# recording vs collecting, writing and compressing each event: measured on the CPU, 8-10x)
FINISH_FACTOR = 10.0
# Chrome-trace JSON compresses about 8-15x: a raw file above this many times the byte limit
# cannot fit, so it is not compressed at all
MAX_RAW_RATIO = 15
_state: dict[str, Any] = {
    "window": None,
    "explicit": False,
    "profiler": None,
    "first": None,
    "torch": None,
    "last_boundary_ns": None,
    "done": False,
    "durations": collections.deque(maxlen=64),
    "median_s": None,
    "budget_s": None,
    "start_s": 0.0,
    "excess_s": 0.0,
    "profiled": [],
    "after": None,
    "compiles_seen": 0,
    "postponed": 0,
    # deep capture: a window of one step on an anomaly, once per kind (kind, why)
    "trigger": None,
    "captured": set(),
    "capture_t": None,
    # a window that stood down for its cost is tried once more without Python stacks
    "lite": False,
}
ANOMALY_FACTOR = 2.0  # a step this many times the median of the steps before it
ANOMALY_ONLY = "anomaly"  # TRAINDX_TORCH_PROFILE=anomaly: no default window, anomaly windows only
ANOMALY_MIN_STEPS = 3


def _budget_s(median_s: float | None) -> float:
    raw = os.environ.get("TRAINDX_TORCH_PROFILE_BUDGET_S")
    if raw:
        return float(raw)
    if _state["explicit"]:
        return max(EXPLICIT_BUDGET_S, EXPLICIT_BUDGET_STEPS * (median_s or 0.0))
    return max(median_s or 0.0, MIN_BUDGET_S)


def parse_window(text: str | None) -> tuple[int, int] | None:
    """(first, last) steps, None for off or anomaly-only; raises ValueError for what it cannot
    read."""
    text = (text or "").strip().lower()
    if text in ("", "default"):
        return DEFAULT_START, DEFAULT_START + DEFAULT_STEPS - 1
    if text in ("off", "0", "none", "no", ANOMALY_ONLY):
        return None
    if "-" in text:
        low, _, high = text.partition("-")
        first, last = int(low), int(high)
    else:
        first = DEFAULT_START
        last = first + int(text) - 1
    if first < 0 or last < first:
        raise ValueError(f"bad step window {text!r}")
    return first, last


def _trace_path() -> str:
    run_dir = os.environ["TRAINDX_RUN_DIR"]
    w = get_writer()
    rank = w.rank if w is not None else os.environ.get("RANK", "0")
    folder = roles.own_dir(os.path.join(run_dir, "trace"))
    trigger = _state["trigger"]
    if trigger:  # an anomaly's window beside the default one (the loader reads both)
        return os.path.join(folder, f"{rank}.anomaly-{trigger[0]}.json.gz")
    return os.path.join(folder, f"{rank}.json.gz")


def _teardown_cupti_after(torch: Any) -> None:
    """Ask kineto to finalize CUPTI when the window stops. Without TEARDOWN_CUPTI=1 kineto leaves
    CUPTI's callbacks subscribed after the profiler stops (pytorch/pytorch#144455), and every kernel
    launch of the rest of the job pays for them: on a launch-bound 10 ms H100 step the default
    window made every later step 30-50 % slower (BENCHMARKS.md). Teardown crashes a CUDA graph's
    re-init before CUDA 12.6 (torch's own note): there, and where the job or torch set it, left alone."""
    if "TEARDOWN_CUPTI" in os.environ:
        return
    try:
        major, minor = (int(x) for x in str(torch.version.cuda).split(".")[:2])
    except (TypeError, ValueError):
        return
    if (major, minor) >= (12, 6):
        os.environ["TEARDOWN_CUPTI"] = "1"


def _start(step: int) -> None:
    torch = _state["torch"]
    memwatch.ours_from(step)  # the profiler's buffers grow the process: not the job's memory
    # torch is imported here only once the job has imported it: the shim never imports it first
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
        _teardown_cupti_after(torch)
    # with_stack records every Python call: most of a launch-bound step's profiling cost
    stacks = not _state["lite"]
    # with_flops: torch counts the FLOPs of matmuls and convolutions from their sizes (no
    # record_shapes: the sizes are kept for those ops only); summed per op at the stop
    prof = profile(activities=activities, with_stack=stacks, record_shapes=False, with_flops=True)
    t0 = time.time_ns()
    # kineto prints "USDT: ... profiler_start/stop" on the job's stderr at its highest log level;
    # it reads the level once, at its first start: quiet it there unless the job chose a level
    quiet = "KINETO_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        prof.start()
    finally:
        if quiet:
            os.environ.pop("KINETO_LOG_LEVEL", None)
    start_s = (time.time_ns() - t0) / 1e9
    median = statistics.median(_state["durations"]) if _state["durations"] else None
    _state.update(
        profiler=prof,
        first=step,
        start_s=start_s,
        excess_s=0.0,
        profiled=[],
        median_s=median,
        budget_s=_budget_s(median),
    )
    trigger = _state["trigger"]
    emit(
        schema.TORCH_PROFILE_START,
        step=step,
        start_s=start_s,
        activities=[a.name for a in activities],
        median_step_s=median,
        budget_s=_state["budget_s"],
        max_bytes=MAX_BYTES,
        stacks=stacks,
        trigger=trigger[0] if trigger else None,
        trigger_reason=trigger[1] if trigger else None,
        **_math_settings(torch),
    )


def _spent_s() -> float:
    return _state["start_s"] + _state["excess_s"]


def _stop(last_step: int, reason: str) -> None:
    """Stop the profiler; export its trace only within the time and byte budget."""
    prof = _state["profiler"]
    _state["profiler"] = None
    _state["done"] = True
    memwatch.ours_until(last_step + 1)  # the export frees (or keeps) them in the step after
    budget = _state["budget_s"] or MIN_BUDGET_S
    t0 = time.time_ns()
    prof.stop()
    t1 = time.time_ns()
    stop_s = (t1 - t0) / 1e9
    path, size, stood_down, raw_bytes = None, None, None, None
    if _spent_s() + stop_s > budget:
        stood_down = (
            f"the window had cost {_spent_s() + stop_s:.2f} s by its stop, over its "
            f"budget of {budget:.2f} s: trace not written"
        )
    else:
        path, size, raw_bytes, stood_down = _export(prof, budget - _spent_s() - stop_s)
    t2 = time.time_ns()
    export_s = (t2 - t1) / 1e9
    flops = _flop_counts(prof, budget - _spent_s() - stop_s - export_s) if path else None
    flops_s = (time.time_ns() - t2) / 1e9
    emit(
        schema.TORCH_PROFILE,
        first_step=_state["first"],
        last_step=last_step,
        path=path,
        stop_s=stop_s,
        export_s=export_s,
        start_s=_state["start_s"],
        excess_s=_state["excess_s"],
        cost_s=_spent_s() + stop_s + export_s,
        budget_s=budget,
        median_step_s=_state["median_s"],
        bytes=size,
        raw_bytes=raw_bytes,
        max_bytes=MAX_BYTES,
        profiled_steps_s=list(_state["profiled"]),
        ended_by=reason,
        stood_down=stood_down,
        trigger=_state["trigger"][0] if _state["trigger"] else None,
        stacks=not _state["lite"],
        flops=flops,
        flops_s=flops_s,
    )
    _state["after"] = {"step": last_step + 1, "cost_s": _spent_s() + stop_s + export_s}
    if (
        stood_down
        and _state["trigger"] is None
        and not _state["lite"]
        and (reason == "window end" or reason.startswith("budget"))
    ):
        _retry_without_stacks(last_step)


FLOP_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_mm",
    "aten::conv1d",
    "aten::conv2d",
    "aten::conv3d",
    "aten::convolution",
)


def _flop_counts(prof: Any, time_left_s: float) -> dict[str, float] | None:
    """{op: FLOPs} torch.profiler counted in the window (matmuls and convolutions, each op's own
    count: an op nested in another counted op is not counted twice); None when reading the events
    would pass the window's time budget (their number times a measured ~2 µs each) or fails."""
    try:
        if time_left_s <= 0:
            return None
        t0 = time.perf_counter()
        counts: dict[str, float] = {}
        open_until: dict[Any, int] = {}  # thread -> end (µs) of the counted op it is inside
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            flops = getattr(e, "flops", 0) or 0
            if not flops or e.name not in FLOP_OPS:
                continue
            if e.time_range.start < open_until.get(e.thread, -1):
                continue  # inside a counted op (conv2d -> convolution)
            open_until[e.thread] = e.time_range.end
            counts[e.name] = counts.get(e.name, 0.0) + float(flops)
            if time.perf_counter() - t0 > time_left_s:
                return None
        return counts
    except Exception as exc:  # a profiler without FLOP counts: the window stands without them
        report_error("torch.profiler flop counts", exc)
        return None


def _math_settings(torch: Any) -> dict[str, Any]:
    """The settings that pick the kernels' math: float32 matmul precision, TF32 switches, cuDNN
    benchmark mode (read as the window starts)."""
    try:
        return {
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        }
    except Exception:
        return {}


def _retry_without_stacks(last_step: int) -> None:
    """A window that stood down for its cost left the job with no kernel-level evidence, and the
    jobs it stands down on are mostly launch-bound ones (thousands of small ops a step), where
    the Python stacks are most of the cost (H200, a 140 ms step of tiny kernels: 1.7 s with
    stacks against a 1 s budget). One step more, without stacks, once, after the step that
    follows the window (it carries the stop's after-effects)."""
    _state.update(window=(last_step + 2, last_step + 2), done=False, lite=True)


def _export(prof: Any, time_left_s: float) -> tuple[str | None, int | None, int, str | None]:
    """(path, bytes, raw bytes, why it stood down): kineto writes the JSON (C++), then it is
    gzipped in chunks, abandoned as soon as it passes the byte limit or the time left."""
    final = _trace_path()
    tmp = final[: -len(".json.gz")] + ".raw.json"
    start = time.perf_counter()
    try:
        prof.export_chrome_trace(tmp)  # a .json path: kineto's own writer, no Python JSON
        raw = os.path.getsize(tmp)
        if raw > MAX_RAW_RATIO * MAX_BYTES:
            return (
                None,
                None,
                raw,
                (
                    f"the trace holds {raw / 1e6:.0f} MB of JSON: it cannot "
                    f"compress under {MAX_BYTES / 1e6:.0f} MB: not written"
                ),
            )
        why = _bounded_gzip(tmp, final, MAX_BYTES, start + time_left_s)
        if why:
            return None, None, raw, why
        return final, os.path.getsize(final), raw, None
    finally:
        try:
            os.remove(tmp)
        except OSError:
            pass


def _bounded_gzip(src: str, dst: str, max_bytes: int, deadline: float) -> str | None:
    with open(src, "rb") as fin, open(dst, "wb") as raw:
        gz = gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=6)
        why = None
        while True:
            chunk = fin.read(1 << 20)
            if not chunk:
                break
            gz.write(chunk)
            if raw.tell() > max_bytes:
                why = f"the compressed trace passed {max_bytes / 1e6:.0f} MB: not written"
            elif time.perf_counter() > deadline:
                why = "compressing the trace would pass the window's time budget: not written"
            if why:
                break
        gz.close()
    if why:
        os.remove(dst)
    return why


def _anomaly(step: int, last_s: float | None) -> tuple[str, str] | None:
    """(kind, why) when the step that just ended (or diagnose, through control/capture.json)
    calls for a deep capture of the next step and that kind has not been captured yet."""
    if _state["torch"] is None or not _state["torch"].cuda.is_initialized() or "*" in _state["captured"]:
        return None  # CPU jobs: py-spy's burst of snapshots is their deep capture
    durations = _state["durations"]
    if (
        last_s is not None
        and step - 1 >= 1
        and len(durations) >= ANOMALY_MIN_STEPS
        and "slow_step" not in _state["captured"]
    ):
        median = statistics.median(durations)
        if median > 0 and last_s >= ANOMALY_FACTOR * median:
            return (
                "slow_step",
                f"step {step - 1} took {last_s:.3g} s, {last_s / median:.1f}x the median {median:.3g} s",
            )
    request = control.read("capture.json")
    if request and request.get("t_ns") != _state["capture_t"]:
        _state["capture_t"] = request.get("t_ns")
        kind = str(request.get("kind") or "diagnose")[:40]
        if kind not in _state["captured"]:
            return (kind, str(request.get("reason") or "")[:200])
    return None


def _compiled_since_last_boundary() -> bool:
    seen, now = _state["compiles_seen"], compiles.counts["compiles"]
    _state["compiles_seen"] = now
    return now > seen


def on_boundary(step: int) -> bool:
    """Called as `step` begins (so the previous one has just ended). True when a window ran,
    started or stopped here (on purpose: its cost is stated once, not per step)."""
    now = time.time_ns()
    previous = _state["last_boundary_ns"]
    last_s = (now - previous) / 1e9 if previous is not None else None
    was = _state["profiler"] is not None
    try:
        _boundary(step, now, previous, last_s)
    finally:
        # the next step starts after this hook: what it cost (a stop, an export) is in no step
        _state["last_boundary_ns"] = time.time_ns()
    return was or _state["profiler"] is not None


def _emit_after(step: int, last_s: float, after: dict[str, Any]) -> None:
    """The step after a window: its duration against the median (the window's tail cost)."""
    _state["after"] = None
    median = _state["median_s"]
    emit(
        schema.TORCH_PROFILE_AFTER,
        step=step - 1,
        duration_s=last_s,
        median_step_s=median,
        excess_s=max(0.0, last_s - median) if median else None,
        window_cost_s=after["cost_s"] + (max(0.0, last_s - median) if median else 0.0),
    )


def _skip_reason(now: int, previous: int | None) -> str | None:
    """Why the window's first step is not profiled at all, or None."""
    if _state["torch"]._C._autograd._profiler_enabled():
        return "the job runs a profiler of its own (kineto runs one at a time)"
    if not _state["explicit"] and not _state["torch"].cuda.is_initialized():
        return (
            "no CUDA in this job: the default window is for GPU jobs (on a CPU job its "
            "export can stall a step for seconds); pass --torch-profile A-B to "
            "profile anyway"
        )
    if not _state["explicit"] and any(a in JOB_PROFILER_FLAGS for a in sys.argv):
        return "the job was asked to profile itself (its own flag)"
    if not _state["explicit"] and previous is not None and (now - previous) / 1e9 > LONG_STEP_S:
        return (
            f"the previous step took {(now - previous) / 1e9:.1f} s "
            f"(> {LONG_STEP_S:.0f} s); pass --torch-profile A-B to profile anyway"
        )
    return None


def _skipped_for_compiles(step: int, first: int, last: int) -> bool:
    """The window's first step comes after compiles: an anomaly's capture is skipped, the
    default window moves on a step (at most MAX_POSTPONE times, then none). True: not now."""
    if _state["trigger"]:
        _state["done"] = True
        emit(
            schema.TORCH_PROFILE_SKIPPED,
            step=step,
            trigger=_state["trigger"][0],
            reason=(
                "the step before compiled or autotuned kernels: the JIT findings and py-spy's "
                "snapshots cover it (a profiled compile would cost seconds)"
            ),
        )
        return True
    if _state["explicit"]:
        return False
    # a step that compiles or autotunes is not a steady step, and a Triton autotune
    # launches thousands of benchmark kernels: kineto's stop alone would cost seconds
    # (measured on an H200: 5.3 median steps). Profile a later step, or none.
    if _state["postponed"] < MAX_POSTPONE:
        _state["postponed"] += 1
        _state["window"] = (first + 1, last + 1)
        return True
    _state["done"] = True
    emit(
        schema.TORCH_PROFILE_SKIPPED,
        step=step,
        reason=(
            f"kernels compiled or autotuned in each of the {MAX_POSTPONE + 1} steps before "
            f"step {step}: no steady step to profile (the JIT findings cover what they "
            "cost); pass --torch-profile A-B to profile anyway"
        ),
    )
    return True


def _boundary(step: int, now: int, previous: int | None, last_s: float | None) -> None:
    after = _state["after"]
    if after is not None and last_s is not None and step - 1 == after["step"]:
        _emit_after(step, last_s, after)
    window = _state["window"]
    counted = False
    if window is None or _state["done"]:
        if _state["profiler"] is not None:
            return
        trigger = _anomaly(step, last_s)
        if last_s is not None and step - 1 >= 1:
            _state["durations"].append(last_s)  # step 0 is warm-up: not the median's
        if trigger is None:
            return
        # deep capture: this step, profiled with the default window's rules and budget
        _state.update(window=(step, step), done=False, trigger=trigger)
        _state["captured"].add(trigger[0])
        window, counted = _state["window"], True
    first, last = window
    if _state["profiler"] is not None:
        if last_s is not None:
            _state["profiled"].append(round(last_s, 6))
            if _state["median_s"]:
                _state["excess_s"] += max(0.0, last_s - _state["median_s"])
        if step > last:
            _stop(step - 1, "window end")
        elif _spent_s() + FINISH_FACTOR * _state["excess_s"] > (_state["budget_s"] or 0):
            _stop(
                step - 1,
                f"budget: {_spent_s():.2f} s spent, stop and export projected "
                f"{FINISH_FACTOR * _state['excess_s']:.2f} s, budget "
                f"{_state['budget_s']:.2f} s",
            )
        return
    if last_s is not None and step - 1 >= 1 and not counted:
        _state["durations"].append(last_s)
    compiled = _compiled_since_last_boundary()
    if step == first:
        if steps.MAX_STEPS and step >= steps.MAX_STEPS:
            return  # `diagnose --steps N` stops the job before this step runs
        reason = _skip_reason(now, previous)
        if reason:
            _state["done"] = True
            emit(schema.TORCH_PROFILE_SKIPPED, step=step, reason=reason)
            return
        if compiled and _skipped_for_compiles(step, first, last):
            return
        _start(step)


def _at_exit() -> None:
    if _state["profiler"] is not None:
        try:
            _stop(steps.current_step(), "job exit")
            w = get_writer()
            if w is not None:
                w.flush()
        except Exception as exc:
            report_error("torch.profiler export at exit", exc)


def _yield_to_the_job(torch: Any) -> None:
    """Kineto runs one profiler at a time: when the job starts its own while the window is open,
    close the window first (its trace is written) so the job's profiler works as it would."""
    profile = torch.autograd.profiler.profile
    original = profile._prepare_trace

    def _prepare_trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        ours = _state["profiler"]
        if ours is not None and getattr(ours, "profiler", None) is not self:
            try:
                _stop(steps.current_step(), "the job started its own profiler")
            except Exception as exc:
                report_error("closing the torch.profiler window for the job's own", exc)
        return original(self, *args, **kwargs)

    profile._prepare_trace = _prepare_trace


def _on_torch(torch: Any) -> None:
    _state["torch"] = torch
    steps.boundary_hooks.append(on_boundary)
    atexit.register(_at_exit)
    try:
        _yield_to_the_job(torch)
    except Exception as exc:  # no such method in this torch: the window still works
        report_error("torch.profiler yield hook", exc)


def register() -> None:
    raw = os.environ.get("TRAINDX_TORCH_PROFILE")
    try:
        _state["window"] = parse_window(raw)
    except ValueError as exc:
        report_error("TRAINDX_TORCH_PROFILE", exc)
        return
    mode = (raw or "").strip().lower()
    _state["explicit"] = bool(mode and mode not in ("", "default", ANOMALY_ONLY))
    if _state["window"] is None and mode != ANOMALY_ONLY:
        _state["done"] = True
        _state["captured"].add("*")  # off: no window at all, not even on an anomaly
    if _state["window"] is not None or mode == ANOMALY_ONLY:
        importhooks.on_import("torch", _on_torch)
