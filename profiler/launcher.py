"""Runs a training command unchanged while the collectors record it into a run folder.

The job runs in its own process group so SIGINT/SIGTERM can be forwarded to all of it
(torchrun workers included); its output is passed through live and kept, timestamped, in
log.txt. Collectors are started and stopped around it; none of their failures reach the job.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from . import manifest as manifest_mod
from .nvml import NvmlSampler, gpu_inventory
from .pyspy import PySpyManager
from . import rolling
from .shim._traindx_shim.segments import SEGMENT_BYTES_ENV
from .shim._traindx_shim.roles import announced_ranks

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")


class CommandNotFound(Exception):
    pass


def resolve_command(command):
    exe = command[0]
    if os.sep in exe:
        if not os.path.exists(exe):
            raise CommandNotFound(f"command not found: {exe}")
        if not os.access(exe, os.X_OK):
            raise CommandNotFound(f"not executable: {exe}")
    elif shutil.which(exe) is None:
        raise CommandNotFound(f"command not found: {exe}")


def new_run_dir(root):
    stamp = time.strftime("%Y%m%d-%H%M%S")
    os.makedirs(root, exist_ok=True)
    for i in range(1000):
        path = os.path.join(root, stamp if i == 0 else f"{stamp}-{i}")
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise RuntimeError("could not create a run folder")


def write_json_atomic(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


class Options:
    def __init__(self, steps=0, pyspy=True, shim=True, nvml=True, pyspy_rate_hz=20,
                 dump_interval_s=2.0, nvml_interval_s=0.5, extra_env=None, torch_profile=None,
                 step_marker=None, log_regex=None, disk_budget_mb=2048, window_s=600.0,
                 keep_windows=3):
        self.steps = steps
        self.pyspy = pyspy
        self.shim = shim
        self.nvml = nvml
        self.pyspy_rate_hz = pyspy_rate_hz
        self.dump_interval_s = dump_interval_s
        self.nvml_interval_s = nvml_interval_s
        self.extra_env = extra_env or {}
        self.torch_profile = torch_profile  # None: the shim's default window; "off"; "N"; "A-B"
        self.step_marker = step_marker  # "module:function" whose calls end steps, or None
        self.log_regex = log_regex  # the job's own step/loss line (kept in the manifest for re-analysis)
        # long runs (docs/long-runs.md): evidence per training process stays under this many MB
        self.disk_budget_mb = disk_budget_mb
        self.window_s = window_s  # py-spy windows (0: one recording for the whole job)
        self.keep_windows = keep_windows  # the last windows/segments kept whole

    def budget(self):
        return rolling.Budget(rank_bytes=int(self.disk_budget_mb * rolling.MB),
                              window_s=self.window_s, keep=self.keep_windows)

    def as_dict(self):
        return dict(vars(self))


def job_environment(run_dir, options, base=None):
    env = dict(os.environ if base is None else base)
    env.update(options.extra_env)
    env["PYTHONUNBUFFERED"] = "1"  # the job's output is a pipe now; keep it live
    if options.shim:
        env["PYTHONPATH"] = SHIM_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["TRAINDX_RUN_DIR"] = os.path.abspath(run_dir)
        if options.steps:
            env["TRAINDX_MAX_STEPS"] = str(options.steps)
        if options.torch_profile is not None:
            env["TRAINDX_TORCH_PROFILE"] = str(options.torch_profile)
        if options.step_marker:
            env["TRAINDX_STEP_MARKER"] = options.step_marker
        env[SEGMENT_BYTES_ENV] = str(options.budget().segment_bytes(rolling.EVENTS_SHARE))
    return env


class Job:
    """One run of the command: start, pass output through, forward signals, collect, finish."""

    def __init__(self, command, run_dir, options, on_line=None):
        self.command = list(command)
        self.run_dir = run_dir
        self.options = options
        self.on_line = on_line or (lambda stream, text: None)
        self.proc = None
        self.missing = {}
        self.signals = []
        self._log_lock = threading.Lock()

    # -- output ------------------------------------------------------------------------------
    def _pump(self, pipe, tag, sink, log):
        for raw in iter(pipe.readline, b""):
            t = time.time_ns()
            text = raw.decode(errors="replace").rstrip("\n")
            with self._log_lock:
                log.write(f"{t} {tag} {text}\n")
                log.flush()
            try:
                self.on_line(tag, text)
            except Exception:
                sink.write(text + "\n")
                sink.flush()
        pipe.close()

    # -- signals -----------------------------------------------------------------------------
    def _forward(self, signum, frame):
        self.signals.append(signal.Signals(signum).name)
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def run(self):
        resolve_command(self.command)
        os.makedirs(os.path.join(self.run_dir, "events"), exist_ok=True)
        env = job_environment(self.run_dir, self.options)
        manifest = {
            "traindx_run": 1,
            "command": manifest_mod.redact_command(self.command), "cwd": os.getcwd(), "start_ns": time.time_ns(),
            "end_ns": None, "exit_code": None, "host": manifest_mod.host_info(),
            "gpus": [], "packages": manifest_mod.package_versions(),
            "env": manifest_mod.redact_env(env), "options": manifest_mod.redact_options(self.options.as_dict()),
            "ranks": {}, "missing": self.missing, "status": "running",
        }
        manifest["options"]["extra_env"] = manifest_mod.redact_env(self.options.extra_env)
        manifest_path = os.path.join(self.run_dir, "manifest.json")
        try:
            manifest["gpus"] = gpu_inventory()
        except Exception as exc:
            self.missing["gpus"] = f"no GPU inventory: {type(exc).__name__}: {exc}"
        write_json_atomic(manifest_path, manifest)

        nvml = NvmlSampler(os.path.join(self.run_dir, "nvml.csv"), self.options.nvml_interval_s,
                           env=env)
        if self.options.nvml and not nvml.start():
            self.missing["nvml"] = nvml.error
        if nvml.selection is not None:  # which GPUs nvml.csv holds, and why those
            manifest["nvml"] = nvml.selection
        elif not self.options.nvml:
            self.missing["nvml"] = "disabled (--no-nvml)"

        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        for s in previous:
            signal.signal(s, self._forward)
        budget = self.options.budget()
        manifest["budget"] = budget.as_dict()
        # the job's output streams to disk in segments: nothing per line stays in memory
        log = rolling.RollingLines(os.path.join(self.run_dir, "log.txt"),
                                   budget.segment_bytes(rolling.LOG_SHARE))
        pyspy = PySpyManager(os.path.join(self.run_dir, "pyspy"), self.options.pyspy_rate_hz,
                             self.options.dump_interval_s, budget=budget)
        roller = rolling.Roller(self.run_dir, budget, self.options.log_regex)
        roller.start()
        try:
            self.proc = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
            pumps = [threading.Thread(target=self._pump, args=(self.proc.stdout, "o", sys.stdout, log), daemon=True),
                     threading.Thread(target=self._pump, args=(self.proc.stderr, "e", sys.stderr, log), daemon=True)]
            for p in pumps:
                p.start()
            if self.options.pyspy:
                if not pyspy.start(self.proc.pid, self.run_dir if self.options.shim else None):
                    self.missing["pyspy"] = pyspy.error
            else:
                self.missing["pyspy"] = "disabled (--no-pyspy)"
            if not self.options.shim:
                self.missing["shim"] = "disabled (--no-shim)"
            returncode = self._wait()
            for p in pumps:
                p.join(timeout=10)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            nvml.stop()
            pyspy.stop()
            log.close()
            roller.stop()
            if roller.errors:
                self.missing["rolling"] = "; ".join(roller.errors)[:1000]
            rolled = rolling.rolled_summaries(self.run_dir)
            if rolled:  # what a long run thinned or dropped to stay in its budget
                manifest["rolled"] = rolled
            errors = pyspy.errors()
            if errors and "pyspy" not in self.missing:
                self.missing["pyspy"] = "; ".join(dict.fromkeys(errors))[:1000]
            # {rank label: pid} of the training processes (the shim's announcements, or py-spy's
            # view of the process tree without the shim); the run loader maps files by the same rule
            manifest["ranks"] = (announced_ranks(self.run_dir) if self.options.shim
                                 else pyspy.rank_labels())
            manifest["end_ns"] = time.time_ns()
            code = None if self.proc is None else self.proc.returncode
            manifest["exit_code"] = code
            manifest["signals_forwarded"] = self.signals
            manifest["status"] = "finished" if code is not None else "failed to start"
            if self.options.shim and not os.listdir(os.path.join(self.run_dir, "events")):
                self.missing.setdefault("shim", "no events: the job never ran Python with the "
                                        "shim (python -I/-E/-S, or not a Python job)")
            write_json_atomic(manifest_path, manifest)
        return returncode

    def _wait(self):
        while True:
            try:
                return self.proc.wait()
            except KeyboardInterrupt:  # already forwarded by the handler; keep waiting
                continue


def exit_status(returncode):
    """The shell's convention: a job killed by signal N exits 128+N."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode
