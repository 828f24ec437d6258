"""How much CPU the training process got, and how busy the machine was, per step.

One `cpu` event at each step end (the training thread), with the deltas since the previous one:
  proc_cpu_s    CPU seconds of this process, all its threads (time.process_time)
  thread_cpu_s  CPU seconds of the training thread itself (time.thread_time)
  sys_idle_s    core-seconds the whole machine was idle (/proc/stat idle + iowait), Linux only
  sys_total_s   core-seconds the machine had (/proc/stat, all states)
  running       runnable tasks on the machine at the step end (/proc/loadavg; the training
                thread that reads it is one of them)
  cores         cores this process may run on (sched_getaffinity), once, on the first event
The DataLoader's own CPU seconds ride on its `data` span (spans.py). Together they say how many
cores were really free to the job (a prediction that adds worker processes needs that); a
read of /proc/stat is ~30 µs, so one per step costs nothing a step would notice.
"""
import os
import threading
import time

from . import emit

_TICK = [None]
_prev = {}
_cores_sent = [False]


def _proc_stat():
    """(idle core-seconds, total core-seconds since boot, runnable tasks now), or None off
    Linux. Only the first line of /proc/stat is read (on a many-core host the file is long:
    a line per core and the interrupt counts), the runnable count from /proc/loadavg."""
    try:
        if _TICK[0] is None:
            _TICK[0] = float(os.sysconf("SC_CLK_TCK"))
        with open("/proc/stat", "rb") as f:
            first = f.readline().decode("ascii", "replace")
        with open("/proc/loadavg", "rb") as f:
            load = f.read(256).decode("ascii", "replace").split()
    except (OSError, ValueError):
        return None
    if not first.startswith("cpu "):
        return None
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    ticks = [int(v) for v in first.split()[1:9]]
    running = int(load[3].split("/")[0]) if len(load) > 3 and "/" in load[3] else None
    return (ticks[3] + ticks[4]) / _TICK[0], sum(ticks) / _TICK[0], running


def _snapshot():
    return {"proc": time.process_time(), "thread": time.thread_time(),
            "tid": threading.get_ident(), "stat": _proc_stat()}


def emit_step(step):
    """The CPU evidence of the step that just ended; the first call only takes the snapshot the
    next one is measured from (so a step's deltas never include start-up)."""
    now = _snapshot()
    prev = dict(_prev)
    _prev.clear()
    _prev.update(now)
    if not prev:
        return
    fields = {"proc_cpu_s": now["proc"] - prev["proc"]}
    if now["tid"] == prev["tid"]:  # a retro step begin may be taken on another thread
        fields["thread_cpu_s"] = now["thread"] - prev["thread"]
    if now["stat"] and prev["stat"]:
        fields.update(sys_idle_s=now["stat"][0] - prev["stat"][0],
                      sys_total_s=now["stat"][1] - prev["stat"][1], running=now["stat"][2])
    if not _cores_sent[0]:
        _cores_sent[0] = True
        try:
            fields["cores"] = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            fields["cores"] = os.cpu_count()
    emit("cpu", step=step, **fields)
