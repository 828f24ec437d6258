"""Live judgement: the analyzers run on the run record while it grows, within a CPU budget.

A cheap stage at every poll reads only the appended bytes and raises triggers (a slow step, a new
compile key, a moved span line); a full stage runs the same loader and analyzers as the end-of-run
analysis (one definition of every judgement) on a trigger, routed first to the analyzers of the
category standing out when a full pass would come too late. Both stay within a share of one core
(`LiveOptions.cpu_share`), counted as process CPU because the Arrow loader parses in threads of its
own. A high finding is handed on once stable (seen in two steady steps; a recompile at once), and
`until_diagnosed` writes `control/stop.json` once the top root is stable. docs/live.md says why
each rule and what it costs."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from traindx.analyzers.core.declaration import catalog
from traindx.analyzers.core.findings import Finding

# what is shown (re-exported: its names are part of the live judgement's)
from traindx.analyzers.live.shown import (  # noqa: F401
    CAPTURE_ANALYZERS,
    GROW_FACTOR,
    NOT_CAUSES,
    PROVEN_AT_ONCE,
    SHOWN_FILE,
    STABLE_AFTER_STEPS,
    STOP_MARGIN_S,
    TOP_HOLD_FACTOR,
    ShownFindings,
)

# the options, state and control files (re-exported: part of the live judgement's names)
from traindx.analyzers.live.state import (  # noqa: F401
    CAPTURE_FILE,
    STOP_FILE,
    WINDOW_STEPS,
    LiveOptions,
    LiveState,
    Routes,
    request_capture,
    request_stop,
    run_is_live,
)

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
from traindx.profiler.proctree import lower_priority

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord
    from traindx.derive.so_far import EventsSoFar

__all__ = [
    "CADENCE_S",
    "CAPTURE_ANALYZERS",
    "CAPTURE_FILE",
    "CATEGORY_ANALYZERS",
    "FULL_PASS_GUESS_S",
    "GROW_FACTOR",
    "LINE_SHIFT",
    "LINE_STEPS",
    "NOT_CAUSES",
    "ROUTED_KINDS",
    "SHOWN_FILE",
    "SHOW_WITHIN_STEPS",
    "STABLE_AFTER_STEPS",
    "START_PASSES",
    "STOP_FILE",
    "TRIGGER_ANALYZERS",
    "WINDOW_STEPS",
    "EventTail",
    "LiveJudge",
    "LiveOptions",
    "LiveState",
    "request_capture",
    "request_stop",
    "run_is_live",
]

# which analyzers judge what: derived from the analyzers' declarations (analyzers/core/declaration.py)
_CATALOG = catalog()
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
TRIGGER_ANALYZERS = _CATALOG.trigger_analyzers
# a slow step, a moved span line or a first line with time outside the model, when the budget
# has no room for every analyzer, is judged by the analyzers that read the span category
# standing out in it (a pass of a fraction of the cost, on screen before the budget refills);
# a full pass confirms it after. Routing evidence to its readers, like a compile to the compile
# analyzer: no verdict here.
CATEGORY_ANALYZERS = _CATALOG.category_analyzers
ROUTED_KINDS = frozenset({"slow_step", "line", "steps", "compile"})
FULL_PASS_GUESS_S = 0.2  # a full pass's CPU before one was measured
# a finding is due on screen within this many steps of the record that shows it (issue 24's
# goal for ledger-based findings); a full pass longer than that many steps goes routed first
SHOW_WITHIN_STEPS = 3
ANALYSES_KEPT = 200  # the per-pass log kept in live.json


class LiveJudge(ShownFindings):
    """Runs the two stages on a growing run folder in a background thread."""

    def __init__(
        self,
        run_dir: str,
        options: LiveOptions = LiveOptions(),
        on_finding: Callable[[Finding, LiveState], None] = lambda f, s: None,
        on_state: Callable[[LiveState], None] = lambda s: None,
        on_analysis: Callable[[RunRecord, list[Finding]], None] | None = None,
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
        self._shown: dict[str, dict[str, Any]] = {}
        self._start = clock()
        # CPU seconds the next analysis is expected to cost: full, or of one analyzer set
        self._cost: dict[Routes, float] = {}
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
        self._so_far: EventsSoFar | None = None  # the events parsed by the passes so far
        # (the top root's id, step count it became top at)
        self._top: tuple[str | None, int] = (None, 0)
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
        lower_priority(threading.get_native_id())  # the judge yields a contended core to the job
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
        try:  # imported in the judge's thread, after the job started (not counted in its budget)
            import importlib

            from traindx import analyzers
            from traindx.derive import run as record  # noqa: F401

            for name in analyzers.REGISTRY + analyzers.JUDGES:
                importlib.import_module(analyzers.MODULES[name])
        except Exception as exc:
            self._error("imports", exc)
        self.state.import_cpu_s = time.process_time() - t0

    def _warm_sources(self) -> None:
        """Parse the job's own scripts once its manifest names them (codefix keeps each file's
        tree per version): the analyzers that place an edit read them at every pass, and the
        end-of-run analysis in any case; a one-time cost like the imports."""
        t0 = time.process_time()
        try:  # imported here, in the judge's thread, like the analyzers (_warm_imports)
            from traindx.analyzers import codefix
            from traindx.analyzers.core.evidence import job_scripts
            from traindx.derive.run import RunRecord
            from traindx.profiler.columnar import EventTables

            with open(os.path.join(self.run_dir, "manifest.json"), encoding="utf-8") as f:
                manifest = json.load(f)
            if isinstance(manifest, dict) and isinstance(manifest.get("command"), list):
                self._sources_warm = True
                no_events = EventTables(files=[], labels_by_file=[], flat={}, nested={})
                for path in job_scripts(RunRecord(path=self.run_dir, manifest=manifest, tables=no_events)):
                    codefix.source_tree(path)
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

    def _expected(self, only: Routes) -> float:
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

    def _due(self, force: bool) -> tuple[str | None, Routes]:
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

    def _full_pass_spans_steps(self, only: Routes) -> bool:
        """Whether the pass of `only` (None: every analyzer) is expected to take as long as
        SHOW_WITHIN_STEPS of the job's steps: the job runs on while it runs, so a finding it
        shows is on screen that many steps after the record it read (its CPU is its wall time
        at best)."""
        step_s = self.tail.median_step_s()
        return only is None and step_s is not None and self._expected(None) >= SHOW_WITHIN_STEPS * step_s

    def _route(self, kinds: set[str]) -> Routes:
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

    def _analyse(self, trigger: str, only: Routes = None) -> None:
        t0 = time.process_time()
        covered = self.tail.step
        judged = self._take_triggers(trigger, only)
        shown = False
        run = None
        findings: list[Finding] = []
        try:  # imported in the judge's thread (_warm_imports), never at the job's start
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
            self._log_pass(trigger, only, covered, time.process_time() - t0)
        self._since_report += 1
        if run is not None and only is None and (shown or self._since_report >= self.options.report_every):
            self._rewrite_report(run, findings)

    def _take_triggers(self, trigger: str, only: Routes) -> set[str]:
        """The pending triggers a pass of `only` judges, taken; the span categories it judges
        (all of those its routes point at that its analyzers read)."""
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
        return judged

    def _log_pass(self, trigger: str, only: Routes, covered: int, cost: float) -> None:
        """A pass's cost in the budget and in live.json's per-pass log."""
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

    def _rewrite_report(self, run: RunRecord, findings: list[Finding]) -> None:
        """The caller's report of a full pass (report.html), lowest priority: only with room for a
        trigger's analysis after it."""
        if (
            self.on_analysis is None
            or not self.options.report_every
            or not self._room(self._report_cost + self._expected(None))
        ):
            return
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
