"""The run record: everything one `diagnose` run collected, loaded into one immutable object.

Raw evidence stays as written in the run folder; this module derives per-rank pandas DataFrames
from it (one `rank` column each, HTA-style) on a single wall-clock-ns time axis. The shim's
events are read per type (traindx.profiler.columnar: Arrow, no Python loop per event); each table is
built when first used. Analyzers, reports and comparisons read only this object and never
change it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar, cast

import pandas as pd

from traindx.common import untrusted
from traindx.common.errors import UserError
from traindx.derive import record_tables
from traindx.derive.ledger import compute, host_code, measured_forward, spans_table
from traindx.derive.loading import Labels, load_tables
from traindx.derive.loading import write_tables as write_tables  # re-exported: the CLI's run command
from traindx.derive.record_tables import COMPILE_COLUMNS as COMPILE_COLUMNS  # re-exported
from traindx.derive.record_tables import STEP_COLUMNS as STEP_COLUMNS  # re-exported
from traindx.derive.record_tables import spread_coalesced as _spread_coalesced  # noqa: F401  (re-exported)
from traindx.derive.so_far import EventsSoFar as EventsSoFar  # the live loads' state, re-exported
from traindx.profiler import columnar, gputime
from traindx.profiler.columnar import CorruptEvidenceWarning as CorruptEvidenceWarning  # re-exported
from traindx.profiler.columnar import TruncatedEvidenceWarning as TruncatedEvidenceWarning  # re-exported
from traindx.profiler.manifest import CAPTURED, read_manifest
from traindx.profiler.nodes import load_traces
from traindx.profiler.nvml import COLUMNS as NVML_COLUMNS
from traindx.profiler.nvml import load_csv as load_nvml_csv
from traindx.profiler.rolling import ThreadSamples, load_pyspy
from traindx.profiler.shim._traindx_shim import schema
from traindx.profiler.shim._traindx_shim.roles import parse_process_file

PROCESS_COLUMNS = ["pid", "ppid", "label", "rank", "evidence", "argv", "file"]
T = TypeVar("T")


def _empty_processes() -> pd.DataFrame:
    return pd.DataFrame(columns=PROCESS_COLUMNS)


@dataclass(frozen=True)
class RunRecord:
    path: str
    manifest: dict[str, Any]
    # the shim's events, one table per type (a subset(): the same, filtered to some ranks)
    tables: columnar.EventTables | columnar.RankSubset = field(repr=False)
    # every Python process the shim saw (launchers too): pid, ppid, label (rank label or None),
    # rank, evidence (what showed it trains), argv, file
    processes: pd.DataFrame = field(repr=False, default_factory=_empty_processes)
    labels: Labels = field(repr=False, default_factory=dict)  # {pid: rank label}
    # derived, shared tables (cached())
    memo: dict[Hashable, Any] = field(repr=False, default_factory=dict, compare=False)

    def of_type(self, type_: str) -> pd.DataFrame:
        """The events of one type (a `rank` column; the fields that type has), in t order."""
        df = self.tables.frame(type_)
        return df.copy(deep=False) if len(df) else pd.DataFrame()

    @cached_property
    def events(self) -> pd.DataFrame:
        """Every event of every rank in one wide frame, t order (built only if asked for:
        per-type tables via of_type() are what the analyzers read)."""
        return self.tables.all_events()

    def subset(self, ranks: Iterable[str]) -> RunRecord:
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

        def only(df: pd.DataFrame) -> pd.DataFrame:
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

    def cached(self, key: Hashable, build: Callable[[], T]) -> T:
        """A table derived once per run and shared by analyzers (e.g. the steady steps)."""
        if key not in self.memo:
            self.memo[key] = build()
        return cast(T, self.memo[key])

    def _label_of_file(self, stem: str) -> str | None:
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
    def ranks(self) -> list[str]:
        ranks = set(self.tables.ranks())
        ranks |= set(self.manifest.get("ranks", {}).keys())
        return sorted(ranks, key=lambda r: (len(str(r)), str(r)))

    @cached_property
    def t_min(self) -> int | None:
        """The earliest event time (ns), None without events."""
        return self.tables.t_min()

    @cached_property
    def steps(self) -> pd.DataFrame:
        """One row per completed optimizer step of each rank: each step_end paired with the
        latest step_begin of the same rank and step number before it (merge_asof)."""
        return record_tables.steps_table(self.of_type(schema.STEP_END), self.of_type(schema.STEP_BEGIN))

    @cached_property
    def compiles(self) -> pd.DataFrame:
        return record_tables.compiles_table(self.of_type(schema.COMPILE))

    @cached_property
    def gc(self) -> pd.DataFrame:
        return self.of_type(schema.GC).reset_index(drop=True)

    @cached_property
    def alloc(self) -> pd.DataFrame:
        return self.of_type(schema.ALLOC).reset_index(drop=True)

    @cached_property
    def gpu(self) -> pd.DataFrame:
        path = os.path.join(self.path, "nvml.csv")
        if not os.path.exists(path):
            return pd.DataFrame(columns=NVML_COLUMNS)
        df, problem = load_nvml_csv(path)
        if problem:
            warnings.warn(problem, CorruptEvidenceWarning, stacklevel=2)
        return df

    @cached_property
    def log(self) -> pd.DataFrame:
        """The job's output: t (ns), stream ('o'|'e'), text."""
        return record_tables.log_table(os.path.join(self.path, "log.txt"))

    @cached_property
    def log_steps(self) -> pd.DataFrame:
        """Steps and losses the job printed itself (see profiler/logparse.py for the formats;
        `diagnose --log-regex` adds the job's own). A line without a step (HF Trainer's dicts:
        the step is the Trainer's state.global_step) gets the number of optimizer steps the shim
        had seen end when the line was printed, else its position among such lines."""

        def step_end_times() -> list[int]:
            step_end = self.of_type(schema.STEP_END)
            return sorted(int(t) for t in step_end["t"]) if len(step_end) else []

        pattern = (self.manifest.get("options") or {}).get("log_regex")
        pattern = pattern if isinstance(pattern, str) else None
        if pattern and not untrusted.trusted(self.manifest):  # the sender's pattern is code
            warnings.warn(
                f"{self.path}: its --log-regex {str(pattern)[:80]!r} is not run: the run was recorded on "
                f"another machine ({untrusted.TRUST_ENV}=1 runs it, for a copy of your own run)",
                stacklevel=2,
            )
            pattern = None
        return record_tables.log_steps_table(self.log, pattern, step_end_times)

    @cached_property
    def pyspy(self) -> dict[tuple[str, str], dict[str, ThreadSamples]]:
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
    def dumps(self) -> pd.DataFrame:
        """py-spy dump snapshots: t, rank, thread_name, thread_id, active, owns_gil, top frame;
        trigger: the anomaly a burst snapshot was taken for (None for the periodic ones)."""
        return record_tables.dumps_table(os.path.join(self.path, "pyspy"), self._label_of_file)

    @cached_property
    def torch_trace(self) -> pd.DataFrame:
        """The torch.profiler window of every rank (trace/<rank>.json.gz): one row per event."""
        table, errors = load_traces(self.path, self.manifest)
        for message in errors.values():
            warnings.warn(message, TruncatedEvidenceWarning, stacklevel=2)
        return table

    @cached_property
    def spans(self) -> pd.DataFrame:
        """The shim's measured intervals (traindx.derive.ledger.spans_table): rank, cat, start_ns,
        end_ns, tid, caller."""
        return spans_table(self.of_type(schema.SPAN))

    @cached_property
    def _ledgers(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        return compute(
            self.steps,
            self.spans,
            self.compiles,
            self.of_type(schema.PROCESS_START),
            forward_measured=measured_forward(self.spans, self.of_type(schema.HOST_SAMPLES)),
            cpu=self.of_type(schema.CPU),
            gpu_busy=self.gpu_busy,
        )

    @property
    def gpu_busy(self) -> pd.DataFrame:
        """Where each rank's GPU still ran work queued before (rank, start_ns, end_ns on the
        host's clock; traindx.profiler.gputime.busy_before), empty without GPU time marks."""
        return self.cached("gpu_busy", lambda: gputime.busy_before(gputime.for_run(self)[0]))

    @property
    def ledger(self) -> pd.DataFrame:
        """One row per rank-step: its wall time split into exclusive measured categories
        (traindx.derive.ledger.CATEGORIES) plus unexplained; each row sums to wall_s."""
        return self._ledgers[0]

    @property
    def startup_ledger(self) -> pd.DataFrame:
        """One row per rank (step -1): process start -> first step begin, split the same way;
        its unexplained is imports, model build and data set-up."""
        return self._ledgers[1]

    @cached_property
    def cpu_threads(self) -> dict[str, dict[str, Any]]:
        """{rank: the shim's latest `cpu_threads` picture}: intra_op_threads, inter_op_threads,
        process_threads, affinity_cores, cgroup_quota_cores, cpu_count, thread_env,
        dataloader_workers [{pid, threads}], children [{pid, name, threads}], load1, step
        (profiler/shim/_traindx_shim/cpustat.py); ranks without one are absent."""
        return record_tables.latest_cpu_threads(self.of_type("cpu_threads"))

    @property
    def host_code(self) -> pd.DataFrame:
        """What ran inside each rank-step's `host` line (traindx.derive.ledger.host_code)."""
        return host_code(self)

    # -- conveniences --------------------------------------------------------------------------
    @property
    def command(self) -> list[str]:
        command: list[str] = self.manifest.get("command", [])
        return command

    @property
    def missing(self) -> dict[str, Any]:
        missing: dict[str, Any] = self.manifest.get("missing", {})
        return missing

    @cached_property
    def fault_stacks(self) -> dict[str, str]:
        """{label: text} of every process that died by a fatal signal: the Python stacks the
        shim's faulthandler wrote (profiler/shim/_traindx_shim/faults.py); label is 'rank L'
        where the pid's rank label is known, else 'pid N'."""
        return record_tables.fault_stacks(os.path.join(self.path, "faults"), self.labels)

    def rank_steps(self, rank: str) -> pd.DataFrame:
        return self.rank_rows("steps", rank)

    def rank_rows(self, table: Hashable, rank: str, frame: pd.DataFrame | None = None) -> pd.DataFrame:
        """The rows of one rank of a derived table ('steps', 'gc', 'spans', 'ledger', ... or
        `frame` under that name), from one groupby per table: per-rank analyzers then cost
        O(that rank's rows), not a scan of every rank's rows each."""

        def split() -> tuple[pd.DataFrame, dict[Any, pd.DataFrame]]:
            df = getattr(self, cast(str, table)) if frame is None else frame
            if not len(df) or "rank" not in df:
                return df.iloc[0:0], {}
            # not dict(groupby): a GroupBy has a `keys` attribute, which dict() would call
            return df.iloc[0:0], {r: g for r, g in df.groupby("rank", sort=False)}  # noqa: C416

        empty, groups = self.cached(("by_rank", table), split)
        got = groups.get(rank)
        return (empty if got is None else got).copy(deep=False)


# what a run folder holds besides its manifest (any of them makes it a run to analyse)
EVIDENCE_PATHS = {
    "events": "events",
    "pyspy": "py-spy recordings",
    "log.txt": "log",
    "nvml.csv": "NVML samples",
    "trace": "torch.profiler window",
}


def _evidence_present(path: str) -> list[str]:
    return [
        what
        for name, what in EVIDENCE_PATHS.items()
        if os.path.isfile(os.path.join(path, name))
        or (os.path.isdir(os.path.join(path, name)) and os.listdir(os.path.join(path, name)))
    ]


def refuse_links(path: str) -> None:
    """A run folder is read only as it is: one that holds a symbolic link (a py-spy file linked
    to /dev/zero, an events folder linked to someone else's files) is refused in one line. Its
    readers never follow a link either (traindx.common.untrusted), should one appear later."""
    links = untrusted.folder_links(path, skip=(CAPTURED,))  # --fix's copies of the job's folders
    if links:
        first = os.path.join(path, links[0])
        more = f" and {len(links) - 1} more" if len(links) > 1 else ""
        raise UserError(
            f"{path} holds a symbolic link ({links[0]} -> {os.readlink(first)}){more}: a run folder "
            "is read as it is, never through a link; copy it without its links"
        )


def load_run(
    path: str | os.PathLike[str], cache: bool | None = None, so_far: EventsSoFar | None = None
) -> RunRecord:
    """Load a run folder written by `diagnose`. Raises UserError for anything that is not one.
    cache: keep the parsed event tables as Parquet under tables/events/ (None: only for large
    runs; the environment variable TRAINDX_CACHE=0|1 overrides). so_far: an EventsSoFar kept
    between loads of a folder still being written (only what was appended is parsed)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise UserError(
            f"{path} is a file, not a run folder" if os.path.lexists(path) else f"no such run folder: {path}"
        )
    manifest_path = os.path.join(path, "manifest.json")
    nodes = os.path.isdir(os.path.join(path, "nodes"))
    # any other folder (/etc) is not ours, whatever links it holds
    if not os.path.lexists(manifest_path) and not nodes and not _evidence_present(path):
        raise UserError(f"{path} is not a traindx run (no manifest.json)")
    refuse_links(path)
    if not os.path.isfile(manifest_path) and os.path.isdir(os.path.join(path, "nodes")):
        raise UserError(
            f"{path} is a multi-node run not merged yet: run `diagnose merge "
            f"{path}` once every node has finished"
        )
    manifest, problem = read_manifest(manifest_path)
    if manifest is None:  # problem says why
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
    untrusted.note_folder(path, manifest)  # recorded elsewhere: this machine's files not read
    tables, processes, labels = load_tables(path, cache, manifest, so_far=so_far)
    columns = PROCESS_COLUMNS + (["node"] if manifest.get("nodes") else [])
    return RunRecord(
        path=path,
        manifest=manifest,
        tables=tables,
        processes=pd.DataFrame(processes, columns=columns),
        labels=labels,
    )
