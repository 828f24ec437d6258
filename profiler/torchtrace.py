"""Reading the torch.profiler window (`trace/<rank>.json.gz`, Chrome trace JSON) into one table.

Kineto writes `ts`/`dur` in µs relative to `baseTimeNanoseconds`, a `time.time_ns()` value, so
start_ns lands on the run's one clock. Kineto writes `baseTimeNanoseconds` after the event
array, so it is applied once the file is read.

Traces reach GBs (a few steps of a large model; hundreds of ranks). A file is streamed, never
loaded whole: the `traceEvents` array is cut into its objects by the standard library's C
decoder (json.JSONDecoder.raw_decode on a sliding text window; it is several times faster
than an event-by-event streaming parser such as ijson, and needs no dependency), and only the
complete ('X') events' columns the analyzers read go into compact columns (numbers in
arrays, repeated strings — names, categories, pids — kept once). Memory is the window
(CHUNK_CHARS) plus the columns, not the JSON document. Gzip is decompressed on the fly.
"""

import glob
import io
import json
import math
import os
import zlib
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt
import pandas as pd

from traindx.common import untrusted
from traindx.common.errors import UserError

TRACE_COLUMNS = [
    "rank",
    "cat",
    "name",
    "start_ns",
    "end_ns",
    "dur_s",
    "pid",
    "tid",
    "py_id",
    "py_parent",
    "device",
    "stream",
    "bytes",
    "correlation",
    "seq",
]  # bytes: of a memcpy/memset; correlation: links a kernel to its launch (cudaLaunchKernel);
# seq: autograd's sequence number, shared by a forward op and the backward node it made
# (column, Kineto's args key) of the numeric columns read from an event's args
NUMERIC_ARGS = (
    ("py_id", "Python id"),
    ("py_parent", "Python parent id"),
    ("device", "device"),
    ("stream", "stream"),
    ("bytes", "bytes"),
    ("correlation", "correlation"),
    ("seq", "Sequence number"),
)
NUMERIC_COLUMNS = tuple(column for column, _ in NUMERIC_ARGS)
Array = npt.NDArray[Any]
CHUNK_CHARS = 1 << 20  # 1 Mi characters of text per read
MAX_EVENT_CHARS = 1 << 26  # one event (or top-level value other than traceEvents) past 64 Mi: corrupt
_WS = " \t\n\r"


class _Window:
    """A sliding window of text over a stream, for raw_decode."""

    def __init__(self, f: TextIO) -> None:
        self.f = f
        self.buf = ""
        self.pos = 0
        self.eof = False

    def more(self) -> bool:
        """Read another chunk (dropping what was consumed); False at the end of the stream."""
        if self.eof:
            return False
        chunk = self.f.read(CHUNK_CHARS)
        if not chunk:
            self.eof = True
            return False
        self.buf = self.buf[self.pos :] + chunk
        self.pos = 0
        return True

    def skip(self, chars: str = _WS) -> str:
        """Move past `chars`; the next character, or '' at the end of the stream."""
        while True:
            buf, pos = self.buf, self.pos
            n = len(buf)
            while pos < n and buf[pos] in chars:
                pos += 1
            self.pos = pos
            if pos < n:
                return buf[pos]
            if not self.more():
                return ""

    def decode(self, decoder: json.JSONDecoder) -> Any:
        """The next JSON value, reading more text while the window holds only part of it."""
        while True:
            try:
                value, end = decoder.raw_decode(self.buf, self.pos)
            except ValueError:
                # the value may run past the window: read on; at the end, or past any sane
                # event size, it is corrupt (so a corrupt file cannot grow the window unbounded)
                if len(self.buf) - self.pos > MAX_EVENT_CHARS or not self.more():
                    raise
                continue
            # a number cut at the window's edge decodes as a shorter number: read on
            if end == len(self.buf) and not self.eof and isinstance(value, (int, float)) and self.more():
                continue
            self.pos = end
            return value


class _Columns:
    """The columns of TRACE_COLUMNS for one file, compact while they grow: events are taken in
    batches (list comprehensions over a batch are far cheaper than per-event method calls),
    numbers kept as float64 arrays, repeated strings (names, categories, pids) once each."""

    BATCH = 2048  # ~1.5 KB of Python objects per decoded event: a few MB at a time

    def __init__(self) -> None:
        self.batch: list[dict[str, Any]] = []
        self.numeric: dict[str, list[Array]] = {k: [] for k in ("ts", "dur", *NUMERIC_COLUMNS)}
        self.codes: dict[str, list[Array]] = {k: [] for k in ("cat", "name", "pid", "tid")}
        self.values: dict[str, dict[Any, int]] = {k: {} for k in ("cat", "name", "pid", "tid")}

    def add(self, e: dict[str, Any]) -> None:
        self.batch.append(e)
        if len(self.batch) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        batch, self.batch = self.batch, []
        if not batch:
            return
        n = len(batch)
        num = self.numeric
        num["ts"].append(np.fromiter((float(e["ts"]) for e in batch), np.float64, n))
        num["dur"].append(np.fromiter((float(e.get("dur") or 0.0) for e in batch), np.float64, n))
        args = [e.get("args") or _EMPTY for e in batch]
        for column, key in NUMERIC_ARGS:
            num[column].append(np.fromiter((_num(a.get(key)) for a in args), np.float64, n))
        for column, key, default in (
            ("cat", "cat", None),
            ("name", "name", ""),
            ("pid", "pid", None),
            ("tid", "tid", None),
        ):
            table = self.values[column]
            codes = [table.setdefault(_hashable(e.get(key, default)), len(table)) for e in batch]
            self.codes[column].append(np.asarray(codes, dtype=np.int64))

    def frame(self, rank: str, base: int) -> pd.DataFrame:
        self.flush()

        def joined(parts: list[Array], dtype: type) -> Array:
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        ts, dur = joined(self.numeric["ts"], np.float64), joined(self.numeric["dur"], np.float64)
        n = len(ts)
        start = base + np.rint(ts * 1000).astype(np.int64)
        cols = {
            "rank": np.full(n, rank, dtype=object),
            "cat": self._decoded("cat"),
            "name": self._decoded("name"),
            "start_ns": start,
            "end_ns": start + np.rint(dur * 1000).astype(np.int64),
            "dur_s": dur / 1e6,
            # ints stay int64 columns, as when the table was built from rows
            "pid": pd.Series(self._decoded("pid"), dtype=object).infer_objects(),
            "tid": pd.Series(self._decoded("tid"), dtype=object).infer_objects(),
        }
        for column in NUMERIC_COLUMNS:
            cols[column] = joined(self.numeric[column], np.float64)
        return pd.DataFrame(cols, columns=TRACE_COLUMNS)

    def _decoded(self, column: str) -> Array:
        uniques = np.empty(len(self.values[column]), dtype=object)
        for value, c in self.values[column].items():
            uniques[c] = value
        codes = self.codes[column]
        return uniques[np.concatenate(codes)] if codes else np.empty(0, dtype=object)


_EMPTY: dict[str, Any] = {}


def _hashable(value: Any) -> Any:
    return value if not isinstance(value, (list, dict)) else json.dumps(value)


def _num(value: Any) -> float:
    if value is None or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _read(f: TextIO, rank: str) -> pd.DataFrame:
    """The DataFrame of the 'X' events of one open text stream (on baseTimeNanoseconds)."""
    decoder = json.JSONDecoder()
    win = _Window(f)
    if win.skip() != "{":
        raise ValueError("a trace is a JSON object")
    win.pos += 1
    cols, base, seen_events = _Columns(), 0, False
    while True:
        ch = win.skip(_WS + ",")
        if ch == "}":
            break
        if ch != '"':
            raise ValueError(f"expected a key, found {ch!r}")
        key = win.decode(decoder)
        if win.skip() != ":":
            raise ValueError("expected ':'")
        win.pos += 1
        win.skip()
        if key == "traceEvents":
            seen_events = True
            if win.skip() != "[":
                raise ValueError("traceEvents is not an array")
            win.pos += 1
            while True:
                ch = win.skip(_WS + ",")
                if ch == "]":
                    win.pos += 1
                    break
                if ch == "":
                    raise ValueError("the trace ends inside traceEvents")
                e = win.decode(decoder)
                if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e:
                    cols.add(e)
        else:
            value = win.decode(decoder)
            if key == "baseTimeNanoseconds":
                base = int(value or 0)
    if not seen_events:
        raise KeyError("traceEvents")
    return cols.frame(rank, base)


# -- the fast path for the layout Kineto writes ----------------------------------------------
# Kineto puts every event of traceEvents on its own lines at an indent of two spaces: "\n  {"
# ... "\n  },". A raw newline is never inside a JSON string (it must be escaped there), so
# "\n  }," is always the structural end of an event. Turning those ends into newlines and every
# other newline into a space makes the array NDJSON, which Arrow's C++ reader parses with an
# explicit schema of just the fields read here (the others skipped unparsed). A pid/tid that is
# text ("Spans", "") is renamed to its own column first (`"pid": "` only matches a real key: a
# quote inside a JSON string is escaped). Anything else (another writer's layout, a type Arrow
# cannot take) raises _NotKineto and the file is read by the general reader above.
FAST_CHUNK_CHARS = 1 << 22  # text per Arrow parse: the replace chain holds a few copies of it
_END = "\n  },"


class _NotKineto(Exception):
    pass


def _fast_schema() -> Any:
    import pyarrow as pa  # pyarrow (~1 s to import): only when a trace is read

    args = pa.struct([(key, pa.int64()) for _, key in NUMERIC_ARGS])
    return pa.schema(
        [
            ("ph", pa.string()),
            ("cat", pa.string()),
            ("name", pa.string()),
            ("ts", pa.float64()),
            ("dur", pa.float64()),
            ("pid", pa.int64()),
            ("pid_s", pa.string()),
            ("tid", pa.int64()),
            ("tid_s", pa.string()),
            ("args", args),
        ]
    )


def _fast_events(text: str, schema: Any) -> Any:
    """Arrow table of the 'X' events in `text`: whole Kineto events, each ending in "\n  }"."""
    import pyarrow as pa  # pyarrow (~1 s to import): only when a trace is read
    import pyarrow.compute as pc
    import pyarrow.json as pa_json

    nd = (
        text.replace(_END, "}\x00")
        .replace("\n", " ")
        .replace("}\x00", "}\n")
        .replace('"pid": "', '"pid_s": "')
        .replace('"tid": "', '"tid_s": "')
    )
    # the system allocator: freed chunks go back to the OS at once (Arrow's default pool keeps
    # them, and numpy, which allocates the final columns, cannot reuse them): a lower peak
    pool = pa.system_memory_pool()
    try:
        table = pa_json.read_json(
            pa.py_buffer(nd.encode("utf-8")),
            read_options=pa_json.ReadOptions(block_size=1 << 22),
            parse_options=pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
            memory_pool=pool,
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise _NotKineto(str(exc)) from None
    del nd
    keep = pc.and_(
        pc.equal(table["ph"], "X", memory_pool=pool),
        pc.is_valid(table["ts"], memory_pool=pool),
        memory_pool=pool,
    )
    keep = pc.if_else(pc.is_null(keep, memory_pool=pool), False, keep, memory_pool=pool)
    out = {}
    for k in ("cat", "name", "ts", "dur", "pid", "pid_s", "tid", "tid_s"):
        out[k] = pc.filter(table[k], keep, memory_pool=pool)
    for column, key in NUMERIC_ARGS:
        out[column] = pc.filter(pc.struct_field(table["args"], key, memory_pool=pool), keep, memory_pool=pool)
    return pa.table(out)


def _read_kineto(f: TextIO, rank: str) -> tuple[pd.DataFrame, int]:
    """(DataFrame, base) of a Kineto-layout trace, or _NotKineto."""
    import pyarrow as pa  # pyarrow (~1 s to import): only when a trace is read

    schema = _fast_schema()
    head = f.read(FAST_CHUNK_CHARS)
    at = head.find('"traceEvents": [')
    while at < 0 or len(head) - at < 32:  # the header is read whole, and a little past it
        more = f.read(FAST_CHUNK_CHARS)
        if not more or len(head) > MAX_EVENT_CHARS:
            raise _NotKineto("no traceEvents near the start")
        head += more
        at = head.find('"traceEvents": [')
    header_text = head[:at].rstrip().rstrip(",")
    buf = head[at + len('"traceEvents": [') :]
    if not buf.lstrip(" ").startswith("\n  {"):
        raise _NotKineto("events are not laid out as Kineto writes them")
    tables, tail = [], None
    while tail is None:
        chunk = f.read(FAST_CHUNK_CHARS)
        if not chunk:  # the last event ends "\n  }\n  ]": the rest is the document's tail
            close = buf.rfind("\n  }")
            end = buf.find("]", close)
            if close < 0 or end < 0:
                raise _NotKineto("the trace ends inside traceEvents")
            events, tail = buf[: close + 4], buf[end + 1 :]
        else:
            buf += chunk
            cut = buf.rfind(_END)
            if cut < 0:
                if len(buf) > MAX_EVENT_CHARS:
                    raise _NotKineto("no event end in a window")
                continue
            events, buf = buf[: cut + len(_END) - 1], buf[cut + len(_END) :]
        if events.strip():
            tables.append(_fast_events(events, schema))
    try:
        top = json.loads(header_text + "}") if header_text.strip() != "{" else {}
        rest = tail.strip().lstrip(",").strip()
        if rest not in ("}", ""):
            top.update(json.loads("{" + rest))
    except ValueError as exc:
        raise _NotKineto(f"header/tail: {exc}") from None
    base = int(top.get("baseTimeNanoseconds") or 0)
    table = pa.concat_tables(tables) if tables else _fast_events("", schema)
    del tables
    columns = {name: table[name] for name in table.column_names}
    del table  # each column is let go as soon as it is converted: the peak stays near one table
    return _kineto_frame(columns, rank, base), base


def _kineto_frame(columns: dict[str, Any], rank: str, base: int) -> pd.DataFrame:
    n = len(columns["ts"])
    ts = columns.pop("ts").to_numpy()
    start = base + np.rint(ts * 1000).astype(np.int64)
    del ts
    dur = columns.pop("dur").fill_null(0.0).to_numpy()
    cols = {
        "rank": np.full(n, rank, dtype=object),
        "cat": columns.pop("cat").to_pandas(),
        "name": columns.pop("name").fill_null("").to_pandas(),
        "start_ns": start,
        "end_ns": start + np.rint(dur * 1000).astype(np.int64),
        "dur_s": dur / 1e6,
    }
    del dur
    for column in ("pid", "tid"):
        ints, texts = columns.pop(column), columns.pop(column + "_s")
        if texts.null_count == n:
            values = ints.to_pandas()  # float64 only if some event has no pid at all
            if ints.null_count == 0:
                values = values.astype(np.int64)
        else:  # some are text: one object column, as the row-built table had
            values = pd.Series(
                np.where(
                    texts.is_null().to_numpy(zero_copy_only=False),
                    ints.to_pandas().astype(object),
                    texts.to_pandas().astype(object),
                ),
                dtype=object,
            )
            values = values.map(lambda v: int(v) if isinstance(v, float) and v == v else v)
        cols[column] = values
    for column in NUMERIC_COLUMNS:
        cols[column] = columns.pop(column).to_numpy(zero_copy_only=False).astype(np.float64)
    # copy=False: no second copy of every column while pandas builds its blocks
    return pd.DataFrame(cols, columns=TRACE_COLUMNS, copy=False)


def load_trace(path: str, rank: str, fast: bool = True) -> pd.DataFrame:
    """The complete ('X') events of one trace file as a DataFrame of TRACE_COLUMNS (fast=False:
    always the general streaming reader)."""

    def opened() -> io.TextIOWrapper:
        # a run folder's file: no link, FIFO or device; inflated size capped (untrusted)
        raw = untrusted.open_gzip(path) if path.endswith(".gz") else untrusted.open_file(path)
        return io.TextIOWrapper(raw, encoding="utf-8")

    try:
        if fast:
            try:
                with opened() as f:
                    return _read_kineto(f, rank)[0]
            except _NotKineto:
                pass  # the general reader below decides, and names any error
        with opened() as f:
            return _read(f, rank)
    except (
        OSError,
        EOFError,
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        RecursionError,
        zlib.error,
    ) as exc:  # garbage: named, and the rest of the run stands
        raise UserError(
            f"{path} is not a readable torch.profiler trace ({type(exc).__name__}: {exc})"
        ) from None


def load_traces(run_path: str) -> tuple[pd.DataFrame, dict[str, str]]:
    """(table of every rank's events, {path: error} for files that could not be read)."""
    frames: list[pd.DataFrame] = []
    errors: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(run_path, "trace", "*.json.gz"))):
        # trace/<rank>.json.gz, and trace/<rank>.anomaly-<kind>.json.gz: a deep capture's window
        rank = os.path.basename(path)[: -len(".json.gz")].split(".anomaly-")[0]
        try:
            frames.append(load_trace(path, rank))
        except UserError as exc:
            errors[path] = str(exc)
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=TRACE_COLUMNS), errors
    return (frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)), errors


# -- the GPU's view of the window: busy time by kind, top kernels ------------------------------
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
COMM_KERNEL_WORDS = (
    "allreduce",
    "all_reduce",
    "allgather",
    "all_gather",
    "reducescatter",
    "reduce_scatter",
    "alltoall",
    "all_to_all",
    "sendrecv",
    "cross_device_reduce",
)


def gpu_kind(cat: Any, name: Any) -> str | None:
    """'communication' (NCCL and custom all-reduce kernels), 'copy' (memcpy, memset) or
    'compute' (every other kernel) of one GPU event."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    lower = (name or "").lower()
    if lower.startswith("nccl") or any(w in lower for w in COMM_KERNEL_WORDS):
        return "communication"
    return "compute"


def union_ns(starts: Array, ends: Array) -> tuple[int, Array]:
    """Total length (ns) of the union of intervals, and the merged intervals."""
    if not len(starts):
        return 0, np.zeros((0, 2), dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = np.asarray(starts, np.int64)[order], np.asarray(ends, np.int64)[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    merged = np.stack([s[idx], np.append(reach[idx[1:] - 1], reach[-1])], axis=1)
    return int((merged[:, 1] - merged[:, 0]).sum()), merged


def _overlap_ns(a: Array, b: Array) -> int:
    """Length of the intersection of two sets of merged, sorted intervals."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return int(total)


def gpu_window(trace: pd.DataFrame, start_ns: int, end_ns: int) -> dict[str, Any]:
    """The GPU's time inside [start_ns, end_ns] of one rank's window (rows of the trace table):
    seconds busy (the union of every kernel, copy and memset, all streams), busy by kind (each
    kind's own union: they overlap when streams run together), communication not overlapped by
    compute ('exposed'), and the copies' direction and memory kind (pageable / pinned)."""
    gpu = trace[trace["cat"].isin(GPU_CATS).to_numpy()]
    gpu = gpu[(gpu["end_ns"] > start_ns).to_numpy() & (gpu["start_ns"] < end_ns).to_numpy()]
    s = np.clip(gpu["start_ns"].to_numpy(np.int64), start_ns, end_ns)
    e = np.clip(gpu["end_ns"].to_numpy(np.int64), start_ns, end_ns)
    kinds = np.array([gpu_kind(c, n) for c, n in zip(gpu["cat"], gpu["name"])], dtype=object)
    busy, _ = union_ns(s, e)
    by_kind, merged = {}, {}
    for kind in ("compute", "communication", "copy"):
        m = kinds == kind
        by_kind[kind], merged[kind] = union_ns(s[m], e[m])
    exposed = by_kind["communication"] - _overlap_ns(merged["communication"], merged["compute"])
    copies = gpu[gpu["cat"].to_numpy() == "gpu_memcpy"]
    wall = max(0, end_ns - start_ns)
    return {
        "wall_s": wall / 1e9,
        "busy_s": busy / 1e9,
        "idle_s": (wall - busy) / 1e9,
        "compute_s": by_kind["compute"] / 1e9,
        "communication_s": by_kind["communication"] / 1e9,
        "copy_s": by_kind["copy"] / 1e9,
        "exposed_communication_s": exposed / 1e9,
        "pageable_h2d_s": float(
            copies[copies["name"].str.contains("HtoD (Pageable", regex=False).to_numpy()]["dur_s"].sum()
        ),
    }


def top_kernels(trace: pd.DataFrame, limit: int = 10) -> pd.DataFrame:
    """The kernels (and copies) with the most GPU time in the window: name, kind, calls,
    seconds, share of all GPU time."""
    gpu = trace[trace["cat"].isin(GPU_CATS).to_numpy()]
    if not len(gpu):
        return pd.DataFrame(columns=["name", "kind", "calls", "seconds", "share"])
    g = gpu.groupby(["name", "cat"], sort=False)["dur_s"].agg(["count", "sum"]).reset_index()
    g = g.sort_values("sum", ascending=False)
    total = float(gpu["dur_s"].sum()) or 1.0
    out = pd.DataFrame(
        {
            "name": g["name"].to_numpy(),
            "kind": [gpu_kind(c, n) for c, n in zip(g["cat"], g["name"])],
            "calls": g["count"].to_numpy(),
            "seconds": g["sum"].to_numpy(),
            "share": g["sum"].to_numpy() / total,
        }
    )
    return out.head(limit).reset_index(drop=True)
