"""Long runs stay bounded (docs/long-runs.md): segments, gzip, thinning, drops and py-spy windows
keep a run folder under its disk budget without losing track of what was there."""

import gzip
import json
import os
import shutil
import statistics
import subprocess
import threading
import time

import pytest
from helpers import PY, ROOT

from traindx.profiler import rolling
from traindx.profiler.shim._traindx_shim import segments as seg
from traindx.profiler.shim._traindx_shim.writer import EventWriter
from traindx.profiler.speedscope import Frame, ThreadSamples

CATS = ("data", "backward", "optimizer")


def _write_steps(events_dir, monkeypatch, steps, segment_bytes):
    """A real shim writer writing `steps` steps of a training loop: step_begin, a data wait, a
    backward in two calls (gradient accumulation), an optimizer step, step_end."""
    monkeypatch.setenv(seg.SEGMENT_BYTES_ENV, str(segment_bytes))
    writer = EventWriter(str(events_dir))
    t = 1_000_000_000
    for step in range(steps):
        writer.emit("step_begin", step=step, t=t)
        for cat, dur in (
            ("data", 300_000),
            ("backward", 2_000_000),
            ("backward", 2_000_000),
            ("optimizer", 500_000),
        ):
            writer.emit("span", cat=cat, start=t, t=t + dur, tid=7)
            t += dur + 100_000
        writer.emit("step_end", step=step, t=t, duration_s=0.005, source="torch.optim")
        if step % 200 == 0:
            writer.flush()
    writer.flush()
    return writer.path


def _events(head):
    return [json.loads(line) for line in rolling.read_text(head).splitlines() if line.strip()]


def _span_seconds(events):
    """{(step, cat): seconds} with spans assigned to the step they fall in."""
    out, step = {}, None
    for e in sorted(events, key=lambda e: (e["t"], e["type"] != "step_begin")):
        if e["type"] == "step_begin":
            step = e["step"]
        elif e["type"] == "span":
            out[(step, e["cat"])] = out.get((step, e["cat"]), 0) + (e["t"] - e["start"])
    return out


def test_events_roll_gzip_thin_then_drop_and_say_what_went(tmp_path, monkeypatch):
    steps = 3000
    head = _write_steps(tmp_path, monkeypatch, steps, segment_bytes=40_000)
    segs = seg.segments(head)
    assert len(segs) >= 10
    for _, path, _ in segs:  # every segment ends on a whole line
        assert open(path).read().endswith("\n")
    original = rolling.read_text(head)
    assert len(_events(head)) == steps * 6

    # within budget: closed segments past the last 2 are gzipped, nothing is lost
    rolling.settle(head, keep=2, cap=10**9, thin=rolling.thin_events, live=False)
    after = seg.segments(head)
    assert [gz for _, _, gz in after][-2:] == [False, False] and all(gz for _, _, gz in after[:-2])
    assert rolling.read_text(head) == original
    assert not os.path.exists(seg.summary_path(head))

    # over budget: the oldest gzipped segments are thinned: the backward pair of each step
    # becomes one span with their summed time; the step table is whole
    before = rolling.family_bytes(head)
    expected = _span_seconds(_events(head))
    rolling.settle(head, keep=2, cap=before - 1, thin=rolling.thin_events, live=False)
    thinned = _events(head)
    assert sorted(e["step"] for e in thinned if e["type"] == "step_end") == list(range(steps))
    assert _span_seconds(thinned) == expected
    assert any(e.get("merged") == 2 for e in thinned)
    summary = json.load(open(seg.summary_path(head)))
    assert summary["thinned"]["segments"] >= 1 and summary["thinned"]["spans_merged"] > 0

    # far over budget: gzipped segments are dropped, oldest first, never the head or the kept
    # ones; the summary accounts for every dropped step
    head_text = open(head).read()
    floor = sum(os.path.getsize(p) for p in [head] + [p for _, p, gz in seg.segments(head) if not gz])
    cap = floor + 2_000
    rolling.settle(head, keep=2, cap=cap, thin=rolling.thin_events, live=False)
    assert rolling.family_bytes(head) <= cap
    assert open(head).read() == head_text
    summary = json.load(open(seg.summary_path(head)))
    left = sorted(e["step"] for e in _events(head) if e["type"] == "step_end")
    dropped = summary["dropped"]
    assert dropped["steps"] > 0 and len(left) + dropped["steps"] == steps
    assert set(left) | set(range(dropped["first_step"], dropped["last_step"] + 1)) == set(range(steps))
    assert left[-1] == steps - 1 and left[0] == 0


def test_the_log_thins_to_the_jobs_step_lines_and_the_dumps_to_their_top_frames(tmp_path):
    log = rolling.RollingLines(str(tmp_path / "log.txt"), segment_bytes=4000)
    t = 1_796_000_000_000_000_000
    for step in range(400):
        log.write(f"{t + step} o step {step} loss {1 / (step + 1):.4f}\n")
        log.write(f"{t + step} e [W] a warning the job prints every step, {step}\n")
    log.close()
    head = log.head
    rolling.settle(head, keep=1, cap=10**9, thin=rolling.thin_log(), live=False)  # gzip only
    rolling.settle(head, keep=1, cap=rolling.family_bytes(head) - 1, thin=rolling.thin_log(), live=False)
    lines = rolling.read_text(head).splitlines()
    steps = [int(l.split()[3]) for l in lines if " o step " in l]
    summary = json.load(open(seg.summary_path(head)))
    # the thinned segments keep every step line and lose the warnings
    assert summary["thinned"]["lines_dropped"] > 0 and "dropped" not in summary
    assert steps == list(range(400))
    assert len(lines) == 800 - summary["thinned"]["lines_dropped"]

    dumps = rolling.RollingLines(str(tmp_path / "p1-dump.jsonl"), segment_bytes=3000)
    frames = [{"name": f"f{i}", "filename": "train.py", "line": i} for i in range(30)]
    for i in range(60):
        dumps.write(
            json.dumps(
                {
                    "t": t + i,
                    "pid": 1,
                    "threads": [
                        {
                            "thread_id": 1,
                            "thread_name": "MainThread",
                            "active": True,
                            "owns_gil": i % 2 == 0,
                            "frames": frames,
                        }
                    ],
                }
            )
            + "\n"
        )
    dumps.close()
    head = dumps.head
    rolling.settle(head, keep=1, cap=10**9, thin=rolling.thin_dumps, live=False)
    rolling.settle(head, keep=1, cap=rolling.family_bytes(head) - 1, thin=rolling.thin_dumps, live=False)
    snaps = [json.loads(l) for l in rolling.read_text(head).splitlines()]
    assert [s["t"] - t for s in snaps] == list(range(60))  # the GIL timeline is whole
    depth = [len(s["threads"][0]["frames"]) for s in snaps]
    assert depth[0] == 30 and depth[-1] == 30 and 3 in depth  # the head and the last kept whole
    assert [s["threads"][0]["owns_gil"] for s in snaps] == [i % 2 == 0 for i in range(60)]


def test_a_progress_bars_carriage_returns_stay_inside_their_log_line(tmp_path):
    """A tqdm/rich bar rewrites itself with '\\r' inside one record line (transformers'
    "Writing model shards" at every save): read back, the head and a gzipped segment keep each
    line whole, every line with its time stamp (the log parser reads the bar's last update)."""
    log = rolling.RollingLines(str(tmp_path / "log.txt"), segment_bytes=300)
    t = 1_796_000_000_000_000_000
    for step in range(12):
        log.write(f"{t + step} e \rWriting shards:   0%| 0/1\rWriting shards: 100%| 1/1\n")
        log.write(f"{t + step} o step {step} loss 1.0\n")
    log.close()
    rolling.settle(log.head, keep=1, cap=10**9, thin=None, live=False)  # older segments gzipped
    lines = [l for l in rolling.read_text(log.head).split("\n") if l]
    assert len(lines) == 24 and all(l.partition(" ")[0].isdigit() for l in lines)
    assert lines[0].endswith("\rWriting shards: 100%| 1/1")


def test_a_kill_between_the_steps_of_rolling_loses_and_duplicates_nothing(tmp_path, monkeypatch):
    head = _write_steps(tmp_path, monkeypatch, 600, segment_bytes=20_000)
    original = rolling.read_text(head)
    n, path, _ = seg.segments(head)[0]
    # killed after the .gz was renamed in but before the plain segment was removed
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    # and killed while writing the next one: a partial temporary file is left
    n2, path2, _ = seg.segments(head)[1]
    with open(path2 + ".gz.tmp", "wb") as f:
        f.write(b"\x1f\x8b partial")
    assert rolling.read_text(head) == original
    rolling.settle(head, keep=1, cap=10**9, thin=rolling.thin_events, live=False)
    assert rolling.read_text(head) == original
    # a thinning that was cut short leaves its .tmp beside a whole segment
    assert all(not p.endswith(".tmp") for _, p, _ in seg.segments(head))


def _window(frames_weights):
    """{thread: ThreadSamples} from {thread: [(stack of names, weight)]}."""
    out = {}
    for thread, samples in frames_weights.items():
        ts = out.setdefault(thread, ThreadSamples(thread))
        for names, w in samples:
            ts.stacks.append(tuple(Frame(n, "train.py", i + 1) for i, n in enumerate(names)))
            ts.weights.append(w)
    return out


def test_pyspy_windows_fold_into_one_summary_that_keeps_the_whole_runs_proportions(tmp_path):
    from traindx.profiler.speedscope import load

    out = str(tmp_path)
    for n in range(6):  # window n: the main thread in forward (n+1) and backward (2) samples
        samples = {
            'Thread 1 "MainThread"': [(("main", "forward"), 0.05)] * (n + 1)
            + [(("main", "backward"), 0.05)] * 2,
            'Thread 2 "loader"': [(("worker",), 0.05)],
        }
        stacks = {}
        rolling._add(stacks, _window(samples))  # each distinct stack once, its weights summed
        rolling._write_speedscope(rolling.window_path(out, "p9-all", n), stacks, [])
        assert sum(
            sum(ts.weights) for ts in load(rolling.window_path(out, "p9-all", n)).values()
        ) == pytest.approx(0.05 * (n + 4))
    rolling.fold_windows(out, "p9-all", 3)
    assert sorted(os.listdir(out)) == [
        "p9-all.rolled.speedscope.json",
        "p9-all.speedscope.json",
        "p9-all.w000004.speedscope.json",
        "p9-all.w000005.speedscope.json",
    ]
    # a kill after the summary was written but before window 3 was removed
    shutil.copy(rolling.window_path(out, "p9-all", 4), rolling.window_path(out, "p9-all", 3))
    loaded = rolling.load_pyspy(out)
    threads, errors = loaded[("p9", "all")]
    assert not errors
    main = threads['Thread 1 "MainThread"']
    by_leaf = {}
    for stack, w in zip(main.stacks, main.weights):
        by_leaf[stack[-1].name] = by_leaf.get(stack[-1].name, 0) + w
    assert by_leaf["forward"] == pytest.approx(0.05 * (1 + 2 + 3 + 4 + 5 + 6))
    assert by_leaf["backward"] == pytest.approx(0.05 * 2 * 6)
    # folding again (the roll after the kill) takes window 3 as already folded
    rolling.fold_windows(out, "p9-all", 3)
    threads, _ = rolling.load_pyspy(out)[("p9", "all")]
    assert sum(threads['Thread 2 "loader"'].weights) == pytest.approx(0.05 * 6)


def test_a_short_first_window_keeps_the_next_one_whole_and_the_run_reads_in_order(tmp_path):
    """The first py-spy window is short (the live judgement reads a GIL held by another thread
    from it), so the start-up windows are 0 and 1: folding starts at 2, the summary says so, and
    the loader reads window 1 (not folded) before the summary, a window the summary holds once."""
    from traindx.profiler.speedscope import load

    budget = rolling.Budget(window_s=600, first_window_s=20)
    assert budget.window_length(0) == 20 and budget.window_length(1) == 600
    assert budget.startup_windows() == 2 and rolling.Budget(first_window_s=900).startup_windows() == 1
    out = str(tmp_path)
    for n in range(6):  # window n: n+1 samples in a function of its own, 1 in "main"
        stacks = {}
        rolling._add(
            stacks,
            _window({'Thread 1 "MainThread"': [(("main", f"w{n}"), 0.05)] * (n + 1) + [(("main",), 0.05)]}),
        )
        rolling._write_speedscope(rolling.window_path(out, "p9-gil", n), stacks, [])
    rolling.fold_windows(out, "p9-gil", 3, first=budget.startup_windows())
    assert sorted(os.listdir(out)) == [
        "p9-gil.rolled.speedscope.json",
        "p9-gil.speedscope.json",
        "p9-gil.w000001.speedscope.json",
        "p9-gil.w000004.speedscope.json",
        "p9-gil.w000005.speedscope.json",
    ]
    # a kill after the summary was written but before window 2 was removed
    shutil.copy(rolling.window_path(out, "p9-gil", 4), rolling.window_path(out, "p9-gil", 2))
    threads, errors = rolling.load_pyspy(out)[("p9", "gil")]
    assert not errors
    main = threads['Thread 1 "MainThread"']
    weights = {}
    for stack, w in zip(main.stacks, main.weights):
        weights[stack[-1].name] = weights.get(stack[-1].name, 0) + w
    assert weights == pytest.approx({"main": 0.05 * 6, **{f"w{n}": 0.05 * (n + 1) for n in range(6)}})
    # in order: window 0, window 1, the summary (windows 2-3), then 4 and 5
    leaves = [stack[-1].name for stack in main.stacks if stack[-1].name != "main"]
    assert leaves.index("w1") < leaves.index("w2") < leaves.index("w4")
    assert load(rolling.rolled_window_path(out, "p9-gil"))  # a valid speedscope file


def _evidence_bytes(run_dir):
    """What the collectors wrote (analysis outputs are derived and rebuilt at will)."""
    derived = {"report.html", "findings.json", "ledger.csv", "tables"}
    total = 0
    for root, dirs, files in os.walk(run_dir):
        if os.path.relpath(root, run_dir).split(os.sep)[0] in derived:
            continue
        for name in files:
            if os.path.relpath(os.path.join(root, name), run_dir) in derived:
                continue
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _recording(run_dir):
    try:
        with open(run_dir / "manifest.json") as f:
            return json.load(f).get("status") == "running"
    except (OSError, ValueError):
        return False


def _live_warmed(run_dir):
    """Whether the live judge has made its first full analysis."""
    try:
        shown = json.load(open(run_dir / "live.json"))
    except (OSError, ValueError):
        return False
    return shown.get("full_stage_cpu_s", 0) > 0


def _rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None


@pytest.mark.slow
@pytest.mark.serial  # the in-run bound is what the job writes while the launcher's roller waits
# for a core: beside two other tests' jobs on two cores it waited seconds
def test_an_accelerated_long_run_stays_in_its_budget_and_still_analyses(tmp_path):
    """A real job under `diagnose` for 26 s with 2 s windows and a 1 MB budget: the run folder
    stays under the budget, the rolled-off windows and segments are summarised, the report is
    written and every step the job made is either loaded or counted in the summary. (It ran 40 s
    with 3 s windows, 50 s of a serial test: 26 s still folds ~9 windows of py-spy where 5 are
    asked, and leaves ~25 s of the launcher's memory after the live judge's first analysis where
    12 s are asked.)"""
    budget_mb, seconds = 1.0, 26
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop("TRAINDX_RUN_DIR", None)
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "traindx",
            "--run-dir",
            str(run_dir),
            "--quiet",
            "--disk-budget",
            str(budget_mb),
            "--window",
            "2",
            "--keep-windows",
            "2",
            "--",
            PY,
            os.path.join(ROOT, "tests", "jobs", "long_train.py"),
            "--seconds",
            str(seconds),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    samples = []  # (seconds since start, evidence bytes, launcher RSS kB)

    def watch():
        start = time.monotonic()
        while proc.poll() is None:
            if _recording(run_dir):  # the job runs (the analysis after it loads the run)
                samples.append(
                    (
                        time.monotonic() - start,
                        _evidence_bytes(run_dir),
                        _rss_kb(proc.pid),
                        _live_warmed(run_dir),
                    )
                )
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    out, err = proc.communicate(timeout=240)
    watcher.join()
    assert proc.returncode == 0, err[-3000:]
    budget = budget_mb * rolling.MB
    done = int(out.rsplit("done: ", 1)[1].split()[0])

    # disk: under the budget at the end; while running, over it by what the job writes between
    # two settles of the roller (0.75 s here, ~0.2-0.5 MB at this job's rate; seconds more when a
    # loaded machine keeps the launcher's roller from a core, so a single sample's height is the
    # scheduler's, not the roller's). What the roller owes is a level: the evidence does not grow
    # with the run. Without live rolling this job's evidence grows ~50 KB/s, ~0.9 MB between the
    # early and the late third compared here.
    assert _evidence_bytes(run_dir) <= budget, sorted(os.listdir(run_dir))
    during = [(t, b) for t, b, _, _ in samples if t > 5]
    assert len(during) >= 12, during
    third = len(during) // 3
    early = statistics.median(b for _, b in during[:third])
    late = statistics.median(b for _, b in during[-third:])
    assert late <= early + 0.5 * budget, (early, late)
    assert statistics.median(b for _, b in during) <= 2 * budget, during

    # the launcher's memory does not grow with the run (the log, dumps and queues stream to disk)
    # (counted from the live judge's first analysis: its imports, pandas and the analyzers, are a
    # one-off step up that comes later on a loaded machine)
    rss = [(t, r) for t, _, r, warmed in samples if r and warmed]
    # (12 s of them at least: an early and a late stretch that do not overlap)
    assert rss and rss[-1][0] - rss[0][0] >= 12, (
        f"the live judge first analysed {rss[0][0] if rss else None} s in, too late to compare"
    )
    early = [r for t, r in rss if rss[0][0] + 1 < t < rss[0][0] + 7]
    late = [r for t, r in rss if t > rss[-1][0] - 5]
    assert early and late and max(late) - min(early) < 15_000, (early, late)

    # py-spy: the first window, the folded summary, the last ones
    files = os.listdir(run_dir / "pyspy")
    rolled = [f for f in files if f.endswith(".rolled.speedscope.json")]
    assert len(rolled) == 2, files  # --idle and --gil
    doc = json.load(open(run_dir / "pyspy" / rolled[0]))
    assert doc["traindx_folded_through"] >= 5

    from traindx.derive.run import load_run

    run = load_run(run_dir)
    manifest = run.manifest
    assert manifest["budget"]["rank_bytes"] == budget and manifest["budget"]["window_s"] == 2
    # every step the job made is in the step table or counted as dropped, from both ends
    events_summary = [v for k, v in manifest.get("rolled", {}).items() if k.startswith("events")]
    dropped = sum(s.get("dropped", {}).get("steps", 0) for s in events_summary)
    steps = sorted(run.steps["step"])
    assert len(steps) + dropped == done
    assert steps[0] == 0 and steps[-1] == done - 1
    assert dropped == 0 or events_summary[0]["dropped"]["first_step"] > 0
    # py-spy still sees the whole run: the folded summary holds more of the main thread than the
    # kept windows do (>= 5 windows folded, 2 kept), and the loaded run holds all of it. Measured
    # against each other, not against the clock: py-spy takes fewer samples on a loaded machine
    from traindx.profiler.speedscope import load as load_speedscope

    def main_seconds(threads):
        # a window may hold no sample (the last one, cut short by the job's end)
        return max((sum(ts.weights) for ts in threads.values()), default=0.0)

    flavour = rolled[0][: -len(".rolled.speedscope.json")]  # p<pid>-all or p<pid>-gil
    kept = [
        load_speedscope(str(run_dir / "pyspy" / f))
        for f in files
        if f.startswith(flavour + ".w") and f.endswith(".speedscope.json")
    ]
    folded_s = main_seconds(load_speedscope(str(run_dir / "pyspy" / rolled[0])))
    assert kept and folded_s > sum(main_seconds(k) for k in kept), (folded_s, len(kept))
    # the loaded main thread holds all of that thread's folded and kept samples (one thread
    # compared with itself: under load py-spy misses samples of one thread and not another, so
    # the busiest thread of a window is not always the busiest of the run)
    main = max(run.pyspy[("0", flavour.rsplit("-", 1)[1])].values(), key=lambda ts: sum(ts.weights))

    def seconds_of(threads, name):
        return sum(threads[name].weights) if name in threads else 0.0

    folded = load_speedscope(str(run_dir / "pyspy" / rolled[0]))
    assert main.thread in folded, (main.thread, sorted(folded))
    assert (
        sum(main.weights)
        >= seconds_of(folded, main.thread) + sum(seconds_of(k, main.thread) for k in kept) - 1e-6
    )
    assert (run_dir / "findings.json").exists() and (run_dir / "report.html").exists()
    assert any(f.endswith(".gz") for f in os.listdir(run_dir / "events"))  # rolled, not just cut
    print(
        f"\nlong run: {done} steps ({len(steps)} loaded, {dropped} dropped and counted); "
        f"evidence {_evidence_bytes(run_dir)} B at the end, max {max(during)} B while running "
        f"(budget {budget:.0f}); launcher RSS {min(early)} -> {max(late)} kB; py-spy main "
        f"thread {sum(main.weights):.1f} s of {seconds} s; live judge warm {rss[0][0]:.1f} s in, "
        f"{doc['traindx_folded_through']} py-spy windows folded"
    )
