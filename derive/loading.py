"""Loading a run folder's events: the shim's per-process JSONL files parsed into per-type tables
(traindx.profiler.columnar), the processes they came from, and which of them are ranks and by
what label. The run record (traindx.derive.run) is built from what this returns.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from collections.abc import Set as AbstractSet
from typing import Any

from traindx.derive.record_tables import none_if_nan
from traindx.derive.so_far import EventsSoFar
from traindx.profiler import columnar, eventcache, nodes
from traindx.profiler.columnar import CorruptEvidenceWarning, FileParse, TruncatedEvidenceWarning
from traindx.profiler.shim._traindx_shim import schema
from traindx.profiler.shim._traindx_shim.roles import rank_labels

TRAINING_EVENTS = schema.TRAINING_EVENTS
IDENTITY_EVENTS = schema.IDENTITY_EVENTS

# {pid: rank label}; on a merged multi-node run {(node, pid): rank label}
Labels = dict[Any, str]
# one process of the run (_process_info): pid, ppid, rank, start, evidence, argv, file, index,
# node, training, recorded
ProcessInfo = dict[str, Any]
Notes = list[tuple[type[Warning], str]]


def load_tables(
    path: str,
    cache: bool | None = None,
    manifest: dict[str, Any] | None = None,
    write_cache: bool = True,
    so_far: EventsSoFar | None = None,
) -> tuple[columnar.EventTables, list[dict[str, Any]], Labels]:
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
    read = eventcache.may_read_cache(cache)
    write = write_cache and eventcache.use_cache(files, cache)
    fp = eventcache.fingerprint(files) if (read or write) else None
    hit = eventcache.read_cache(path, fp) if read else None
    if hit is not None:
        index, paths = hit
        columnar.warn_all(_notes_from_json(index["notes"]), stacklevel=4)
        tables = columnar.EventTables(
            files, index["labels_by_file"], {}, {}, cached=paths, summary=index["summary"]
        )
        return tables, index["processes"], _labels_from_json(index["labels"])
    # a merged run: the tables each node wrote for itself at its job's end (node_tables)
    known = _KnownFiles.of_nodes(files, _node_tables(path, manifest, files) if multi and read else {})
    todo = [i for i in range(len(files)) if known.summary[i] is None]
    parsed = (
        columnar.parse_files([files[i] for i in todo], indices=todo)
        if so_far is None
        else so_far.parse([files[i] for i in todo], todo)
    )
    notes = known.notes + [n for _, _, ns, _ in parsed for n in ns]
    columnar.warn_all(notes, stacklevel=4)
    for i, (_, _, _, ident) in zip(todo, parsed):
        known.summary[i] = [ident["count"], ident["t_min"]]
        pid = columnar.process_pid(files[i].rel)
        if pid is not None:
            known.info_of_file[i] = _process_info(pid, files[i], i, ident)
    label_of_file: list[str | None] = [
        os.path.basename(x.rel)[: -len(".jsonl")] if columnar.process_pid(x.rel) is None else None
        for x in files
    ]
    per_process = [p for p in known.info_of_file if p is not None]
    replaced, exec_notes = _replaced_images(per_process)
    labels, table = _label_processes(per_process, label_of_file, multi, replaced)
    columnar.warn_all(exec_notes, stacklevel=4)
    notes += exec_notes
    flat, nested = _by_type(parsed)
    del parsed
    tables = columnar.EventTables(
        files,
        label_of_file,
        flat,
        nested,
        summary=known.summary,
        node_tables=known.node_tables,
        kept=None if so_far is None else so_far.frames,
    )
    # every node's own tables read: a run-wide copy would only duplicate them
    if write and (todo or not known.node_tables):
        meta = {
            "summary": known.summary,
            "processes": table,
            "labels": _labels_to_json(labels),
            "labels_by_file": label_of_file,
            "per_process": per_process,
            "notes": [["corrupt" if c is CorruptEvidenceWarning else "truncated", m] for c, m in notes],
        }
        tables.write_cache(path, fp, meta)
    return tables, table, labels


def _by_type(parsed: list[FileParse]) -> tuple[dict[str, list[Any]], dict[str, list[dict[str, Any]]]]:
    """Every file's parse gathered per event type: ({type: [Arrow tables]}, {type: [rows]})."""
    flat: dict[str, list[Any]] = {}
    nested: dict[str, list[dict[str, Any]]] = {}
    for tables_of_file, rows_of_file, _, _ in parsed:
        for typ, t in tables_of_file.items():
            flat.setdefault(typ, []).append(t)
        for typ, rows in rows_of_file.items():
            nested.setdefault(typ, []).extend(rows)
    return flat, nested


class _KnownFiles:
    """What is known of each event file before parsing: from the tables its node wrote for
    itself (a merged multi-node run), its summary [count, t_min] and its process info."""

    def __init__(self, n_files: int) -> None:
        self.info_of_file: list[ProcessInfo | None] = [None] * n_files
        self.summary: list[list[Any] | None] = [None] * n_files
        self.node_tables: list[tuple[int, Any]] = []
        self.notes: Notes = []

    @classmethod
    def of_nodes(
        cls, files: list[columnar.EventFile], node_hits: dict[int, tuple[dict[str, Any], Any]]
    ) -> _KnownFiles:
        known = cls(len(files))
        for base, (node_index, paths) in node_hits.items():
            known.node_tables.append((base, paths))
            known.notes += _notes_from_json(node_index["notes"])
            for j, count_t in enumerate(node_index["summary"]):
                known.summary[base + j] = count_t
            for p in node_index["per_process"]:
                i = base + p["index"]
                known.info_of_file[i] = dict(p, index=i, file=files[i].rel, node=files[i].node)
        return known


def _replaced_images(per_process: list[ProcessInfo]) -> tuple[set[int], Notes]:
    """A process that replaced its program (os.execv: the same pid, a second events file) is one
    rank with two programs whose steps would collide: the first program that trains (else the
    first) is analysed; the files of the others are kept but not analysed, said in one note.
    Returns (the indices of the files left out, the notes)."""
    by_pid: dict[tuple[Any, int], list[ProcessInfo]] = {}
    for p in per_process:
        by_pid.setdefault((p["node"], p["pid"]), []).append(p)
    left_out: set[int] = set()
    notes: Notes = []
    for (_, pid), images in by_pid.items():
        if len(images) < 2:
            continue
        images = sorted(images, key=lambda p: (not p["training"], p["start"]))
        kept, others = images[0], images[1:]
        left_out.update(p["index"] for p in others)
        notes.append(
            (
                TruncatedEvidenceWarning,
                f"process {pid} replaced its program (exec) while the job ran: {len(images)} "
                f"programs under one pid; the steps of {' '.join(kept['argv'] or ['its first'])!s:.120} "
                f"are analysed, the events of the other{'s' if len(others) > 1 else ''} "
                f"({', '.join(p['file'] for p in others)}) are kept but not analysed",
            )
        )
    return left_out, notes


def _label_processes(
    per_process: list[ProcessInfo],
    label_of_file: list[str | None],
    multi: bool,
    replaced: AbstractSet[int] = frozenset(),
) -> tuple[Labels, list[dict[str, Any]]]:
    """(labels, process table rows) of the run's processes; each rank's file gets its label in
    label_of_file (not the files of a program an exec replaced: `replaced`)."""
    ranked = [p for p in per_process if p["index"] not in replaced]
    has_label_files = any(label is not None for label in label_of_file)
    key: Callable[[ProcessInfo], Hashable]
    if multi:
        by_node: dict[Any, list[ProcessInfo]] = {}
        for p in ranked:
            by_node.setdefault(p["node"], []).append(p)
        per_node = [
            (node, rank_labels(_rank_processes(procs, has_label_files))) for node, procs in by_node.items()
        ]
        labels = nodes.rename_labels(per_node)
        key = lambda p: (p["node"], p["pid"])  # noqa: E731
    else:
        labels = rank_labels(_rank_processes(ranked, has_label_files))
        key = lambda p: p["pid"]  # noqa: E731
    table = []
    for p in per_process:
        label = None if p["index"] in replaced else labels.get(key(p))
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
    return labels, table


def _process_info(pid: int, x: columnar.EventFile, i: int, ident: dict[str, Any]) -> ProcessInfo:
    """One process of the run from its file's identity events: pid, ppid, the rank it reported
    (the last rank_known, else process_start's), start, training evidence, what it recorded."""
    info: ProcessInfo = {
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
            info.update(ppid=none_if_nan(e.get("ppid")), argv=e.get("argv"), start=e["t"])
            if none_if_nan(e.get("rank")) is not None:
                info["rank"] = str(e["rank"])
        elif kind == schema.RANK_KNOWN and none_if_nan(e.get("rank")) is not None:
            info["rank"] = str(e["rank"])
        if kind == schema.TRAINING and info["evidence"] is None:
            info["evidence"] = none_if_nan(e.get("evidence"))
    if info["start"] is None:
        info["start"] = ident["first_t"] if ident["first_t"] is not None else 0
    return info


def _node_tables(
    path: str, manifest: dict[str, Any] | None, files: list[columnar.EventFile]
) -> dict[int, tuple[dict[str, Any], Any]]:
    """{index of the node's first file in `files`: (its cache index, {type: (parquet, json
    columns)})} for every node of a merged run whose own tables (written by its diagnose,
    `write_tables`) match its raw files now. The node's tables hold its own clock's times;
    its offset is applied with everything else in EventTables._place. A node without them, or
    with tables that no longer match (a file grew, was copied without its mtime), is parsed."""
    out, base = {}, 0
    for folder, node, _ in nodes.parts(path, manifest or {}):
        own = columnar.event_files(folder)
        hit = eventcache.read_cache(folder, eventcache.fingerprint(own)) if own else None
        if hit is not None and "per_process" in hit[0] and len(hit[0]["summary"]) == len(own):
            out[base] = hit
        base += len(own)
    return out if base == len(files) else {}  # a node's files changed meanwhile: parse all


def write_tables(path: str) -> str | None:
    """Write the run folder's Parquet event tables (tables/events/) now, whatever its size:
    what each node of a multi-node run does when its job ends, so that the central analysis
    reads tables instead of parsing every node's JSONL. Returns None, or why it could not."""
    if os.environ.get("TRAINDX_CACHE") == "0":
        return None  # the user turned the tables off
    try:
        tables, _, _ = load_tables(path, cache=True)
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if tables._cached is None:
        return tables.cache_error or "the tables were not written"
    return None


def _notes_from_json(items: list[list[str]]) -> Notes:
    return [(CorruptEvidenceWarning if c == "corrupt" else TruncatedEvidenceWarning, m) for c, m in items]


def _rank_processes(per_process: list[ProcessInfo], has_label_files: bool) -> list[ProcessInfo]:
    ranks = [p for p in per_process if p["training"]] or [p for p in per_process if p["recorded"]]
    if not ranks and per_process and not has_label_files:
        ranks = [min(per_process, key=lambda p: (p["start"], p["pid"]))]
    return ranks


def _labels_to_json(labels: Labels) -> list[list[Any]]:
    """[[node or None, pid, label]]: keys are pids, or (node, pid) on a multi-node run."""
    return [[k[0], k[1], v] if isinstance(k, tuple) else [None, k, v] for k, v in labels.items()]


def _labels_from_json(items: list[list[Any]] | dict[str, str]) -> Labels:
    if isinstance(items, dict):  # a cache written before multi-node runs
        return {int(k): v for k, v in items.items()}
    return {(node, int(pid)) if node is not None else int(pid): label for node, pid, label in items}


def load_node_events(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Labels]:
    """(collective span rows as dicts, process table rows, {pid: label}) of one node's run
    folder: what `diagnose merge` needs to align that node's clock and to name its ranks."""
    # the node's own tables when its diagnose wrote them (write_tables); never written here:
    # merge leaves the node folders as their nodes wrote them
    tables, table, labels = load_tables(path, cache=None, write_cache=False)
    spans = tables.frame(schema.SPAN)
    rows = []
    if len(spans) and "cat" in spans:
        coll = spans[spans["cat"] == "collective"]
        rows = [{k: none_if_nan(v) for k, v in event.items()} for event in coll.to_dict("records")]
    return rows, table, labels
