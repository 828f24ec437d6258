"""`diagnose attach`: record a job that is already running, with py-spy only (no shim, no
restart), then analyse and report it like a recorded run.

The collectors and the analyzers (pandas) are imported where they are used: `diagnose attach
--help` needs none of them."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from traindx.common.atomic import write_json
from traindx.common.errors import UserError


@dataclass(frozen=True)
class AttachOptions:
    pid: int
    duration_s: float = 30.0  # stops early if the job ends
    rank: str | None = None  # default: RANK of the process, or 0
    out: str = "runs"
    pyspy_rate_hz: int = 20
    dump_interval_s: float = 2.0


def _cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _write_manifest(run_dir: str, manifest: dict[str, Any]) -> None:
    write_json(os.path.join(run_dir, "manifest.json"), manifest, indent=2, default=str)


def attach(options: AttachOptions) -> int:
    from traindx.derive.run import load_run
    from traindx.profiler import manifest as manifest_mod
    from traindx.profiler import proctree
    from traindx.profiler.launcher import new_run_dir
    from traindx.profiler.pyspy import PySpyManager
    from traindx.report.outputs import analyze_and_write
    from traindx.report.terminal import print_summary

    pid = options.pid
    if not os.path.exists(f"/proc/{pid}"):
        raise UserError(f"no process with pid {pid}")
    if not proctree.is_python(pid):
        raise UserError(f"process {pid} is not a Python process")
    env = proctree.environ(pid)
    rank = options.rank or env.get("RANK", "0")
    run_dir = new_run_dir(options.out)
    manifest: dict[str, Any] = {
        "traindx_run": 1,
        "mode": "attach",
        "command": manifest_mod.redact_command(proctree.cmdline(pid)),
        "cwd": _cwd(pid),
        "pid": pid,
        "start_ns": time.time_ns(),
        "end_ns": None,
        "exit_code": None,
        "host": manifest_mod.host_info(),
        "gpus": [],
        "packages": manifest_mod.package_versions(),
        "env": manifest_mod.redact_env(env),
        "ranks": {rank: pid},
        "options": {"duration_s": options.duration_s, "pyspy_rate_hz": options.pyspy_rate_hz},
        "missing": {"shim": "attach mode: py-spy evidence only"},
        "status": "attached",
    }
    _write_manifest(run_dir, manifest)
    pyspy = PySpyManager(os.path.join(run_dir, "pyspy"), options.pyspy_rate_hz, options.dump_interval_s)
    if not pyspy.attach(pid, rank):
        raise UserError(pyspy.error)
    _sample_until(pid, time.time() + options.duration_s)
    for sampler in pyspy.samplers.values():  # py-spy writes its file on SIGINT
        for _, proc, _ in sampler.recorders:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
    pyspy.stop()
    manifest["end_ns"] = time.time_ns()
    manifest["status"] = "finished"
    if pyspy.errors():
        manifest["missing"]["pyspy"] = "; ".join(pyspy.errors())[:1000]
    _write_manifest(run_dir, manifest)
    record = load_run(run_dir)
    judgement, report_path = analyze_and_write(record)
    print_summary(record, judgement, report_path)
    return 0


def _sample_until(pid: int, deadline: float) -> None:
    """While py-spy samples: until the deadline, the job's end or Ctrl-C."""
    try:
        while time.time() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
