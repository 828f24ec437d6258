"""The live judgement's rolling window (traindx.derive.so_far): a long run's live state stays bounded,
and a pass over the window is the batch analysis of the window's rows."""

import json
import math
import os

import pandas as pd
import pytest
from records import FakeClock

from traindx.analyzers import analyze
from traindx.derive.run import load_run
from traindx.derive.so_far import PER_STEP_TYPES, TRIM_SLACK, EventsSoFar

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpu-gc-freeze-pair", "base")
TIME_FIELDS = ("t", "start", "t0")


def _recording():
    """(manifest, header lines through step 0, [the lines of each steady step], the period in
    ns): a real recorded CPU job (a GC storm, 30 steps)."""
    (name,) = os.listdir(os.path.join(SRC, "events"))
    events = [json.loads(line) for line in open(os.path.join(SRC, "events", name))]
    begins = [i for i, e in enumerate(events) if e.get("type") == "step_begin"]
    header = events[: begins[1]]
    # each steady step: its begin to the next step's begin (the last begin has no end), its
    # per-step events (a one-off event repeated would be a run that grows them)
    blocks = [
        [e for e in events[a:b] if e.get("type") in PER_STEP_TYPES] for a, b in zip(begins[1:], begins[2:])
    ]
    period = events[begins[-1]]["t"] - events[begins[1]]["t"]
    manifest = json.load(open(os.path.join(SRC, "manifest.json")))
    manifest.update(status="running", end_ns=None, exit_code=None)
    return manifest, name, header, blocks, period


def _step_lines(header, blocks, period, first, count):
    """The lines of steps first..first+count-1 of an endless run made of the recording's steady
    steps repeated, each copy later by one period, its step numbers counted on."""
    out = [json.dumps(e) for e in header] if first == 0 else []
    n = len(blocks)
    for k in range(max(first, 1), first + count):
        copy, i = divmod(k - 1, n)
        for e in blocks[i]:
            e = dict(e)
            for f in TIME_FIELDS:
                if isinstance(e.get(f), int):
                    e[f] += copy * (period + 1_000_000)
            if isinstance(e.get("step"), int):
                e["step"] = e["step"] + copy * n
            out.append(json.dumps(e))
    return out


def _write_window_folder(dst, manifest, name, lines, cutoff):
    """A run folder holding what a window starting at `cutoff` keeps: every line of the other
    event types, the per-step types' lines from `cutoff` on (what the batch loader then reads)."""
    os.makedirs(os.path.join(dst, "events"), exist_ok=True)
    with open(os.path.join(dst, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(dst, "events", name), "w") as f:
        for line in lines:
            e = json.loads(line)
            if e.get("type") not in PER_STEP_TYPES or e["t"] >= cutoff:
                f.write(line + "\n")


def _verdicts(run):
    return [(f.id, f.severity, f.title, f.cause) for f in analyze(run)]


@pytest.mark.slow
def test_a_long_growing_run_keeps_a_bounded_window_and_judges_it_as_the_batch_does(tmp_path):
    """A run growing to 3000 steps, read every 150 steps with a 40-step window: the rows held
    and their bytes stop growing once the window is full, the steps a pass sees stay within the
    window (plus its slack), the steps trimmed off are counted; and at the end the pass's
    tables and findings are the batch loader's of the window's rows."""
    manifest, name, header, blocks, period = _recording()
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "events")
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    keep, total, piece = 40, 3000, 150
    so_far = EventsSoFar(keep_steps=keep)
    held, written = [], []
    for first in range(0, total, piece):
        lines = _step_lines(header, blocks, period, first, piece)
        written += lines
        with open(run_dir / "events" / name, "a") as f:
            f.write("\n".join(lines) + "\n")
        run = load_run(str(run_dir), cache=False, so_far=so_far)
        steps = run.steps
        assert keep <= len(steps) <= keep * (1 + TRIM_SLACK) + 1
        assert so_far.steps_dropped + len(steps) == first + piece  # every step counted once
        held.append(so_far.kept_rows())
    # bounded: after the window first filled, the rows held do not grow with the run
    assert max(held[2:]) <= 1.1 * min(held[2:])
    assert max(held) < len(written) / 10
    assert so_far.dropped["span"] > 0 and so_far.dropped["gc"] > 0
    # the last pass = the batch analysis of the rows the window holds
    cutoff = int(steps["start_ns"].min())
    batch_dir = tmp_path / "window"
    _write_window_folder(str(batch_dir), manifest, name, written, cutoff)
    batch = load_run(str(batch_dir), cache=False)
    assert run.tables.types == batch.tables.types
    for typ in batch.tables.types:
        pd.testing.assert_frame_equal(run.tables.frame(typ), batch.tables.frame(typ), check_like=True)
    pd.testing.assert_frame_equal(run.steps, batch.steps)
    pd.testing.assert_frame_equal(run.ledger, batch.ledger)
    found = _verdicts(run)
    assert found == _verdicts(batch)
    # the GC storm of the recording is still what the window's pass finds
    assert any(fid.startswith("gc.") for fid, *_ in found)


def _replay(src, dst, judge_options, on_analysis=None):
    """A recorded run written again into `dst`, event by event in time order, a LiveJudge
    polled at every step end on a clock that is the events' own time. Returns the judge and
    [(finding id, step on screen)]."""
    from traindx.analyzers.live.live import LiveJudge

    events = []
    for name in os.listdir(os.path.join(src, "events")):
        for n, line in enumerate(open(os.path.join(src, "events", name), encoding="utf-8")):
            events.append((json.loads(line)["t"], name, n, line))
    events.sort()
    os.makedirs(os.path.join(dst, "events"))
    manifest = json.load(open(os.path.join(src, "manifest.json")))
    json.dump(
        dict(manifest, status="running", end_ns=None, exit_code=None),
        open(os.path.join(dst, "manifest.json"), "w"),
    )
    now = [manifest["start_ns"] / 1e9]
    shown = []
    judge = LiveJudge(
        dst,
        judge_options,
        on_finding=lambda f, s: shown.append((f.id, s.step)),
        on_analysis=on_analysis,
        clock=lambda: now[0],
    )
    handles = {}
    for t, name, _, line in events:
        f = handles.get(name) or handles.setdefault(name, open(os.path.join(dst, "events", name), "a"))
        f.write(line)
        if '"step_end"' in line:
            f.flush()
            now[0] = max(now[0], t / 1e9)
            judge.step_once()
    for f in handles.values():
        f.close()
    return judge, shown


@pytest.mark.slow
def test_without_room_for_every_analyzer_a_slow_step_is_judged_by_its_categorys_first(tmp_path):
    """A recorded GC storm replayed with a budget that has room for a pass of a few analyzers
    but never for a full one (the budget's arithmetic fixed, so that CPU noise decides
    nothing): the slow step's span line is mostly GC, so its pass runs the GC analyzer alone
    and shows the GC finding; once the budget has room, the full pass confirms it on the same
    record, and the last full pass (the run through its end, within the window) finds what
    the batch analysis of the finished run finds."""
    from traindx.analyzers.live.live import CATEGORY_ANALYZERS, LiveJudge, LiveOptions

    finals = []
    room = {"s": 0.2}

    def expected(self, only):  # a full pass costs 1 s, a routed one 0.1 s
        return 1.0 if only is None else 0.1

    def has_room(self, cost):
        return cost <= room["s"]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(LiveJudge, "_expected", expected)
        m.setattr(LiveJudge, "_room", has_room)
        judge, shown = _replay(
            SRC,
            str(tmp_path / "run"),
            LiveOptions(report_every=1),
            on_analysis=lambda run, findings: finals.append(findings),
        )
        assert not judge.errors, judge.errors
        passes = judge.state.passes
        assert passes and all(p["analyzers"] != "all" for p in passes)
        gc_found = [fid for fid, _ in shown if fid.startswith("gc.")]
        assert gc_found, (shown, passes)
        by_gc = next(p for p in passes if "gc_pauses" in p["analyzers"])
        assert by_gc["analyzers"] == list(CATEGORY_ANALYZERS["gc"])
        assert set(by_gc["trigger"].split("+")) <= {"slow_step", "line", "steps"}
        assert "confirm" in judge._pending  # shown, waiting for the full pass
        room["s"] = 10.0
        judge.step_once()  # the same record: no new step needed
        assert judge.state.passes[-1]["analyzers"] == "all"
        assert "confirm" in judge.state.passes[-1]["trigger"]
        judge.step_once(force=True)  # the end: a full pass over the record
    batch = analyze(load_run(str(tmp_path / "run"), cache=False))
    assert [(f.id, f.severity, f.title, f.cause) for f in finals[-1]] == [
        (f.id, f.severity, f.title, f.cause) for f in batch
    ]


@pytest.mark.slow
@pytest.mark.parametrize("full_s, routed_first", [(1.0, True), (0.01, False)])
def test_a_full_pass_longer_than_three_steps_is_preceded_by_the_routed_one(tmp_path, full_s, routed_first):
    """The same recorded GC storm (steps of ~30 ms), the budget always with room: when a full
    pass is expected to cost as long as 3 of the job's steps (1 s of CPU), each trigger is
    judged first by the analyzers of the category standing out in it (a finding on screen
    that many steps sooner), and its triggers stay pending, so the full pass follows at the
    next step end whatever the routed pass showed; a full pass shorter than that (10 ms) runs
    at once, with nothing routed."""
    from traindx.analyzers.live.live import SHOW_WITHIN_STEPS, LiveJudge, LiveOptions

    def expected(self, only):
        return full_s if only is None else full_s / 10

    with pytest.MonkeyPatch.context() as m:
        m.setattr(LiveJudge, "_expected", expected)
        m.setattr(LiveJudge, "_room", lambda self, cost: True)
        judge, shown = _replay(SRC, str(tmp_path / "run"), LiveOptions(report_every=0))
    assert not judge.errors, judge.errors
    passes = judge.state.passes
    step_s = judge.tail.median_step_s()
    assert step_s and (full_s >= SHOW_WITHIN_STEPS * step_s) == routed_first
    routed = [i for i, p in enumerate(passes) if p["analyzers"] != "all"]
    if not routed_first:
        assert passes and not routed, passes
        return
    assert routed and routed[0] == 0, passes  # the first judgement went routed
    for i in routed:
        assert i + 1 < len(passes), passes
        after = passes[i + 1]
        # the full pass judged what the routed one did (its triggers were kept pending)
        assert after["analyzers"] == "all", passes
        assert set(passes[i]["trigger"].split("+")) - {"confirm"} <= set(after["trigger"].split("+")), passes
    assert any(fid.startswith("gc.") for fid, _ in shown), (shown, passes)


def test_the_budget_starts_with_three_full_passes_at_their_measured_cost(tmp_path):
    """A job's first seconds hold START_PASSES full passes at the cost the last one measured
    (0.4 s each on a slow host: 1.2 s, where a share of a few seconds would hold none); over a
    long run the share of one core decides."""
    from traindx.analyzers.live.live import START_PASSES, LiveJudge, LiveOptions

    clock = FakeClock(0)  # the judge's seconds since the job started: the test moves them
    judge = LiveJudge(str(tmp_path), LiveOptions(cpu_share=0.02), clock=clock)
    judge._cost[None] = 0.4
    assert START_PASSES == 3
    assert judge._room(1.2) and not judge._room(1.25)
    judge.state.analysis_cpu_s = 0.8  # two passes spent: one left
    assert judge._room(0.4) and not judge._room(0.45)
    clock.advance(200.0)  # 2 % of 200 s: 4 s
    assert judge._room(3.2) and not judge._room(3.25)


COLD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cold-first-step")


def test_a_finding_just_below_the_floor_is_judged_again_as_the_record_grows(tmp_path):
    """A recorded job (tests/data/cold-first-step.README): a per-step gc.collect() behind a
    one-off first steady step 10x the others, replayed step by step with the live budget as it
    is. The first judgement (step 3, the GC standing out in the span line) reads the collection
    as medium: the one-off is still in the steady window. Nothing else would judge again
    before the 30 s cadence (a ~5 s job); the record grown by GROW_FACTOR, it is judged again,
    reads high and is shown."""
    from traindx.analyzers.live.live import GROW_FACTOR, LiveOptions

    judge, shown = _replay(COLD, str(tmp_path / "run"), LiveOptions(report_every=0))
    assert not judge.errors, judge.errors
    passes = judge.state.passes
    first = passes[0]
    assert (first["trigger"], first["step"], first["analyzers"]) == ("steps", 3, "all"), passes
    grown = [p for p in passes if "grown" in p["trigger"]]
    assert grown and grown[0]["analyzers"] == "all", passes
    assert grown[0]["step"] <= math.ceil(GROW_FACTOR * 3) + 1, passes
    assert [fid for fid, _ in shown] == ["gc.gen2_in_step"], shown
    assert shown[0][1] == grown[0]["step"], (shown, passes)
    # one pass for the growth, not one per step
    assert len(passes) <= 3, passes
