"""Live judgement: the analyzers run on the run record while it grows, within a CPU budget.

Two stages. The *cheap stage* runs at every poll (every step end on fast steps): it reads only
the bytes appended to each events file since the last poll (`traindx.profiler.live_tail.EventTail`) and
keeps per-step signals: the step time against its running median, every kernel's compile keys,
and a per-step line of measured span shares. It costs tens of microseconds a step and makes no
judgement: it only says when the record holds something new worth judging (a *trigger*): enough
steps for a first judgement, a step at least 2x the running median, a kernel compiled again (a
new key) once that step has ended, a span line that moved by LINE_SHIFT since the last
judgement; and which span category stands out in it (compile, data, gc, io, ..., `other`: time
no span covers).
The *full stage* is the same loader and the same analyzers as the end-of-run analysis (one
definition of every judgement). It runs on a trigger, or on the slow cadence (CADENCE_S) when the
budget has room for it and a trigger's analysis besides, and only while the CPU spent by both
stages stays within a bounded share of one core over the run so far (`LiveOptions.cpu_share`).
The budget banks while nothing happens, so an onset finds it full: what the cheap stage buys;
a job's first seconds start with START_PASSES full passes banked (what judging needs at least).
A trigger whose full pass would take SHOW_WITHIN_STEPS of the job's steps or more (the job runs
on meanwhile: fast steps), or that the budget has no room to judge with every analyzer, is judged
first by the analyzers that read the category standing out in it (CATEGORY_ANALYZERS: a GC pause by the GC analyzer, a
compile by the compile analyzer; a compile-only trigger always so): a fraction of a full pass's
cost, so on screen before the budget refills; the full pass confirms what it showed, on the same
record, before any other routed pass. A pass reads each process's last `window_steps` steps
(traindx.derive.so_far: a rolling window; a days-long run's live memory and pass cost bounded), the
batch analysis of those rows.

A finding of severity high or critical is *stable* once it has been seen in two steady steps: the
analysis that found it covered at least STABLE_AFTER_STEPS steps (step 0, the warm-up, and two
steady ones), or two analyses at different step counts found it; a recompile or a re-autotune is
stable as soon as the analyzer reports it (it needs two compiles of one kernel with a changed key
to exist at all). Stable findings are handed to `on_finding` once each.

The budget is measured with the process's CPU time during each analysis (the Arrow loader parses
in threads of its own, so the analysing thread's time alone would under-count) and the polling
thread's own CPU time for the cheap stage.

With `until_diagnosed`, the judge asks the job to stop cleanly (as `--steps` does) once the top
root finding is stable and no unstable finding of its severity or above is pending (a generic top,
one a specific finding may still make its symptom, once it held while the record doubled): it writes
`control/stop.json` with the step at which every rank stops; the shim reads it at step ends.
"""

from __future__ import annotations

import glob
import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from traindx.analyzers.findings import SEVERITIES, Finding

# the cheap stage (re-exported: its names are part of the live judgement's)
from traindx.profiler.live_tail import (  # noqa: F401
    ANOMALY_FACTOR,
    ANOMALY_MIN_STEPS,
    ANOMALY_WINDOW,
    FILES_EVERY_S,
    KEYS_KEPT,
    LINE_SHIFT,
    LINE_STEPS,
    MODEL_SPANS,
    TRIGGERS_PER_SOURCE,
    EventTail,
    line_outside_model,
)
from traindx.profiler.manifest import write_json_atomic

STOP_FILE = os.path.join("control", "stop.json")
# when each finding was first shown (time to finding, measured): {id: {t_ns, step, severity}}
SHOWN_FILE = "live.json"
# a recompile or re-autotune is proven by the analyzer's own rule (two compiles of one kernel,
# key changed): finding ids of that family
_PROVEN_AT_ONCE = ("recompile", "reautotune", "re_autotune", "autotune")
STABLE_AFTER_STEPS = 3
# --until-diagnosed stops on a generic top root (host code at a line) once it stayed the top
# while the record grew to this many times the steps it became the top at (a specific rival at
# its line that needs more steps had its chance)
TOP_HOLD_FACTOR = 2
CAPTURE_FILE = os.path.join("control", "capture.json")
# stable findings of these analyzers are anomalies worth a deep capture too
CAPTURE_ANALYZERS = ("ranks", "sync_points", "gpu_idle", "gpu_clocks")
STOP_MARGIN_S = 1.0
# the slow cadence: a full analysis at most this often without a trigger, and only with room
# left in the budget for a trigger's analysis after it
CADENCE_S = 30.0
# the budget is the share of one core over the run so far, and never less than this many full
# passes (at their measured cost): a job's first seconds hold a first judgement, an onset's pass
# and its confirmation, on a slow host as on a fast one (a fixed 0.6 s held one 0.35-0.5 s pass
# on the H200's host: a host-bound onset at step 30 waited 630 steps for the budget). Over a run
# longer than a minute or so the share holds as it is.
START_PASSES = 3
# a trigger that only concerns compiles is judged by the compile analyzer alone; a py-spy
# recording (a window written) by the analyzer that reads who holds the GIL
TRIGGER_ANALYZERS = {"compile": ("jit",), "recording": ("gil",)}
# a slow step, a moved span line or a first line with time outside the model, when the budget
# has no room for every analyzer, is judged by the analyzers that read the span category
# standing out in it (a pass of a fraction of the cost, on screen before the budget refills);
# a full pass confirms it after. Routing evidence to its readers, like a compile to the compile
# analyzer: no verdict here.
CATEGORY_ANALYZERS = {
    "compile": ("jit",),
    "data": ("dataloader",),
    "gc": ("gc_pauses",),
    "io": ("stability", "host_work"),
    "sync": ("host_sync",),
    "collective": ("ranks",),
    "other": ("host_work",),
}
ROUTED_KINDS = frozenset({"slow_step", "line", "steps", "compile"})
FULL_PASS_GUESS_S = 0.2  # a full pass's CPU before one was measured
# a finding is due on screen within this many steps of the record that shows it (issue 24's
# goal for ledger-based findings); a full pass longer than that many steps goes routed first
SHOW_WITHIN_STEPS = 3
# a root finding one severity below the printed floor is judged again when the record has grown
# this many times (its share may have been diluted by a warm-up in the first steps: a warm-up is
# at most half the steps, so a one-off of k steps is set apart from 2k + 1 steps on)
GROW_FACTOR = 1.5
# findings that are no cause of a slowdown (the verdict, traindx's own state, missing evidence)
NOT_CAUSES = ("verdict.", "traindx.", "evidence.", "analysis.")
ANALYSES_KEPT = 200  # the per-pass log kept in live.json
# the per-step events a pass reads: each process's last WINDOW_STEPS steps (traindx.derive.so_far: a
# rolling window, 1.25x at most; enough for a period of tens of steps to repeat)
WINDOW_STEPS = 200


@dataclass(frozen=True)
class LiveOptions:
    cpu_share: float = 0.02  # live CPU (both stages) <= this share of one core
    poll_s: float = 0.1  # how often the events are tailed for new step ends
    min_severity: str = "high"  # findings printed while the job runs
    until_diagnosed: bool = False  # stop the job once the top finding is stable
    report_every: int = 3  # rewrite report.html every N analyses (0: never), budget
    # permitting; also after an analysis that showed a finding
    window_steps: int = WINDOW_STEPS  # a pass judges each process's last N steps (0: all):
    # a days-long run's live memory and pass cost bounded


@dataclass
class LiveState:
    """What the live view shows: the newest analysis and the tail of the events."""

    step: int = 0  # steps finished (the furthest rank)
    last_step_s: float | None = None
    median_step_s: float | None = None
    compiles: int = 0
    ledger_line: str | None = None
    top: Finding | None = None  # the current top root finding, if any
    analyses: int = 0
    analysis_cpu_s: float = 0.0  # full stage (the report rewrites included)
    cheap_cpu_s: float = 0.0  # cheap stage (tailing, signals)
    report_cpu_s: float = 0.0  # of analysis_cpu_s: report.html rewrites
    polls: int = 0
    import_cpu_s: float = 0.0  # one-time imports (the final analysis's too)
    elapsed_s: float = 0.0
    stop_requested_at: int | None = None  # the step the job was asked to stop at
    stable: list = field(default_factory=list)  # ids of the findings printed so far
    captures: list = field(default_factory=list)  # deep captures asked for: kind, why, when
    passes: list = field(default_factory=list)  # each full analysis: trigger, step, cpu_s
    running: bool = True


def _severity_rank(severity: str) -> int:
    """Higher is more severe; unknown severities rank lowest."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else -1


def _at_least(severity: str, floor: str) -> bool:
    return _severity_rank(severity) >= _severity_rank(floor)


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, data)  # no .tmp left on a full disk; the old file stands


def request_stop(run_dir: str, at_step: int, reason: str) -> None:
    """Ask every rank of the job to stop cleanly once it has finished `at_step` steps."""
    _write_json(
        os.path.join(run_dir, STOP_FILE), {"steps": int(at_step), "reason": reason, "t_ns": time.time_ns()}
    )


def request_capture(run_dir: str, kind: str, reason: str) -> None:
    """Ask the shim for a torch.profiler window on the next step (once per kind, within the
    window's budget: the shim decides)."""
    _write_json(os.path.join(run_dir, CAPTURE_FILE), {"kind": kind, "reason": reason, "t_ns": time.time_ns()})


def run_is_live(run_dir: str) -> bool:
    """The manifest (or any node part's) says running; a folder without one is starting."""
    paths = [os.path.join(run_dir, "manifest.json")]
    paths += glob.glob(os.path.join(run_dir, "nodes", "*", "manifest.json"))
    seen = False
    for p in paths:
        try:
            with open(p, encoding="utf-8") as f:
                status = json.load(f).get("status")
        except (OSError, ValueError):
            continue
        seen = True
        if status == "running":
            return True
    return not seen


class LiveJudge:
    """Runs the two stages on a growing run folder in a background thread."""

    def __init__(
        self,
        run_dir: str,
        options: LiveOptions = LiveOptions(),
        on_finding: Callable[[Finding, LiveState], None] = lambda f, s: None,
        on_state: Callable[[LiveState], None] = lambda s: None,
        on_analysis: Callable[[object, list], None] | None = None,
        on_anomaly: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run_dir = run_dir
        self.options = options
        self.on_finding = on_finding
        self.on_state = on_state
        self.on_analysis = on_analysis  # e.g. rewrite report.html (the caller's choice)
        self.on_anomaly = on_anomaly  # deep capture: called once per kind of anomaly
        self.clock = clock  # the budget's wall clock (a replay passes its own)
        self._captured: set[str] = set()
        self.tail = EventTail(run_dir)
        self.state = LiveState()
        self._seen: dict[str, int] = {}  # finding id -> step count of its first sighting
        self._printed: set[str] = set()
        self._shown: dict[str, dict] = {}
        self._start = clock()
        # CPU seconds the next analysis is expected to cost: full, or of one analyzer set
        self._cost: dict[tuple | None, float] = {}
        self._report_cost = 0.1
        self._analysed_at = -1  # step count of the last analysis
        self._full_at = -1  # ... of the last one with every analyzer
        self._analysed_t = self._start  # when (the budget's clock); the cadence counts
        # from the start
        self._pending: dict[str, str] = {}  # trigger kind -> why, not judged yet
        self._since_report = 0
        self._soft_first = False  # a first judgement waits for room (nothing urgent)
        self._routes: set[str] = set()  # span categories the pending triggers point at
        self._first_routed = False  # the first judgement ran routed: a full one next
        self._sources_warm = False  # the job's scripts parsed (_warm_sources)
        self._routed: set[str] = set()  # categories whose routed pass showed a finding,
        # since the last full pass
        self._routed_first = False  # the pass due runs routed ahead of a full one
        self._so_far = None  # the events parsed by the passes so far
        self._top = (None, 0)  # (the top root's id, step count it became top at)
        self._hold_until = 0  # a pass due at this step: has the top held?
        self._near = ""  # that finding's id
        self._grow_at = 0  # a pass due at this step: has a finding just
        # below the floor risen? (0: none due)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    # -- the loop ---------------------------------------------------------------------------
    def start(self) -> LiveJudge:
        self._thread = threading.Thread(target=self._loop, name="traindx-live", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> LiveState:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.state.running = False
        # whenever the judge watched a job (the captures it took, what it cost), even with no
        # pass yet; a run refused before its job started writes nothing
        st = self.state
        if self._shown or st.analyses or st.captures or st.polls:
            self._write_shown()
        return self.state

    def _loop(self) -> None:
        self._warm_imports()
        while not self._stop.wait(self.options.poll_s):
            if not self._sources_warm:
                self._warm_sources()
            self.step_once()

    def _warm_imports(self) -> None:
        """Import the loader and every analyzer once, before the first analysis. Not counted in
        the live budget: the end-of-run analysis imports the same modules in any case, and
        counting it would hold the first analyses back by tens of seconds."""
        t0 = time.process_time()
        try:
            import importlib

            from traindx import analyzers  # noqa: F401
            from traindx.derive import run as record  # noqa: F401

            for name in analyzers.REGISTRY + analyzers.JUDGES:
                importlib.import_module(f"traindx.analyzers.{name}")
        except Exception as exc:
            self._error("imports", exc)
        self.state.import_cpu_s = time.process_time() - t0

    def _warm_sources(self) -> None:
        """Parse the job's own scripts once its manifest names them (codefix keeps each file's
        tree per version): the analyzers that place an edit read them at every pass, and the
        end-of-run analysis in any case; a one-time cost like the imports."""
        t0 = time.process_time()
        try:
            from traindx.analyzers import codefix
            from traindx.analyzers.evidence import job_scripts
            from traindx.derive.run import RunRecord

            with open(os.path.join(self.run_dir, "manifest.json"), encoding="utf-8") as f:
                manifest = json.load(f)
            if isinstance(manifest, dict) and isinstance(manifest.get("command"), list):
                self._sources_warm = True
                for path in job_scripts(RunRecord(path=self.run_dir, manifest=manifest, tables=None)):
                    codefix._tree(path)
        except (OSError, ValueError):
            pass  # not written yet: the next poll
        except Exception as exc:
            self._sources_warm = True
            self._error("sources", exc)
        self.state.import_cpu_s += time.process_time() - t0

    def _worth_analysing(self) -> bool:
        """Whether an analysis now could show a stable finding: enough steps for one seen in
        two steady steps, or a kernel compiled again after step 0 once that step has ended (two
        compiles of one kernel: what a recompile finding needs). An earlier analysis would spend
        the budget on evidence that cannot convince."""
        again = self.tail.recompiled_in
        # the step that compiled again must have ended: the analyzer judges finished steps
        return self.tail.step >= STABLE_AFTER_STEPS or (again is not None and self.tail.step > again)

    def spent_s(self) -> float:
        """The live judgement's CPU so far (both stages; the one-time imports apart)."""
        return self.state.analysis_cpu_s + self.state.cheap_cpu_s

    def _room(self, cost: float) -> bool:
        """Whether `cost` CPU seconds more stay within the share of one core over the run."""
        share = self.options.cpu_share * (self.clock() - self._start)
        return self.spent_s() + cost <= max(share, START_PASSES * self._expected(None))

    def _expected(self, only: tuple | None) -> float:
        """The CPU a pass of `only` (None: every analyzer) is expected to cost: its last one; a
        full pass never measured yet, at least twice the dearest routed pass (a full pass run
        first after routed ones would overshoot the budget on a guess)."""
        routed = [c for k, c in self._cost.items() if k is not None]
        full = self._cost.get(None, max([FULL_PASS_GUESS_S] + [2 * c for c in routed]))
        return self._cost.get(only, full if only is None else full / 2)

    def step_once(self, force: bool = False) -> None:
        """The cheap stage (tail the events, take the triggers); the full stage when a trigger
        is pending and the budget has room for it, on the slow cadence, or when `force`d."""
        t0 = time.thread_time()
        step_before = self.tail.step
        try:
            self.tail.poll()
            triggers = self.tail.take_triggers()
        except Exception as exc:  # a live view must never break the job's run
            self._error("events", exc)
            triggers = []
        for kind, why in self.tail.take_anomalies():
            self._anomaly(kind, why)
        for kind, why in triggers:
            self._pending.setdefault(kind, why)
        self._routes |= self.tail.take_categories()
        if self._hold_until and self.tail.step >= self._hold_until:
            self._pending.setdefault("confirm", f"the top held to step {self._hold_until}?")
            self._hold_until = 0
        if self._grow_at and self.tail.step >= self._grow_at and self._room(self._expected(None)):
            # no reserve kept beside it, unlike the cadence's speculative pass: a finding is
            # already there, a step below the floor (the starting allowance of a short job
            # holds the first judgement and this one, not a third beside them)
            self._pending.setdefault(
                "grown", f"the record grew to {self.tail.step} steps: {self._near} rises?"
            )
            self._grow_at = 0
        if (
            self._full_at < STABLE_AFTER_STEPS <= self.tail.step
            and "steps" not in self._pending
            and not self._first_routed
        ):
            # no full judgement of two steady steps yet: what a finding needs to be stable
            outside = self.tail.outside_model()
            if outside >= LINE_SHIFT or self.tail.recompiled_in is not None:
                self._pending["steps"] = (
                    f"{self.tail.step} steps: the first judgement "
                    f"({outside:.0%} of the step outside the model's spans)"
                )
                # what a pass reads first when there is no room for every analyzer
                self._routes |= self.tail.outside_categories()
                if self.tail.recompiled_in is not None:  # a kernel compiled again
                    self._routes.add("compile")
            else:  # nothing stands out yet: judged when there is room beside a reserve
                self._soft_first = True
        s = self.state
        s.step, s.last_step_s, s.compiles = self.tail.step, self.tail.last_step_s, self.tail.compiles
        s.elapsed_s = self.clock() - self._start
        s.polls += 1
        s.cheap_cpu_s += time.thread_time() - t0
        trigger, only = self._due(force)
        if trigger is not None:
            self._analyse(trigger, only)
        if trigger is not None or self.tail.step != step_before or s.polls % 10 == 0:
            self.on_state(s)

    def _due(self, force: bool) -> tuple[str | None, tuple | None]:
        """(the trigger of the analysis to run now, the analyzers it runs: None for all)."""
        if force:
            return "final" if not self._pending else "+".join(sorted(self._pending)), None
        # a routed pass that showed something is confirmed on the same record, without waiting
        # for a step end (a 280 s step would hold the verdict and --until-diagnosed's stop)
        confirm_now = "confirm" in self._pending and self._full_at < self._analysed_at
        if self.tail.step <= self._analysed_at and not confirm_now or not self._worth_analysing():
            return None, None
        if self._pending:
            kinds = set(self._pending)
            only = TRIGGER_ANALYZERS.get(next(iter(kinds))) if len(kinds) == 1 else None
            # a finding shown to confirm waits for the full pass (its verdict, the stop)
            routed = None if "confirm" in kinds else self._route(kinds)
            if (
                routed is not None
                and self._full_pass_spans_steps(only)
                and self._room(self._expected(routed) + self._expected(None))
            ):
                # the full pass would let the job run SHOW_WITHIN_STEPS steps or more before
                # its finding is on screen: the analyzers of what stands out first (a fraction
                # of the cost), the full pass confirming it next, on the same record; only with
                # room for both (else --until-diagnosed's stop waits for the budget); the
                # triggers stay pending for it whatever the routed pass shows
                self._routed_first = True
                return "+".join(sorted(kinds)), routed
            if self._room(self._expected(only)):
                return "+".join(sorted(kinds)), only
            # no room for every analyzer: those of what stands out first (not under
            # --until-diagnosed: a routed pass and its confirming full pass cost more than one
            # full pass, and its stop came later: 907 steps against 47 measured)
            if self.options.until_diagnosed:
                routed = None
            if routed is not None and self._room(self._expected(routed)):
                return "+".join(sorted(kinds)), routed
            for kind in sorted(kinds & set(TRIGGER_ANALYZERS)):
                # no room for every analyzer: the compile analyzer alone first, the rest wait
                if self._room(self._expected(TRIGGER_ANALYZERS[kind])):
                    return kind, TRIGGER_ANALYZERS[kind]
            return None, None
        # the slow cadence, from the start (a first judgement when nothing stood out too: an
        # onset in the job's first seconds, when the budget is smallest, would find it spent):
        # only with room for a trigger's analysis after it
        if (
            (self._soft_first or self._full_at >= STABLE_AFTER_STEPS)
            and self.clock() - self._analysed_t >= CADENCE_S
            and self._room(2 * self._expected(None))
        ):
            return ("steps" if self._full_at < STABLE_AFTER_STEPS else "cadence"), None
        return None, None

    def _full_pass_spans_steps(self, only: tuple | None) -> bool:
        """Whether the pass of `only` (None: every analyzer) is expected to take as long as
        SHOW_WITHIN_STEPS of the job's steps: the job runs on while it runs, so a finding it
        shows is on screen that many steps after the record it read (its CPU is its wall time
        at best)."""
        step_s = self.tail.median_step_s()
        return only is None and step_s is not None and self._expected(None) >= SHOW_WITHIN_STEPS * step_s

    def _route(self, kinds: set) -> tuple | None:
        """The analyzers that read what the pending triggers point at (TRIGGER_ANALYZERS,
        CATEGORY_ANALYZERS), or None: every analyzer (a trigger of another kind, one that points
        at nothing outside the model, or only at categories a routed pass showed a finding from
        since the last full pass: the same evidence again is the confirming full pass's)."""
        if not kinds or not kinds <= ROUTED_KINDS:
            return None
        names = [a for c in sorted(self._routes - self._routed) for a in CATEGORY_ANALYZERS.get(c, ())]
        if kinds - {"compile"} and not names:
            return None
        if "compile" in kinds:
            names += TRIGGER_ANALYZERS["compile"]
        return tuple(dict.fromkeys(names))

    def _anomaly(self, kind: str, why: str) -> None:
        if kind in self._captured or self.on_anomaly is None:
            return
        self._captured.add(kind)
        self.state.captures.append({"kind": kind, "why": why, "t_ns": time.time_ns()})
        try:
            self.on_anomaly(kind, why)
        except Exception as exc:
            self._error(f"capture on {kind}", exc)

    def _error(self, what: str, exc: BaseException) -> None:
        text = f"{what}: {type(exc).__name__}: {exc}"
        if text not in self.errors:
            self.errors.append(text)

    def _analyse(self, trigger: str, only: tuple | None = None) -> None:
        t0 = time.process_time()
        covered = self.tail.step
        judged: set[str] = set()
        if only is None:
            self._pending.clear()
            self.tail.mark_judged()
            self._routed.clear()
        else:
            judged = {
                c for c in self._routes if c in CATEGORY_ANALYZERS and set(CATEGORY_ANALYZERS[c]) <= set(only)
            }
            kinds = trigger.split("+")
            for kind in kinds if not self._routed_first else ():
                self._pending.pop(kind, None)
            self._routed_first = False
            if "line" in kinds:  # the moved line was judged by the analyzers that read it
                self.tail.mark_judged()
            if "steps" in kinds:  # the full first judgement: when there is room
                self._first_routed = self._soft_first = True
        self._routes.clear()
        shown = False
        run = None
        findings: list[Finding] = []
        try:
            from traindx.analyzers import analyze
            from traindx.derive.run import load_run
            from traindx.derive.so_far import EventsSoFar

            self._so_far = self._so_far or EventsSoFar(self.options.window_steps or None)
            # only the bytes appended since the last pass are parsed; no Parquet tables of a
            # record still growing
            run = load_run(self.run_dir, cache=False, so_far=self._so_far)
            findings = analyze(run, only=only)
            shown = self._judge(run, findings, only, trigger)
            if only is not None and shown:
                # what it showed waits for the full pass; the same evidence again is its
                self._routed |= judged
        except Exception as exc:
            self._error("analysis", exc)
        finally:
            cost = time.process_time() - t0
            s = self.state
            s.analysis_cpu_s += cost
            s.analyses += 1
            self._cost[only] = max(cost, 0.01)
            self._analysed_at = covered
            if only is None:
                self._full_at = covered
            self._analysed_t = self.clock()
            s.passes.append(
                {
                    "trigger": trigger,
                    "step": covered,
                    "cpu_s": round(cost, 4),
                    "analyzers": list(only) if only else "all",
                }
            )
            del s.passes[:-ANALYSES_KEPT]
            self._write_shown()  # the per-pass log, readable while the job runs
        self._since_report += 1
        if (
            run is not None
            and self.on_analysis is not None
            and self.options.report_every
            and only is None
            and (shown or self._since_report >= self.options.report_every)
        ):
            # lowest priority: only with room for a trigger's analysis after it
            if self._room(self._report_cost + self._expected(None)):
                t1 = time.process_time()
                try:
                    self.on_analysis(run, findings)
                except Exception as exc:
                    self._error("report", exc)
                cost = time.process_time() - t1
                self._report_cost = max(cost, 0.01)
                self.state.analysis_cpu_s += cost
                self.state.report_cpu_s += cost
                self._since_report = 0

    def _write_shown(self) -> None:
        s = self.state
        try:
            _write_json(
                os.path.join(self.run_dir, SHOWN_FILE),
                {
                    "findings": self._shown,
                    "captures": s.captures,
                    "analyses": s.analyses,
                    "analysis_cpu_s": round(s.analysis_cpu_s + s.cheap_cpu_s, 4),
                    "full_stage_cpu_s": round(s.analysis_cpu_s, 4),
                    "cheap_stage_cpu_s": round(s.cheap_cpu_s, 4),
                    "report_cpu_s": round(s.report_cpu_s, 4),
                    "polls": s.polls,
                    "import_cpu_s": round(s.import_cpu_s, 4),
                    "passes": s.passes,
                    # a pass that failed says why (the live view never breaks the job)
                    "errors": self.errors,
                },
            )
        except OSError as exc:
            self._error(f"writing {SHOWN_FILE}", exc)

    def _stop_step(self) -> int:
        """A step every rank has not reached yet: the furthest rank's step now, plus the steps
        that fit in STOP_MARGIN_S (each rank reads the request at its next step end, at most
        CONTROL_POLL_NS late; ranks that stop at different steps would hang in a collective)."""
        try:
            self.tail.poll()
        except Exception:
            pass
        step_s = self.state.median_step_s or self.tail.last_step_s or STOP_MARGIN_S
        return self.tail.step + max(2, math.ceil(STOP_MARGIN_S / max(step_s, 1e-3)))

    def _judge(self, run, findings: list[Finding], only: tuple | None = None, trigger: str = "") -> bool:
        """Print what became stable; True when something was shown."""
        s = self.state
        covered = self.tail.step
        steps = run.steps
        if len(steps) and "duration_s" in steps:
            durations = steps["duration_s"].dropna()
            s.median_step_s = float(durations.median()) if len(durations) else None
        if only is None:
            s.ledger_line = _ledger_line(run)
        floor = self.options.min_severity
        roots = [
            f
            for f in findings
            if f.cause is None and _at_least(f.severity, floor) and not f.id.startswith(NOT_CAUSES)
        ]
        stable = []
        for f in roots:
            first = self._seen.setdefault(f.id, covered)
            proven = (
                any(k in f.id for k in _PROVEN_AT_ONCE)
                or len(set(f.steps_affected)) >= 2
                or covered >= STABLE_AFTER_STEPS
            )
            if proven or covered > first:
                stable.append(f)
        if only is None or roots:  # a partial analysis says nothing of the other analyzers
            s.top = roots[0] if roots else s.top if only else None
        if only is None:
            self._watch_near(findings, covered)
        new = [f for f in stable if f.id not in self._printed]
        if new:
            try:  # the step on the screen when it is printed, not the one the analysis read
                self.tail.poll()
            except Exception:
                pass
        s.step = max(s.step, self.tail.step)
        for f in new:
            self._printed.add(f.id)
            s.stable.append(f.id)
            self._shown[f.id] = {
                "t_ns": time.time_ns(),
                "step": s.step,
                "analysed_step": covered,
                "trigger": trigger,
                "severity": f.severity,
                "title": f.title,
            }
            self.on_finding(f, s)
            kernel = (f.evidence or {}).get("kernel")
            if isinstance(kernel, str) and any(k in f.id for k in _PROVEN_AT_ONCE):
                self.tail.judged_kernels.add(kernel)
            if f.analyzer in CAPTURE_ANALYZERS:  # a straggler, an idle GPU: capture it
                self._anomaly(f.analyzer, f.title)
        if new:
            self._write_shown()
        unconfirmed = [f for f in roots if f not in stable]
        if unconfirmed or (only is not None and new):
            # seen once, or found by one analyzer alone: judged again at the next step end
            why = unconfirmed[0].id if unconfirmed else f"{new[0].id} found by {only}"
            self._pending.setdefault("confirm", why)
        if (
            self.options.until_diagnosed and roots and s.stop_requested_at is None and only is None
        ):  # the top is only known from a full analysis
            top = roots[0]
            pending = [
                f
                for f in roots
                if f not in stable and _severity_rank(f.severity) >= _severity_rank(top.severity)
            ]
            if top.id != self._top[0]:
                self._top = (top.id, covered)  # first seen as the top at this step count
            if top in stable and not pending and self._top_held(top, covered):
                at = self._stop_step()
                request_stop(self.run_dir, at, f"diagnosed: {top.id}")
                s.stop_requested_at = at
        return bool(new)

    def _watch_near(self, findings: list[Finding], covered: int) -> None:
        """A root finding one severity below the floor, not printed yet, is judged again once
        the record has grown by GROW_FACTOR: a share of the step measured over the first few
        steps can still hold a warm-up (minGPT's first optimizer step is 5x the others, so a
        per-step gc.collect() read medium at step 3 and high from step 5; the next pass was due
        at the 30 s cadence, after the job). Geometric growth keeps it to a few passes over
        any run, within the budget."""
        floor = _severity_rank(self.options.min_severity)
        near = [
            f
            for f in findings
            if f.cause is None
            and _severity_rank(f.severity) == floor - 1
            and f.id not in self._printed
            and not f.id.startswith(NOT_CAUSES)
        ]
        self._near = near[0].id if near else ""
        self._grow_at = max(covered + 1, math.ceil(GROW_FACTOR * covered)) if near else 0

    def _top_held(self, top: Finding, covered: int) -> bool:
        """Whether the top root finding can be the diagnosis. A generic finding - one at a line
        (host code at a line, a GPU starved by host work: chains.GENERIC_AT_A_LINE, the
        symptom of a specific finding at that line once one is found) or the per-step judge's
        finding made only while no specialised analyzer made one (step_causes) - can be
        superseded by a specific analyzer that needs more steps (GC pauses made by that line's
        garbage, a checkpoint every 5th step): it is the diagnosis only once it stayed the top
        while the record grew to TOP_HOLD_FACTOR times the steps it became the top at. Until
        then a pass is due once the record has grown that far. Specific findings hold at once."""
        from traindx.analyzers.chains import GENERIC_AT_A_LINE

        if top.id not in GENERIC_AT_A_LINE and top.analyzer != "step_causes":
            return True
        need = max(self._top[1] * TOP_HOLD_FACTOR, self._top[1] + 1)
        if covered >= need:
            return True
        self._hold_until = need
        return False


def _ledger_line(run) -> str | None:
    """The steady steps' mean ledger, its three largest lines ("data 61% · fwd/bwd 30% ...")."""
    try:
        from traindx.derive.ledger import CATEGORIES, LABELS

        ledger = run.ledger
        if not len(ledger):
            return None
        steady = ledger[ledger["step"] > ledger["step"].min()] if ledger["step"].nunique() > 2 else ledger
        wall = float(steady["wall_s"].sum())
        if wall <= 0:
            return None
        parts = []
        for c in list(CATEGORIES) + ["unexplained"]:
            col = f"{c}_s"
            if col in steady:
                parts.append((float(steady[col].sum()) / wall, LABELS.get(c, c)))
        parts.sort(reverse=True)
        return " · ".join(f"{label} {share:.0%}" for share, label in parts[:3] if share >= 0.01)
    except Exception:
        return None
