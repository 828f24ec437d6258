"""The per-type columnar event tables: the same events a json.loads reading gives, ranks from the
per-process files, file order kept on ties, bad lines handled, a Parquet cache that follows the
raw files, and per-file clock offsets applied to every timestamp."""

import json
import os
import shutil
import sys
import warnings

import pandas as pd
import pytest

from traindx.derive.run import CorruptEvidenceWarning, TruncatedEvidenceWarning, load_run
from traindx.profiler import columnar
from traindx.profiler.columnar import CACHE_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


def _null(v):
    return not isinstance(v, (dict, list)) and pd.isna(v)


def reference_events(run_path, labels):
    """{type: [event dicts with rank]} read line by line with json.loads, in (t, file, line)
    order: what the columnar reader must reproduce."""
    rows = []
    for i, x in enumerate(columnar.event_files(run_path)):
        stem = os.path.basename(x.path)[: -len(".jsonl")]
        label = (
            labels.get(int(stem[1:].split(".")[0]))
            if stem.startswith("p") and stem[1:].split(".")[0].isdigit()
            else stem
        )
        if label is None:
            continue
        with open(x.path, encoding="utf-8") as f:
            for n, line in enumerate(f):
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(e, dict) or not columnar.valid_event(e):
                    continue
                e["rank"] = label
                rows.append((e["t"], i, n, e))
    out = {}
    for _, _, _, e in sorted(rows, key=lambda r: r[:3]):
        out.setdefault(e["type"], []).append(e)
    return out


def assert_same(run, expected):
    assert set(run.tables.types) == set(expected)
    for typ, events in expected.items():
        got = run.of_type(typ)
        assert len(got) == len(events), typ
        for col in {k for e in events for k in e}:
            values = [e.get(col) for e in events]
            if all(v is None for v in values):
                continue
            for a, b in zip(values, got[col]):
                assert (a is None and _null(b)) or a == b, (typ, col, a, b)


@pytest.mark.parametrize(
    "name", ["h200-seed-b17-tensor", "h200-fa4-int-cold-start", "h200-gpu-pathologies/alloc_retries"]
)
def test_same_events_as_json_loads_on_real_runs(name, tmp_path):
    path = shutil.copytree(os.path.join(DATA, name), tmp_path / "run")
    run = load_run(path)
    assert_same(run, reference_events(str(path), run.labels))
    # nested fields the analyzers read stay Python objects
    compiles = run.of_type("compile")
    if len(compiles):
        assert isinstance(compiles.iloc[0]["key_fields"], dict)
        assert isinstance(run.compiles.iloc[0]["caller"], dict)
    assert list(run.steps["step"]) == sorted(run.steps["step"])
    # the wide table of every type is still there for whoever needs it
    assert len(run.events) == sum(len(v) for v in reference_events(str(path), run.labels).values())


def _synthetic(tmp_path, ranks=4, steps=60):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import synth_run

    return synth_run.write_run(str(tmp_path / "run"), ranks=ranks, steps=steps, seed=1)


def test_per_process_files_heterogeneous_fields_and_ties(tmp_path):
    path = _synthetic(tmp_path)
    # a field that is a number in one line and text in another (Arrow cannot type it: that
    # file falls back to json.loads), an event type of its own, two events at the same t
    with open(os.path.join(path, "events", "p10001.jsonl"), "a") as f:
        f.write(json.dumps({"type": "shim_error", "where": "gc", "error": 3, "t": 1}) + "\n")
        f.write(json.dumps({"type": "shim_error", "where": "alloc", "error": "boom", "t": 1}) + "\n")
        f.write(json.dumps({"type": "signal", "signum": 15, "t": 1}) + "\n")
    # a launcher process with no training evidence: not a rank
    with open(os.path.join(path, "events", "p9999.jsonl"), "w") as f:
        f.write(json.dumps({"type": "process_start", "pid": 9999, "argv": ["torchrun"], "t": 5}) + "\n")
    run = load_run(path)
    assert run.ranks == ["0", "1", "2", "3"]
    assert pd.isna(run.processes.set_index("pid").loc[9999, "label"])
    assert_same(run, reference_events(path, run.labels))
    errors = run.of_type("shim_error")
    assert list(errors["error"]) == [3, "boom"] and list(errors["where"]) == ["gc", "alloc"]
    assert list(run.events["type"][:3]) == ["shim_error", "shim_error", "signal"]
    # steps: each end paired with its rank's begin; 4 ranks x 60 steps
    assert len(run.steps) == 240 and run.steps["duration_s"].notna().all()
    assert set(run.spans["cat"]) == {"data", "backward", "optimizer"}


def test_truncated_last_line_warns_corrupt_middle_line_is_skipped(tmp_path):
    path = _synthetic(tmp_path, ranks=2, steps=10)
    events = os.path.join(path, "events", "p10000.jsonl")
    with open(events, "a") as f:
        f.write('{"type": "step_begin", "step": 10, "t": 18')  # the job was killed mid-write
    with pytest.warns(TruncatedEvidenceWarning, match="last line is truncated"):
        run = load_run(path)
    assert len(run.rank_steps("0")) == 10
    with open(events) as f:
        lines = f.read().split("\n")
    lines[5] = lines[5][:-7]  # a flat line cut in the middle of the file
    with open(events, "w") as f:
        f.write("\n".join(lines[:-1]) + "\n")
    with pytest.warns(CorruptEvidenceWarning, match=r"p10000.jsonl: corrupt line 6 skipped"):
        run = load_run(path)
    assert_same(run, reference_events(path, run.labels))


def test_parquet_cache_is_used_and_follows_the_raw_files(tmp_path):
    path = _synthetic(tmp_path, ranks=3, steps=30)
    raw = {
        p: open(os.path.join(path, "events", p), "rb").read()
        for p in os.listdir(os.path.join(path, "events"))
    }
    first = load_run(path, cache=True)
    index = os.path.join(path, CACHE_DIR, "index.json")
    assert os.path.exists(index)
    steps, compiles = first.steps, first.compiles
    # a hit gives the same tables, nested values decoded again, without parsing the JSONL
    cached = load_run(path, cache=True)
    assert cached.tables._cached is not None
    pd.testing.assert_frame_equal(steps, cached.steps)
    assert isinstance(cached.compiles.iloc[0]["key_fields"], dict)
    assert list(cached.compiles["key_fields"]) == list(compiles["key_fields"])
    pd.testing.assert_frame_equal(first.ledger, cached.ledger)
    # keyed by the raw files: names, sizes, mtimes, nodes and clock offsets
    files = json.loads(json.load(open(index))["fingerprint"])["files"]
    assert sorted(f[0] for f in files) == [os.path.join("events", p) for p in sorted(raw)]
    # a raw file that grows invalidates it
    with open(os.path.join(path, "events", "p10002.jsonl"), "a") as f:
        f.write(json.dumps({"type": "stop_requested", "t": 2_000_000_000_000_000_000}) + "\n")
    before = json.load(open(index))["fingerprint"]
    grown = load_run(path, cache=True)
    assert len(grown.of_type("stop_requested")) == 1
    assert json.load(open(index))["fingerprint"] != before  # parsed again, cache rewritten
    # raw files are never rewritten by the loader
    for p, content in raw.items():
        now = open(os.path.join(path, "events", p), "rb").read()
        assert now == content or (p == "p10002.jsonl" and now.startswith(content))
    # a run folder that cannot take the cache: the tables are all still there
    ro = _synthetic(tmp_path / "ro", ranks=2, steps=8)
    os.makedirs(os.path.join(ro, "tables"))
    with open(os.path.join(ro, CACHE_DIR), "w") as f:
        f.write("not a folder")
    with open(os.path.join(ro, CACHE_DIR + f".tmp{os.getpid()}"), "w") as f:
        f.write("not a folder either")
    kept = load_run(ro, cache=True)
    assert len(kept.steps) == 16 and len(kept.of_type("gc")) and len(kept.spans) == 48
    # small runs write no cache unless asked
    other = _synthetic(tmp_path / "small", ranks=2, steps=5)
    load_run(other)
    assert not os.path.exists(os.path.join(other, CACHE_DIR))


def test_clock_offsets_shift_every_timestamp_of_their_file(tmp_path, monkeypatch):
    path = _synthetic(tmp_path, ranks=2, steps=20)
    plain = load_run(path)
    listed = columnar.event_files

    def shifted(run_path, manifest=None):  # rank 1's host clock runs 3 s ahead: add -3 s to its events
        return [
            x._replace(offset_ns=-3_000_000_000) if x.rel.endswith("p10001.jsonl") else x
            for x in listed(run_path, manifest)
        ]

    monkeypatch.setattr(columnar, "event_files", shifted)
    run = load_run(path)
    for table in ("steps", "spans", "compiles"):
        a, b = (
            getattr(r, table).sort_values(["rank", "start_ns"], kind="stable").reset_index(drop=True)
            for r in (plain, run)
        )
        col = "start_ns"
        delta = (b[col] - a[col]).groupby(a["rank"]).unique()
        assert list(delta["0"]) == [0] and list(delta["1"]) == [-3_000_000_000], table
    gc = run.of_type("gc")
    assert gc["t"].is_monotonic_increasing  # the order is by the corrected time
    pd.testing.assert_frame_equal(
        plain.ledger.drop(columns=["start_ns", "end_ns"]), run.ledger.drop(columns=["start_ns", "end_ns"])
    )


def test_steps_pairing_matches_the_event_by_event_definition(tmp_path):
    path = tmp_path / "run"
    (path / "events").mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"command": ["x"]}))
    lines = [
        {"type": "process_start", "pid": 7, "rank": "0", "argv": ["x"], "t": 0},
        {"type": "step_begin", "step": 0, "t": 10},
        {"type": "step_end", "step": 0, "t": 20},
        {"type": "step_end", "step": 1, "t": 25},  # no begin: NaN start
        {"type": "step_begin", "step": 0, "t": 30},  # a restarted counter
        {"type": "step_end", "step": 0, "t": 45},
        {"type": "step_begin", "step": 2, "t": 50},
        {"type": "step_end", "step": 2, "t": 50},
    ]
    (path / "events" / "p7.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps = load_run(path).steps
    assert list(steps["step"]) == [0, 1, 0, 2]
    assert list(steps["end_ns"]) == [20, 25, 45, 50]
    assert steps["start_ns"].tolist()[0] == 10 and pd.isna(steps["start_ns"].tolist()[1])
    assert steps["start_ns"].tolist()[2:] == [30, 50]
    assert steps["duration_s"].tolist()[2:] == [15e-9, 0.0]
