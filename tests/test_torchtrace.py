"""The torch.profiler trace reader streams a trace into the same table json.load gave."""

import gzip
import json
import os
import sys
import tracemalloc

import pandas as pd
import pytest

from traindx.common.errors import UserError
from traindx.profiler import torchtrace
from traindx.profiler.torchtrace import TRACE_COLUMNS, load_trace, load_traces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHOLOGIES = os.path.join(ROOT, "tests", "data", "h200-gpu-pathologies")
REAL = os.path.join(PATHOLOGIES, "sync", "trace", "0.json.gz")  # as Kineto wrote it
COMPACT = os.path.join(PATHOLOGIES, "launch_bound", "trace", "0.json.gz")  # one line of JSON


def reference(doc, rank):
    """The table the whole-document reader built (json.load, one row per 'X' event)."""
    base = int(doc.get("baseTimeNanoseconds") or 0)
    rows = []
    for e in doc["traceEvents"]:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        start = base + int(round(float(e["ts"]) * 1000))
        dur = float(e.get("dur") or 0.0)
        args = e.get("args") or {}
        rows.append(
            (
                rank,
                e.get("cat"),
                e.get("name", ""),
                start,
                start + int(round(dur * 1000)),
                dur / 1e6,
                e.get("pid"),
                e.get("tid"),
                args.get("Python id"),
                args.get("Python parent id"),
                args.get("device"),
                args.get("stream"),
                args.get("bytes"),
                args.get("correlation"),
                args.get("Sequence number"),
            )
        )
    return pd.DataFrame(rows, columns=TRACE_COLUMNS)


def assert_same(expected, got):
    assert list(got.columns) == TRACE_COLUMNS
    assert len(expected) == len(got)
    for col in TRACE_COLUMNS:
        for a, b in zip(expected[col], got[col]):
            assert (pd.isna(a) and pd.isna(b)) or a == b, (col, a, b)


@pytest.mark.slow
def test_real_h200_trace_same_table_as_whole_document_reader(monkeypatch):
    with gzip.open(COMPACT, "rt") as f:
        compact = reference(json.load(f), "0")
    assert len(compact) > 10000
    assert_same(compact, load_trace(COMPACT, "0"))  # not Kineto's layout: the general reader
    with gzip.open(REAL, "rt") as f:
        doc = json.load(f)
    expected = reference(doc, "0")
    assert len(expected) > 5000 and (expected["cat"] == "kernel").any()
    assert (expected["pid"] == "Spans").any()  # text pids of Kineto's own spans survive
    # Kineto's layout: the Arrow fast path reads it (and does not fall back)
    with gzip.open(REAL, "rt") as f:
        fast, base = torchtrace._read_kineto(f, "0")
    assert base == doc["baseTimeNanoseconds"]
    assert_same(expected, fast)
    assert_same(expected, load_trace(REAL, "0"))
    assert_same(expected, load_trace(REAL, "0", fast=False))
    # tiny windows: every event and key straddles a read boundary somewhere
    monkeypatch.setattr(torchtrace, "CHUNK_CHARS", 97)
    monkeypatch.setattr(torchtrace, "FAST_CHUNK_CHARS", 97)
    with gzip.open(REAL, "rt") as f:
        assert_same(expected, torchtrace._read_kineto(f, "0")[0])
    assert_same(expected, load_trace(REAL, "0", fast=False))


def test_base_time_after_the_events_and_plain_json(tmp_path, monkeypatch):
    # Kineto writes baseTimeNanoseconds after traceEvents in some versions: it still applies
    events = [
        {
            "ph": "X",
            "cat": "kernel",
            "name": "k",
            "pid": 0,
            "tid": 7,
            "ts": 10.5,
            "dur": 2.25,
            "args": {"device": 0, "stream": 7},
        },
        {"ph": "i", "name": "marker", "ts": 11},
        {
            "ph": "X",
            "cat": "python_function",
            "name": "f",
            "pid": "Spans",
            "tid": 1,
            "ts": 12,
            "args": {"Python id": 3, "Python parent id": 1},
        },
    ]
    path = tmp_path / "1.json"
    path.write_text(
        json.dumps(
            {"traceEvents": events, "traceName": "x", "baseTimeNanoseconds": 1_800_000_000_000_000_123}
        )
    )
    monkeypatch.setattr(torchtrace, "CHUNK_CHARS", 5)
    # one line of JSON is not Kineto's layout: the general reader reads it
    with open(path) as f, pytest.raises(torchtrace._NotKineto):
        torchtrace._read_kineto(f, "1")
    got = load_trace(str(path), "1")
    assert list(got["start_ns"]) == [1_800_000_000_000_010_623, 1_800_000_000_000_012_123]
    assert list(got["end_ns"]) == [1_800_000_000_000_012_873, 1_800_000_000_000_012_123]
    assert got["stream"].iloc[0] == 7 and got["py_parent"].iloc[1] == 1
    assert list(got["pid"]) == [0, "Spans"]


def test_unreadable_traces_are_one_clear_error(tmp_path):
    os.makedirs(tmp_path / "trace")
    with gzip.open(REAL, "rb") as f:
        data = f.read()
    with gzip.open(tmp_path / "trace" / "0.json.gz", "wb") as f:
        f.write(data[: len(data) // 2])  # the job was killed while the trace was written
    (tmp_path / "trace" / "1.json.gz").write_bytes(b"not gzip")
    with gzip.open(tmp_path / "trace" / "2.json.gz", "wt") as f:
        f.write('{"schemaVersion": 1}')
    with pytest.raises(UserError, match="0.json.gz is not a readable torch.profiler trace"):
        load_trace(str(tmp_path / "trace" / "0.json.gz"), "0")
    table, errors = load_traces(str(tmp_path))
    assert len(table) == 0 and list(table.columns) == TRACE_COLUMNS
    assert sorted(os.path.basename(p) for p in errors) == ["0.json.gz", "1.json.gz", "2.json.gz"]


@pytest.mark.slow
def test_memory_is_bounded_by_the_table_not_the_document(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import synth_trace

    info = synth_trace.write_trace(str(tmp_path / "0.json"), mb=30)
    # the window is a constant (a few copies of FAST_CHUNK_CHARS); shrunk here so that a small
    # trace shows what a GB trace does: memory grows with the table, not with the document
    monkeypatch.setattr(torchtrace, "FAST_CHUNK_CHARS", 1 << 20)
    tracemalloc.start()
    try:
        table = load_trace(str(tmp_path / "0.json"), "0")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    ops = (info["events"] - 2 - info["steps"]) // 6  # 6 events per operator, 4 of them 'X'
    assert len(table) == 4 * ops + info["steps"]
    assert (table["cat"] == "kernel").sum() == (table["cat"] == "cpu_op").sum()
    assert_same(table, load_trace(str(tmp_path / "0.json"), "0", fast=False))
    # json.load of this document alone needs several times its size (the old reader: > 5x)
    assert peak < 0.5 * info["bytes_uncompressed"], peak
