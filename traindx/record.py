"""The run record: everything one `diagnose` run collected, loaded into one immutable object.

Raw evidence stays as written in the run folder; this module derives per-rank pandas DataFrames
from it (one `rank` column each, HTA-style) on a single wall-clock-ns time axis. Analyzers,
reports and comparisons read only this object and never change it.
"""
import glob
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from functools import cached_property

import pandas as pd

from traindx.errors import UserError
from traindx.profiler.shim._traindx_shim.roles import parse_process_file, rank_labels

STEP_COLUMNS = ["rank", "step", "start_ns", "end_ns", "duration_s"]
PROCESS_COLUMNS = ["pid", "ppid", "label", "rank", "evidence", "argv", "file"]
COMPILE_COLUMNS = ["rank", "kind", "kernel", "start_ns", "end_ns", "duration_s", "thread",
                   "is_main_thread", "step", "caller", "key", "key_fields", "detail"]


_WRAPPED_VALUE = re.compile(r"loss\w*:\s*$")
_VALUE_LINE = re.compile(r"^[\s\d:.,/%•-]*\s[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\s*$|"
                         r"^\s*[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\s*$")


class TruncatedEvidenceWarning(UserWarning):
    pass


class CorruptEvidenceWarning(TruncatedEvidenceWarning):
    """A line of an evidence file that is not a JSON object was skipped."""


def _read_jsonl(path, valid=None):
    """JSON objects of one JSONL file. A line that is not one (a job killed mid-write leaves a
    cut-off last line; a disk or copy fault can leave one anywhere) is skipped with a warning
    naming the file and the line: the rest of the evidence is still good."""
    from traindx.profiler.rolling import read_text

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
            warnings.warn(f"{path}:{n + 1}: last line is truncated (the job was killed "
                          "mid-write); it was skipped", TruncatedEvidenceWarning, stacklevel=3)
        else:
            bad.append(n + 1)
    if bad:
        where = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        warnings.warn(f"{path}: corrupt line{'s' if len(bad) > 1 else ''} {where} skipped",
                      CorruptEvidenceWarning, stacklevel=3)
    return events


def _rank_of(path, suffix):
    return os.path.basename(path)[: -len(suffix)]


@dataclass(frozen=True)
class RunRecord:
    path: str
    manifest: dict
    events: pd.DataFrame = field(repr=False)  # every rank's shim events, one row each, `rank` column
    # every Python process the shim saw (launchers too): pid, ppid, label (rank label or None),
    # rank, evidence (what showed it trains), argv, file
    processes: pd.DataFrame = field(repr=False, default_factory=lambda: pd.DataFrame(
        columns=PROCESS_COLUMNS))
    labels: dict = field(repr=False, default_factory=dict)  # {pid: rank label}

    def _label_of_file(self, stem):
        """Rank label of a per-process file stem 'p<pid>' (None: not a rank); other stems are
        rank labels already (attach mode, runs of earlier versions)."""
        pid = parse_process_file(stem, "")
        if pid is None:
            return stem
        if pid in self.labels:
            return self.labels[pid]
        by_manifest = {int(p): label for label, p in self.manifest.get("ranks", {}).items()
                       if str(p).isdigit()}
        return by_manifest.get(pid)

    # -- the derived tables --------------------------------------------------------------------
    @cached_property
    def ranks(self):
        ranks = set(self.events["rank"].unique()) if len(self.events) else set()
        ranks |= set(self.manifest.get("ranks", {}).keys())
        return sorted(ranks, key=lambda r: (len(str(r)), str(r)))

    def _of_type(self, type_):
        if not len(self.events):
            return pd.DataFrame()
        return self.events[self.events["type"] == type_].dropna(axis=1, how="all")

    @cached_property
    def steps(self):
        """One row per completed optimizer step of each rank."""
        rows = []
        for rank, ev in self.events.groupby("rank") if len(self.events) else []:
            begins = {}
            for e in ev[ev["type"].isin(["step_begin", "step_end"])].itertuples():
                if e.type == "step_begin":
                    begins[int(e.step)] = int(e.t)
                else:
                    start = begins.get(int(e.step))
                    rows.append({"rank": rank, "step": int(e.step), "start_ns": start,
                                 "end_ns": int(e.t),
                                 "duration_s": None if start is None else (int(e.t) - start) / 1e9})
        return pd.DataFrame(rows, columns=STEP_COLUMNS)

    @cached_property
    def compiles(self):
        df = self._of_type("compile")
        if not len(df):
            return pd.DataFrame(columns=COMPILE_COLUMNS)
        df = df.rename(columns={"t": "end_ns", "start": "start_ns"}).reset_index(drop=True)
        for col in COMPILE_COLUMNS:
            if col not in df:
                df[col] = None
        return df

    @cached_property
    def gc(self):
        return self._of_type("gc").reset_index(drop=True)

    @cached_property
    def alloc(self):
        return self._of_type("alloc").reset_index(drop=True)

    @cached_property
    def gpu(self):
        path = os.path.join(self.path, "nvml.csv")
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            return pd.DataFrame(columns=["t", "gpu", "util", "mem_util", "sm_clock_mhz",
                                         "mem_used_bytes", "power_w", "clock_event_reasons"])
        df = pd.read_csv(path, on_bad_lines="skip")
        return df.apply(pd.to_numeric, errors="coerce").dropna(subset=["t"])

    @cached_property
    def log(self):
        """The job's output: t (ns), stream ('o'|'e'), text."""
        path = os.path.join(self.path, "log.txt")
        rows = []
        if os.path.exists(path):
            from traindx.profiler.rolling import read_text

            for line in read_text(path).split("\n"):  # a long run's segments too
                t, _, rest = line.partition(" ")
                stream, _, text = rest.partition(" ")
                if t.isdigit():
                    rows.append((int(t), stream, text))
        return pd.DataFrame(rows, columns=["t", "stream", "text"])

    @cached_property
    def log_steps(self):
        """Steps and losses the job printed itself (see profiler/logparse.py for the formats;
        `diagnose --log-regex` adds the job's own). A line without a step (HF Trainer's dicts:
        the step is the Trainer's state.global_step) gets the number of optimizer steps the shim
        had seen end when the line was printed, else its position among such lines."""
        from traindx.profiler.logparse import compile_custom, parse_line

        pattern = (self.manifest.get("options") or {}).get("log_regex")
        try:
            custom = compile_custom(pattern) if pattern else None
        except ValueError as exc:
            warnings.warn(str(exc), TruncatedEvidenceWarning, stacklevel=2)
            custom = None
        columns = ["t", "step", "loss", "step_time_s", "format", "tokens"]
        rows = []
        texts = list(self.log["text"])
        for i, (t, text) in enumerate(zip(self.log["t"], texts)):
            if i + 1 < len(texts) and _WRAPPED_VALUE.search(text) and _VALUE_LINE.match(texts[i + 1]):
                # rich (Lightning's progress bar) wraps the bar's columns onto the next line:
                # the metric's value is that line's last number (after the times it pushed down)
                text = text.rstrip() + " " + texts[i + 1].split()[-1]
            parsed = parse_line(text, custom)
            if parsed:
                parsed["t"] = t
                rows.append(parsed)
        if any(r["step"] is None for r in rows):
            ends = sorted(int(t) for t in self.events["t"][self.events["type"] == "step_end"]) \
                if len(self.events) and "type" in self.events else []
            import bisect
            unnumbered = 0
            for r in rows:
                if r["step"] is None:
                    unnumbered += 1
                    r["step"] = bisect.bisect_right(ends, int(r["t"])) if ends else unnumbered
        return pd.DataFrame(rows, columns=columns)

    @cached_property
    def pyspy(self):
        """{(rank, 'all'|'gil'): {thread: ThreadSamples}} for every recording present."""
        from traindx.profiler.rolling import load_pyspy

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
        """py-spy dump snapshots: t, rank, thread_name, thread_id, active, owns_gil, top frame."""
        rows = []
        for path in sorted(glob.glob(os.path.join(self.path, "pyspy", "*-dump.jsonl"))):
            rank = self._label_of_file(_rank_of(path, "-dump.jsonl"))
            if rank is None:
                continue
            for snap in _read_jsonl(path):
                for th in snap.get("threads", []):
                    frames = th.get("frames") or []
                    rows.append({"t": snap["t"], "rank": rank, "thread_name": th.get("thread_name"),
                                 "thread_id": th.get("thread_id"), "active": th.get("active"),
                                 "owns_gil": th.get("owns_gil"), "frames": frames,
                                 "os_thread_id": th.get("os_thread_id")})
        return pd.DataFrame(rows, columns=["t", "rank", "thread_name", "thread_id", "active",
                                           "owns_gil", "frames", "os_thread_id"])

    @cached_property
    def torch_trace(self):
        """The torch.profiler window of every rank (trace/<rank>.json.gz): one row per event."""
        from traindx.nodes import load_traces  # a merged multi-node run: every node's windows

        table, errors = load_traces(self.path, self.manifest)
        for message in errors.values():
            warnings.warn(message, TruncatedEvidenceWarning, stacklevel=2)
        return table

    @cached_property
    def spans(self):
        """The shim's measured intervals (traindx.ledger.spans_table): rank, cat, start_ns,
        end_ns, tid, caller."""
        from traindx.ledger import spans_table

        return spans_table(self.events)

    @cached_property
    def _ledgers(self):
        from traindx.ledger import compute

        return compute(self.steps, self.spans, self.compiles, self.events)

    @property
    def ledger(self):
        """One row per rank-step: its wall time split into exclusive measured categories
        (traindx.ledger.CATEGORIES) plus unexplained; each row sums to wall_s."""
        return self._ledgers[0]

    @property
    def startup_ledger(self):
        """One row per rank (step -1): process start -> first step begin, split the same way;
        its unexplained is imports, model build and data set-up."""
        return self._ledgers[1]

    # -- conveniences --------------------------------------------------------------------------
    @property
    def command(self):
        return self.manifest.get("command", [])

    @property
    def missing(self):
        return self.manifest.get("missing", {})

    def rank_steps(self, rank):
        return self.steps[self.steps["rank"] == rank]


def is_run_dir(path):
    return os.path.isfile(os.path.join(path, "manifest.json"))


def load_run(path):
    """Load a run folder written by `diagnose`. Raises UserError for anything that is not one."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise UserError(f"no such run folder: {path}")
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        if os.path.isdir(os.path.join(path, "nodes")):
            raise UserError(f"{path} is a multi-node run not merged yet: run `diagnose merge "
                            f"{path}` once every node has finished")
        raise UserError(f"{path} is not a traindx run (no manifest.json)")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError:
        raise UserError(f"{manifest_path} is corrupt (not JSON)") from None
    if not isinstance(manifest, dict) or "command" not in manifest:
        raise UserError(f"{manifest_path} is not a traindx manifest")
    rows, processes, labels = _load_parts(path, manifest)
    events = pd.DataFrame(rows)
    if len(events):
        events = events.sort_values("t", kind="stable").reset_index(drop=True)
    columns = PROCESS_COLUMNS + (["node"] if manifest.get("nodes") else [])
    return RunRecord(path=path, manifest=manifest, events=events,
                     processes=pd.DataFrame(processes, columns=columns), labels=labels)


def _load_parts(path, manifest):
    """Events of the run, or of a merged multi-node run (`diagnose merge`): every node's
    events/ folder as `_load_events` reads it, its timestamps moved by that node's clock offset
    (traindx.nodes.parts lists (folder, node, offset_ns); nodes.shift_events applies it)."""
    from traindx import nodes

    parts = nodes.parts(path, manifest)
    if len(parts) == 1 and parts[0][1] is None:
        return _load_events(path)
    return nodes.combine([(node, offset, _load_events(folder)) for folder, node, offset in parts])


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _valid_event(event):
    """The fields every reader relies on: type, t (ns), and a whole step number on steps."""
    if not isinstance(event.get("type"), str) or not _is_number(event.get("t")):
        return False
    if event["type"] in ("step_begin", "step_end"):
        return isinstance(event.get("step"), int)
    return True


TRAINING_EVENTS = {"training", "step_begin", "step_end", "optimizer_created"}
IDENTITY_EVENTS = {"process_start", "rank_known"}


def _load_events(path):
    """Events of the ranks, with their rank label; the process table; {pid: label}.

    `events/p<pid>.jsonl` holds one process (any process of the job); its rank is the last
    `rank_known` it wrote, else the rank in its `process_start`. Ranks are the processes that
    showed training evidence; when none did (a job without an optimizer: inference, a
    compile-only script), the processes that recorded anything, else the first one started.
    Labels come from `roles.rank_labels` (one rank in several processes: kept apart, never
    merged). `events/<label>.jsonl` (attach mode, earlier versions) is that rank as is.
    """
    per_process, by_label = [], {}
    for events_path in sorted(glob.glob(os.path.join(path, "events", "*.jsonl"))):
        name = os.path.basename(events_path)
        events = _read_jsonl(events_path, _valid_event)
        pid = parse_process_file(name, ".jsonl")
        if pid is None:
            by_label[name[: -len(".jsonl")]] = events
            continue
        info = {"pid": pid, "ppid": None, "rank": None, "start": None, "evidence": None,
                "argv": None, "file": os.path.join("events", name), "events": events,
                "training": False, "recorded": False}
        for e in events:
            kind = e["type"]
            if kind == "process_start":
                info.update(ppid=e.get("ppid"), argv=e.get("argv"), start=e["t"])
                if e.get("rank") is not None:
                    info["rank"] = str(e["rank"])
            elif kind == "rank_known" and e.get("rank") is not None:
                info["rank"] = str(e["rank"])
            if kind == "training" and info["evidence"] is None:
                info["evidence"] = e.get("evidence")
            info["training"] |= kind in TRAINING_EVENTS
            info["recorded"] |= kind not in IDENTITY_EVENTS
        info["start"] = info["start"] if info["start"] is not None else (events[0]["t"] if events else 0)
        per_process.append(info)
    ranks = [p for p in per_process if p["training"]] or [p for p in per_process if p["recorded"]]
    if not ranks and per_process and not by_label:
        ranks = [min(per_process, key=lambda p: (p["start"], p["pid"]))]
    labels = rank_labels(ranks)
    rows = []
    for label, events in by_label.items():
        for event in events:
            event["rank"] = label
            rows.append(event)
    table = []
    for p in per_process:
        label = labels.get(p["pid"])
        table.append({"pid": p["pid"], "ppid": p["ppid"], "label": label, "rank": p["rank"],
                      "evidence": p["evidence"], "argv": p["argv"], "file": p["file"]})
        if label is None:
            continue
        for event in p["events"]:
            event["rank"] = label
            rows.append(event)
    return rows, table, labels
