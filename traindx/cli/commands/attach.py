"""Record a job that is already running, with py-spy only (no shim, no restart).

usage: diagnose attach --pid PID [--duration S]
"""

import os
import signal
import time

from traindx.cli import argtypes
from traindx.common.errors import UserError


def prepare_parser(parser):
    parser.add_argument("--pid", type=argtypes.pid, required=True, help="the training process to sample")
    parser.add_argument(
        "--duration",
        type=argtypes.positive,
        default=30.0,
        metavar="S",
        help="seconds to sample (default 30; stops early if the job ends)",
    )
    parser.add_argument(
        "--rank", type=argtypes.name, default=None, help="rank label (default: RANK of the process, or 0)"
    )
    parser.add_argument("--out", type=argtypes.output_folder, default=argtypes.DEFAULT_RUNS, metavar="DIR")
    parser.add_argument("--pyspy-rate", type=argtypes.pyspy_rate, default=20, metavar="HZ")
    parser.add_argument("--dump-interval", type=argtypes.non_negative, default=2.0, metavar="S")


def run(args, parser):
    from traindx.cli.outputs import analyze_and_write
    from traindx.derive.run import load_run
    from traindx.profiler import manifest as manifest_mod
    from traindx.profiler import proctree
    from traindx.profiler.launcher import new_run_dir, write_json_atomic
    from traindx.profiler.pyspy import PySpyManager
    from traindx.report.terminal import print_summary

    if not os.path.exists(f"/proc/{args.pid}"):
        raise UserError(f"no process with pid {args.pid}")
    if not proctree.is_python(args.pid):
        raise UserError(f"process {args.pid} is not a Python process")
    env = proctree.environ(args.pid)
    rank = args.rank or env.get("RANK", "0")
    run_dir = new_run_dir(args.out)
    manifest = {
        "traindx_run": 1,
        "mode": "attach",
        "command": manifest_mod.redact_command(proctree.cmdline(args.pid)),
        "cwd": _cwd(args.pid),
        "pid": args.pid,
        "start_ns": time.time_ns(),
        "end_ns": None,
        "exit_code": None,
        "host": manifest_mod.host_info(),
        "gpus": [],
        "packages": manifest_mod.package_versions(),
        "env": manifest_mod.redact_env(env),
        "ranks": {rank: args.pid},
        "options": {"duration_s": args.duration, "pyspy_rate_hz": args.pyspy_rate},
        "missing": {"shim": "attach mode: py-spy evidence only"},
        "status": "attached",
    }
    write_json_atomic(os.path.join(run_dir, "manifest.json"), manifest)
    pyspy = PySpyManager(os.path.join(run_dir, "pyspy"), args.pyspy_rate, args.dump_interval)
    if not pyspy.attach(args.pid, rank):
        raise UserError(pyspy.error)
    deadline = time.time() + args.duration
    try:
        while time.time() < deadline and os.path.exists(f"/proc/{args.pid}"):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    for sampler in pyspy.samplers.values():  # py-spy writes its file on SIGINT
        for _, proc, _ in sampler.recorders:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
    pyspy.stop()
    manifest["end_ns"] = time.time_ns()
    manifest["status"] = "finished"
    if pyspy.errors():
        manifest["missing"]["pyspy"] = "; ".join(pyspy.errors())[:1000]
    write_json_atomic(os.path.join(run_dir, "manifest.json"), manifest)
    record = load_run(run_dir)
    findings, report_path = analyze_and_write(record)
    print_summary(record, findings, report_path)
    return 0


def _cwd(pid):
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
