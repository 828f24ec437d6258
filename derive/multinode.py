"""The multi-node merge as an engine: one run from each node's part, clocks aligned from the
collectives the nodes share (clock.json, the merged manifest, nvml.csv, log.txt, pyspy/ beside
the untouched node folders). Derive layer: it reads the parts' events (traindx.derive.run) and
writes only derived files; the record layer's node bookkeeping is traindx.profiler.nodes."""

from __future__ import annotations

import os
from typing import Any

from traindx.common.errors import UserError
from traindx.derive.loading import load_node_events
from traindx.derive.run import RunRecord, load_run
from traindx.profiler import clocks
from traindx.profiler.nodes import (
    CLOCK_FILE,
    combine,
    merge_log,
    merge_nvml,
    merge_pyspy,
    merged_manifest,
    node_dirs,
    read_manifest,
    write_json,
)


def merge_parts(run_dir: str, reference: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write clock.json and the merged pieces; returns (clock document, merged manifest)."""
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise UserError(f"no such run folder: {run_dir}")
    found = node_dirs(run_dir)
    if not found:
        raise UserError(
            f"{run_dir} has no node parts (nodes/<node>/manifest.json): it is not a multi-node run"
        )
    if reference is not None and reference not in found:
        raise UserError(f"--reference {reference}: no such node (nodes: {', '.join(found)})")
    manifests = {n: read_manifest(d) for n, d in found.items()}
    loaded = {n: load_node_events(d) for n, d in found.items()}
    by_node: dict[str, list[tuple[Any, list[dict[str, Any]]]]] = {}
    for n, (rows, _, _) in loaded.items():
        per_rank: dict[Any, list[dict[str, Any]]] = {}
        for event in rows:
            per_rank.setdefault(event.get("rank"), []).append(event)
        by_node[n] = list(per_rank.items())
    per_node, summary = clocks.align(by_node, reference=reference)
    for n, entry in per_node.items():
        entry["host"] = (manifests[n].get("host") or {}).get("hostname")
        entry["ranks"] = sorted({str(r) for r in (manifests[n].get("ranks") or {})})
    offsets = {n: e["offset_ns"] for n, e in per_node.items()}
    clock = {
        "method": clocks.METHOD,
        "reference": summary["reference"],
        "consistent": summary["consistent"],
        "conflicts": summary["conflicts"],
        "usable_collectives": summary["usable_collectives"],
        "nodes": per_node,
        "pairs": summary["pairs"],
        "note": "offset_ns is added to every timestamp of that node; the true offset lies "
        "within offset_ns ± error_ns if the node's clock ran at a constant offset",
    }
    write_json(os.path.join(run_dir, CLOCK_FILE), clock)

    ordered = list(found)
    _, _, labels = combine([(n, offsets[n], loaded[n]) for n in ordered])
    manifest = merged_manifest(manifests, offsets, labels, summary, per_node)
    parts = [(found[n], n, offsets[n]) for n in ordered]
    gpu_base: dict[str, int] = {}
    count = 0
    for n in ordered:
        gpu_base[n] = count
        count += len(manifests[n].get("gpus") or [])
    if not merge_nvml(parts, os.path.join(run_dir, "nvml.csv"), gpu_base):
        manifest["missing"].setdefault("nvml", "no node recorded NVML samples")
    merge_log(parts, os.path.join(run_dir, "log.txt"))
    merge_pyspy(parts, labels, os.path.join(run_dir, "pyspy"))
    write_json(os.path.join(run_dir, "manifest.json"), manifest)
    return clock, manifest


def merge(run_dir: str, reference: str | None = None) -> RunRecord:
    """Merge the node parts of a multi-node run (RUN/nodes/<node>/) into one run over all ranks:
    clock.json, the merged manifest, nvml.csv, log.txt and pyspy/ beside the untouched node
    folders. Returns the merged run, loaded (traindx.derive.run.RunRecord); its clock document is
    `run.manifest["clock"]` plus RUN/clock.json. Raises UserError for a folder that is not one."""
    merge_parts(run_dir, reference=reference)
    return load_run(run_dir)
