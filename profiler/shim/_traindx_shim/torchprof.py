"""A short torch.profiler window, driven from the step boundaries: host-device syncs, time in the
DataLoader, kernel gaps, collectives. Written per rank as `trace/<rank>.json.gz` (Perfetto and
chrome://tracing open it as is).

TRAINDX_TORCH_PROFILE: unset = the default window; "off" = none; "N" = N steps from step
DEFAULT_START; "A-B" = steps A to B. The default window stands down when steps are long
(with_stack traces every Python call; a long step is usually a Python-heavy one, such as a JIT
compile, where the trace would cost seconds and grow to gigabytes); an explicit window does not.
TRAINDX_TORCH_PROFILE_MAX_STEP_S sets that limit (default 5 s).
"""
import atexit
import os
import sys
import time

from . import emit, get_writer, importhooks, report_error
from . import steps

# a job that profiles itself keeps its profiler: kineto runs one at a time
JOB_PROFILER_FLAGS = ("--profile", "--use-pytorch-profiler", "--torch-profile", "--profiler")
DEFAULT_START = 3
DEFAULT_STEPS = 2
LONG_STEP_S = float(os.environ.get("TRAINDX_TORCH_PROFILE_MAX_STEP_S") or 5.0)
_state = {"window": None, "explicit": False, "profiler": None, "first": None, "torch": None,
          "last_boundary_ns": None, "done": False}


def parse_window(text):
    """(first, last) steps, None for off; raises ValueError for what it cannot read."""
    text = (text or "").strip().lower()
    if text in ("", "default"):
        return DEFAULT_START, DEFAULT_START + DEFAULT_STEPS - 1
    if text in ("off", "0", "none", "no"):
        return None
    if "-" in text:
        first, _, last = text.partition("-")
        first, last = int(first), int(last)
    else:
        first = DEFAULT_START
        last = first + int(text) - 1
    if first < 0 or last < first:
        raise ValueError(f"bad step window {text!r}")
    return first, last


def _trace_path():
    run_dir = os.environ["TRAINDX_RUN_DIR"]
    w = get_writer()
    rank = w.rank if w is not None else os.environ.get("RANK", "0")
    folder = os.path.join(run_dir, "trace")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{rank}.json.gz")


def _start(step):
    torch = _state["torch"]
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, with_stack=True, record_shapes=False)
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
    _state.update(profiler=prof, first=step)
    emit("torch_profile_start", step=step, start_s=(time.time_ns() - t0) / 1e9,
         activities=[a.name for a in activities])


def _stop(last_step, reason):
    prof = _state["profiler"]
    _state["profiler"] = None
    _state["done"] = True
    t0 = time.time_ns()
    prof.stop()
    t1 = time.time_ns()
    path = _trace_path()
    prof.export_chrome_trace(path)
    t2 = time.time_ns()
    emit("torch_profile", first_step=_state["first"], last_step=last_step, path=path,
         stop_s=(t1 - t0) / 1e9, export_s=(t2 - t1) / 1e9, bytes=os.path.getsize(path),
         ended_by=reason)


def on_boundary(step):
    """Called as `step` begins (so the previous one has just ended)."""
    now = time.time_ns()
    previous = _state["last_boundary_ns"]
    _state["last_boundary_ns"] = now
    window = _state["window"]
    if window is None or _state["done"]:
        return
    first, last = window
    if _state["profiler"] is not None:
        if step > last:
            _stop(step - 1, "window end")
        return
    if step == first:
        if steps.MAX_STEPS and step >= steps.MAX_STEPS:
            return  # `diagnose --steps N` stops the job before this step runs
        reason = None
        if _state["torch"]._C._autograd._profiler_enabled():
            reason = "the job runs a profiler of its own (kineto runs one at a time)"
        elif not _state["explicit"] and not _state["torch"].cuda.is_initialized():
            reason = ("no CUDA in this job: the default window is for GPU jobs (on a CPU job its "
                      "export can stall a step for seconds); pass --torch-profile A-B to "
                      "profile anyway")
        elif not _state["explicit"] and any(a in JOB_PROFILER_FLAGS for a in sys.argv):
            reason = "the job was asked to profile itself (its own flag)"
        elif (not _state["explicit"] and previous is not None
              and (now - previous) / 1e9 > LONG_STEP_S):
            reason = (f"the previous step took {(now - previous) / 1e9:.1f} s "
                      f"(> {LONG_STEP_S:.0f} s); pass --torch-profile A-B to profile anyway")
        if reason:
            _state["done"] = True
            emit("torch_profile_skipped", step=step, reason=reason)
            return
        _start(step)


def _at_exit():
    if _state["profiler"] is not None:
        try:
            _stop(steps.current_step(), "job exit")
            w = get_writer()
            if w is not None:
                w.flush()
        except Exception as exc:
            report_error("torch.profiler export at exit", exc)


def _yield_to_the_job(torch):
    """Kineto runs one profiler at a time: when the job starts its own while the window is open,
    close the window first (its trace is written) so the job's profiler works as it would."""
    profile = torch.autograd.profiler.profile
    original = profile._prepare_trace

    def _prepare_trace(self, *args, **kwargs):
        ours = _state["profiler"]
        if ours is not None and getattr(ours, "profiler", None) is not self:
            try:
                _stop(steps.current_step(), "the job started its own profiler")
            except Exception as exc:
                report_error("closing the torch.profiler window for the job's own", exc)
        return original(self, *args, **kwargs)

    profile._prepare_trace = _prepare_trace


def _on_torch(torch):
    _state["torch"] = torch
    steps.boundary_hooks.append(on_boundary)
    atexit.register(_at_exit)
    try:
        _yield_to_the_job(torch)
    except Exception as exc:  # no such method in this torch: the window still works
        report_error("torch.profiler yield hook", exc)


def register():
    raw = os.environ.get("TRAINDX_TORCH_PROFILE")
    try:
        _state["window"] = parse_window(raw)
    except ValueError as exc:
        report_error("TRAINDX_TORCH_PROFILE", exc)
        return
    _state["explicit"] = bool(raw and raw.strip().lower() not in ("", "default"))
    if _state["window"] is not None:
        importhooks.on_import("torch", _on_torch)
