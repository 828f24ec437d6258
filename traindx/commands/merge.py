"""Merge the node parts of a multi-node run into one run over all ranks.

usage: diagnose merge RUN [--no-report] [--reference NODE]

RUN/nodes/<node>/ are the run folders each node's `diagnose` wrote. This aligns the nodes'
clocks from the job's own collectives (traindx.clocks: no clock is assumed to be right) and
writes, beside the untouched node folders:
  RUN/clock.json     per node: offset_ns (added to its timestamps), error_ns (the true offset
                     is within offset_ns ± error_ns), constraints, method; conflicts if any
  RUN/manifest.json  the merged manifest: nodes, ranks over every node, GPUs with their node
  RUN/nvml.csv, RUN/log.txt, RUN/pyspy/  the nodes' samples on the reference clock (py-spy
                     files named by rank); events and torch.profiler windows stay in the node
                     folders and are read with their node's offset
then analyses the merged run and writes its report, like `diagnose` does after a job.
Running it again re-estimates and rewrites these (e.g. after a late node's folder arrived).
"""
import json
import os
import shutil
import sys

from traindx.errors import UserError


def prepare_parser(parser):
    parser.add_argument("run_dir", metavar="RUN", help="a multi-node run folder (with nodes/)")
    parser.add_argument("--reference", metavar="NODE", default=None,
                        help="the node whose clock is the run's (default: the node with the "
                             "most matched collectives)")
    parser.add_argument("--no-report", action="store_true",
                        help="only write the merged pieces; no analysis or report")
    parser.add_argument("--quiet", action="store_true", help="print only the clock table")


def _read_manifest(folder):
    path = os.path.join(folder, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"{path} is unreadable or not JSON") from None
    if not isinstance(manifest, dict) or "command" not in manifest:
        raise UserError(f"{path} is not a traindx manifest")
    return manifest


def _write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


def clock_line(per_node, reference):
    """One line for the report's host table: each node's offset and bound."""
    out = []
    for n, e in per_node.items():
        if n == reference:
            continue
        err = "unaligned" if e["error_ns"] is None else f"± {e['error_ns'] / 1e6:.3f} ms"
        out.append(f"{n} {e['offset_ns'] / 1e9:+.6f} s {err}")
    return "; ".join(out) + f" (reference {reference}; clock.json)"


def merged_manifest(node_manifests, offsets, labels, clock_summary, per_node_clock=None):
    """One manifest over the nodes (the reference node's command, options and packages)."""
    reference = clock_summary.get("reference") or next(iter(node_manifests))
    base = dict(node_manifests[reference])
    shifted = lambda m, key: (m.get(key) + offsets.get(n, 0)) if isinstance(m.get(key), int) else None
    starts, ends, gpus, missing, per_node = [], [], [], {}, {}
    codes = []
    for n, m in node_manifests.items():
        starts.append(shifted(m, "start_ns"))
        ends.append(shifted(m, "end_ns"))
        for g in m.get("gpus") or []:  # run_index: the GPU's index in the merged nvml.csv
            g = dict(g) if isinstance(g, dict) else {"gpu": g}
            gpus.append(dict(g, node=n, run_index=len(gpus)))
        for key, why in (m.get("missing") or {}).items():
            missing[f"{key}@{n}"] = why
        codes.append(m.get("exit_code"))
        per_node[n] = {"host": m.get("host"), "node": m.get("node"), "start_ns": m.get("start_ns"),
                       "end_ns": m.get("end_ns"), "exit_code": m.get("exit_code"),
                       "status": m.get("status"), "command": m.get("command"),
                       "ranks": m.get("ranks"), "nvml": m.get("nvml")}
    hosts = sorted({(m.get("host") or {}).get("hostname") or "?" for m in node_manifests.values()})
    failed = [c for c in codes if c not in (0, None)]
    base.update({
        "nodes": list(node_manifests),
        "node_manifests": per_node,
        "host": dict(base.get("host") or {}, hostname=", ".join(hosts),
                     nodes=len(node_manifests),
                     clock_offsets=clock_line(per_node_clock or {}, reference)),
        "start_ns": min((s for s in starts if s is not None), default=None),
        "end_ns": max((e for e in ends if e is not None), default=None),
        "exit_code": failed[0] if failed else (0 if all(c == 0 for c in codes) else None),
        "status": "merged",
        "gpus": gpus,
        "missing": missing,
        "ranks": {label: pid for (node, pid), label in sorted(labels.items(), key=lambda kv: kv[1])
                  if _is_rank(label)},
        "rank_nodes": {label: node for (node, pid), label in labels.items() if _is_rank(label)},
        "clock": {"file": "clock.json", "reference": reference,
                  "consistent": clock_summary.get("consistent")},
    })
    base.pop("node", None)
    base.pop("nvml", None)
    return base


def _is_rank(label):
    return label is not None


def _merge_nvml(parts, out_path, gpu_base):
    """Every node's nvml.csv on the reference clock; GPU indices made run-wide (the merged
    manifest's gpus list), the node kept in its own column."""
    import pandas as pd

    frames = []
    for folder, node, offset in parts:
        path = os.path.join(folder, "nvml.csv")
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            continue
        try:
            df = pd.read_csv(path, on_bad_lines="skip")
        except (ValueError, pd.errors.EmptyDataError):
            continue
        if "t" not in df or not len(df):
            continue
        df["t"] = pd.to_numeric(df["t"], errors="coerce")
        df = df.dropna(subset=["t"])
        df["t"] = df["t"].astype("int64") + offset
        if "gpu" in df:
            df["gpu"] = pd.to_numeric(df["gpu"], errors="coerce") + gpu_base.get(node, 0)
        df["node"] = node
        frames.append(df)
    if not frames:
        return False
    pd.concat(frames, ignore_index=True).sort_values("t", kind="stable").to_csv(out_path, index=False)
    return True


def _merge_log(parts, out_path):
    lines = []
    for folder, node, offset in parts:
        path = os.path.join(folder, "log.txt")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                t, _, rest = line.rstrip("\n").partition(" ")
                if t.isdigit():
                    lines.append((int(t) + offset, rest))
    lines.sort(key=lambda x: x[0])
    with open(out_path, "w", encoding="utf-8") as f:
        for t, rest in lines:
            f.write(f"{t} {rest}\n")


def _merge_pyspy(parts, labels, out_dir):
    """py-spy files of each node's ranks, named by the rank (pids may repeat across nodes);
    recordings are linked (no timestamps inside), dump snapshots rewritten on the reference
    clock."""
    from traindx.profiler.shim._traindx_shim.roles import parse_process_file

    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    for folder, node, offset in parts:
        src = os.path.join(folder, "pyspy")
        try:
            names = sorted(os.listdir(src))
        except OSError:
            continue
        for name in names:
            stem, dot, ext = name.partition(".")
            who, _, flavour = stem.rpartition("-")
            pid = parse_process_file(who, "")
            label = labels.get((node, pid)) if pid is not None else who
            if label is None or not flavour:
                continue
            target = os.path.join(out_dir, f"{label}-{flavour}{dot}{ext}")
            if name.endswith("-dump.jsonl"):
                with open(os.path.join(src, name), encoding="utf-8", errors="replace") as f, \
                        open(target, "w", encoding="utf-8") as out:
                    for line in f:
                        try:
                            snap = json.loads(line)
                            snap["t"] = int(snap["t"]) + offset
                            snap["node"] = node
                            out.write(json.dumps(snap) + "\n")
                        except (ValueError, KeyError, TypeError):
                            continue  # a cut-off line: the node's own file keeps it
            else:
                try:
                    os.link(os.path.join(src, name), target)
                except OSError:
                    shutil.copyfile(os.path.join(src, name), target)


def merge(run_dir, reference=None):
    """Write clock.json and the merged pieces; returns (clock document, merged manifest)."""
    from traindx import clocks, nodes
    from traindx.record import _load_events

    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise UserError(f"no such run folder: {run_dir}")
    found = nodes.node_dirs(run_dir)
    if not found:
        raise UserError(f"{run_dir} has no node parts (nodes/<node>/manifest.json): it is not a "
                        "multi-node run")
    if reference is not None and reference not in found:
        raise UserError(f"--reference {reference}: no such node (nodes: {', '.join(found)})")
    manifests = {n: _read_manifest(d) for n, d in found.items()}
    loaded = {n: _load_events(d) for n, d in found.items()}
    by_node = {}
    for n, (rows, _, _) in loaded.items():
        per_rank = {}
        for event in rows:
            per_rank.setdefault(event.get("rank"), []).append(event)
        by_node[n] = list(per_rank.items())
    per_node, summary = clocks.align(by_node, reference=reference)
    for n, entry in per_node.items():
        entry["host"] = (manifests[n].get("host") or {}).get("hostname")
        entry["ranks"] = sorted({str(r) for r in (manifests[n].get("ranks") or {})})
    offsets = {n: e["offset_ns"] for n, e in per_node.items()}
    clock = {"method": clocks.METHOD, "reference": summary["reference"],
             "consistent": summary["consistent"], "conflicts": summary["conflicts"],
             "usable_collectives": summary["usable_collectives"], "nodes": per_node,
             "pairs": summary["pairs"],
             "note": "offset_ns is added to every timestamp of that node; the true offset lies "
                     "within offset_ns ± error_ns if the node's clock ran at a constant offset"}
    _write_json(os.path.join(run_dir, nodes.CLOCK_FILE), clock)

    ordered = list(found)
    _, _, labels = nodes.combine([(n, offsets[n], loaded[n]) for n in ordered])
    manifest = merged_manifest(manifests, offsets, labels, summary, per_node)
    parts = [(found[n], n, offsets[n]) for n in ordered]
    gpu_base, count = {}, 0
    for n in ordered:
        gpu_base[n] = count
        count += len(manifests[n].get("gpus") or [])
    if not _merge_nvml(parts, os.path.join(run_dir, "nvml.csv"), gpu_base):
        manifest["missing"].setdefault("nvml", "no node recorded NVML samples")
    _merge_log(parts, os.path.join(run_dir, "log.txt"))
    _merge_pyspy(parts, labels, os.path.join(run_dir, "pyspy"))
    _write_json(os.path.join(run_dir, "manifest.json"), manifest)
    return clock, manifest


def format_clock(clock):
    lines = [f"clock reference: {clock['reference']} ({clock['usable_collectives']} matched "
             f"collectives usable)"]
    for n, e in clock["nodes"].items():
        err = "unknown" if e["error_ns"] is None else f"± {e['error_ns'] / 1e6:.3f} ms"
        lines.append(f"  {n}: host {e.get('host')}, ranks {','.join(e.get('ranks') or []) or '-'}, "
                     f"offset {e['offset_ns'] / 1e9:+.6f} s {err}, {e['constraints']} constraints"
                     + ("" if e["method"] == clocks_method() else f" ({e['method']})"))
    if not clock["consistent"]:
        lines.append("  INCONSISTENT: " + "; ".join(clock["conflicts"]))
    return "\n".join(lines)


def clocks_method():
    from traindx.clocks import METHOD

    return METHOD


def run(args, parser):
    from traindx import nodes

    unfinished = [n for n, d in nodes.node_dirs(os.path.abspath(args.run_dir)).items()
                  if _read_manifest(d).get("status") == "running"]
    if unfinished:  # merging is still right for what is there; say what may be missing
        print(f"diagnose: warning: node{'s' if len(unfinished) > 1 else ''} "
              f"{', '.join(unfinished)} still running (or killed): merged as far as recorded",
              file=sys.stderr)
    clock, _ = merge(args.run_dir, reference=args.reference)
    print(format_clock(clock), file=sys.stderr if args.quiet else sys.stdout)
    if args.no_report:
        return 0
    from traindx.outputs import analyze_and_write
    from traindx.record import load_run

    record = load_run(args.run_dir)
    findings, report_path = analyze_and_write(record)
    if args.quiet:
        print(report_path)
    else:
        from traindx.report.terminal import print_summary

        print_summary(record, findings, report_path)
    return 0


def main(argv=None):
    from traindx.cli import main as cli_main

    return cli_main(["merge", *(sys.argv[1:] if argv is None else argv)])
