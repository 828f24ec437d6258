"""py-spy evidence for each rank process: an `--idle` and a `--gil` recorder (both
`--nonblocking`, so the job is never paused) and a low-rate `dump --json` for a GIL timeline.

py-spy keeps every sample in memory until it exits, so a long job is recorded in windows of
`window_s`: the next window's recorders start before the last ones are stopped (SIGINT: py-spy
writes its file), and windows past the first and the last `keep` are folded into a summary
(profiler/rolling.py). The dumps file rolls in segments like the other line files."""

import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from typing import IO, Any

from traindx.profiler import proctree, rolling
from traindx.profiler.proctree import rank_processes
from traindx.profiler.shim._traindx_shim import roles

# (flavour, py-spy record process, its log file) of one recorder
Recorder = tuple[str, "subprocess.Popen[bytes]", IO[str]]

# a burst of snapshots on an anomaly: this many, this far apart (each dump pauses nothing: it
# is --nonblocking, and costs the diagnose side ~10-30 ms of CPU)
BURST_COUNT = 5
BURST_INTERVAL_S = 0.2


def find_pyspy() -> str | None:
    """The py-spy binary: $TRAINDX_PYSPY when set, beside this interpreter (a venv's scripts),
    then on PATH."""
    named = os.environ.get("TRAINDX_PYSPY")
    if named:
        return named if os.access(named, os.X_OK) else None
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


class RankSampler:
    """Both recorders and the dump loop of one process."""

    def __init__(
        self,
        pyspy: str,
        pid: int,
        rank: str,
        out_dir: str,
        rate_hz: int,
        dump_interval_s: float,
        budget: rolling.Budget | None = None,
        record: bool = True,
    ) -> None:
        # the rank names this process's files: a safe label whatever the job announced
        self.pyspy, self.pid, self.rank = pyspy, pid, roles.safe_label(rank)
        self.record = record  # False (--always-on): dumps only, no recorder sampling all along
        self.out_dir = out_dir
        self.rate_hz = rate_hz
        self.dump_interval_s = dump_interval_s
        self.budget = budget or rolling.Budget()
        self.recorders: list[Recorder] = []  # the current window's
        self.window = 0
        self._logs: dict[str, IO[str]] = {}
        self.errors: list[str] = []
        self.dumps_ok = 0
        self.cpu_s = 0.0  # the recorders' and snapshots' CPU seconds while the job ran
        self._wake = threading.Event()  # a burst request or the stop: the dump loop wakes at once
        self._burst = 0
        self._burst_kind: str | None = None
        self.dump_errors: list[str] = []
        self._stop = threading.Event()
        self._window_lock = threading.Lock()
        self._dump_thread: threading.Thread | None = None
        self._window_thread: threading.Thread | None = None

    def _start_recorders(self) -> list[Recorder]:
        recorders: list[Recorder] = []
        if not self.record:
            return recorders
        for flavour, flag in (("all", "--idle"), ("gil", "--gil")):  # each at HELPER_NICE
            out = rolling.window_path(self.out_dir, f"{self.rank}-{flavour}", self.window)
            if flavour not in self._logs:
                self._logs[flavour] = open(os.path.join(self.out_dir, f"{self.rank}-{flavour}.log"), "w")
            log = self._logs[flavour]
            cmd = [
                self.pyspy,
                "record",
                "--pid",
                str(self.pid),
                flag,
                "--nonblocking",
                "--threads",
                "-r",
                str(self.rate_hz),
                "-f",
                "speedscope",
                "-o",
                out,
            ]
            # own session: a Ctrl-C meant for the job must not stop the recorder first
            recorders.append(
                (
                    flavour,
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    ),
                    log,
                )
            )
            proctree.lower_priority(recorders[-1][1].pid, own_session=True)
        return recorders

    def start(self) -> None:
        self.recorders = self._start_recorders()
        if self.dump_interval_s > 0:
            self._dump_thread = threading.Thread(
                target=self._dump_loop, daemon=True, name=f"traindx-pyspy-dump-{self.rank}"
            )
            self._dump_thread.start()
        if self.budget.window_s > 0 and self.record:
            self._window_thread = threading.Thread(
                target=self._window_loop, daemon=True, name=f"traindx-pyspy-window-{self.rank}"
            )
            self._window_thread.start()

    def _window_loop(self) -> None:
        """At each window's end (the first one short: Budget.window_length): the next window's
        recorders first, then the old ones told to write (no gap in the samples), then the
        windows past the start-up ones and the last `keep` folded."""
        while not self._stop.wait(self.budget.window_length(self.window)):
            if not os.path.exists(f"/proc/{self.pid}"):
                return
            with self._window_lock:
                if self._stop.is_set():
                    return
                old = self.recorders
                self.window += 1
                self.recorders = self._start_recorders()
            for flavour, proc, _ in old:
                self._finish(flavour, proc)
            first = self.budget.startup_windows()
            fold = list(range(first, self.window - self.budget.keep))
            # the windows' share of the budget: fold kept windows too, oldest first (never the
            # start-up ones or the live one); a folded window costs only its stacks not yet seen
            kept = list(range(max(first, self.window - self.budget.keep), self.window))
            over = self._windows_bytes() - self.budget.cap(rolling.PYSPY_SHARE)
            while kept and over > 0:
                n = kept.pop(0)
                fold.append(n)
                over -= sum(
                    self._size(rolling.window_path(self.out_dir, f"{self.rank}-{fl}", n))
                    for fl in ("all", "gil")
                )
            if fold:
                for flavour in ("all", "gil"):
                    try:
                        rolling.fold_windows(self.out_dir, f"{self.rank}-{flavour}", max(fold), first=first)
                    except Exception as exc:  # the windows stay as they are: nothing lost
                        self._note(self.errors, f"py-spy {flavour} windows not folded: {exc}")

    def _windows_bytes(self) -> int:
        return sum(
            self._size(p)
            for p in glob.glob(os.path.join(self.out_dir, f"{self.rank}-*" + rolling.SPEEDSCOPE))
        )

    @staticmethod
    def _size(path: str) -> int:
        try:
            return os.path.getsize(path)
        except OSError:
            return 0

    @staticmethod
    def _note(where: list[str], text: str, limit: int = 20) -> None:
        if len(where) < limit:  # a launcher running for days keeps no growing list
            where.append(text)

    def _finish(self, flavour: str, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
        self.cpu_s += proctree.cpu_seconds(proc.pid) or 0.0  # before it writes its file
        if proc.poll() is None:
            proc.send_signal(2)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode not in (0, None, -2):
            self._note(self.errors, f"py-spy {flavour} recorder exited {proc.returncode}")

    def _dump_loop(self) -> None:
        path = os.path.join(self.out_dir, f"{self.rank}-dump.jsonl")
        try:
            self._dumps(path)
        except OSError as exc:  # a full disk: the dumps so far stay, the loss is said once
            self._note(
                self.errors,
                f"{os.path.basename(path)}: the dumps from "
                f"{time.strftime('%H:%M:%S')} on were not written "
                f"({exc.strerror or exc})",
            )

    def _dumps(self, path: str) -> None:
        out = rolling.RollingLines(path, self.budget.segment_bytes(rolling.DUMPS_SHARE), mode="a")
        with out:
            while not self._stop.is_set():
                self._wake.wait(BURST_INTERVAL_S if self._burst else self.dump_interval_s)
                self._wake.clear()
                if self._stop.is_set():
                    break
                trigger = None
                if self._burst:  # an anomaly: snapshots in quick succession, tagged with it
                    self._burst -= 1
                    trigger = self._burst_kind
                t = time.time_ns()
                # the snapshot's CPU: this thread's reaped child (the only one reaped meanwhile)
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                try:
                    proc = subprocess.run(
                        [self.pyspy, "dump", "--pid", str(self.pid), "--json", "--nonblocking"],
                        capture_output=True,
                        text=True,
                        timeout=10,
                    )
                except (subprocess.TimeoutExpired, OSError):
                    continue
                finally:
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    self.cpu_s += after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                if proc.returncode != 0:
                    if not os.path.exists(f"/proc/{self.pid}"):
                        return
                    # a dump can fail while the target starts or exits; only all failing matters
                    lines = [l for l in proc.stderr.splitlines() if l.strip()]
                    self._note(self.dump_errors, lines[0][:300] if lines else f"exit {proc.returncode}")
                    continue
                self.dumps_ok += 1
                try:
                    threads = json.loads(proc.stdout)
                except ValueError:
                    continue
                record: dict[str, Any] = {"t": t, "pid": self.pid}
                if trigger:
                    record["trigger"] = trigger
                out.write(
                    json.dumps(
                        {
                            **record,
                            "threads": [
                                {
                                    "thread_id": th.get("thread_id"),
                                    "thread_name": th.get("thread_name"),
                                    "os_thread_id": th.get("os_thread_id"),
                                    "active": th.get("active"),
                                    "owns_gil": th.get("owns_gil"),
                                    "frames": [
                                        {
                                            "name": f.get("name"),
                                            "filename": f.get("filename"),
                                            "line": f.get("line"),
                                        }
                                        for f in th.get("frames", [])[:40]
                                    ],
                                }
                                for th in threads
                            ],
                        }
                    )
                    + "\n"
                )

    def burst(self, kind: str, count: int | None = None) -> None:
        """Take `count` snapshots BURST_INTERVAL_S apart now (an anomaly: the live judge saw a
        step twice the running median, or a kernel compiled again)."""
        self._burst_kind = kind
        self._burst = BURST_COUNT if count is None else count
        self._wake.set()

    def stop(self, timeout: float = 20) -> None:
        if self._stop.is_set():
            return
        with self._window_lock:  # no new window starts once stopping began
            self._stop.set()
        self._wake.set()
        if self._window_thread is not None:
            self._window_thread.join(timeout=60)
        for flavour, proc, log in self.recorders:
            self.cpu_s += proctree.cpu_seconds(proc.pid) or 0.0  # unreaped yet: /proc still has it
            if proc.poll() is None:
                # the target is gone or going: py-spy writes its file when it sees that; nudge it
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    proc.send_signal(2)
                    try:
                        proc.wait(timeout=timeout)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            log.close()  # the same log file every window of this flavour appended to
            if proc.returncode not in (0, None, -2):
                try:
                    with open(log.name) as f:
                        tail = f.read().strip().splitlines()[-1:] or ["no output"]
                except OSError as exc:  # the run folder deleted under it
                    tail = [f"its log is gone ({exc.strerror})"]
                self.errors.append(f"py-spy {flavour} recorder exited {proc.returncode}: {tail[0]}")
        if self._dump_thread is not None:
            self._dump_thread.join(timeout=12)
        if self.dump_errors and not self.dumps_ok:
            self.errors.append(f"py-spy dump failed: {self.dump_errors[0]}")


class PySpyManager:
    """Starts a RankSampler for every training process of the job as it appears.

    With the shim, a process announces itself in `<run>/procs/<pid>.json` when it shows training
    evidence (the definition shared with the shim, in shim/_traindx_shim/roles.py) and its files
    are named by pid (`p<pid>-all.speedscope.json`, ...): its rank may be learned only later
    (init_process_group), and the run loader maps pid -> rank. Without the shim, the process
    tree's environments are all there is (proctree.rank_processes).
    """

    def __init__(
        self,
        out_dir: str,
        rate_hz: int = 20,
        dump_interval_s: float = 2.0,
        poll_s: float = 0.2,
        budget: rolling.Budget | None = None,
        record: bool = True,
    ) -> None:
        self.out_dir = out_dir
        self.record = record
        self.budget = budget
        self.rate_hz = rate_hz
        self.dump_interval_s = dump_interval_s
        self.poll_s = poll_s
        self.samplers: dict[int, RankSampler] = {}
        self.ranks: dict[int, str] = {}  # {pid: rank label} in attach mode; see rank_labels()
        self.env_ranks: dict[int, str | None] = {}  # {pid: rank or None} without the shim
        self.error: str | None = None
        self.pyspy = find_pyspy()
        self._run_dir: str | None = None
        self._root = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, root_pid: int, run_dir: str | None = None) -> bool:
        """Sample the training processes under root_pid; run_dir: where the shim announces
        them (None: the shim is off)."""
        if self.pyspy is None:
            self.error = "py-spy not found (pip install py-spy, or set TRAINDX_PYSPY)"
            return False
        os.makedirs(self.out_dir, exist_ok=True)
        self._root = root_pid
        self._run_dir = run_dir
        self._thread = threading.Thread(target=self._watch, name="traindx-pyspy", daemon=True)
        self._thread.start()
        return True

    def _found(self) -> list[int]:
        if self._run_dir is not None:
            return [int(a["pid"]) for a in roles.read_announcements(self._run_dir)]

        found = rank_processes(self._root)
        for pid, rank in found.items():
            self.env_ranks.setdefault(pid, rank)
        return list(found)

    def _watch(self) -> None:
        pyspy = self.pyspy
        if pyspy is None:  # start() refused already
            return
        while not self._stop.is_set():
            try:
                found = self._found()
            except Exception:
                found = []
            for pid in found:
                if pid in self.samplers or not os.path.exists(f"/proc/{pid}"):
                    continue
                sampler = RankSampler(
                    pyspy,
                    pid,
                    f"p{pid}",
                    self.out_dir,
                    self.rate_hz,
                    self.dump_interval_s,
                    self.budget,
                    self.record,
                )
                try:
                    sampler.start()
                except OSError as exc:
                    self.error = f"py-spy could not start: {exc}"
                    return
                self.samplers[pid] = sampler
            self._drop_unranked()
            self._stop.wait(self.poll_s)

    def _drop_unranked(self) -> None:
        """Without the shim, the top-most Python was sampled while no process had a rank; once
        ranks appear (torchrun's workers) it was their launcher: stop it, leave it unlabelled."""
        if self._run_dir is not None or not any(r is not None for r in self.env_ranks.values()):
            return
        for pid, rank in list(self.env_ranks.items()):
            if rank is None and pid in self.samplers:
                del self.env_ranks[pid]
                threading.Thread(target=self.samplers[pid].stop, daemon=True).start()

    def rank_labels(self) -> dict[str, int]:
        """{label: pid} of what was sampled without the shim (with it: roles.announced_ranks)."""
        procs = [{"pid": pid, "rank": rank, "start": 0} for pid, rank in self.env_ranks.items()]
        labels = {label: pid for pid, label in roles.rank_labels(procs).items()}
        labels.update({label: pid for pid, label in self.ranks.items()})
        return labels

    def attach(self, pid: int, rank: str = "0") -> bool:
        """attach mode: sample one given process."""
        if self.pyspy is None:
            self.error = "py-spy not found (pip install py-spy)"
            return False
        os.makedirs(self.out_dir, exist_ok=True)
        self.ranks[pid] = rank
        sampler = RankSampler(
            self.pyspy, pid, rank, self.out_dir, self.rate_hz, self.dump_interval_s, self.budget, self.record
        )
        sampler.start()
        self.samplers[pid] = sampler
        return True

    def burst(self, kind: str) -> None:
        """A burst of snapshots of every training process (see RankSampler.burst)."""
        for sampler in list(self.samplers.values()):
            try:
                sampler.burst(kind)
            except Exception:
                pass  # evidence only: never the job's problem

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sampler in self.samplers.values():
            sampler.stop()

    def cpu_seconds(self) -> float:
        """CPU seconds py-spy took while the job ran (recorders and snapshots, every rank)."""
        return sum(s.cpu_s for s in list(self.samplers.values()))

    def errors(self) -> list[str]:
        out = [self.error] if self.error else []
        for sampler in self.samplers.values():
            out.extend(sampler.errors)
        return out
