"""Runs a training command unchanged while the collectors record it into a run folder.

The job runs in its own process group so SIGINT/SIGTERM can be forwarded to all of it
(torchrun workers included); its output is passed through live and kept, timestamped, in
log.txt by a relay process of its own (tee.py), so the job never depends on diagnose staying
alive. Collectors are started and stopped around it; none of their failures reach the job.
One recording per run folder (manifest.claim_run_dir). A write that fails (a full disk) is one
line in `not_written`; the job's return code is returned whatever could not be written.
"""

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from traindx.common import redact, stdfds
from traindx.profiler import diskfloor, proctree, rolling
from traindx.profiler import manifest as manifest_mod

# RunDirRefused: raised by Job.run (the CLI catches it from here); write_json_atomic: callers
# import it from here too
from traindx.profiler.manifest import RunDirRefused, write_json_atomic  # noqa: F401
from traindx.profiler.nvml import NvmlSampler, gpu_inventory
from traindx.profiler.pyspy import PySpyManager
from traindx.profiler.shim._traindx_shim.roles import announced_ranks
from traindx.profiler.shim._traindx_shim.segments import SEGMENT_BYTES_ENV
from traindx.profiler.tee import OutputRelay

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")


class CommandNotFound(Exception):
    pass


def resolve_command(command: Sequence[str]) -> None:
    exe = command[0]
    if not exe.strip():
        raise CommandNotFound(f"the command is an empty word ({exe!r}): give the program to run after --")
    if os.sep in exe:
        if not os.path.exists(exe):
            raise CommandNotFound(f"command not found: {exe}")
        if os.path.isdir(exe):
            raise CommandNotFound(f"{exe} is a folder, not a command")
        if not os.access(exe, os.X_OK):
            raise CommandNotFound(f"not executable: {exe}")
    elif shutil.which(exe) is None:
        raise CommandNotFound(f"command not found: {exe}")


def new_run_dir(root: str) -> str:
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


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"


def working_folder() -> str:
    """This process's working folder, also when it was deleted (the job starts there all the
    same, as it would bare): then the path it had, marked so."""
    try:
        return os.getcwd()
    except OSError:
        try:
            return os.readlink("/proc/self/cwd")  # "/old/path (deleted)"
        except OSError:
            return os.environ.get("PWD", "") + " (deleted)"


def inheritable_fds() -> tuple[int, ...]:
    """The descriptors above 2 that a child would inherit now (a caller's `3>file`)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return ()
    found = []
    for name in names:
        fd = int(name) if name.isdigit() else -1
        try:
            if fd > 2 and os.get_inheritable(fd):
                found.append(fd)
        except OSError:
            continue  # the listing's own descriptor, closed since
    return tuple(sorted(found))


# what diagnose's caller handed it beyond stdin/stdout/stderr (a `3>file`, a pipe a wrapper
# reads): the job gets them at the same numbers, as it would bare. Taken at import, before
# anything of ours (a library opening files without close-on-exec) could add to them.
CALLER_FDS = inheritable_fds()


def write_output(stream: str, data: bytes) -> None:
    """The job's bytes onto diagnose's own stdout ("o") or stderr, unchanged."""
    (sys.stdout if stream == "o" else sys.stderr).flush()  # what diagnose printed comes first
    fd = 1 if stream == "o" else 2
    while data:  # a BrokenPipeError goes up: the relay closes the job's end of the pipe
        data = data[os.write(fd, data) :]


class Options:
    def __init__(
        self,
        steps: int = 0,
        pyspy: bool = True,
        shim: bool = True,
        nvml: bool = True,
        pyspy_rate_hz: int = 20,
        dump_interval_s: float = 2.0,
        nvml_interval_s: float = 0.5,
        extra_env: dict[str, str] | None = None,
        torch_profile: str | None = None,
        step_marker: str | None = None,
        log_regex: str | None = None,
        disk_budget_mb: float = 2048,
        window_s: float = 600.0,
        keep_windows: int = 3,
        pyspy_record: bool = True,
        cwd: str | None = None,
        wrap: list[str] | None = None,
        caller_fds: bool = True,
        cost_budget_pct: float | None = None,
    ) -> None:
        self.steps = steps
        # the share of step time the shim may cost before it sheds work (None: its default, 1 %)
        self.cost_budget_pct = cost_budget_pct
        # the caller's extra descriptors (`3>file`) reach the job; not for --fix's arms (one on
        # a user's file would let every arm write there)
        self.caller_fds = caller_fds
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
        # False (--always-on): py-spy only dumps every dump_interval_s, no recorders
        self.pyspy_record = pyspy_record
        self.cwd = cwd  # the job's working directory (None: this process's); --fix's scratch copy
        # argv the command runs under (--fix: traindx.fixing.run.confine's private view; it execs
        # the command, so the job keeps the pid it starts with)
        self.wrap = wrap

    def budget(self, run_dir: str | None = None) -> rolling.Budget:
        """The disk budget; with run_dir, at most EVIDENCE_FREE_SHARE of the space free on its
        disk now (the rest is the job's: on a small disk a checkpoint must still fit)."""
        rank_bytes = int(self.disk_budget_mb * rolling.MB)
        free = diskfloor.free_bytes(run_dir) if run_dir else None
        if free is not None:
            rank_bytes = min(rank_bytes, int(free * diskfloor.EVIDENCE_FREE_SHARE))
        return rolling.Budget(rank_bytes=rank_bytes, window_s=self.window_s, keep=self.keep_windows)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def job_environment(run_dir: str, options: Options, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(options.extra_env)
    env["PYTHONUNBUFFERED"] = "1"  # the job's output is a pipe (to the relay); keep it live
    if options.shim:
        env["PYTHONPATH"] = SHIM_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["TRAINDX_RUN_DIR"] = os.path.abspath(run_dir)
        if options.steps:
            env["TRAINDX_MAX_STEPS"] = str(options.steps)
        if options.torch_profile is not None:
            env["TRAINDX_TORCH_PROFILE"] = str(options.torch_profile)
        if options.step_marker:
            env["TRAINDX_STEP_MARKER"] = options.step_marker
        if options.cost_budget_pct is not None:
            env["TRAINDX_BUDGET_PCT"] = str(options.cost_budget_pct)
        env[SEGMENT_BYTES_ENV] = str(options.budget(run_dir).segment_bytes(rolling.EVENTS_SHARE))
    return env


class Job:
    """One run of the command: start, pass output through, forward signals, collect, finish."""

    def __init__(
        self,
        command: Sequence[str],
        run_dir: str,
        options: Options,
        on_output: Callable[[str, bytes], object] | None = None,
    ) -> None:
        self.command = list(command)
        self.run_dir = run_dir
        self.options = options
        # the job's bytes as it wrote them ("o"/"e", a read of its pipe): the caller writes them
        self.on_output = on_output or write_output
        self.proc: subprocess.Popen[bytes] | None = None
        self.missing: dict[str, Any] = {}
        self.signals: list[str] = []
        self.not_written: list[str] = []  # one line per file (or part of one) a failed write left out
        self._ignored: list[signal.Signals] = []  # ignored when diagnose started
        self.folder_gone: str | None = None  # the run folder was deleted while the job ran
        self._folder_id: tuple[int, int] | None = None
        self._stopwatch: proctree.StopWatch | None = None
        self._pyspy: PySpyManager | None = None
        self._job_started: tuple[int, float] | None = None  # (ns, this process's CPU s) at the job's start
        self._helpers: dict[str, float | None] = {}  # the helpers' CPU seconds while the job ran
        self.redactor = redact.Redactor.for_job(os.environ, self.command)  # run() adds the job env

    # -- signals -----------------------------------------------------------------------------
    def _forward(self, signum: int, frame: object) -> None:
        self.signals.append(signal.Signals(signum).name)
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def run(self) -> int | None:
        """Record the job; returns its raw return code (None: it never started). Raises
        CommandNotFound, or RunDirRefused before anything starts."""
        resolve_command(self.command)
        lock = manifest_mod.claim_run_dir(self.run_dir)
        st = os.stat(self.run_dir)
        self._folder_id = (st.st_dev, st.st_ino)  # a folder made again at its path is another
        try:
            return self._record()
        finally:
            lock.release()

    def _same_folder(self) -> bool:
        try:
            st = os.stat(self.run_dir)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._folder_id

    def _write_manifest(self, manifest: dict[str, Any], what: str) -> bool:
        try:
            write_json_atomic(os.path.join(self.run_dir, "manifest.json"), manifest)
            return True
        except OSError as exc:
            self.not_written.append(f"manifest.json {what} ({_reason(exc)})")
            return False

    def _record(self) -> int | None:
        env = job_environment(self.run_dir, self.options)
        self.redactor = redact.Redactor.for_job(env, self.command)
        manifest = self._first_manifest(env)
        nvml = NvmlSampler(os.path.join(self.run_dir, "nvml.csv"), self.options.nvml_interval_s, env=env)
        if self.options.nvml and not nvml.start():
            self.missing["nvml"] = nvml.error
        if nvml.selection is not None:  # which GPUs nvml.csv holds, and why those
            manifest["nvml"] = nvml.selection
        elif not self.options.nvml:
            self.missing["nvml"] = "disabled (--no-nvml)"

        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        # a signal ignored here (nohup, a shell's background job) is the job's to ignore: it
        # inherits SIG_IGN (the forwarder is set only once it has started), and a job that
        # catches it anyway (its own handler) gets it from diagnose as it would bare
        self._ignored = [s for s, h in previous.items() if h is signal.SIG_IGN]
        for s, h in previous.items():
            if h is not signal.SIG_IGN:
                signal.signal(s, self._forward)
        budget = self.options.budget(self.run_dir)
        manifest["budget"] = budget.as_dict()
        # the job's output streams to disk in segments (by the relay): nothing per line stays
        # in memory here
        relay = OutputRelay(
            os.path.join(self.run_dir, "log.txt"),
            budget.segment_bytes(rolling.LOG_SHARE),
            budget.cap(rolling.LOG_SHARE),
            self.on_output,
            secret_values=self.redactor.values,
        )
        pyspy = PySpyManager(
            os.path.join(self.run_dir, "pyspy"),
            self.options.pyspy_rate_hz,
            self.options.dump_interval_s,
            budget=budget,
            record=self.options.pyspy_record,
        )
        self._pyspy = pyspy
        roller = rolling.Roller(self.run_dir, budget, self.options.log_regex)
        roller.start()
        try:
            return self._start_and_wait(env, manifest, relay, pyspy)
        finally:
            # the relay's CPU before it is reaped (its own process; a zombie still has it)
            self._helpers["relay"] = proctree.cpu_seconds(relay.proc.pid) if relay.proc else None
            relay.finish()  # still under the forwarding handlers: a Ctrl-C here is the job's
            for s, h in previous.items():
                signal.signal(s, h)
            try:  # the job has ended: nothing here may change its exit code
                self._finish(manifest, nvml, pyspy, roller, relay)
            except Exception as exc:
                self.not_written.append(f"the end of the run ({_reason(exc)})")

    def _first_manifest(self, env: dict[str, str]) -> dict[str, Any]:
        """The manifest written before the job starts (status `running`); RunDirRefused when
        it cannot be written: the job is then not started for nothing."""
        manifest = {
            "traindx_run": 1,
            "command": self.redactor.argv(self.command),
            "cwd": self.options.cwd or working_folder(),
            "start_ns": time.time_ns(),
            "end_ns": None,
            "exit_code": None,
            "host": manifest_mod.host_info(),
            "gpus": [],
            "packages": manifest_mod.package_versions(),
            "env": manifest_mod.redact_env(env),
            "options": manifest_mod.redact_options(self.options.as_dict()),
            "ranks": {},
            "missing": self.missing,
            "status": "running",
        }
        manifest["options"]["extra_env"] = manifest_mod.redact_env(self.options.extra_env)
        try:
            manifest["gpus"] = gpu_inventory()
        except Exception as exc:
            self.missing["gpus"] = f"no GPU inventory: {type(exc).__name__}: {exc}"
        try:
            os.makedirs(os.path.join(self.run_dir, "events"), exist_ok=True)
            write_json_atomic(os.path.join(self.run_dir, "manifest.json"), manifest)
        except OSError as exc:  # nothing can be recorded: the job is not started for nothing
            raise RunDirRefused(
                f"cannot write the run folder {self.run_dir} ({_reason(exc)}): the job was not started"
            ) from None
        return manifest

    def _start_and_wait(
        self, env: dict[str, str], manifest: dict[str, Any], relay: OutputRelay, pyspy: PySpyManager
    ) -> int:
        """Start the job with its output to the relay and py-spy on it; its return code."""
        job_out: int | None
        job_err: int | None
        try:
            job_out, job_err = relay.start()
        except OSError as exc:  # the job's output then goes straight to the terminal
            job_out = job_err = None
            self.missing["log"] = f"no output relay: {_reason(exc)}"
        try:
            self.proc = subprocess.Popen(
                list(getattr(self.options, "wrap", None) or []) + self.command,
                env=env,
                cwd=self.options.cwd,
                stdout=job_out,
                stderr=job_err,
                stdin=None,  # the job reads what diagnose was given (a pipe, a file, the terminal)
                pass_fds=self._caller_fds() or self._nulled_fds(),
                # a std stream the caller had closed is closed for the job too, and under --fix
                # the caller's extra numbers hold /dev/null (rare: only then)
                preexec_fn=self._preexec(),
                start_new_session=True,
            )
        except OSError as exc:
            raise CommandNotFound(f"cannot start {self.command[0]}: {_reason(exc)}") from None
        finally:
            for fd in {job_out, job_err}:  # the job holds them now (one for both: 2>&1)
                if fd is not None:
                    os.close(fd)
        relay.job_started(self.proc.pid)
        for s in self._ignored:
            signal.signal(s, self._forward)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._job_started = (time.time_ns(), usage.ru_utime + usage.ru_stime)
        self._stopwatch = proctree.StopWatch(self.proc.pid, os.path.join(self.run_dir, proctree.STOPPED_FILE))
        self._stopwatch.start()
        manifest["pid"] = self.proc.pid  # lets a re-analysis tell whether the job lives on
        self._write_manifest(manifest, "was not updated with the job's pid")
        if self.options.pyspy:
            if not pyspy.start(self.proc.pid, self.run_dir if self.options.shim else None):
                self.missing["pyspy"] = pyspy.error
        else:
            self.missing["pyspy"] = "disabled (--no-pyspy)"
        if not self.options.shim:
            self.missing["shim"] = "disabled (--no-shim)"
        return self._wait()

    def _nulled_fds(self) -> tuple[int, ...]:
        """Under --fix, the caller's extra numbers, still open: the arm finds /dev/null there
        (a job that writes its fd 3 writes nowhere, as confined, never into a file of ours)."""
        if self._caller_fds():
            return ()
        still = set(inheritable_fds())
        return tuple(fd for fd in CALLER_FDS if fd in still)

    def _preexec(self) -> Callable[[], None] | None:
        nulled = self._nulled_fds()
        if not nulled and not stdfds.CLOSED:
            return None

        def before_exec() -> None:  # in the child, between fork and exec
            if nulled:
                stdfds.null_on(nulled)
            stdfds.close_again()

        return before_exec

    def _caller_fds(self) -> tuple[int, ...]:
        """The caller's extra descriptors, still open, for the job; none under --fix's view
        (a descriptor on a user's file would let every arm write there)."""
        if getattr(self.options, "wrap", None) or not getattr(self.options, "caller_fds", True):
            return ()
        still = set(inheritable_fds())
        return tuple(fd for fd in CALLER_FDS if fd in still)

    def _finish(
        self,
        manifest: dict[str, Any],
        nvml: NvmlSampler,
        pyspy: PySpyManager,
        roller: rolling.Roller,
        relay: OutputRelay,
    ) -> None:
        stops = self._stopwatch.stop() if self._stopwatch is not None else []
        if not self._same_folder():  # deleted while the job ran: one line, no more
            for stop in (nvml.stop, pyspy.stop, roller.stop):
                try:
                    stop()
                except Exception:
                    pass
            self.not_written = []
            self.folder_gone = (
                f"the run folder {self.run_dir} was deleted while the job ran: nothing "
                f"was recorded (the job's exit code {self.proc.returncode if self.proc else None} passes through)"
            )
            return
        nvml.stop()
        pyspy.stop()
        roller.stop()
        self._own_cost(manifest, pyspy)
        if nvml.write_error:
            self.missing["nvml"] = nvml.write_error + " were not written"
            self.not_written.append(self.missing["nvml"])
        if relay.problems:
            self.missing["log"] = "; ".join(relay.problems)[:1000]
            self.not_written.extend(relay.problems)
        if roller.errors:
            self.missing["rolling"] = "; ".join(roller.errors)[:1000]
        if roller.shed_bytes:  # the evidence yielded the disk to the job: said, with what went
            self.missing["disk"] = (
                f"free space on the run folder's disk fell under its floor: "
                f"{max(roller.shed_bytes, 0) / rolling.MB:.1f} MB of older evidence shed "
                "(what each dropped segment held is in its *.rolled.json)"
            )
        if stops:  # the job's processes stopped by a signal (SIGSTOP): not its code's time
            manifest["stopped"] = stops
        rolled = rolling.rolled_summaries(self.run_dir)
        if rolled:  # what a long run thinned or dropped to stay in its budget
            manifest["rolled"] = rolled
        errors = pyspy.errors()
        if errors and "pyspy" not in self.missing:
            self.missing["pyspy"] = "; ".join(dict.fromkeys(errors))[:1000]
        self.not_written.extend(e for e in dict.fromkeys(errors) if "not written" in e)
        # {rank label: pid} of the training processes (the shim's announcements, or py-spy's
        # view of the process tree without the shim); the run loader maps files by the same rule
        manifest["ranks"] = announced_ranks(self.run_dir) if self.options.shim else pyspy.rank_labels()
        manifest["end_ns"] = time.time_ns()
        code = None if self.proc is None else self.proc.returncode
        manifest["exit_code"] = code
        manifest["signals_forwarded"] = self.signals
        manifest["status"] = "finished" if code is not None else "failed to start"
        try:
            no_events = self.options.shim and not os.listdir(os.path.join(self.run_dir, "events"))
        except OSError:
            no_events = False
        if no_events:
            self.missing.setdefault(
                "shim",
                "no events: the job never ran Python with the shim (python -I/-E/-S, or not a Python job)",
            )
        if not self._write_manifest(manifest, "was not finalised"):
            self.not_written[-1] += (
                f"; it still says `running` (the job exited with {code}); "
                f"`diagnose report --reanalyze {self.run_dir}` marks it "
                "interrupted"
            )

    def _own_cost(self, manifest: dict[str, Any], pyspy: PySpyManager) -> None:
        """What traindx's helpers took while the job ran (derive/selfcost.py prices it): CPU
        seconds of py-spy (recorders, snapshots), the output relay, and this process (NVML,
        the live judge, the relay's reader), from the job's start to its end."""
        if self._job_started is None:
            return
        t0, cpu0 = self._job_started
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._helpers["pyspy"] = pyspy.cpu_seconds() if self.options.pyspy else None
        self._helpers["diagnose"] = usage.ru_utime + usage.ru_stime - cpu0
        manifest["self_cost"] = {
            "wall_s": (time.time_ns() - t0) / 1e9,
            "helpers_cpu_s": {k: round(v, 4) for k, v in self._helpers.items() if v is not None},
        }

    def burst(self, kind: str) -> None:
        """Deep capture on an anomaly: a burst of py-spy snapshots of every training process."""
        if self._pyspy is not None and self.options.pyspy:
            self._pyspy.burst(kind)

    def _wait(self) -> int:
        assert self.proc is not None  # started by _start_and_wait
        while True:
            try:
                return self.proc.wait()
            except KeyboardInterrupt:  # already forwarded by the handler; keep waiting
                continue


def exit_status(returncode: int | None) -> int:
    """The shell's convention: a job killed by signal N exits 128+N."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode
