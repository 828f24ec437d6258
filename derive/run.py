"""The run record: everything one `diagnose` run collected, loaded into one immutable object.

Raw evidence stays as written in the run folder; this module derives per-rank pandas DataFrames
from it (one `rank` column each, HTA-style) on a single wall-clock-ns time axis. The shim's
events are read per type (traindx.profiler.columnar: Arrow, no Python loop per event); each table is
built when first used. Analyzers, reports and comparisons read only this object and never
change it.
"""

import glob
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from traindx.common.errors import UserError
from traindx.derive.ledger import compute, measured_forward, spans_table
from traindx.derive.so_far import EventsSoFar  # noqa: F401 (the live loads' state, read here)
from traindx.profiler import columnar, nodes
from traindx.profiler.columnar import CorruptEvidenceWarning, TruncatedEvidenceWarning  # noqa: F401
from traindx.profiler.logparse import compile_custom, parse_line
from traindx.profiler.nodes import load_traces
from traindx.profiler.rolling import load_pyspy, read_text
from traindx.profiler.shim._traindx_shim import schema
from traindx.profiler.shim._traindx_shim.roles import parse_process_file, rank_labels

STEP_COLUMNS = ["rank", "step", "start_ns", "end_ns", "duration_s"]
PROCESS_COLUMNS = ["pid", "ppid", "label", "rank", "evidence", "argv", "file"]
COMPILE_COLUMNS = [
    "rank",
    "kind",
    "kernel",
    "start_ns",
    "end_ns",
    "duration_s",
    "thread",
    "is_main_thread",
    "step",
    "caller",
    "key",
    "key_fields",
    "detail",
]


_WRAPPED_VALUE = re.compile(r"loss\w*:\s*$")
_VALUE_LINE = re.compile(
    r"^[\s\d:.,/%•-]*\s[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\s*$|"
    r"^\s*[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\s*$"
)


def _read_jsonl(path, valid=None):
    """JSON objects of one JSONL file. A line that is not one (a job killed mid-write leaves a
    cut-off last line; a disk or copy fault can leave one anywhere) is skipped with a warning
    naming the file and the line: the rest of the evidence is still good."""
    events = []
    lines = read_text(path).split("\n")  # a long run's segments too (profiler/rolling.py)
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    bad = []
    for n, line in enumerate(lines[: last + 1]):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if isinstance(event, dict) and (valid is None or valid(event)):
            events.append(event)
        elif n == last and not bad:
            warnings.warn(
                f"{path}:{n + 1}: last line is truncated (the job was killed mid-write); it was skipped",
                TruncatedEvidenceWarning,
                stacklevel=3,
            )
        else:
            bad.append(n + 1)
    if bad:
        where = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        warnings.warn(
            f"{path}: corrupt line{'s' if len(bad) > 1 else ''} {where} skipped",
            CorruptEvidenceWarning,
            stacklevel=3,
        )
    return events


def _valid_dump(snap):
    """A py-spy dump snapshot: a time and a list of threads."""
    t = snap.get("t")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and isinstance(snap.get("threads"), list)


def _rank_of(path, suffix):
    return os.path.basename(path)[: -len(suffix)]


def _spread_coalesced(rows: list) -> None:
    """Lines placed by time (their step: the step ends seen when the launcher stamped them) that
    arrived in one read of the pipe share one stamp, so a line printed at the end of step k can
    land on k + 1 beside the next one. A run of such lines with one stamp and one step N takes
    the steps just before N that the line before them leaves free (one per line, in order)."""
    i = 0
    while i < len(rows):
        j = i
        while (
            j + 1 < len(rows) and rows[j + 1]["t"] == rows[i]["t"] and rows[j + 1]["step"] == rows[i]["step"]
        ):
            j += 1
        if j > i and i > 0:
            last = rows[i]["step"]
            first = max(rows[i - 1]["step"] + 1, last - (j - i))
            for k in range(i, j + 1):
                rows[k]["step"] = min(first + (k - i), last)
        i = j + 1


@dataclass(frozen=True)
class RunRecord:
    path: str
    manifest: dict
    tables: columnar.EventTables = field(repr=False)  # the shim's events, one table per type
    # every Python process the shim saw (launchers too): pid, ppid, label (rank label or None),
    # rank, evidence (what showed it trains), argv, file
    processes: pd.DataFrame = field(repr=False, default_factory=lambda: pd.DataFrame(columns=PROCESS_COLUMNS))
    labels: dict = field(repr=False, default_factory=dict)  # {pid: rank label}
    memo: dict = field(repr=False, default_factory=dict, compare=False)  # derived, shared tables

    def of_type(self, type_):
        """The events of one type (a `rank` column; the fields that type has), in t order."""
        df = self.tables.frame(type_)
        return df.copy(deep=False) if len(df) else pd.DataFrame()

    @cached_property
    def events(self):
        """Every event of every rank in one wide frame, t order (built only if asked for:
        per-type tables via of_type() are what the analyzers read)."""
        return self.tables.all_events()

    def subset(self, ranks):
        """The same run restricted to some ranks: every derived table filtered once, by one
        vectorised isin (nothing re-parsed or re-computed; the log, NVML and manifest shared)."""
        keep = set(ranks)
        sub = RunRecord(
            path=self.path,
            manifest=self.manifest,
            tables=columnar.RankSubset(self.tables, keep),
            processes=self.processes,
            labels=self.labels,
        )

        def only(df):
            return df[df["rank"].isin(keep).to_numpy()] if len(df) and "rank" in df else df

        for name in ("steps", "spans", "compiles", "gc", "alloc", "torch_trace", "dumps"):
            sub.__dict__[name] = only(getattr(self, name))
        ledger, startup = self._ledgers
        sub.__dict__["_ledgers"] = (only(ledger), only(startup))
        for name in ("log", "log_steps", "gpu", "t_min"):
            sub.__dict__[name] = getattr(self, name)
        sub.__dict__["pyspy"] = {k: v for k, v in self.pyspy.items() if k[0] in keep}
        sub.__dict__["ranks"] = [r for r in self.ranks if r in keep]
        return sub

    def cached(self, key, build):
        """A table derived once per run and shared by analyzers (e.g. the steady steps)."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    def _label_of_file(self, stem):
        """Rank label of a per-process file stem 'p<pid>' (None: not a rank); other stems are
        rank labels already (attach mode, runs of earlier versions)."""
        pid = parse_process_file(stem, "")
        if pid is None:
            return stem
        if pid in self.labels:
            return self.labels[pid]
        by_manifest = {
            int(p): label for label, p in self.manifest.get("ranks", {}).items() if str(p).isdigit()
        }
        return by_manifest.get(pid)

    # -- the derived tables --------------------------------------------------------------------
    @cached_property
    def ranks(self):
        ranks = set(self.tables.ranks())
        ranks |= set(self.manifest.get("ranks", {}).keys())
        return sorted(ranks, key=lambda r: (len(str(r)), str(r)))

    def _of_type(self, type_):
        return self.of_type(type_)

    @cached_property
    def t_min(self):
        """The earliest event time (ns), None without events."""
        return self.tables.t_min()

    @cached_property
    def steps(self):
        """One row per completed optimizer step of each rank: each step_end paired with the
        latest step_begin of the same rank and step number before it (merge_asof)."""
        ends = self.of_type(schema.STEP_END)
        if not len(ends):
            return pd.DataFrame(columns=STEP_COLUMNS)
        ends = pd.DataFrame(
            {
                "rank": pd.Series(ends["rank"].to_numpy(object), dtype=object),
                "step": ends["step"].astype(np.int64).to_numpy(),
                "end_ns": ends["t"].astype(np.int64).to_numpy(),
            }
        )
        begins = self.of_type(schema.STEP_BEGIN)
        if len(begins):
            begins = pd.DataFrame(
                {
                    "rank": pd.Series(begins["rank"].to_numpy(object), dtype=object),
                    "step": begins["step"].astype(np.int64).to_numpy(),
                    "start_ns": begins["t"].astype(np.int64).to_numpy(),
                }
            )
            begins["t"] = begins["start_ns"]
            begins["_begin"] = np.arange(len(begins), dtype=np.float64)
            ends["t"] = ends["end_ns"]
            ends["_row"] = np.arange(len(ends))
            paired = pd.merge_asof(
                ends,
                begins.drop(columns=["start_ns"]),
                on="t",
                by=["rank", "step"],
                direction="backward",
                allow_exact_matches=True,
            )
            which = paired.sort_values("_row", kind="stable")["_begin"].to_numpy(np.float64)
            found = ~np.isnan(which)
            start_ns = begins["start_ns"].to_numpy(np.int64)[np.where(found, which, 0).astype(np.int64)]
            start = (
                np.where(found, start_ns, 0)
                if found.all()
                else np.where(found, start_ns.astype(np.float64), np.nan)
            )
        else:
            start = np.full(len(ends), np.nan)
        out = pd.DataFrame(
            {
                "rank": pd.Series(ends["rank"].to_numpy(object), dtype=object),
                "step": ends["step"].to_numpy(),
                "start_ns": start,
                "end_ns": ends["end_ns"].to_numpy(),
            }
        )
        # exact ns difference; a step without its begin: NaN (start_ns then a float column)
        out["duration_s"] = (
            (out["end_ns"] - out["start_ns"]) / 1e9
            if start.dtype == np.int64
            else (out["end_ns"].astype(np.float64) - start) / 1e9
        )
        # rank order (as groupby gives it), t order within a rank
        codes, _ = pd.factorize(out["rank"], sort=True)
        out = out.iloc[np.argsort(codes, kind="stable")]
        return out.reset_index(drop=True)[STEP_COLUMNS]

    @cached_property
    def compiles(self):
        df = self._of_type(schema.COMPILE)
        if not len(df):
            return pd.DataFrame(columns=COMPILE_COLUMNS)
        df = df.rename(columns={"t": "end_ns", "start": "start_ns"}).reset_index(drop=True)
        for col in COMPILE_COLUMNS:
            if col not in df:
                df[col] = None
        return df

    @cached_property
    def gc(self):
        return self._of_type(schema.GC).reset_index(drop=True)

    @cached_property
    def alloc(self):
        return self._of_type(schema.ALLOC).reset_index(drop=True)

    @cached_property
    def gpu(self):
        from traindx.profiler.nvml import COLUMNS, load_csv

        path = os.path.join(self.path, "nvml.csv")
        if not os.path.exists(path):
            return pd.DataFrame(columns=COLUMNS)
        df, problem = load_csv(path)
        if problem:
            warnings.warn(problem, CorruptEvidenceWarning, stacklevel=2)
        return df

    @cached_property
    def log(self):
        """The job's output: t (ns), stream ('o'|'e'), text."""
        path = os.path.join(self.path, "log.txt")
        rows = []
        if os.path.exists(path):
            from traindx.profiler.rolling import read_text

            skipped = 0
            for line in read_text(path).split("\n"):  # a long run's segments too
                t, _, rest = line.partition(" ")
                stream, _, text = rest.partition(" ")
                if t.isdigit() and stream in ("o", "e"):
                    rows.append((int(t), stream, text))
                elif line.strip():
                    skipped += 1
            if skipped:  # garbage (a disk fault, a bad copy): the readable lines still count
                warnings.warn(
                    f"{path}: {skipped} line{'s' if skipped > 1 else ''} without the "
                    "launcher's time and stream skipped",
                    CorruptEvidenceWarning,
                    stacklevel=2,
                )
        return pd.DataFrame(rows, columns=["t", "stream", "text"])

    @cached_property
    def log_steps(self):
        """Steps and losses the job printed itself (see profiler/logparse.py for the formats;
        `diagnose --log-regex` adds the job's own). A line without a step (HF Trainer's dicts:
        the step is the Trainer's state.global_step) gets the number of optimizer steps the shim
        had seen end when the line was printed, else its position among such lines."""
        pattern = (self.manifest.get("options") or {}).get("log_regex")
        try:
            custom = compile_custom(pattern) if pattern else None
        except ValueError as exc:
            warnings.warn(str(exc), TruncatedEvidenceWarning, stacklevel=2)
            custom = None
        columns = ["t", "step", "loss", "step_time_s", "format", "tokens"]
        rows = []
        texts = list(self.log["text"])
        streams = list(self.log["stream"]) if "stream" in self.log else [None] * len(texts)
        following = _next_of_same_stream(streams)
        for i, (t, text) in enumerate(zip(self.log["t"], texts)):
            j = following[i]
            if j is not None and _WRAPPED_VALUE.search(text) and _VALUE_LINE.match(texts[j]):
                # rich (Lightning's progress bar) wraps the bar's columns onto the next line of
                # its stream (a stderr line can land between the two): the metric's value is that
                # line's last number (after the times it pushed down)
                text = text.rstrip() + " " + texts[j].split()[-1]
            parsed = parse_line(text, custom)
            if parsed:
                parsed["t"] = t
                rows.append(parsed)
        if any(r["step"] is None for r in rows):
            step_end = self.of_type(schema.STEP_END)
            ends = sorted(int(t) for t in step_end["t"]) if len(step_end) else []
            import bisect

            unnumbered = 0
            placed = []
            for r in rows:
                if r["step"] is None:
                    unnumbered += 1
                    r["step"] = bisect.bisect_right(ends, int(r["t"])) if ends else unnumbered
                    placed.append(r)
            _spread_coalesced(placed)
        return pd.DataFrame(rows, columns=columns)

    @cached_property
    def pyspy(self):
        """{(rank, 'all'|'gil'): {thread: ThreadSamples}} for every recording present."""
        out = {}
        # a long run's windows: the first, the summary of those rolled off, the last ones
        for (stem, source), (threads, errors) in load_pyspy(os.path.join(self.path, "pyspy")).items():
            rank = self._label_of_file(stem)
            if rank is None:
                continue
            for message in errors:
                warnings.warn(message, TruncatedEvidenceWarning, stacklevel=2)
            if threads:
                out[(rank, source)] = threads
        return out

    @cached_property
    def dumps(self):
        """py-spy dump snapshots: t, rank, thread_name, thread_id, active, owns_gil, top frame;
        trigger: the anomaly a burst snapshot was taken for (None for the periodic ones)."""
        rows = []
        for path in sorted(glob.glob(os.path.join(self.path, "pyspy", "*-dump.jsonl"))):
            rank = self._label_of_file(_rank_of(path, "-dump.jsonl"))
            if rank is None:
                continue
            for snap in _read_jsonl(path, valid=_valid_dump):
                for th in snap["threads"]:
                    if not isinstance(th, dict):
                        continue
                    frames = th.get("frames")
                    frames = frames if isinstance(frames, list) else []
                    rows.append(
                        {
                            "t": snap["t"],
                            "rank": rank,
                            "thread_name": th.get("thread_name"),
                            "thread_id": th.get("thread_id"),
                            "active": th.get("active"),
                            "owns_gil": th.get("owns_gil"),
                            "frames": frames,
                            "os_thread_id": th.get("os_thread_id"),
                            "trigger": snap.get("trigger"),
                        }
                    )
        return pd.DataFrame(
            rows,
            columns=[
                "t",
                "rank",
                "thread_name",
                "thread_id",
                "active",
                "owns_gil",
                "frames",
                "os_thread_id",
                "trigger",
            ],
        )

    @cached_property
    def torch_trace(self):
        """The torch.profiler window of every rank (trace/<rank>.json.gz): one row per event."""
        table, errors = load_traces(self.path, self.manifest)
        for message in errors.values():
            warnings.warn(message, TruncatedEvidenceWarning, stacklevel=2)
        return table

    @cached_property
    def spans(self):
        """The shim's measured intervals (traindx.derive.ledger.spans_table): rank, cat, start_ns,
        end_ns, tid, caller."""
        return spans_table(self.of_type(schema.SPAN))

    @cached_property
    def _ledgers(self):
        return compute(
            self.steps,
            self.spans,
            self.compiles,
            self.of_type(schema.PROCESS_START),
            forward_measured=measured_forward(self.spans, self.of_type(schema.HOST_SAMPLES)),
        )

    @property
    def ledger(self):
        """One row per rank-step: its wall time split into exclusive measured categories
        (traindx.derive.ledger.CATEGORIES) plus unexplained; each row sums to wall_s."""
        return self._ledgers[0]

    @property
    def startup_ledger(self):
        """One row per rank (step -1): process start -> first step begin, split the same way;
        its unexplained is imports, model build and data set-up."""
        return self._ledgers[1]

    @cached_property
    def cpu_threads(self):
        """{rank: the shim's latest `cpu_threads` picture}: intra_op_threads, inter_op_threads,
        process_threads, affinity_cores, cgroup_quota_cores, cpu_count, thread_env,
        dataloader_workers [{pid, threads}], children [{pid, name, threads}], load1, step
        (profiler/shim/_traindx_shim/cpustat.py); ranks without one are absent."""
        df = self.of_type("cpu_threads")
        if not len(df):
            return {}
        out = {}
        for row in df.sort_values("t", kind="stable").to_dict("records"):
            out[str(row["rank"])] = {
                k: (None if _is_nan(v) else v) for k, v in row.items() if k not in ("type", "rank")
            }
        return out

    @property
    def host_code(self):
        """What ran inside each rank-step's `host` line (traindx.derive.ledger.host_code)."""
        from traindx.derive.ledger import host_code

        return host_code(self)

    # -- conveniences --------------------------------------------------------------------------
    @property
    def command(self):
        return self.manifest.get("command", [])

    @property
    def missing(self):
        return self.manifest.get("missing", {})

    @cached_property
    def fault_stacks(self):
        """{label: text} of every process that died by a fatal signal: the Python stacks the
        shim's faulthandler wrote (profiler/shim/_traindx_shim/faults.py); label is 'rank L'
        where the pid's rank label is known, else 'pid N'."""
        folder = os.path.join(self.path, "faults")
        found = {}
        if not os.path.isdir(folder):
            return found
        for name in sorted(os.listdir(folder)):
            pid = name[1:-4] if name.startswith("p") and name.endswith(".txt") else ""
            try:
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                    text = f.read(200_000)
            except OSError:
                continue
            if text.strip() and pid.isdigit():
                label = self.labels.get(int(pid))
                found[f"rank {label}" if label is not None else f"pid {pid}"] = text
        return found

    def rank_steps(self, rank):
        return self.rank_rows("steps", rank)

    def rank_rows(self, table, rank, frame=None):
        """The rows of one rank of a derived table ('steps', 'gc', 'spans', 'ledger', ... or
        `frame` under that name), from one groupby per table: per-rank analyzers then cost
        O(that rank's rows), not a scan of every rank's rows each."""

        def split():
            df = getattr(self, table) if frame is None else frame
            if not len(df) or "rank" not in df:
                return df.iloc[0:0], {}
            # not dict(groupby): a GroupBy has a `keys` attribute, which dict() would call
            return df.iloc[0:0], {r: g for r, g in df.groupby("rank", sort=False)}  # noqa: C416

        empty, groups = self.cached(("by_rank", table), split)
        got = groups.get(rank)
        return (empty if got is None else got).copy(deep=False)


def _next_of_same_stream(streams):
    """For each log line, the index of the next line of the same stream (stdout/stderr), or None."""
    out, last = [None] * len(streams), {}
    for i in range(len(streams) - 1, -1, -1):
        out[i] = last.get(streams[i])
        last[streams[i]] = i
    return out


# what a run folder holds besides its manifest (any of them makes it a run to analyse)
EVIDENCE_PATHS = {
    "events": "events",
    "pyspy": "py-spy recordings",
    "log.txt": "log",
    "nvml.csv": "NVML samples",
    "trace": "torch.profiler window",
}


def _evidence_present(path):
    return [
        what
        for name, what in EVIDENCE_PATHS.items()
        if os.path.isfile(os.path.join(path, name))
        or (os.path.isdir(os.path.join(path, name)) and os.listdir(os.path.join(path, name)))
    ]


# the manifest's fields and their JSON types (launcher, attach, merge write them)
MANIFEST_SHAPES = {
    "command": list,
    "gpus": list,
    "signals_forwarded": list,
    "host": dict,
    "packages": dict,
    "env": dict,
    "options": dict,
    "ranks": dict,
    "missing": dict,
    "nvml": dict,
    "budget": dict,
    "start_ns": (int, float),
    "end_ns": (int, float),
    "exit_code": int,
    "pid": int,
    "cwd": str,
    "status": str,
}


def _read_manifest(manifest_path):
    """(manifest dict, None), or (None, why it is not one): missing, unreadable, not JSON."""
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, "no manifest.json"
    except OSError as exc:
        return None, f"manifest.json unreadable ({exc.strerror})"
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None, "manifest.json is corrupt (not JSON)"
    if not isinstance(manifest, dict) or "command" not in manifest:
        return None, "manifest.json is not a traindx manifest"
    if isinstance(manifest["command"], str):
        manifest["command"] = [manifest["command"]]
    wrong = []
    for key, kind in MANIFEST_SHAPES.items():  # the shapes every reader relies on
        value = manifest.get(key)
        if value is None and key in manifest and kind in (list, dict):
            manifest[key] = kind()  # readers take a missing one as empty; null is the same
            continue
        if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
            continue
        wrong.append(key)
        manifest[key] = [] if kind is list else {} if kind is dict else None
    if wrong:
        warnings.warn(
            f"{manifest_path}: field{'s' if len(wrong) > 1 else ''} of the wrong type "
            f"ignored: {', '.join(wrong)}",
            CorruptEvidenceWarning,
            stacklevel=3,
        )
    return manifest, None


def is_run_dir(path):
    return os.path.isfile(os.path.join(path, "manifest.json"))


def load_run(path, cache=None, so_far=None):
    """Load a run folder written by `diagnose`. Raises UserError for anything that is not one.
    cache: keep the parsed event tables as Parquet under tables/events/ (None: only for large
    runs; the environment variable TRAINDX_CACHE=0|1 overrides). so_far: an EventsSoFar kept
    between loads of a folder still being written (only what was appended is parsed)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise UserError(f"no such run folder: {path}")
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path) and os.path.isdir(os.path.join(path, "nodes")):
        raise UserError(
            f"{path} is a multi-node run not merged yet: run `diagnose merge "
            f"{path}` once every node has finished"
        )
    manifest, problem = _read_manifest(manifest_path)
    if problem is not None:
        evidence = _evidence_present(path)
        if not evidence:
            raise UserError(f"{path} is not a traindx run ({problem})")
        # the evidence outlived its manifest (a disk fault, a copy without it): analyse what is
        # there; only what the manifest alone knew (command, options, GPUs, exit code) is lost
        warnings.warn(
            f"{manifest_path}: {problem}; analysing the run's {', '.join(evidence)} "
            "without it (its command, options and exit code are unknown)",
            CorruptEvidenceWarning,
            stacklevel=2,
        )
        manifest = {"traindx_run": 1, "command": [], "status": "unknown", "missing": {"manifest": problem}}
    tables, processes, labels = _load_tables(path, cache, manifest, so_far=so_far)
    columns = PROCESS_COLUMNS + (["node"] if manifest.get("nodes") else [])
    return RunRecord(
        path=path,
        manifest=manifest,
        tables=tables,
        processes=pd.DataFrame(processes, columns=columns),
        labels=labels,
    )


TRAINING_EVENTS = schema.TRAINING_EVENTS
IDENTITY_EVENTS = schema.IDENTITY_EVENTS


def _load_tables(path, cache=None, manifest=None, write_cache=True, so_far=None):
    """(EventTables, process table rows, labels) of the run's events.

    `events/p<pid>.jsonl` holds one process (any process of the job); its rank is the last
    `rank_known` it wrote, else the rank in its `process_start`. Ranks are the processes that
    showed training evidence; when none did (a job without an optimizer: inference, a
    compile-only script), the processes that recorded anything, else the first one started.
    Labels come from `roles.rank_labels` (one rank in several processes: kept apart, never
    merged). `events/<label>.jsonl` (attach mode, earlier versions) is that rank as is.
    A merged multi-node run (traindx.profiler.nodes): each node's processes are labelled on their own,
    then combined (`nodes.rename_labels`); labels are then keyed by (node, pid), since a pid may
    repeat on another host.
    """
    files = columnar.event_files(path, manifest)
    multi = any(x.node is not None for x in files) or bool((manifest or {}).get("nodes"))
    read = columnar.may_read_cache(cache)
    write = write_cache and columnar.use_cache(files, cache)
    fp = columnar.fingerprint(files) if (read or write) else None
    hit = columnar.read_cache(path, fp) if read else None
    if hit is not None:
        index, paths = hit
        columnar.warn_all(_notes_from_json(index["notes"]), stacklevel=4)
        tables = columnar.EventTables(
            files, index["labels_by_file"], {}, {}, cached=paths, summary=index["summary"]
        )
        return tables, index["processes"], _labels_from_json(index["labels"])
    # a merged run: the tables each node wrote for itself at its job's end (node_tables)
    node_hits = _node_tables(path, manifest, files) if multi and read else {}
    info_of_file, summary = [None] * len(files), [None] * len(files)
    node_tables, notes = [], []
    for base, (node_index, paths) in node_hits.items():
        node_tables.append((base, paths))
        notes += _notes_from_json(node_index["notes"])
        for j, count_t in enumerate(node_index["summary"]):
            summary[base + j] = count_t
        for p in node_index["per_process"]:
            i = base + p["index"]
            info_of_file[i] = dict(p, index=i, file=files[i].rel, node=files[i].node)
    todo = [i for i in range(len(files)) if summary[i] is None]
    parsed = (
        columnar.parse_files([files[i] for i in todo], indices=todo)
        if so_far is None
        else so_far.parse([files[i] for i in todo], todo)
    )
    notes += [n for _, _, ns, _ in parsed for n in ns]
    columnar.warn_all(notes, stacklevel=4)
    for i, (_, _, _, ident) in zip(todo, parsed):
        summary[i] = [ident["count"], ident["t_min"]]
        pid = columnar.process_pid(files[i].rel)
        if pid is not None:
            info_of_file[i] = _process_info(pid, files[i], i, ident)
    label_of_file = [
        os.path.basename(x.rel)[: -len(".jsonl")] if columnar.process_pid(x.rel) is None else None
        for x in files
    ]
    per_process = [p for p in info_of_file if p is not None]
    has_label_files = any(label is not None for label in label_of_file)
    if multi:
        by_node = {}
        for p in per_process:
            by_node.setdefault(p["node"], []).append(p)
        per_node = []
        for node, procs in by_node.items():
            node_labels = rank_labels(_rank_processes(procs, has_label_files))
            per_node.append((node, node_labels))
        labels = nodes.rename_labels(per_node)
        key = lambda p: (p["node"], p["pid"])  # noqa: E731
    else:
        labels = rank_labels(_rank_processes(per_process, has_label_files))
        key = lambda p: p["pid"]  # noqa: E731
    table = []
    for p in per_process:
        label = labels.get(key(p))
        row = {
            "pid": p["pid"],
            "ppid": p["ppid"],
            "label": label,
            "rank": p["rank"],
            "evidence": p["evidence"],
            "argv": p["argv"],
            "file": p["file"],
        }
        if multi:
            row["node"] = p["node"]
        table.append(row)
        if label is not None:
            label_of_file[p["index"]] = label
    flat, nested = {}, {}
    for tables_of_file, rows_of_file, _, _ in parsed:
        for typ, t in tables_of_file.items():
            flat.setdefault(typ, []).append(t)
        for typ, rows in rows_of_file.items():
            nested.setdefault(typ, []).extend(rows)
    del parsed
    tables = columnar.EventTables(
        files,
        label_of_file,
        flat,
        nested,
        summary=summary,
        node_tables=node_tables,
        kept=None if so_far is None else so_far.frames,
    )
    # every node's own tables read: a run-wide copy would only duplicate them
    if write and (todo or not node_tables):
        meta = {
            "summary": summary,
            "processes": table,
            "labels": _labels_to_json(labels),
            "labels_by_file": label_of_file,
            "per_process": per_process,
            "notes": [["corrupt" if c is CorruptEvidenceWarning else "truncated", m] for c, m in notes],
        }
        tables.write_cache(path, fp, meta)
    return tables, table, labels


def _process_info(pid, x, i, ident):
    """One process of the run from its file's identity events: pid, ppid, the rank it reported
    (the last rank_known, else process_start's), start, training evidence, what it recorded."""
    info = {
        "pid": pid,
        "ppid": None,
        "rank": None,
        "start": None,
        "evidence": None,
        "argv": None,
        "file": x.rel,
        "index": i,
        "node": x.node,
        "training": bool(ident["types"] & TRAINING_EVENTS),
        "recorded": bool(ident["types"] - IDENTITY_EVENTS),
    }
    for e in ident["events"]:
        kind = e["type"]
        if kind == schema.PROCESS_START:
            info.update(ppid=_none_if_nan(e.get("ppid")), argv=e.get("argv"), start=e["t"])
            if _none_if_nan(e.get("rank")) is not None:
                info["rank"] = str(e["rank"])
        elif kind == schema.RANK_KNOWN and _none_if_nan(e.get("rank")) is not None:
            info["rank"] = str(e["rank"])
        if kind == schema.TRAINING and info["evidence"] is None:
            info["evidence"] = _none_if_nan(e.get("evidence"))
    if info["start"] is None:
        info["start"] = ident["first_t"] if ident["first_t"] is not None else 0
    return info


def _node_tables(path, manifest, files):
    """{index of the node's first file in `files`: (its cache index, {type: (parquet, json
    columns)})} for every node of a merged run whose own tables (written by its diagnose,
    `write_tables`) match its raw files now. The node's tables hold its own clock's times;
    its offset is applied with everything else in EventTables._place. A node without them, or
    with tables that no longer match (a file grew, was copied without its mtime), is parsed."""
    out, base = {}, 0
    for folder, node, _ in nodes.parts(path, manifest or {}):
        own = columnar.event_files(folder)
        hit = columnar.read_cache(folder, columnar.fingerprint(own)) if own else None
        if hit is not None and "per_process" in hit[0] and len(hit[0]["summary"]) == len(own):
            out[base] = hit
        base += len(own)
    return out if base == len(files) else {}  # a node's files changed meanwhile: parse all


def write_tables(path):
    """Write the run folder's Parquet event tables (tables/events/) now, whatever its size:
    what each node of a multi-node run does when its job ends, so that the central analysis
    reads tables instead of parsing every node's JSONL. Returns None, or why it could not."""
    if os.environ.get("TRAINDX_CACHE") == "0":
        return None  # the user turned the tables off
    try:
        tables, _, _ = _load_tables(path, cache=True)
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if tables._cached is None:
        return tables.cache_error or "the tables were not written"
    return None


def _notes_from_json(items):
    return [(CorruptEvidenceWarning if c == "corrupt" else TruncatedEvidenceWarning, m) for c, m in items]


def _rank_processes(per_process, has_label_files):
    ranks = [p for p in per_process if p["training"]] or [p for p in per_process if p["recorded"]]
    if not ranks and per_process and not has_label_files:
        ranks = [min(per_process, key=lambda p: (p["start"], p["pid"]))]
    return ranks


def _labels_to_json(labels):
    """[[node or None, pid, label]]: keys are pids, or (node, pid) on a multi-node run."""
    return [[k[0], k[1], v] if isinstance(k, tuple) else [None, k, v] for k, v in labels.items()]


def _labels_from_json(items):
    if isinstance(items, dict):  # a cache written before multi-node runs
        return {int(k): v for k, v in items.items()}
    return {(node, int(pid)) if node is not None else int(pid): label for node, pid, label in items}


def _load_events(path):
    """(collective span rows as dicts, process table rows, {pid: label}) of one node's run
    folder: what `diagnose merge` needs to align that node's clock and to name its ranks."""
    # the node's own tables when its diagnose wrote them (write_tables); never written here:
    # merge leaves the node folders as their nodes wrote them
    tables, table, labels = _load_tables(path, cache=None, write_cache=False)
    spans = tables.frame(schema.SPAN)
    rows = []
    if len(spans) and "cat" in spans:
        coll = spans[spans["cat"] == "collective"]
        for event in coll.to_dict("records"):
            rows.append({k: _none_if_nan(v) for k, v in event.items()})
    return rows, table, labels


def _none_if_nan(value):
    return None if value is None or (isinstance(value, float) and value != value) else value


def _is_nan(value):
    return isinstance(value, float) and value != value
