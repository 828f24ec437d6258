"""Where a step's GPU and host time goes in the model's own structure: each GPU event and each
host op of the torch.profiler window tied to a place = (module path, phase), with the user's
function that launched it, and what its work needs at the device's roofline.

The evidence is the window itself, no extra instrumentation: its Python tracer (`with_stack`)
records every `nn.Module` call as a `python_function` event named "nn.Module: <Class>_<n>"
(one per instance) around the ops it runs, and every Python function (the job's own ones give
the line); `with_flops` records each op's input sizes and dtypes (profiler/opargs.py). A hook per
module call (forward pre/post hooks with record_function ranges) would cost a Python call and
two range events per module per step; the tracer's events are there already, so they are used.
A window without stacks (the retry of a window that stood down) has no module events: its
places are phases only.

- module: the chain of module calls around the op ("GPT_0.Block_3.Linear_7"); a backward op
  takes its forward op's chain through autograd's sequence number (the backward node carries
  the number of the forward op that made it);
- phase: `optimizer` (inside torch.optim's "Optimizer.step#…"/"Optimizer.zero_grad#…" ranges),
  `backward` (inside an autograd node, "autograd::engine::evaluate_function: …"), `recompute`
  (a module call or a forward op with a sequence number inside an autograd node: the forward
  re-run during backward, as activation checkpointing does), `evaluation` (a module call whose
  ops carry no sequence number: under no_grad / inference_mode), `forward` (the rest that has
  a sequence number) and `other` (ops outside any module with none: copies, loss bookkeeping);
- line: the innermost frame of the job's own code around the op ("model.py(45): forward": the
  function and the line it starts at, as the tracer names it); a backward op takes its forward's;
- GPU time: each kernel, copy and memset of the profiled steps, by the launch that made it
  (Kineto's correlation) and that launch's place; host time: the outermost ops' own time, less
  the time they were blocked waiting for the GPU (`wait_s`: host time that is the GPU's): in a
  sync, a synchronous copy or cudaFree, or in a launch that found the GPU's queue full (a launch
  of over 50 µs: a busy GPU makes the host wait wherever its next launch happens to be);
- need: per op, FLOPs (matmul, bmm, convolution, attention, from their input sizes) at the peak
  of the precision its kernels ran in, or the bytes its inputs and output occupy at the memory
  bandwidth, whichever is longer (device_peaks.py); an estimate of the floor, not a model of it.

Derive layer: tables and arithmetic, no judgement.
"""

from __future__ import annotations

import glob
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from traindx.common.errors import UserError
from traindx.derive import device_peaks
from traindx.derive import gpu_efficiency as G
from traindx.derive import kernel_classes as K
from traindx.derive import opwork as W
from traindx.derive import place_cost as C
from traindx.derive import place_lines as L
from traindx.derive import place_params as T
from traindx.derive.ledger import host_samples
from traindx.derive.steady import median_step_s
from traindx.profiler.opargs import read_op_args

PHASES = ("forward", "backward", "recompute", "optimizer", "evaluation", "other")
PLACE_COLUMNS = [
    "module",
    "phase",
    "line",
    "gpu_s",
    "kernels",
    "host_s",
    "wait_s",
    "flops",
    "bytes",
    "need_s",
    "top_kernels",
]
# one row per outermost host op: its place, own seconds, seconds waiting for the GPU, and where
# it ran (thread, start, end: consecutive ops of one place make a run, the Python between them too)
HOST_COLUMNS = ["module", "phase", "line", "host_s", "wait_s", "tid", "start_ns", "end_ns"]
MODULE_PREFIX = "nn.Module: "
# a kernel launch takes a few µs; one this long waited for room in the GPU's full launch queue
LAUNCH_BLOCKED_NS = 50_000
NODE_PREFIX = "autograd::engine::evaluate_function:"
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
NO_MODULE = "(no module)"
# frames not the job's own (the tracer names a frame by its path under sys.path: "torch/nn/modules/linear.py(125): forward")
LIBRARIES = frozenset(
    (  # noqa: SIM905 (one line of names, not one line each)
        "torch torchvision torchaudio triton numpy transformers accelerate lightning pytorch_lightning "
        "lightning_fabric timm deepspeed apex flash_attn megatron peft diffusers _traindx_shim traindx "
        "site-packages dist-packages"
    ).split()
)
LIBRARIES |= frozenset(getattr(sys, "stdlib_module_names", ()))
_FRAME = re.compile(r"^(?P<path>[^<(][^(]*)\((?P<line>\d+)\): (?P<func>.+)$")


def is_job_frame(name: str) -> bool:
    """A tracer frame of the job's own code (not a built-in, the standard library, torch or a
    framework)."""
    m = _FRAME.match(name)
    if not m:
        return False
    head = m.group("path").replace("\\", "/").lstrip("./").split("/")[0]
    return head.removesuffix(".py") not in LIBRARIES and "site-packages" not in m.group("path")


def frame_text(name: str | None) -> str | None:
    """'model.py(45): forward' -> 'model.py:45 forward'."""
    m = _FRAME.match(name or "")
    return f"{m.group('path')}:{m.group('line')} {m.group('func')}" if m else None


@dataclass
class Context:
    """Where one host event ran: its place, its line and the innermost op around it."""

    module: str
    phase: str
    line: str | None
    op: int  # row position of the innermost cpu_op (-1: none)
    outermost: bool  # a cpu_op with no cpu_op around it
    root: int = -1  # row position of the outermost cpu_op around it (-1: none)
    redo_root: bool = False  # the outermost op of a forward re-run inside an autograd node
    call: int = -1  # row position of the innermost module call around it; a backward op's: its forward's


def _containers(rows: pd.DataFrame) -> pd.DataFrame:
    """The host events a query can be inside: ops, annotations, module calls, the job's frames."""
    cat = rows["cat"].to_numpy()
    names = rows["name"].astype(str)
    py = cat == "python_function"
    keep_py = py & (names.str.startswith(MODULE_PREFIX).to_numpy() | names.map(is_job_frame).to_numpy(bool))
    keep = (cat == "cpu_op") | (cat == "user_annotation") | keep_py
    out = rows[keep]
    kind = np.where(
        out["cat"].to_numpy() == "cpu_op",
        0,
        np.where(out["cat"].to_numpy() == "user_annotation", 1, 2),
    )
    kind = np.where((kind == 2) & ~out["name"].astype(str).str.startswith(MODULE_PREFIX).to_numpy(), 3, kind)
    return out.assign(_kind=kind)


def _stack_contexts(rows: pd.DataFrame, queries: np.ndarray[Any, Any]) -> dict[int, list[tuple[Any, ...]]]:
    """{row position: the stack of containers (outer to inner) at its start} for each query
    (row positions into `rows`), per thread: a sweep over the containers in time order."""
    cont = _containers(rows)
    out: dict[int, list[tuple[Any, ...]]] = {}
    tids = rows["tid"].to_numpy(object)
    starts = rows["start_ns"].to_numpy(np.int64)
    for tid in pd.unique(tids[queries]):
        mine = cont[(cont["tid"].to_numpy(object) == tid)]
        order = np.lexsort((-mine["end_ns"].to_numpy(np.int64), mine["start_ns"].to_numpy(np.int64)))
        c_start = mine["start_ns"].to_numpy(np.int64)[order]
        c_end = mine["end_ns"].to_numpy(np.int64)[order]
        c_item = list(
            zip(
                mine["_kind"].to_numpy()[order],
                mine["name"].astype(str).to_numpy()[order],
                mine["seq"].to_numpy(float)[order],
                mine.index.to_numpy()[order],
            )
        )
        q = queries[tids[queries] == tid]
        q = q[np.argsort(starts[q], kind="stable")]
        stack: list[tuple[int, tuple[Any, ...]]] = []
        ci = 0
        for pos in q:
            t = starts[pos]
            while ci < len(c_start) and c_start[ci] <= t:
                while stack and stack[-1][0] <= c_start[ci]:
                    stack.pop()
                stack.append((int(c_end[ci]), c_item[ci]))
                ci += 1
            while stack and stack[-1][0] <= t:
                stack.pop()
            out[int(pos)] = [item for _, item in stack]
    return out


def _context(
    stack: list[tuple[Any, ...]], row_index: Any, index_pos: dict[Any, int], stacks: bool = True
) -> tuple[Context, float]:
    """A stack's place (its backward modules still unresolved) and the autograd node's sequence
    number (NaN outside a node)."""
    optimizer = any(k == 1 and n.startswith(OPTIMIZER_PREFIXES) for k, n, _, _ in stack)
    node = next((i for i, (k, n, _, _) in enumerate(stack) if k == 0 and n.startswith(NODE_PREFIX)), None)
    modules = [n[len(MODULE_PREFIX) :] for k, n, _, _ in stack if k == 2]
    frames = [n for k, n, _, _ in stack if k == 3]
    ops = [(i, s, n) for i, (k, n, s, _) in enumerate(stack) if k == 0]
    op = index_pos.get(stack[ops[-1][0]][3], -1) if ops else -1
    outermost = len(ops) == 1 and stack[ops[0][0]][3] == row_index
    line = frames[-1] if frames else None
    node_seq = float("nan")
    redo_root = False
    calls = stack
    if optimizer:
        phase = "optimizer"
    elif node is not None:
        node_seq = stack[node][2]
        after = stack[node + 1 :]
        # a module call inside a node; without Python stacks, a forward op (one with a sequence
        # number): with stacks that alone is a double backward's graph (create_graph), not a re-run
        redo = any(k == 2 for k, _, _, _ in after) or (
            not stacks and any(k == 0 and s == s and n.startswith("aten::") for k, n, s, _ in after)
        )
        phase = "recompute" if redo else "backward"
        redo_root = redo and _first_redone_op(after) == row_index
        modules = [n[len(MODULE_PREFIX) :] for k, n, _, _ in after if k == 2]
        line = next((n for k, n, _, _ in reversed(after) if k == 3), None)
        calls = after  # the module call a forward re-run is in
    elif modules:
        phase = "module?"  # forward or evaluation: decided by the module call's ops
    else:
        phase = "forward" if any(s == s for _, s, _ in ops) else "other"
    root = index_pos.get(stack[ops[0][0]][3], -1) if ops else -1
    module = ".".join(modules) if modules else NO_MODULE
    call = next((index_pos.get(item[3], -1) for item in reversed(calls) if item[0] == 2), -1)
    return Context(module, phase, line, op, outermost, root, redo_root, call), node_seq


def attribute(rows: pd.DataFrame) -> dict[int, Context]:
    """{row position: Context} for every cpu_op and CUDA runtime/driver call of one rank's
    window (`rows`: that rank's trace table, indexed 0..n-1)."""
    rows = rows.reset_index(drop=True)
    cat = rows["cat"].to_numpy()
    queries = np.flatnonzero((cat == "cpu_op") | (cat == "cuda_runtime") | (cat == "cuda_driver"))
    contexts_at = _stack_contexts(rows, queries)
    stacks = bool(rows["name"].astype(str).str.startswith(MODULE_PREFIX).any())
    index_pos = {i: i for i in range(len(rows))}
    seq = rows["seq"].to_numpy(float)
    tids = rows["tid"].to_numpy(object)
    starts = rows["start_ns"].to_numpy(np.int64)
    seq_ops = {
        tid: np.sort(starts[(cat == "cpu_op") & (seq == seq) & (tids == tid)]) for tid in pd.unique(tids)
    }
    bounds = (tids, starts, rows["end_ns"].to_numpy(np.int64))
    out: dict[int, Context] = {}
    nodes: dict[int, float] = {}
    forward_of: dict[float, tuple[int, Context]] = {}
    for pos in queries:
        stack = contexts_at.get(int(pos), [])
        ctx, node_seq = _context(stack, pos, index_pos, stacks)
        if ctx.phase == "module?":
            ctx.phase = "forward" if _module_has_seq(stack, bounds, seq_ops) else "evaluation"
        out[int(pos)] = ctx
        if node_seq == node_seq:
            nodes[int(pos)] = node_seq
        elif (
            cat[pos] == "cpu_op"
            and seq[pos] == seq[pos]
            and ctx.phase in ("forward", "other")
            # every op records the counter's value; the op that made the node is the last to
            # record it (an op before it that made no node, a `.item()`, recorded it too)
            and starts[pos] >= forward_of.get(float(seq[pos]), (-1, None))[0]
        ):
            forward_of[float(seq[pos])] = (int(starts[pos]), ctx)
    for inside, node_seq in nodes.items():
        ctx, made_by = out[inside], forward_of.get(node_seq)
        if made_by is None:
            continue
        fwd = made_by[1]
        if ctx.phase == "backward" or ctx.module == NO_MODULE:
            ctx.module, ctx.call = fwd.module, fwd.call
        if ctx.line is None:
            ctx.line = fwd.line
    return out


def _first_redone_op(after: list[tuple[Any, ...]]) -> Any:
    """The row index of the first op re-run inside a node (the stack after the node): the first
    op inside its first module call, else its first forward op (one with a sequence number)."""
    module = next((i for i, item in enumerate(after) if item[0] == 2), None)
    for i, (k, n, s, index) in enumerate(after):
        if k == 0 and (
            (module is not None and i > module) or (module is None and s == s and n.startswith("aten::"))
        ):
            return index
    return None


def _module_has_seq(
    stack: list[tuple[Any, ...]], bounds: tuple[Any, Any, Any], seq_ops: dict[Any, Any]
) -> bool:
    """Whether the outermost module call of the stack ran an op with a sequence number."""
    outer = next((item for item in stack if item[0] == 2), None)
    if outer is None:
        return True
    pos = int(outer[3])
    tid, lo, hi = bounds[0][pos], int(bounds[1][pos]), int(bounds[2][pos])
    starts = seq_ops.get(tid)
    if starts is None or not len(starts):
        return False
    i = int(np.searchsorted(starts, lo))
    return i < len(starts) and starts[i] < hi


def _in_spans(t: np.ndarray[Any, Any], spans: list[tuple[int, int]]) -> np.ndarray[Any, Any]:
    inside = np.zeros(len(t), dtype=bool)
    for lo, hi in spans:
        inside |= (t >= lo) & (t < hi)
    return inside


def _op_need(
    rows: pd.DataFrame, args: pd.DataFrame | None, device: str | None
) -> dict[int, tuple[float, float, str | None]]:
    """{cpu_op row position: (FLOPs, bytes, dtype precision)} of the ops whose sizes were read."""
    if args is None or not len(args):
        return {}
    cpu = rows[rows["cat"].to_numpy() == "cpu_op"][["tid", "start_ns", "name"]].reset_index()
    merged = cpu.merge(args.drop(columns=["name"]), on=["tid", "start_ns"], how="inner")
    return {
        int(i): W.op_work(str(n), d, t)
        for i, n, d, t in zip(merged["index"], merged["name"], merged["dims"], merged["types"])
    }


def gpu_events(
    rows: pd.DataFrame,
    contexts: dict[int, Context],
    spans: list[tuple[int, int]],
    work: dict[int, tuple[float, float, str | None]],
    device: str | None,
) -> pd.DataFrame:
    """One row per GPU event the profiled steps launched: its place, line, class, seconds, the
    module call that launched it (`call`), its start on the GPU, and its share of its op's
    FLOPs, bytes and roofline time."""
    rows = rows.reset_index(drop=True)
    cat = rows["cat"].to_numpy()
    launch = np.flatnonzero(
        np.isin(cat, ("cuda_runtime", "cuda_driver")) & rows["correlation"].notna().to_numpy()
    )
    launch = launch[_in_spans(rows["start_ns"].to_numpy(np.int64)[launch], spans)]
    by_corr = {int(c): int(p) for c, p in zip(rows["correlation"].to_numpy(float)[launch], launch)}
    gpu = rows[np.isin(cat, K.GPU_CATS) & rows["correlation"].notna().to_numpy()]
    # SDPA's math path (its forward op and the backward nodes of the ops inside it): one class,
    # as the class table names it
    math_ops = K.op_spans(rows, (K.SDPA_MATH_OP,))
    in_math = K.launched_inside(gpu, rows, math_ops + K.backward_spans(rows, math_ops))
    out = []
    corrs, starts = gpu["correlation"].to_numpy(float), gpu["start_ns"].to_numpy(np.int64)
    for name, gcat, dur, corr, m, start in zip(gpu["name"], gpu["cat"], gpu["dur_s"], corrs, in_math, starts):
        pos = by_corr.get(int(corr))
        if pos is None:
            continue
        kc = K.classify(gcat, name, bool(math_ops))
        if m:
            kc = K.KernelClass("attention", K.SDPA_MATH_LABEL, kc.precision)
        ctx = contexts.get(pos)
        if ctx is None:
            continue
        out.append(
            (
                ctx.module,
                ctx.phase,
                ctx.line,
                str(name),
                kc.family,
                kc.label,
                kc.precision,
                float(dur),
                ctx.op,
                ctx.call,
                int(start),
            )
        )
    cols = ["module", "phase", "line", "name", "family", "label", "precision", "seconds", "op", "call"]
    cols.append("start_ns")
    events = pd.DataFrame(out, columns=cols)
    # an op's work split over its GPU events by their time (a GEMM and its bias kernel)
    op_time = events.groupby("op")["seconds"].transform("sum").replace(0.0, np.nan)
    share = (events["seconds"] / op_time).fillna(0.0).to_numpy(float)
    flops, nbytes, need = [], [], []
    for op, w, prec, fam in zip(events["op"], share, events["precision"], events["family"]):
        f, b, dtype_prec = work.get(int(op), (math.nan, math.nan, None))
        p = prec if fam in ("matmul", "conv", "attention") and prec else dtype_prec
        flops.append(f * w)
        nbytes.append(b * w)
        need.append(W.need_s(f, b, p, device) * w if f == f else math.nan)
    return events.assign(flops=flops, bytes=nbytes, need_s=need)


def host_ops(rows: pd.DataFrame, contexts: dict[int, Context], spans: list[tuple[int, int]]) -> pd.DataFrame:
    """The outermost host ops of the profiled steps with their place, seconds, the seconds
    their sync calls held them (waiting for the GPU), and their thread, start and end."""
    rows = rows.reset_index(drop=True)
    names = rows["name"].astype(str)
    cat = rows["cat"].to_numpy()
    dur_ns = (rows["end_ns"] - rows["start_ns"]).to_numpy(np.int64)
    runtime = (cat == "cuda_runtime") | (cat == "cuda_driver")
    sync = runtime & (
        names.str.match(K.SYNC_CALLS).to_numpy()
        | names.str.startswith(("cudaMemcpy", "cudaFree")).to_numpy()
        # a launch that blocks: the GPU's queue is full, the host waits for the busy GPU
        | (names.str.contains("LaunchKernel").to_numpy() & (dur_ns > LAUNCH_BLOCKED_NS))
    )
    waits: Counter[int] = Counter()
    for call in np.flatnonzero(sync):
        held = contexts.get(int(call))
        if held is not None and held.root >= 0:
            waits[held.root] += int(rows.at[call, "end_ns"] - rows.at[call, "start_ns"])
    t = rows["start_ns"].to_numpy(np.int64)
    dur = rows["dur_s"].to_numpy(float)
    # a forward re-run inside an autograd node is its own unit, taken out of the node's time
    redone: Counter[int] = Counter()
    for pos, ctx in contexts.items():
        if ctx.redo_root and ctx.root >= 0:
            redone[ctx.root] += int(round(dur[pos] * 1e9))
    inside = _in_spans(t, spans)
    tids, ends = rows["tid"].to_numpy(object), rows["end_ns"].to_numpy(np.int64)
    out = []
    for pos, ctx in contexts.items():
        if (ctx.outermost or ctx.redo_root) and cat[pos] == "cpu_op" and inside[pos]:
            own = float(dur[pos]) - (redone.get(pos, 0) / 1e9 if ctx.outermost else 0.0)
            wait = min(own, waits.get(pos, 0) / 1e9) if ctx.outermost else 0.0
            out.append(
                (
                    ctx.module,
                    ctx.phase,
                    ctx.line,
                    max(0.0, own - wait),
                    wait,
                    tids[pos],
                    int(t[pos]),
                    int(ends[pos]),
                )
            )
    return pd.DataFrame(out, columns=HOST_COLUMNS)


def _top_kernels(events: pd.DataFrame, limit: int = 3) -> list[dict[str, Any]]:
    g = events.groupby(["name", "family", "label"], sort=False)["seconds"].agg(["sum", "size"])
    g = g.sort_values("sum", ascending=False).head(limit)
    return [
        {"name": str(n)[:120], "family": str(f), "label": str(lab), "seconds": float(s), "calls": int(c)}
        for (n, f, lab), (s, c) in zip(g.index, g.to_numpy())
    ]


def place_table(events: pd.DataFrame, host: pd.DataFrame, n_steps: int) -> pd.DataFrame:
    """The places (module, phase) per step, most GPU time first: GPU seconds, kernels, host
    seconds, host seconds waiting for the GPU, FLOPs, bytes, roofline seconds, the line that
    took the most GPU time (or host time) and the top kernels."""
    n = max(int(n_steps), 1)
    keys = ["module", "phase"]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for key, g in events.groupby(keys, sort=False) if len(events) else []:
        lines = g.groupby(g["line"].fillna(""))["seconds"].sum()
        need = g["need_s"].to_numpy(float)
        rows[key] = {
            "gpu_s": float(g["seconds"].sum()) / n,
            "kernels": len(g) / n,
            "flops": float(np.nansum(g["flops"].to_numpy(float))) / n,
            "bytes": float(np.nansum(g["bytes"].to_numpy(float))) / n,
            "need_s": float(np.nansum(need)) / n if np.isfinite(need).any() else math.nan,
            "line": frame_text(str(lines.idxmax())) if len(lines) and lines.idxmax() else None,
            "top_kernels": _top_kernels(g),
        }
    for key, g in host.groupby(keys, sort=False) if len(host) else []:
        row = rows.setdefault(
            key, {"gpu_s": 0.0, "kernels": 0.0, "flops": 0.0, "bytes": 0.0, "need_s": math.nan}
        )
        row["host_s"] = float(g["host_s"].sum()) / n
        row["wait_s"] = float(g["wait_s"].sum()) / n
        if not row.get("line"):
            lines = g.groupby(g["line"].fillna(""))["host_s"].sum()
            row["line"] = frame_text(str(lines.idxmax())) if len(lines) and lines.idxmax() else None
    table = pd.DataFrame(
        [{"module": k[0], "phase": k[1], **v} for k, v in rows.items()], columns=PLACE_COLUMNS
    )
    table[["host_s", "wait_s"]] = table[["host_s", "wait_s"]].fillna(0.0)
    table["top_kernels"] = [v if isinstance(v, list) else [] for v in table["top_kernels"]]
    order = table["gpu_s"] + table["host_s"]
    return table.loc[order.sort_values(ascending=False).index].reset_index(drop=True)


def rollup(table: pd.DataFrame, depth: int) -> pd.DataFrame:
    """The places table summed to module paths of at most `depth` levels (per phase)."""
    if not len(table):
        return table
    cut = table.assign(module=[".".join(str(m).split(".")[:depth]) for m in table["module"]])
    num = ["gpu_s", "kernels", "host_s", "wait_s", "flops", "bytes", "need_s"]
    g = cut.groupby(["module", "phase"], sort=False)
    out = g[num].sum(min_count=1).reset_index()
    out["line"] = g["line"].first().to_numpy()
    return out.sort_values("gpu_s", ascending=False).reset_index(drop=True)


@dataclass
class RankPlaces:
    """One rank's profiled window by place, per step."""

    rank: str
    steps: int
    wall_s: float  # the rank's steady median step
    busy_s: float  # the GPU's busy time per step (gpu_efficiency)
    table: pd.DataFrame  # place_table
    events: pd.DataFrame  # gpu_events
    modules: bool  # the window recorded module calls (a window without stacks did not)
    sizes: bool  # the window recorded op sizes (FLOPs and bytes known)
    host: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=HOST_COLUMNS))  # host_ops
    tables: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=T.TABLE_COLUMNS)
    )  # T.whole_tables
    window_s: float = 0.0  # a profiled step's wall time (the profiler's cost per event makes it longer)
    profiler_s_per_event: float = 0.0  # place_cost: what each recorded host event added to it


def _rank_args(run_path: str, rank: str) -> pd.DataFrame | None:
    frames = []
    for path in sorted(glob.glob(os.path.join(run_path, "trace", f"{rank}.*json.gz"))):
        if os.path.basename(path).split(".")[0] != str(rank):
            continue
        try:
            frames.append(read_op_args(path))
        except UserError:
            continue
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else None


def rank_places(
    rows: pd.DataFrame,
    spans: list[tuple[int, int]],
    args: pd.DataFrame | None,
    device: str | None,
    rank: str = "0",
    wall_s: float | None = None,
    busy_s: float | None = None,
    frames: pd.DataFrame | None = None,
) -> RankPlaces:
    """The places of one rank's window rows inside the profiled steps' spans (`frames`: the
    shim's samples of the training thread, which name the lines of a window without stacks)."""
    rows = rows.reset_index(drop=True)
    contexts = attribute(rows)
    work = _op_need(rows, args, device)
    events = gpu_events(rows, contexts, spans, work, device)
    host = host_ops(rows, contexts, spans)
    n = max(len(spans), 1)
    window_s = sum(b - a for a, b in spans) / 1e9 / n
    names = rows["name"].astype(str)
    stacks = bool(names.str.startswith(MODULE_PREFIX).any())
    if not stacks and frames is not None:
        host, events = L.name_lines(host, events, frames)
    counts, per_step = C.event_counts(rows, host, spans)
    host = host.assign(events=counts)
    return RankPlaces(
        rank=str(rank),
        steps=n,
        wall_s=wall_s or window_s,
        busy_s=busy_s if busy_s is not None else float(events["seconds"].sum()) / n,
        table=place_table(events, host, n),
        events=events,
        modules=stacks,
        sizes=bool(work),
        host=host,
        tables=T.whole_tables(T.op_inputs(rows, args), contexts, events, n),
        window_s=window_s,
        profiler_s_per_event=C.cost_per_event(window_s, wall_s or window_s, per_step),
    )


def cached_places(run: Any) -> dict[str, RankPlaces]:
    """{rank: RankPlaces} of every rank with a torch.profiler window, once per loaded run."""
    built: dict[str, RankPlaces] = run.cached("places.rank_places", lambda: _run_places(run))
    return built


def _run_places(run: Any) -> dict[str, RankPlaces]:
    trace = getattr(run, "torch_trace", None)
    if trace is None or not len(trace):
        return {}
    views = G.cached_rank_views(run)
    device = device_peaks.device_name(run.manifest)
    samples = host_samples(run)
    out = {}
    for rank in sorted(set(trace["rank"]), key=lambda r: (len(str(r)), str(r))):
        mine = trace[(trace["rank"] == rank).to_numpy()]
        spans = G._window_bounds(run, str(rank), mine)
        if not spans:
            continue
        view = views.get(str(rank))
        out[str(rank)] = rank_places(
            mine,
            spans,
            _rank_args(run.path, str(rank)),
            device,
            str(rank),
            wall_s=median_step_s(run, str(rank)),
            busy_s=view.busy_s if view is not None else None,
            frames=L.sample_frames(
                samples[(samples["rank"].astype(str) == str(rank)).to_numpy()], L.cwd_of(run.manifest)
            ),
        )
    return out
