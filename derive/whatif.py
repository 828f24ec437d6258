"""What-if analysis of a multi-rank job's op table: how much faster would each step be if ...

- the *ideal*: every op took the typical time of its type (mean duration for compute, median
  transfer for communication); S = replayed step time / ideal step time (the slowdown the
  stragglers cost);
- attribution: only one op type, one DP rank, one stage kept as recorded, the rest ideal
  (S_t, S_dp, S_stage: the slowdown that group alone causes); a worker's score is the smaller of
  its DP rank's and its stage's;
- balance_dp_speedup: each compute op at its mean over the DP ranks in its step (the work
  spread evenly, the step-to-step and communication variation kept: what balancing tokens
  per DP rank gives);
- M_W: the share of the slowdown removed by fixing the top 3 % of workers by score; M_S: by
  fixing the last stage (and each stage: `stage_share`); M_Q: by making each compute op as long as
  its type's mean *on its own stage* (the compute variation inside a stage: across DP ranks,
  micro-batches and steps); `micro_batch_spread`: how much the micro-batches of one worker-step
  differ and whether a micro-batch's forward and backward move together (a long sequence makes
  both long; a slow worker does not make one micro-batch longer than another).

Pure computation: the numbers; `traindx.analyzers.ranks.whatif` judges them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from traindx.derive import depmodel, optable, replay
from traindx.derive.optable import Layout, OpType

TOP_WORKER_SHARE = 0.03  # M_W fixes this share of the workers (at least one)
PP_COMM_LABEL = {
    OpType.FWD_SEND: "forward-pp-comm",
    OpType.FWD_RECV: "forward-pp-comm",
    OpType.BWD_SEND: "backward-pp-comm",
    OpType.BWD_RECV: "backward-pp-comm",
    OpType.FWD_SEND_WAIT: "forward-pp-comm",
    OpType.BWD_SEND_WAIT: "backward-pp-comm",
    OpType.FWD_RECV_POST: "forward-pp-comm",
    OpType.BWD_RECV_POST: "backward-pp-comm",
}


@dataclass
class WhatIf:
    layout: Layout
    steps: list[int]
    recorded: list[float]  # per step, from the table
    replayed: list[float]  # per step, the model on the recorded work (no launch gaps)
    ideal: list[float]
    slowdown: float  # S
    by_optype: dict[str, float] = field(default_factory=dict)
    by_dp: dict[int, float] = field(default_factory=dict)
    by_stage: dict[int, float] = field(default_factory=dict)
    worker_score: dict[tuple[int, int], float] = field(default_factory=dict)  # (stage, dp) -> score
    top_workers: list[tuple[int, int]] = field(default_factory=list)
    m_w: float = 0.0
    fix_top_speedup: float = 1.0  # replayed / the top workers at the typical work of the others
    balance_dp_speedup: float = 1.0  # replayed / each compute op at its mean over the DP ranks
    m_s: float = 0.0  # the last stage
    stage_share: dict[int, float] = field(default_factory=dict)
    stage_speedup: dict[int, float] = field(default_factory=dict)  # replayed / that stage made ideal
    balance_stages_speedup: float = 1.0  # replayed / each compute op at its mean over the stages
    m_q: float = 0.0
    mb_spread: float | None = None
    mb_correlation: float | None = None
    optype_share: dict[str, float] = field(default_factory=dict)  # share removed fixing one type
    optype_time: dict[str, float] = field(default_factory=dict)  # its share of the ideal work
    optype_tail: dict[str, float] = field(default_factory=dict)  # mean / median work - 1
    stage_compute: dict[int, float] = field(default_factory=dict)  # compute s per worker-step
    replay_error: float = 0.0  # mean recorded / mean replayed - 1 (the launch gaps)
    runq_share: float | None = None  # a run folder's: step time spent waiting for a CPU
    dropped_rows: int = 0
    sim: dict[str, Any] = field(default_factory=dict)  # what the timelines need (not serialised)

    @property
    def t_replayed(self) -> float:
        return float(np.mean(self.replayed))

    @property
    def t_ideal(self) -> float:
        return float(np.mean(self.ideal))

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": vars(self.layout),
            "steps": len(self.steps),
            "step_time_recorded_s": float(np.mean(self.recorded)),
            "step_time_recorded_median_s": float(np.median(self.recorded)),
            "step_time_replayed_s": self.t_replayed,
            "step_time_ideal_s": self.t_ideal,
            "S": self.slowdown,
            "M_W": self.m_w,
            "fix_top_speedup": self.fix_top_speedup,
            "balance_dp_speedup": self.balance_dp_speedup,
            "M_S": self.m_s,
            "M_Q": self.m_q,
            "mb_spread": self.mb_spread,
            "mb_correlation": self.mb_correlation,
            "by_optype": self.by_optype,
            "optype_share": self.optype_share,
            "optype_time": self.optype_time,
            "optype_tail": self.optype_tail,
            "by_dp": {str(k): v for k, v in self.by_dp.items()},
            "by_stage": {str(k): v for k, v in self.by_stage.items()},
            "stage_share": {str(k): v for k, v in self.stage_share.items()},
            "stage_speedup": {str(k): v for k, v in self.stage_speedup.items()},
            "balance_stages_speedup": self.balance_stages_speedup,
            "top_workers": [{"stage": s, "dp": d} for s, d in self.top_workers],
            "worker_score": [
                {"stage": s, "dp": d, "score": v} for (s, d), v in sorted(self.worker_score.items())
            ],
            "stage_compute": {str(k): v for k, v in self.stage_compute.items()},
            "replay_error": self.replay_error,
            "runq_share": self.runq_share,
            "dropped_rows": self.dropped_rows,
        }


def _share(t_ori: float, t_fixed: float, t_ideal: float) -> float:
    gap = t_ori - t_ideal
    return float((t_ori - t_fixed) / gap) if gap > 0 else 0.0


def _stagewise_work(model: depmodel.DepModel, cube: replay.Cube) -> np.ndarray:
    """The recorded work with each compute op at its type's mean on its own stage."""
    work: np.ndarray = cube.work.copy()
    keys = model.nodes["pp"].astype(str) + "|" + model.nodes["optype"].astype(str)
    for key in pd.unique(keys):
        nodes = np.flatnonzero(keys.to_numpy() == key)
        if optable.is_comm(str(model.nodes["optype"].iloc[nodes[0]])):
            continue
        values = cube.work[nodes][cube.present[nodes]]
        if values.size:
            work[nodes] = float(values.mean())
    return work


def _stages_balanced(model: depmodel.DepModel, cube: replay.Cube) -> np.ndarray:
    """The recorded work with each compute op at the mean of the same op (type and order) over
    the stages, in its step and DP rank: the layers moved until every stage computes alike,
    the step-to-step and communication variation kept."""
    work: np.ndarray = cube.work.copy()
    nodes_ = model.nodes
    keys = nodes_["optype"].astype(str) + "|" + nodes_["seq"].astype(str)
    for key in pd.unique(keys):
        nodes = np.flatnonzero(keys.to_numpy() == key)
        if len(nodes) < 2 or optable.is_comm(str(nodes_["optype"].iloc[nodes[0]])):
            continue
        if str(nodes_["optype"].iloc[nodes[0]]) not in OpType.COMPUTE:
            continue
        present = cube.present[nodes]
        total = np.where(present, cube.work[nodes], 0.0).sum(axis=0)
        count = present.sum(axis=0)
        mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
        work[nodes] = np.where(count > 0, mean, cube.work[nodes])
    return work


def _typical_elsewhere(node_optype: pd.Series, cube: replay.Cube, chosen: np.ndarray) -> np.ndarray:
    """Each op type's median work over the workers *not* chosen: a fixed worker runs like the
    others (the plain ideal's mean would still hold its own slow ops), and not with their
    one-off stalls (a process descheduled once in 30 steps on a busy host) spread over its
    every step, as their mean would."""
    mask = np.broadcast_to(chosen, cube.work.shape)
    present = cube.present & ~mask
    if not present.any():
        present = cube.present
    return replay.ideal_work(node_optype, replace(cube, present=present), median=True)


def micro_batch_spread(table: pd.DataFrame) -> tuple[float | None, float | None]:
    """(spread, correlation) of the micro-batches' compute times on one worker in one step:
    the mean coefficient of variation of forward and backward durations across the
    micro-batches, and the correlation of a micro-batch's forward and backward durations once
    the worker-step mean is taken out (a long sequence makes both long). None where
    micro-batches are not recorded."""
    comp = table[
        table["optype"].isin(OpType.COMPUTE) & (table["mb"] >= 0) & (table["tp"] == table["tp"].min())
    ]
    if comp.empty:
        return None, None
    keys = ["pp", "dp", "step", "chunk", "mb"]
    wide = comp.pivot_table(index=keys, columns="optype", values="duration", aggfunc="sum", observed=True)
    if OpType.FWD not in wide or OpType.BWD not in wide:
        return None, None
    wide = wide[[OpType.FWD, OpType.BWD]].dropna()
    if len(wide) < 8:
        return None, None
    per = wide.groupby(level=["pp", "dp", "step"])
    mean = per.transform("mean")
    spread = float((per.std() / per.mean()).mean().mean())
    resid = wide - mean
    f, b = resid[OpType.FWD].to_numpy(), resid[OpType.BWD].to_numpy()
    if f.std() == 0 or b.std() == 0:
        return (0.0 if math.isnan(spread) else spread), 0.0
    return (0.0 if math.isnan(spread) else spread), float(np.corrcoef(f, b)[0, 1])


@dataclass
class _Ctx:
    model: depmodel.DepModel
    cube: replay.Cube
    rec: np.ndarray
    ideal: np.ndarray
    node_optype: pd.Series
    node_pp: np.ndarray
    labels: np.ndarray
    optypes: list[str]
    t_ori: float
    t_ideal: float


def analyze(
    table: pd.DataFrame,
    vpp: int | None = None,
    dp_sync: bool | None = None,
    serial: bool = False,
    oneway_sends: bool = False,
) -> WhatIf:
    """The what-if analysis of a normalised op table (`traindx.derive.optable.normalize`);
    `serial`: each rank's ops were blocking calls of one thread (a traindx run folder);
    `oneway_sends`: its sends were isends (the receive waits for the send, not the reverse)."""
    layout = optable.layout_of(table, vpp=vpp, dp_sync=dp_sync, serial=serial, oneway_sends=oneway_sends)
    model = depmodel.build(table, layout)
    cube = replay.cube(table, model, layout.dp)
    node_optype = model.nodes["optype"].astype(str)
    ideal = replay.ideal_work(node_optype, cube)
    both = replay.replay(model, np.stack([cube.work, ideal], axis=1), keep=True)
    t_rep_steps, t_ideal_steps = both.step_time[0], both.step_time[1]
    t_ori, t_ideal = float(t_rep_steps.mean()), float(t_ideal_steps.mean())
    per_rank = layout.serial and layout.pp > 1
    recorded = optable.step_times(table, per_rank=per_rank).reindex(cube.steps).to_numpy()
    res = WhatIf(
        layout=layout,
        steps=[int(s) for s in cube.steps],
        recorded=[float(x) for x in recorded],
        replayed=[float(x) for x in t_rep_steps],
        ideal=[float(x) for x in t_ideal_steps],
        slowdown=t_ori / t_ideal if t_ideal > 0 else 1.0,
        replay_error=float(np.mean(recorded) / t_ori - 1) if t_ori > 0 else 0.0,
        dropped_rows=cube.dropped_rows,
    )
    res.sim = {"model": model, "cube": cube, "replayed": both}
    labels = node_optype.map(lambda o: PP_COMM_LABEL.get(o, o)).to_numpy()
    ctx = _Ctx(
        model,
        cube,
        cube.work,
        ideal,
        node_optype,
        model.nodes["pp"].to_numpy(),
        labels,
        [str(o) for o in pd.unique(labels)],
        t_ori,
        t_ideal,
    )
    _attribute(res, ctx)
    _fixes(res, ctx)
    res.mb_spread, res.mb_correlation = micro_batch_spread(table)
    comp = table[table["optype"].isin(OpType.COMPUTE)]
    per_worker_step = comp.groupby(["pp", "dp", "step"], observed=True)["duration"].sum()
    res.stage_compute = {int(k): float(v) for k, v in per_worker_step.groupby(level="pp").mean().items()}
    return res


def _attribute(res: WhatIf, c: _Ctx) -> None:
    """Keep one group as recorded, everything else ideal: S_t, S_dp, S_stage, worker scores."""
    n, _, p = c.rec.shape
    pp = res.layout.pp
    masks: list[np.ndarray] = [(c.labels == o)[:, None, None] for o in c.optypes]
    masks += [(np.arange(p) == d)[None, None, :] for d in range(p)]
    masks += [(c.node_pp == st)[:, None, None] for st in range(pp)]
    kept = replay.replay_mixed(c.model, c.ideal, c.rec, masks)
    k = len(c.optypes)
    res.by_optype = {o: float(kept[i] / c.t_ideal) for i, o in enumerate(c.optypes)}
    res.by_dp = {d: float(kept[k + d] / c.t_ideal) for d in range(p)}
    res.by_stage = {st: float(kept[k + p + st] / c.t_ideal) for st in range(pp)}
    res.worker_score = {(st, d): min(res.by_dp[d], res.by_stage[st]) for st in range(pp) for d in range(p)}
    n_top = max(1, math.ceil(len(res.worker_score) * TOP_WORKER_SHARE))
    ranked = sorted(
        res.worker_score,
        key=lambda w: (-res.worker_score[w], -res.by_stage[w[0]], -res.by_dp[w[1]], w[1] * pp + w[0]),
    )
    res.top_workers = ranked[:n_top]


def _fixes(res: WhatIf, c: _Ctx) -> None:
    """The recorded run with one group made ideal (M_W, M_S, shares), and the other fixes."""
    n, _, p = c.rec.shape
    pp = res.layout.pp
    top = np.zeros((n, 1, p), dtype=bool)
    for st, d in res.top_workers:
        top[c.node_pp == st, 0, d] = True
    fixes = [top] + [(c.node_pp == st)[:, None, None] for st in range(pp)]
    fixes += [(c.labels == o)[:, None, None] for o in c.optypes]
    fixed = replay.replay_mixed(c.model, c.rec, c.ideal, fixes)
    res.m_w = _share(c.t_ori, float(fixed[0]), c.t_ideal)
    res.stage_share = {st: _share(c.t_ori, float(fixed[1 + st]), c.t_ideal) for st in range(pp)}
    res.m_s = res.stage_share[pp - 1]
    res.stage_speedup = {st: c.t_ori / float(fixed[1 + st]) if fixed[1 + st] > 0 else 1.0 for st in range(pp)}
    res.optype_share = {
        o: _share(c.t_ori, float(fixed[1 + pp + k]), c.t_ideal) for k, o in enumerate(c.optypes)
    }
    everything = np.ones((n, 1, 1), dtype=bool)
    others = _typical_elsewhere(c.node_optype, c.cube, top)
    balanced = c.rec.copy()
    compute = ~c.node_optype.map(optable.is_comm).to_numpy()
    balanced[compute] = np.broadcast_to(c.rec[compute].mean(axis=-1, keepdims=True), c.rec[compute].shape)
    t_top, t_even, t_within, t_stages = (
        float(replay.replay_mixed(c.model, c.rec, alt, [mask])[0])
        for alt, mask in (
            (others, top),
            (balanced, everything),
            (_stagewise_work(c.model, c.cube), everything),
            (_stages_balanced(c.model, c.cube) if pp > 1 else c.rec, everything),
        )
    )
    res.fix_top_speedup = c.t_ori / t_top if t_top > 0 else 1.0
    res.balance_stages_speedup = c.t_ori / t_stages if t_stages > 0 else 1.0
    res.balance_dp_speedup = c.t_ori / t_even if t_even > 0 else 1.0
    res.m_q = _share(c.t_ori, t_within, c.t_ideal)
    total = float(c.ideal.sum())
    for o in c.optypes:
        sel = c.labels == o
        values = c.rec[sel][c.cube.present[sel]]
        med = float(np.median(values)) if values.size else 0.0
        res.optype_tail[o] = float(values.mean()) / med - 1 if med > 0 else 0.0
        res.optype_time[o] = float(c.ideal[sel].sum()) / total if total > 0 else 0.0
