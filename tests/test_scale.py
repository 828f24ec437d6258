"""Scale: the period search gives the brute-force answer in O(N log N); the synthetic run
generator writes a record the analyzers read and find its injected problems in."""

import json
import os
import random
import sys

from traindx.analyzers.model import stability
from traindx.analyzers.model.stability import find_period

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def brute_force_period(steps, durations):
    """The definition, literally (the O(N^3) search find_period replaced)."""
    median = (
        sorted(durations)[len(durations) // 2]
        if len(durations) % 2
        else sum(sorted(durations)[len(durations) // 2 - 1 : len(durations) // 2 + 1]) / 2
    )
    slow = {
        s
        for s, d in zip(steps, durations)
        if d > stability.SLOW_FACTOR * median and d - median > stability.MIN_EXCESS_S
    }
    if len(slow) < stability.MIN_OCCURRENCES:
        return None
    best = None
    for period in range(2, len(steps) // stability.MIN_OCCURRENCES + 1):
        for residue in range(period):
            on = [s for s in steps if s % period == residue]
            hits = [s for s in on if s in slow]
            if len(hits) < stability.MIN_OCCURRENCES:
                continue
            precision, recall = len(hits) / len(slow), len(hits) / len(on)
            if precision < stability.MIN_PRECISION or recall < stability.MIN_RECALL:
                continue
            score = (2 * precision * recall / (precision + recall), -period)
            if best is None or score > best[0]:
                best = (score, period, residue, hits)
    return None if best is None else (best[1], best[2], best[3])


def _case(rng):
    n = rng.randint(8, 160)
    start = rng.randint(0, 40)
    steps = list(range(start, start + n))
    if rng.random() < 0.3:  # gaps: profiled steps left out of the steady window
        steps = [s for s in steps if rng.random() > 0.1]
    if rng.random() < 0.1:  # a restarted step counter repeats step numbers
        steps = steps + steps[: rng.randint(3, 20)]
    durations = [0.1 * rng.uniform(0.95, 1.05) for _ in steps]
    kind = rng.random()
    if kind < 0.6:
        period, residue = rng.randint(2, 30), None
        residue = rng.randrange(period)
        for i, s in enumerate(steps):
            if s % period == residue and rng.random() > rng.choice([0.0, 0.1, 0.3]):
                durations[i] = 0.1 * rng.uniform(2.5, 4)
    n_noise = rng.choice([0, 1, 2, 5, 20])
    for _ in range(n_noise):
        durations[rng.randrange(len(steps))] = 0.1 * rng.uniform(2.5, 4)
    return steps, durations


def test_find_period_matches_brute_force_on_random_patterns():
    rng = random.Random(15)
    found = 0
    for _ in range(400):
        steps, durations = _case(rng)
        expected = brute_force_period(steps, durations)
        assert find_period(steps, durations) == expected, (steps, durations)
        found += expected is not None
    assert found > 50  # the cases exercise the periodic branch, not only "no pattern"


def test_find_period_finds_the_period_of_a_long_run():
    # its speed on this run (milliseconds; the O(N^3) search took hours) is measured by
    # bench/analysis_speed.py: a wall-clock bound here is one another job's load can move
    steps = list(range(20_000))
    durations = [0.25 + (1.5 if s % 50 == 7 else 0.0) + (s % 13) * 1e-4 for s in steps]
    period, residue, hits = find_period(steps, durations)
    assert (period, residue, len(hits)) == (50, 7, 400)


def test_synthetic_run_is_a_run_record_the_analyzers_read(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import synth_run

    from traindx.analyzers import analyze
    from traindx.derive.run import load_run

    path = synth_run.write_run(str(tmp_path / "run"), ranks=4, steps=160, seed=3)
    again = synth_run.write_run(str(tmp_path / "again"), ranks=4, steps=160, seed=3)
    for name in ("events/p10002.jsonl", "log.txt", "nvml.csv"):
        with open(os.path.join(path, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), name  # deterministic
    run = load_run(path)
    assert sorted(run.ranks) == ["0", "1", "2", "3"]
    assert len(run.steps) == 4 * 160
    ids = {}
    for f in analyze(run):
        ids.setdefault(f.id, []).append(f)
    periodic = ids["steps.periodic_slow"]
    assert {f.evidence["period"] for f in periodic} == {synth_run.PERIOD}
    # the cause: the line the job printed inside exactly those steps (rank 0 prints the log)
    lines = [f.evidence.get("log_lines_in_slow_steps") for f in periodic if f.ranks == ("0",)]
    assert lines and lines[0][0]["text"].startswith("saving checkpoint to ckpt/step_N.pt")
    assert lines[0][0]["steps"] == len(periodic[0].evidence["slow_steps"])
    (straggler,) = ids["ranks.straggler"]
    assert straggler.title.startswith("Rank 2 is 25% slower")
    with open(os.path.join(path, "manifest.json")) as f:
        assert json.load(f)["options"]["synthetic"]["slow_rank"] == "2"


def test_large_jobs_analyze_a_sample_of_ranks_that_keeps_the_odd_one(tmp_path, monkeypatch):
    """Past MAX_ANALYZED_RANKS, per-rank analyzers read the first and last rank and the extremes
    of every step-time and ledger measure: the slow rank is among them, the straggler analysis
    still reads every rank, and a finding says what was sampled."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import synth_run

    from traindx.analyzers import analyze
    from traindx.analyzers.core import sampling
    from traindx.derive.run import load_run

    path = synth_run.write_run(str(tmp_path / "run"), ranks=10, steps=160, seed=2)
    monkeypatch.setattr(sampling, "MAX_ANALYZED_RANKS", 4)
    run = load_run(path)
    picked = sampling.representative_ranks(run)
    assert len(picked) == 4 and {"0", "9", "5"} <= set(picked)  # first, last, the slow rank
    findings = analyze(run)
    (note,) = [f for f in findings if f.id == "analysis.ranks_sampled"]
    assert note.evidence["ranks_analyzed"] == picked and note.evidence["ranks"] == 10
    per_rank = {f.ranks[0] for f in findings if f.id == "steps.periodic_slow"}
    assert per_rank and per_rank <= set(picked)
    (straggler,) = [f for f in findings if f.id == "ranks.straggler"]
    assert straggler.title.startswith("Rank 5 is 25% slower")
    # the subset shares the parent's tables, filtered: nothing recomputed
    sub = run.subset(picked)
    assert set(sub.steps["rank"]) == set(picked) and len(sub.ledger) == 4 * 160
    assert set(sub.of_type("gc")["rank"]) == set(picked)
