"""py-spy's view: the GIL holder's stacks as an icicle tree, each thread's GIL share, and thread
lanes (which thread ran, which held the GIL) around the worst step."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from traindx.analyzers.core import evidence as ev
from traindx.profiler import speedscope
from traindx.profiler.code_paths import code_kind
from traindx.report.steps_view import MAX_STEP_BARS
from traindx.report.text import clip

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord

# the rule for the job's code vs a library's is the shim's (frames.code_kind); cached: a flame
# tree asks it for every frame of every sample
_frame_kind = lru_cache(maxsize=65536)(code_kind)


FLAME_MIN_SHARE = 0.004  # icicle nodes smaller than this share of the samples are pruned

FLAME_MAX_DEPTH = 80

MAX_LANE_SNAPSHOTS = 400

MAX_GIL_RANKS = 8  # icicles drawn; a 64-rank job would otherwise outgrow the size budget


def worst_rank_first(per_rank: list[dict[str, Any]], worst: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    if worst:
        per_rank = sorted(per_rank, key=lambda g: g["rank"] != worst["rank"])
    return per_rank[:MAX_GIL_RANKS]


def thread_label(name: object, names: Mapping[str, str] | None = None) -> str:
    """py-spy's 'Thread 6263 "MainThread"' -> 'MainThread (6263)'; an empty name is looked up in
    `names` ({native thread id: Python thread name}, from py-spy's dumps)."""
    parsed = speedscope.parse_thread_label(name)
    if not parsed:  # not a py-spy thread label
        return str(name)
    tid, label = parsed
    shown = label or (names or {}).get(tid)
    return f"{shown} ({tid})" if shown else f"thread {tid}"


def flame_tree(
    threads: Mapping[str, Any],
    min_share: float = FLAME_MIN_SHARE,
    max_depth: int = FLAME_MAX_DEPTH,
    names: Mapping[str, str] | None = None,
    cwd: str = "",
) -> dict[str, Any]:
    """{thread: ThreadSamples} -> a tree {name, file, line, kind, value, children}, threads at the
    first level; nodes under min_share of all samples are dropped (their weight stays in the parent)."""

    def new_node(name: str, kind: str, file: str = "", line: int = 0) -> dict[str, Any]:
        return {"name": name, "file": file, "line": line, "kind": kind, "value": 0, "children": {}}

    root = new_node("all samples", "root")
    for thread, ts in threads.items():
        tnode = root["children"].setdefault(
            ("thread", thread), new_node(thread_label(thread, names), "thread")
        )
        for stack, weight in zip(ts.stacks, ts.weights):
            root["value"] += weight
            tnode["value"] += weight
            node = tnode
            in_import = False
            for frame in stack[:max_depth]:
                if not frame.file and speedscope.root_frame(frame.name):
                    continue  # py-spy's own "thread (id): name" root
                if frame.file.startswith("<frozen importlib"):
                    # a chain of importlib frames says one thing: "importing"; keep one node
                    if in_import:
                        continue
                    in_import = True
                    key = ("(import machinery)", "", 0)
                    kind = "python"
                else:
                    in_import = False
                    key = (frame.name, frame.file, frame.line)
                    kind = _frame_kind(frame.file, cwd)
                child = node["children"].get(key)
                if child is None:
                    child = node["children"][key] = new_node(key[0], kind, key[1], key[2])
                child["value"] += weight
                node = child
    total = root["value"]

    def finish(node: dict[str, Any]) -> dict[str, Any]:
        kids = [c for c in node["children"].values() if total and c["value"] / total >= min_share]
        kids.sort(key=lambda c: -c["value"])
        return {
            "name": clip(node["name"], 300),
            "file": clip(node["file"], 300),
            "line": node["line"],
            "kind": node["kind"],
            "value": node["value"],
            "children": [finish(c) for c in kids],
        }

    return finish(root)


def _hottest_path(tree: dict[str, Any]) -> list[dict[str, Any]]:
    """The heaviest chain of user/library frames under the heaviest thread: the one-line answer to
    'what held the GIL'."""
    path: list[dict[str, Any]] = []
    node = tree
    while node["children"]:
        node = node["children"][0]
        if node["kind"] != "thread":
            path.append(node)
    return path


_PACKAGE = re.compile(r"/(?:site-packages|dist-packages|site)/([^/]+)/(?:dsl_packages/([^/]+)/)?")


def _package_of(file: str) -> str:
    """'…/site-packages/torch/autograd/function.py' -> 'torch' (the hand-overs worth showing)."""
    m = _PACKAGE.search(file or "")
    return (m[2] or m[1]) if m else ""


def _condensed(path: list[dict[str, Any]], keep_last: int = 2, max_lines: int = 12) -> list[dict[str, Any]]:
    """The hottest path for reading: where it starts, every hand-over between the job's code,
    libraries and the stdlib, and where it ends; the rest elided."""
    keep = set(range(len(path) - keep_last, len(path))) | {0}
    owners = [(n["kind"], _package_of(n["file"])) for n in path]
    for i in range(1, len(path)):
        if owners[i] != owners[i - 1]:
            keep |= {i - 1, i}
    out: list[dict[str, Any]] = []
    last = -1
    for i in sorted(k for k in keep if 0 <= k < len(path)):
        if i > last + 1:
            out.append(
                {
                    "name": f"… {i - last - 1} frame{'s' if i - last - 1 > 1 else ''}",
                    "where": "",
                    "kind": "elided",
                }
            )
        n = path[i]
        out.append(
            {"name": n["name"], "where": f"{n['file']}:{n['line']}" if n["file"] else "", "kind": n["kind"]}
        )
        last = i
    if len(out) > max_lines:
        # deep import chains hand over at every level: keep the start and the innermost end
        head, tail = out[:3], out[-(max_lines - 4) :]
        skipped = len(path) - sum(1 for n in head + tail if n["kind"] != "elided")
        out = (
            head
            + [{"name": f"… {skipped} frames", "where": "", "kind": "elided"}]
            + [n for n in tail if n["kind"] != "elided" or n is not tail[0]]
        )
    return out


def _thread_names(run: RunRecord, rank: str) -> dict[str, str]:
    """{native thread id: Python thread name} from py-spy's dumps of one rank."""
    d = run.dumps
    if not len(d) or "os_thread_id" not in d:
        return {}
    d = d[(d["rank"] == rank) & d["os_thread_id"].notna()]
    return {
        str(int(tid)): name
        for tid, name in zip(d["os_thread_id"], d["thread_name"])
        if isinstance(name, str) and name
    }


def gil_view(run: RunRecord) -> list[dict[str, Any]]:
    """Per rank: the --gil recording as a tree and the share of the training time each thread
    held the GIL."""
    out = []
    recordings = run.pyspy
    cwd = str(run.manifest.get("cwd") or "")
    for rank in sorted({r for r, _ in recordings}, key=lambda r: (len(r), r)):
        gil = recordings.get((rank, "gil"))
        idle = recordings.get((rank, "all")) or {}
        if not gil:
            continue
        names = _thread_names(run, rank)
        total_gil = sum(sum(ts.weights) for ts in gil.values())
        # the GIL finding's own measure (analyzers/host/gil.py): a thread's GIL seconds over the main
        # thread's sampled seconds, imports left out; one number per thread, report and finding
        main = ev.main_thread_id(idle, gil)
        window = sum(ev.training_weight(ts) for n, ts in idle.items() if ev.thread_key(n)[0] == main)
        threads: list[dict[str, Any]] = []
        for name, ts in gil.items():
            held = ev.training_weight(ts)
            threads.append(
                {
                    "thread": clip(thread_label(name, names), 100),
                    "gil_s": held,
                    # two recorders sample independently: clamp their noise at 100 %
                    "gil_share": min(1.0, held / window) if window else None,
                }
            )
        threads.sort(key=lambda t: -t["gil_s"])
        tree = flame_tree(gil, names=names, cwd=cwd)
        out.append(
            {
                "rank": rank,
                "total_s": total_gil,
                "threads": threads,
                "tree": tree,
                "hottest": _condensed(_hottest_path(tree)),
            }
        )
    return out


def _chosen_snapshots(times: list[int], w0: float, w1: float) -> tuple[list[int], str]:
    """The snapshot times drawn and the zoom: the worst step's own, else the whole run."""
    inside = [t for t in times if w0 <= t <= w1]
    if len(inside) >= 3:
        chosen, zoom = inside, "step"
    else:
        # the step is shorter than the snapshot interval: show the whole run, step highlighted
        chosen, zoom = times, "run"
    if len(chosen) > MAX_LANE_SNAPSHOTS:
        stride = math.ceil(len(chosen) / MAX_LANE_SNAPSHOTS)
        chosen = chosen[::stride]
    return chosen, zoom


def _snapshots_by_thread(d: Any, t0: int) -> dict[str, list[dict[str, Any]]]:
    lanes: dict[str, list[dict[str, Any]]] = {}
    for r in d.itertuples():
        name = r.thread_name if isinstance(r.thread_name, str) and r.thread_name else f"thread {r.thread_id}"
        frames = r.frames if isinstance(r.frames, list) else []
        state = "gil" if r.owns_gil else ("active" if r.active else "idle")
        top = frames[0] if frames else {}
        lanes.setdefault(name, []).append(
            {
                "t_s": (int(r.t) - t0) / 1e9,
                "state": state,
                "frame": clip(
                    f"{top.get('name', '?')} ({top.get('filename', '')}:{top.get('line', '')})", 300
                )
                if top
                else "",
                "stack": [
                    clip(
                        f"{f.get('name', '?')} ({os.path.basename(str(f.get('filename', '')))}:{f.get('line', '')})",
                        200,
                    )
                    for f in frames[:8]
                ],
            }
        )
    return lanes


def _thread_lane(name: str, snaps: list[dict[str, Any]], interval: float) -> dict[str, Any]:
    """One thread's snapshots as segments: neighbours in one state at one frame merged."""
    segments: list[dict[str, Any]] = []
    for s in snaps:
        if segments and segments[-1]["state"] == s["state"] and segments[-1]["frame"] == s["frame"]:
            segments[-1]["end_s"] = s["t_s"] + interval / 2e9
            continue
        segments.append(
            {
                "start_s": s["t_s"] - interval / 2e9,
                "end_s": s["t_s"] + interval / 2e9,
                "state": s["state"],
                "frame": s["frame"],
                "stack": s["stack"],
            }
        )
    return {
        "name": clip(name, 100),
        "segments": segments,
        "gil_snapshots": sum(1 for s in snaps if s["state"] == "gil"),
        "active_snapshots": sum(1 for s in snaps if s["state"] != "idle"),
    }


def thread_lanes(
    run: RunRecord,
    t0: int,
    worst: Mapping[str, Any] | None,
    compiles: Sequence[Mapping[str, Any]],
    step_rows: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[str, Any] | None:
    """Which thread ran and which held the GIL, snapshot by snapshot, around the worst step."""
    dumps = run.dumps
    if not len(dumps) or worst is None:
        return None
    rank = worst["rank"]
    d = dumps[dumps["rank"] == rank] if rank in set(dumps["rank"]) else dumps
    times = sorted({int(t) for t in d["t"]})
    if not times:
        return None
    chosen, zoom = _chosen_snapshots(times, t0 + worst["start_s"] * 1e9, t0 + worst["end_s"] * 1e9)
    d = d[d["t"].isin(set(chosen))]
    interval = (chosen[-1] - chosen[0]) / max(1, len(chosen) - 1) if len(chosen) > 1 else 1e9
    threads = [_thread_lane(name, snaps, interval) for name, snaps in _snapshots_by_thread(d, t0).items()]
    # busiest first: the GIL holder on top, idle helper threads at the bottom
    threads.sort(key=lambda t: (-t["gil_snapshots"], -t["active_snapshots"], t["name"]))
    lo = chosen[0] / 1e9 - t0 / 1e9 - interval / 2e9
    hi = chosen[-1] / 1e9 - t0 / 1e9 + interval / 2e9
    if zoom == "step":
        lo, hi = min(lo, worst["start_s"]), max(hi, worst["end_s"])
    window_compiles = [c for c in compiles if c["rank"] == rank and c["end_s"] >= lo and c["start_s"] <= hi]
    steps_in_window = [
        {"step": s["step"], "start_s": s["start_s"], "end_s": s["end_s"], "cause": s["cause"]}
        for s in step_rows.get(rank, [])
        if s["end_s"] >= lo and s["start_s"] <= hi
    ]
    return {
        "rank": rank,
        "zoom": zoom,
        "step": worst["step"],
        "steps": steps_in_window[:MAX_STEP_BARS],
        "step_start_s": worst["start_s"],
        "step_end_s": worst["end_s"],
        "start_s": lo,
        "end_s": hi,
        "snapshots": len(chosen),
        "interval_s": interval / 1e9,
        "threads": threads[:24],
        "compiles": [
            {"thread": c["thread"], "start_s": c["start_s"], "end_s": c["end_s"], "kernel": c["kernel"]}
            for c in window_compiles[:200]
        ],
    }
