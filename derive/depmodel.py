"""The dependency model of a data/pipeline-parallel training step: which op waits on which.

Every data-parallel rank and every step runs the same program, so the model is built once, over
the ops of one pipeline (the first DP rank, one step): a node is one op of one stage, named
(stage, optype, seq). The replay (`traindx.derive.replay`) then runs all DP ranks and steps at
once.

What an op waits on:
- on its own rank: the compute ops (forward, backward) run in their recorded order, one stream;
  each kind of pipeline send/recv runs in order on its own stream; a send starts when the
  compute that produced its tensor ends; a receive starts when the previous compute of its
  direction ended and the compute that needs it waits for it; the data-parallel collectives
  (parameter all-gather, gradient reduce-scatter/all-reduce) run in order on one stream, the
  first forward of a model chunk waits for its parameters' all-gather; after the last compute:
  the gradient reductions that did not overlap backward, the layer-norm and embedding gradient
  all-reduces, gradient clipping, the optimizer, in that order;
- across ranks, a collective or a send/recv pair ends for every member at the same time less its
  own transfer: the latest member's start plus the member's transfer time. A send/recv pair is
  the k-th valid send of a stage and the k-th valid receive of its peer stage (1F1B and the
  interleaved schedule alike: a chunk's peer is the next or previous chunk in the model); the
  embedding all-reduce joins the first and the last stage; a data-parallel collective joins the
  stage's ranks of every DP rank; gradient clipping joins every rank.

Pure computation: no judgement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from traindx.derive.optable import Layout, OpType, is_dp_collective

EPS = 5e-5  # seconds: a receive "after the last compute" allows for clock error


@dataclass(frozen=True)
class Group:
    members: tuple[int, ...]
    comm: bool  # members end together (latest start + own transfer)
    dp_sync: bool  # ... and across every data-parallel rank


@dataclass
class DepModel:
    nodes: pd.DataFrame  # one row per node: pp, optype, seq, chunk, gchunk, t0 (template start)
    parents: list[list[int]]
    groups: list[Group]
    order: list[int] = field(default_factory=list)  # group ids, parents first
    # (wait, call) of non-blocking point-to-point ops: a receive's wait waits for the peer's
    # isend call, a send's wait for the peer's irecv call; the wait's work is its end less
    # max(own start, the call's end)
    after: list[tuple[int, int]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.nodes)

    def node_index(self) -> dict[tuple[int, str, int], int]:
        keys = zip(self.nodes["pp"], self.nodes["optype"], self.nodes["seq"], strict=True)
        return {(int(p), str(o), int(s)): i for i, (p, o, s) in enumerate(keys)}


class ModelError(ValueError):
    """The ops do not form a schedule this model knows (a cycle, a missing pipeline peer)."""


def _template(table: pd.DataFrame) -> pd.DataFrame:
    """The ops of one pipeline in one step: the first DP rank, first TP rank, the step with
    the most such ops (a partly recorded step is not the template)."""
    dp0 = table[(table["dp"] == table["dp"].min()) & (table["tp"] == table["tp"].min())]
    counts = dp0.groupby("step").size()
    step = int(counts.idxmax())
    tpl = dp0[dp0["step"] == step]
    tpl = tpl.assign(end=tpl["start"] + tpl["duration"], optype=tpl["optype"].astype(str))
    tpl = tpl.sort_values(["pp", "start", "seq", "optype"], kind="stable")
    return tpl.drop_duplicates(["pp", "optype", "seq"]).reset_index(drop=True)


class _Builder:
    def __init__(self, tpl: pd.DataFrame, layout: Layout) -> None:
        self.tpl = tpl
        self.layout = layout
        self.index = {
            (int(p), str(o), int(s)): i
            for i, (p, o, s) in enumerate(zip(tpl["pp"], tpl["optype"], tpl["seq"]))
        }
        self.parents: list[list[int]] = [[] for _ in range(len(tpl))]
        self.groups: list[Group] = []
        self.grouped: set[int] = set()
        self.after: list[tuple[int, int]] = []

    def dep(self, child: int, parent: int) -> None:
        if parent != child and parent not in self.parents[child]:
            self.parents[child].append(parent)

    def chain(self, nodes: list[int], first_after: list[int] | None = None) -> None:
        prev = list(first_after or [])
        for n in nodes:
            for p in prev:
                self.dep(n, p)
            prev = [n]

    def group(self, members: list[int], dp_sync: bool) -> None:
        members = [m for m in members if m not in self.grouped]
        if members:
            self.groups.append(Group(tuple(members), comm=True, dp_sync=dp_sync))
            self.grouped.update(members)

    def ops(self, stage: int, *optypes: str) -> list[int]:
        rows = self.tpl[(self.tpl["pp"] == stage) & self.tpl["optype"].isin(optypes)]
        return [int(i) for i in rows.index]


def _p2p(b: _Builder, stage: int, valid: dict[tuple[int, str], list[int]]) -> None:
    """Match each send/recv of the stage to its compute; record the valid ones in order."""
    tpl, lay = b.tpl, b.layout
    total_chunks = lay.vpp * lay.pp
    delta = {OpType.FWD_SEND: 1, OpType.FWD_RECV: -1, OpType.BWD_SEND: -1, OpType.BWD_RECV: 1}
    for direction, compute in (("forward", OpType.FWD), ("backward", OpType.BWD)):
        comps = b.ops(stage, compute)
        if not comps:
            continue
        last_start = float(tpl.loc[comps, "start"].max())
        first_end = float(tpl.loc[comps, "end"].min())
        for kind in ("send", "recv"):
            optype = f"{direction}-{kind}"
            ops = b.ops(stage, optype)
            if kind == "recv":
                live = [o for o in ops if tpl.at[o, "start"] <= last_start + EPS]
            else:
                live = [o for o in ops if tpl.at[o, "end"] >= first_end - EPS]
            offset = 1 if kind == "recv" and len(live) + 1 == len(comps) else 0
            good: list[int] = []
            for j, op in enumerate(live):
                if j + offset >= len(comps):
                    break
                comp = comps[j + offset]
                gchunk = int(tpl.at[comp, "gchunk"])
                if gchunk < 0:
                    gchunk = (
                        int(tpl.at[comp, "chunk"]) * lay.pp + stage if tpl.at[comp, "chunk"] >= 0 else stage
                    )
                peer = gchunk + delta[optype]
                if kind == "send":
                    b.dep(op, comp)
                else:
                    b.dep(comp, op)
                    if j + offset > 0:
                        b.dep(op, comps[j + offset - 1])
                if 0 <= peer < total_chunks:
                    good.append(op)
            valid[(stage, optype)] = good


def _first_backward_p2p(b: _Builder, stage: int) -> None:
    """The first backward send/recv is posted with the forward before the first backward."""
    comps = b.ops(stage, *OpType.COMPUTE)
    kinds = [b.tpl.at[c, "optype"] for c in comps]
    if OpType.BWD not in kinds:
        return
    first = kinds.index(OpType.BWD)
    if first < 2 or kinds[first - 1] != OpType.FWD or kinds[first - 2] != OpType.FWD:
        return
    for optype in (OpType.BWD_RECV, OpType.BWD_SEND):
        ops = b.ops(stage, optype)
        if ops:
            b.dep(ops[0], comps[first - 2])


def _dp_and_tail(b: _Builder, stage: int) -> None:
    tpl, lay = b.tpl, b.layout
    comps = b.ops(stage, *OpType.COMPUTE)
    overlapped = bool(b.ops(stage, OpType.SEPARATE_AR))
    if lay.dp_sync:
        dp_stream = b.ops(stage, OpType.PARAMS_AG, OpType.GRADS_RS, OpType.GRADS_AR)
        b.chain(dp_stream)
        gathers = b.ops(stage, OpType.PARAMS_AG)
        for chunk in sorted({int(tpl.at[g, "chunk"]) for g in gathers}):
            last_ag = [g for g in gathers if int(tpl.at[g, "chunk"]) == chunk][-1]
            fwds = [c for c in b.ops(stage, OpType.FWD) if chunk < 0 or int(tpl.at[c, "chunk"]) == chunk]
            if fwds:
                b.dep(fwds[0], last_ag)
        if overlapped:
            for rs in b.ops(stage, OpType.GRADS_RS, OpType.GRADS_AR):
                chunk = int(tpl.at[rs, "chunk"])
                bwds = [c for c in b.ops(stage, OpType.BWD) if chunk < 0 or int(tpl.at[c, "chunk"]) == chunk]
                if bwds:
                    b.dep(rs, max(bwds, key=lambda c: float(tpl.at[c, "end"])))
    last = [max(comps, key=lambda c: float(tpl.at[c, "end"]))] if comps else []
    gcs = b.ops(stage, OpType.GC)
    b.chain(gcs, last)
    after = gcs[-1:] or last
    embed = b.ops(stage, OpType.EMBEDDING_AR)
    head = b.ops(stage, OpType.LAYERNORM_AR) + embed
    reductions = b.ops(stage, OpType.GRADS_RS, OpType.GRADS_AR)
    tail = b.ops(stage, OpType.CLIP) + b.ops(stage, OpType.OPTIMIZER)
    if not lay.dp_sync:
        b.chain(head + tail, after)
    elif overlapped:
        b.chain(head + b.ops(stage, OpType.SEPARATE_AR) + tail, after + reductions[-1:])
    else:
        b.chain(head + reductions + tail, after)
    # anything else recorded on the stage runs in program order after its predecessor
    known = set(OpType.COMPUTE + OpType.P2P + OpType.DP_COMM) | {
        OpType.GC,
        OpType.LAYERNORM_AR,
        OpType.EMBEDDING_AR,
        OpType.CLIP,
        OpType.OPTIMIZER,
    }
    rows = b.tpl[b.tpl["pp"] == stage]
    order = [int(i) for i in rows.index]
    for k, (i, optype) in enumerate(zip(order, rows["optype"], strict=True)):
        if optype not in known:
            if k > 0:
                b.dep(i, order[k - 1])
            if k + 1 < len(order):
                b.dep(order[k + 1], i)


def _program_order(b: _Builder) -> None:
    """No pipeline: each rank runs its ops one after the other; collectives join every rank."""
    b.chain([int(i) for i in b.tpl.index])
    for i, optype in zip(b.tpl.index, b.tpl["optype"], strict=True):
        if is_dp_collective(str(optype)) or optype == OpType.CLIP:
            b.group([int(i)], dp_sync=b.layout.dp_sync)


def _serial_pipeline(b: _Builder) -> None:
    """Blocking calls on one thread per rank (a traindx run folder): each stage runs its ops in
    recorded order, whatever the schedule (GPipe, 1F1B, ...); the k-th forward send of a stage
    meets the k-th forward receive of the next stage, the k-th backward send the k-th backward
    receive of the previous one (with `layout.oneway_sends`, isend/irecv: the receive's wait
    waits for the isend call, the send's wait for the irecv call, each call for nothing);
    collectives join the stage's ranks of every DP rank."""
    lay = b.layout
    for stage in range(lay.pp):
        b.chain([int(i) for i in b.tpl.index[b.tpl["pp"] == stage]])
    pairs = ((OpType.FWD_SEND, OpType.FWD_RECV, 1), (OpType.BWD_SEND, OpType.BWD_RECV, -1))
    for stage in range(lay.pp):
        for send, recv, step in pairs:
            if 0 <= stage + step < lay.pp:
                sends, recvs = b.ops(stage, send), b.ops(stage + step, recv)
                waits, posts = b.ops(stage, f"{send}-wait"), b.ops(stage + step, f"{recv}-post")
                for k in range(min(len(sends), len(recvs))):
                    if lay.oneway_sends:  # isend/irecv: each wait waits for the other side's call
                        b.dep(recvs[k], sends[k])
                        b.after.append((recvs[k], sends[k]))
                        if k < min(len(waits), len(posts)):
                            b.dep(waits[k], posts[k])
                            b.after.append((waits[k], posts[k]))
                    else:
                        b.group([sends[k], recvs[k]], dp_sync=False)
    paired = {n for pair in b.after for n in pair}
    for i, optype in zip(b.tpl.index, b.tpl["optype"], strict=True):
        if is_dp_collective(str(optype)) or optype == OpType.CLIP:
            b.group([int(i)], dp_sync=lay.dp_sync)
        elif optype in OpType.P2P and int(i) not in paired:
            b.group([int(i)], dp_sync=False)  # an unmatched send/recv: its own transfer only


def build(table: pd.DataFrame, layout: Layout) -> DepModel:
    """The dependency model of the normalised op table `table` (`traindx.derive.optable`):
    a pipeline's (1F1B or interleaved) when the table has several stages or send/recv ops,
    else program order on each rank; with `layout.serial`, program order on each stage and
    its send/recv pairs across stages."""
    tpl = _template(table)
    b = _Builder(tpl, layout)
    if layout.pp == 1 and not tpl["optype"].isin(OpType.P2P).any():
        _program_order(b)
        return _finish(b, tpl)
    if layout.serial:
        _serial_pipeline(b)
        return _finish(b, tpl)
    valid: dict[tuple[int, str], list[int]] = {}
    for stage in range(layout.pp):
        b.chain(b.ops(stage, *OpType.COMPUTE))
        for optype in OpType.P2P:
            b.chain(b.ops(stage, optype))
        _p2p(b, stage, valid)
        _first_backward_p2p(b, stage)
        _dp_and_tail(b, stage)
    peers = {OpType.FWD_SEND: (OpType.FWD_RECV, 1), OpType.BWD_SEND: (OpType.BWD_RECV, -1)}
    for stage in range(layout.pp):
        for send, (recv, step) in peers.items():
            sends = valid.get((stage, send), [])
            recvs = valid.get(((stage + step) % layout.pp, recv), [])
            for k in range(min(len(sends), len(recvs))):
                b.group([sends[k], recvs[k]], dp_sync=False)
    embed = [i for s in sorted({0, layout.pp - 1}) for i in b.ops(s, OpType.EMBEDDING_AR)[:1]]
    b.group(embed, dp_sync=False)
    clips = [i for s in range(layout.pp) for i in b.ops(s, OpType.CLIP)[:1]]
    b.group(clips, dp_sync=layout.dp_sync)
    if layout.dp_sync:
        for i in b.tpl.index[b.tpl["optype"].map(is_dp_collective)]:
            b.group([int(i)], dp_sync=True)
    for i in b.tpl.index[b.tpl["optype"].isin(OpType.COMM)]:
        b.group([int(i)], dp_sync=False)  # an unmatched send/recv: its own transfer only
    return _finish(b, tpl)


def _finish(b: _Builder, tpl: pd.DataFrame) -> DepModel:
    for i in range(len(tpl)):
        if i not in b.grouped:
            b.groups.append(Group((i,), comm=False, dp_sync=False))
    nodes = tpl[["pp", "optype", "seq", "chunk", "gchunk"]].assign(t0=tpl["start"]).reset_index(drop=True)
    model = DepModel(nodes=nodes, parents=b.parents, groups=b.groups, after=b.after)
    model.order = topological_order(model)
    return model


def topological_order(model: DepModel) -> list[int]:
    """Group ids so that every group comes after the groups its members wait on."""
    group_of = np.empty(model.size, dtype=np.int64)
    for g, grp in enumerate(model.groups):
        group_of[list(grp.members)] = g
    n = len(model.groups)
    children: list[set[int]] = [set() for _ in range(n)]
    indegree = np.zeros(n, dtype=np.int64)
    for child, parents in enumerate(model.parents):
        gc = int(group_of[child])
        for p in parents:
            gp = int(group_of[p])
            if gp != gc and gc not in children[gp]:
                children[gp].add(gc)
                indegree[gc] += 1
    ready = [g for g in range(n) if indegree[g] == 0]
    order: list[int] = []
    while ready:
        g = ready.pop()
        order.append(g)
        for c in children[g]:
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    if len(order) != n:
        raise ModelError(
            f"the ops wait on each other in a cycle ({n - len(order)} of {n} groups never start)"
        )
    # stable, readable: parents first, then by template start
    return order
