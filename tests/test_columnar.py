"""The columnar loader gives record.load_run's events table, faster, and caches it as Parquet."""
import json
import os
import shutil
import sys
import warnings

import pandas as pd
import pytest

from traindx.columnar import CACHE, load_events
from traindx.errors import UserError
from traindx.record import TruncatedEvidenceWarning, load_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


def _null(v):
    return not isinstance(v, (dict, list)) and pd.isna(v)


def assert_same_events(expected, got):
    assert set(expected.columns) == set(got.columns)
    assert len(expected) == len(got)
    for col in expected.columns:
        assert expected[col].dtype == got[col].dtype, col
        for a, b in zip(expected[col], got[col]):
            assert (_null(a) and _null(b)) or a == b, (col, a, b)


@pytest.mark.parametrize("name", ["h200-seed-b17-tensor", "h200-fa4-int-cold-start",
                                  "h200-gpu-pathologies/alloc_retries"])
def test_same_table_as_load_run_on_real_runs(name, tmp_path):
    run = shutil.copytree(os.path.join(DATA, name), tmp_path / "run")
    expected = load_run(run).events
    got = load_events(str(run))
    assert_same_events(expected, got)
    # nested fields the analyzers read stay Python objects
    start = got[got["type"] == "process_start"].iloc[0]
    assert isinstance(start["argv"], list)
    compiles = got[got["type"] == "compile"]
    if len(compiles):
        assert isinstance(compiles.iloc[0]["key_fields"], dict)


def _synthetic(tmp_path, ranks=4, steps=60):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import synth_run

    return synth_run.write_run(str(tmp_path / "run"), ranks=ranks, steps=steps, seed=1)


def test_many_ranks_heterogeneous_events_and_ties(tmp_path):
    path = _synthetic(tmp_path)
    # a field that is a number in one line and text in another, an event type with its own
    # fields, and two events at the same t in one file (file order must survive)
    with open(os.path.join(path, "events", "1.jsonl"), "a") as f:
        f.write(json.dumps({"type": "shim_error", "where": "gc", "error": 3, "t": 1}) + "\n")
        f.write(json.dumps({"type": "shim_error", "where": "alloc", "error": "boom", "t": 1}) + "\n")
        f.write(json.dumps({"type": "signal", "signum": 15, "t": 1}) + "\n")
    assert_same_events(load_run(path).events, load_events(path))
    got = load_events(path)
    assert list(got["type"][:3]) == ["shim_error", "shim_error", "signal"]
    assert sorted(got["rank"].unique()) == ["0", "1", "2", "3"]


def test_truncated_last_line_warns_corrupt_middle_line_fails(tmp_path):
    path = _synthetic(tmp_path, ranks=2, steps=10)
    events = os.path.join(path, "events", "0.jsonl")
    with open(events, "a") as f:
        f.write('{"type": "step_begin", "step": 10, "t": 18')  # the job was killed mid-write
    with pytest.warns(TruncatedEvidenceWarning, match="last line is truncated"):
        got = load_events(path)
    with pytest.warns(TruncatedEvidenceWarning):
        assert_same_events(load_run(path).events, got)
    with open(events) as f:
        lines = f.read().split("\n")
    lines[5] = lines[5][:-7]
    with open(events, "w") as f:
        f.write("\n".join(lines))
    with pytest.raises(UserError, match=r"0.jsonl:6: corrupt event line"):
        load_events(path)
    with pytest.warns(TruncatedEvidenceWarning, match="corrupt event line; it was skipped"):
        skipped = load_events(path, corrupt="skip")
    assert len(skipped) == len(got) - 1


def test_parquet_cache_is_used_and_follows_the_raw_files(tmp_path):
    path = _synthetic(tmp_path, ranks=3, steps=30)
    raw = {p: open(os.path.join(path, "events", p), "rb").read()
           for p in os.listdir(os.path.join(path, "events"))}
    first = load_events(path, cache=True)
    assert os.path.exists(os.path.join(path, CACHE))
    # a hit returns the same table, nested values decoded again
    cached = load_events(path, cache=True)
    assert_same_events(first, cached)
    assert isinstance(cached[cached["type"] == "compile"].iloc[0]["key_fields"], dict)
    # keyed by the raw files: their names, sizes and mtimes are in the cache's metadata
    import pyarrow.parquet as pq
    meta = json.loads(pq.read_schema(os.path.join(path, CACHE)).metadata[b"traindx.fingerprint"])
    assert sorted(name for name, _, _ in meta["files"]) == ["0.jsonl", "1.jsonl", "2.jsonl"]
    # a raw file that grows invalidates it
    with open(os.path.join(path, "events", "2.jsonl"), "a") as f:
        f.write(json.dumps({"type": "stop_requested", "t": 2_000_000_000_000_000_000}) + "\n")
    grown = load_events(path, cache=True)
    assert len(grown) == len(first) + 1 and grown.iloc[-1]["type"] == "stop_requested"
    # raw files are never rewritten by the loader
    for p, content in raw.items():
        now = open(os.path.join(path, "events", p), "rb").read()
        assert now == content or (p == "2.jsonl" and now.startswith(content))
