"""Multi-rank: the straggler - the rank the others wait for - and pipeline bubbles.

In a synchronous job every rank's step takes as long as the slowest rank's, so step times alone
do not show the straggler. Evidence, best first:

1. The shim's collective spans matched across ranks by (process group, seq), and each backward
   of a DDP job (analyzers/sync_points.py): at every meeting point the rank that waited least
   arrived last, the gap to the next-latest arrival is what it cost, and its own time ledger
   over the stretch before its arrival says why it was late (compiling, GC, data, I/O, a host
   sync, compute - with the GPU's clock beside it). Durations only: no clock has to agree
   across ranks or hosts. A rank that was late because it was itself waiting in send/recv is a
   pipeline dependency, not a straggler.
2. The torch.profiler window (gloo/NCCL record_functions, c10d ops, NCCL kernels) and py-spy
   (main-thread samples inside torch.distributed) for runs without spans (attach mode, older
   runs): the rank with the smallest wait, point-to-point ops left out.
3. Per-rank step times, for ranks that do not wait for each other at all.

Blocking send/recv waits are the pipeline's bubbles (a stage waiting for its neighbour), reported
as their share of the step (`ranks.pipeline_bubble`), never as stragglers.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from traindx.analyzers import evidence as ev
from traindx.analyzers import sync_points as sp
from traindx.analyzers.declaration import Declaration
from traindx.analyzers.findings import Finding, Prescription
from traindx.derive import ledger as ledger_mod

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="ranks",
    order=100,
    ids=("ranks.straggler", "ranks.pipeline_bubble"),
    cross_rank=True,
    live_categories=("collective",),
    capture=True,
    explains=("gpu_idle.exposed_communication",),
)

COLLECTIVE_NAME = re.compile(
    r"^(?:gloo:|nccl:|c10d::|record_param_comms)|nccl.*(?:AllReduce|AllGather|ReduceScatter|Broadcast|"
    r"SendRecv|AllToAll|Reduce)|distributed_c10d\.py\(\d+\): (?:all_reduce|all_gather|"
    r"all_gather_into_tensor|reduce_scatter|reduce_scatter_tensor|broadcast|barrier|all_to_all|"
    r"all_to_all_single|send|recv|wait)$",
    re.IGNORECASE,
)
POINT_TO_POINT_NAME = re.compile(
    r"(?:^|[:_ .])(?:i?send|i?recv|SendRecv|batch_isend_irecv|P2P)\b|"
    r"nccl.*(?:Send|Recv)",
    re.IGNORECASE,
)
C10D_FILE = "torch/distributed/distributed_c10d.py"
MIN_SHARE = 0.05
MIN_WAIT_DIFF_S = 0.005
# the straggler must have caused most of the waiting: in a healthy job the last arrival changes
# from one collective to the next and the costs spread over the ranks
MIN_DOMINANCE = 0.6
MIN_LATE_STEPS = 3  # steady steps in which it made the others wait ...
MIN_LATE_STEP_SHARE = MIN_SHARE  # ... at least this share of a median step (and 5 ms)


def _trace_waits(run, ranks):
    """{rank: (wait seconds per profiled step, steps, collective rows)} from the traces."""
    trace = run.torch_trace
    if not len(trace):
        return {}
    out = {}
    by_rank = dict(tuple(trace.groupby("rank", sort=False)))  # one pass, not one scan per rank
    for rank in ranks:
        steps = ev.trace_steps(run, rank)
        rows = by_rank.get(rank, trace.iloc[0:0])
        if not len(steps) or not len(rows):
            continue
        start, end = steps["start_ns"].min(), steps["end_ns"].max()
        inside = rows[(rows["start_ns"] >= start) & (rows["end_ns"] <= end)]
        named = inside["name"].fillna("")
        coll = inside[named.str.contains(COLLECTIVE_NAME) & ~named.str.contains(POINT_TO_POINT_NAME)]
        wait = ev.union_seconds(zip(coll["start_ns"], coll["end_ns"]))
        out[rank] = (wait / len(steps), len(steps), coll, inside, rows)
    return out


def _in_collective(stack):
    return any(f.file.endswith(C10D_FILE) for f in stack)


def _pyspy_waits(run, ranks):
    """{rank: (share of main-thread samples in torch.distributed, ThreadSamples)}."""
    out = {}
    for rank in ranks:
        rec = run.pyspy.get((rank, "all"))
        if not rec:
            continue
        main = ev.main_thread_id(rec, run.pyspy.get((rank, "gil")))
        threads = ev.merge_threads(rec)
        if main not in threads:
            continue
        samples = threads[main][1]
        total = ev.steps_seconds(run, rank) or ev.training_weight(samples)
        if total > 0:
            out[rank] = (min(1.0, ev.training_weight(samples, keep=_in_collective) / total), samples)
    return out


def _what_straggler_does(run, rank, rows, all_rows, coll, diff_s):
    """From the trace: the innermost Python call on the straggler that takes about as long as
    the others wait, and the job's function around it."""
    if rows is None:
        return None
    py = rows[rows["cat"] == "python_function"]
    py_all = all_rows[all_rows["cat"] == "python_function"]
    if not len(py):
        return None
    candidates = py[py["dur_s"] >= 0.5 * diff_s]
    spans = list(zip(coll["start_ns"], coll["end_ns"]))
    best = None
    for row in candidates.sort_values("dur_s").itertuples():
        if any(row.start_ns <= s and e <= row.end_ns for s, e in spans):
            continue  # it contains a collective: an outer frame, not the work itself
        if COLLECTIVE_NAME.search(row.name or ""):
            continue
        best = row
        break
    if best is None:
        return None
    mid = (best.start_ns + best.end_ns) // 2
    around = ev.enclosing_user_function(py_all, best.tid, mid)
    return {
        "call": best.name,
        "seconds": round(best.dur_s, 4),
        "in_function": None if not around else {"file": around[0], "line": around[1], "function": around[2]},
    }


def _compiles_on(run, rank, steady_ids):
    comp = run.compiles
    if not len(comp):
        return None
    comp = comp[(comp["rank"] == rank) & comp["step"].isin(steady_ids)]
    if not len(comp):
        return None
    return {
        "compiles": int(len(comp)),
        "seconds": round(float(comp["duration_s"].sum()), 3),
        "kernels": sorted(set(map(str, comp["kernel"])))[:5],
    }


# -- 1. meeting points: who arrived last, what it cost, why -------------------------------------
CAUSES = {  # ledger line before the late arrival -> what the user reads
    "compile": "compiling",
    "autotune": "autotuning kernels",
    "gc": "garbage collection",
    "io": "checkpoint/file I/O",
    "sync": "waiting for its GPU (host-device sync)",
    "data": "waiting for its data",
    "optimizer": "its optimizer step",
    "forward_backward": "compute (forward/backward)",
    "host": "its own code between measured calls",
    "unexplained": "untimed host work",
    "collective": "waiting in other communication (send/recv, another group)",
}
SLOWER_CLOCK = 0.9  # the straggler's GPU at <= 90 % of the others' SM clock: a slower GPU


def _steady_ids(run, ranks):
    steady = ev.steady_steps(run)
    return {r: set(g.astype(int)) for r, g in steady.groupby("rank")["step"]}


def _median_steps(run, ranks):
    """{rank: median steady step seconds} from one pass (ev.median_step_s per rank rescans)."""
    steady = ev.steady_steps(run)
    med = steady.groupby("rank")["duration_s"].median().to_dict() if len(steady) else {}
    return {r: (float(med[r]) if r in med else ev.median_step_s(run, r)) for r in ranks}


def _steady_ledger(run):
    """ledger_mod.steady_rows(run), by a join instead of a Python scan of the rows."""
    steady = ev.steady_steps(run)
    led = run.ledger
    if not len(steady) or not len(led):
        return led.iloc[0:0]
    keys = steady[["rank", "step"]].astype({"step": "int64"})
    return led.astype({"step": "int64"}).merge(keys, on=["rank", "step"], how="inner")


def _gpu_clocks(run, ranks):
    """{rank: median SM clock (MHz) of its GPU while busy} when NVML sampled one GPU per rank
    (the rank's LOCAL_RANK-th of the job's GPUs, the usual one-GPU-per-rank launch)."""
    gpu = run.gpu
    chosen = (run.manifest.get("nvml") or {}).get("gpus") or []
    ev_ = run.of_type("process_start")
    if not len(gpu) or not chosen or not len(ev_) or "local_rank" not in ev_:
        return {}
    starts = ev_[ev_["rank"].isin(ranks)]
    out = {}
    for rank, local in zip(starts["rank"], starts["local_rank"]):
        try:
            index = chosen[int(local)]
        except (TypeError, ValueError, IndexError):
            continue
        rows = gpu[(gpu["gpu"] == index) & (gpu["util"] >= 50)]
        if len(rows):
            out[rank] = float(rows["sm_clock_mhz"].median())
    return out


def _late_cause(run, seg, straggler, late_keys, n_steps):
    """Seconds per step of each ledger line by which the straggler's stretch before its late
    arrivals exceeds the other ranks' stretch before the same meeting points."""
    cats = list(ledger_mod.CATEGORIES) + ["unexplained"]
    per_rank = {}
    for rank, rows in seg[seg["key"].isin(late_keys)].groupby("rank"):
        secs = sp.segment_ledger(
            run, rank, rows["seg_start_ns"].to_numpy(np.int64), rows["start_ns"].to_numpy(np.int64)
        )
        per_rank[rank] = secs.sum(axis=0)
    if straggler not in per_rank or len(per_rank) < 2:
        return {}
    others = np.mean([v for r, v in per_rank.items() if r != straggler], axis=0)
    excess = (per_rank[straggler] - others) / max(1, n_steps)
    return {c: float(x) for c, x in zip(cats, excess) if x > 0.0005}  # sub-ms: noise


def _step_points(run):
    """CUDA runs: NCCL collectives return to the host at once (the GPU waits, not the host), and
    the host waits later, in its next sync (.item(), synchronize). There each step is the
    meeting point and a rank's wait is its step's host-sync plus collective lines: the rank
    that waited least there was the one the others' GPUs waited for."""
    led = _steady_ledger(run)
    if not len(led):
        return led
    counts = led.groupby("step")["rank"].transform("nunique")
    led = led[counts == led["rank"].nunique()]
    return pd.DataFrame(
        {
            "key": led["step"].astype("int64"),
            "rank": led["rank"],
            "op": "host sync + collectives of the step",
            "group": "step",
            "start_ns": led["start_ns"].astype("int64"),
            "end_ns": led["end_ns"].astype("int64"),
            "wait_s": led["sync_s"] + led["collective_s"],
        }
    ).reset_index(drop=True)


def _step_cause(run, straggler, late_steps, n_steps):
    """By step: the straggler's ledger lines (waits left out) beyond the others' in those steps."""
    led = _steady_ledger(run)
    led = led[led["step"].isin(late_steps)]
    cats = [c for c in list(ledger_mod.CATEGORIES) + ["unexplained"] if c not in ("sync", "collective")]
    sums = led.groupby("rank")[[f"{c}_s" for c in cats]].sum()
    if straggler not in sums.index or len(sums) < 2:
        return {}
    excess = (sums.loc[straggler] - sums.drop(index=straggler).mean()) / max(1, n_steps)
    return {c: float(x) for c, x in zip(cats, excess.to_numpy()) if x > 0.0005}


def _syncs_every_step(run):
    """CUDA runs in which every rank's host waits for its GPU in (nearly) every steady step: only
    there does a step's sync line hold the wait for the others (a rank that never syncs runs
    ahead of its GPU, and its waits land wherever its launch queue fills up)."""
    spans = run.spans
    if not len(spans) or not (spans["cat"] == "sync").any():
        return False
    led = _steady_ledger(run)
    if not len(led):
        return False
    return bool(((led["sync_s"] > 0).groupby(led["rank"]).mean() >= 0.8).all())


def _core_wait_excess(run, straggler, ranks, steps):
    """Per step (a Series over `steps`) the seconds the straggler's training thread waited for a
    core beyond the other ranks' mean in the same step (the shim's run-queue wait), or None
    when the run has no such record."""
    rows = run.steps.dropna(subset=["start_ns", "end_ns"])
    rows = rows[rows["rank"].astype(str).isin([str(r) for r in ranks])]
    if not len(rows):
        return None
    runq = ev.step_runq_s(
        run, rows["rank"], rows["step"], rows["end_ns"].to_numpy(float) / 1e9, rows["duration_s"]
    )
    if runq is None:
        return None
    table = pd.DataFrame(
        {
            "rank": rows["rank"].astype(str).to_numpy(),
            "step": rows["step"].astype("int64").to_numpy(),
            "runq": runq,
        }
    )
    wide = table.pivot_table(index="step", columns="rank", values="runq", aggfunc="first")
    mine = str(straggler)
    if mine not in wide or wide.shape[1] < 2:
        return None
    others = wide.drop(columns=mine).mean(axis=1)
    excess = (wide[mine] - others).clip(lower=0.0).fillna(0.0)
    return excess.reindex(pd.Index(steps).astype("int64")).fillna(0.0).set_axis(steps)


def _straggler_from_points(run, ranks, points, by_step=False):
    steps = run.steps.dropna(subset=["start_ns", "end_ns"])
    last = sp.last_arrivals(points)
    if not len(last):
        return None
    arrival = points[["key", "rank", "start_ns"]].rename(columns={"rank": "last", "start_ns": "arrival_ns"})
    last = last.merge(arrival, on=["key", "last"], how="left")
    steady = _steady_ids(run, ranks)
    last["step"] = -1
    for rank, rows in last.groupby("last"):
        last.loc[rows.index, "step"] = sp.step_of(steps, rank, rows["arrival_ns"].to_numpy(np.int64))
    keep = np.zeros(len(last), dtype=bool)
    for rank, rows in last.groupby("last"):
        keep[last.index.get_indexer(rows.index)] = rows["step"].isin(steady.get(rank, ())).to_numpy()
    last = last[keep]
    if not len(last):
        return None
    caused = last.groupby("last")["cost_s"].sum()
    total = float(caused.sum())
    straggler = caused.idxmax()
    n_steps = max(1, len(steady.get(straggler, ())))
    cost = float(caused[straggler]) / n_steps
    step_s = _median_steps(run, ranks)
    known = sorted(v for v in step_s.values() if v)
    median_step = known[len(known) // 2] if known else None
    share = cost / median_step if median_step else 0.0
    dominance = float(caused[straggler]) / total if total > 0 else 0.0
    detail = {
        "method": (
            "steps as meeting points (CUDA: collectives return to the host at "
            "once; the host waits in its next sync): the rank whose step has the "
            "least host-sync + collective time was the last"
            if by_step
            else "meeting points matched across ranks (collectives by process group and "
            "seq"
            + ("; each backward of the DDP job" if sp.uses_ddp(run) else "")
            + "): the rank that waited least arrived last"
        )
        + "; durations only, no clock compared across ranks",
        "meeting_points": int(len(last)),
        "cost_caused_per_step_s": {r: round(float(caused.get(r, 0.0)) / n_steps, 4) for r in ranks},
        "straggler_share_of_cost": round(dominance, 3),
    }
    # late again and again, not once: a rank descheduled for 200 ms in one step (a loaded
    # machine, a page fault storm) is no straggler; its worst step alone must not make the cost
    per_step = last[last["last"] == straggler].groupby("step")["cost_s"].sum()
    queued = _core_wait_excess(run, straggler, ranks, per_step.index)
    if queued is not None and not run.manifest.get("nodes"):
        # one host: every rank waits for the same cores, so the time the straggler's training
        # thread waited for one beyond the others in its late steps is the machine's load, not
        # the rank's (a rank on another node that waits for its cores stays a straggler)
        per_step = (per_step - queued).clip(lower=0.0)
        queued_s = float(queued.sum())
        cost = max(0.0, cost - queued_s / n_steps)
        share = cost / median_step if median_step else 0.0
        detail["waited_for_a_core_per_step_s"] = round(queued_s / n_steps, 4)
    late_steps = int((per_step >= max(MIN_WAIT_DIFF_S, MIN_LATE_STEP_SHARE * (median_step or 0))).sum())
    robust = (float(per_step.sum()) - float(per_step.max())) / n_steps if len(per_step) else 0.0
    detail.update({"late_steps": late_steps, "cost_without_worst_step_per_step_s": round(robust, 4)})
    if (
        cost < MIN_WAIT_DIFF_S
        or share < MIN_SHARE
        or dominance < MIN_DOMINANCE
        or late_steps < MIN_LATE_STEPS
        or robust < MIN_WAIT_DIFF_S
        or (median_step and robust / median_step < MIN_SHARE)
    ):
        return None
    # where it came last (and mattered): the cause lies in the stretch before those arrivals
    mine = last[last["last"] == straggler]
    mine = mine[mine["cost_s"] >= 0.1 * mine["cost_s"].quantile(0.9)]  # not: one spike's tenth
    late_keys = set(mine["key"])
    if by_step:
        cause = _step_cause(run, straggler, {int(k) for k in late_keys}, n_steps)
    else:
        cause = _late_cause(run, sp.segments(points, steps), straggler, late_keys, n_steps)
    top = max(cause, key=cause.get) if cause else None
    if top == "collective" and cause[top] >= 0.5 * cost:
        return None  # it was late because it waited for someone else: a dependency, not a straggler
    late = points[points["key"].isin(late_keys)]
    others_wait = {}
    mins = late[late["rank"] == straggler].set_index("key")["wait_s"]
    for rank, rows in late[late["rank"] != straggler].groupby("rank"):
        extra = rows["wait_s"].to_numpy() - mins.reindex(rows["key"]).to_numpy()
        others_wait[rank] = round(float(np.nansum(np.clip(extra, 0, None))) / n_steps, 4)
    if not by_step and not run.manifest.get("nodes"):
        # one host, one clock: the arrivals themselves, a cross-check of the waits' reading
        starts = late.pivot_table(index="key", columns="rank", values="start_ns", aggfunc="first")
        if straggler in starts and starts.shape[1] >= 2:
            gap = starts[straggler] - starts.drop(columns=straggler).max(axis=1)
            detail["arrival_gap_per_step_s"] = round(float(gap.clip(lower=0).sum()) / 1e9 / n_steps, 4)
    ops = Counter(late.loc[late["rank"] == straggler, "op"].astype(str))
    clocks = _gpu_clocks(run, ranks)
    led = _steady_ledger(run)
    detail.update(
        {
            "straggler": straggler,
            "source": "steps (host sync + collective lines)"
            if by_step
            else "matched collectives" + (" and DDP backwards" if sp.uses_ddp(run) else ""),
            "cost_per_step_s": round(cost, 4),
            "others_wait_per_step_s": others_wait,
            "late_at": {
                "points": int(len(mine)),
                "of": int((last["last"] == straggler).sum()),
                "ops": dict(ops.most_common(5)),
            },
            "late_because_per_step_s": {
                c: round(v, 4) for c, v in sorted(cause.items(), key=lambda kv: -kv[1])
            },
            "cause": top,
            "median_step_s": {r: None if v is None else round(v, 4) for r, v in step_s.items()},
            "wait_in_collectives_per_step_s": {
                r: round(float(g["collective_s"].mean()), 4) for r, g in led.groupby("rank")
            }
            if len(led)
            else {},
        }
    )
    slower_gpu = None
    if (
        clocks.get(straggler)
        and len(clocks) >= 2
        and top in ("forward_backward", "sync", "host", "unexplained", "optimizer")
    ):
        rest = [v for r, v in clocks.items() if r != straggler]
        if rest and clocks[straggler] <= SLOWER_CLOCK * float(np.median(rest)):
            slower_gpu = {"straggler_mhz": clocks[straggler], "others_mhz": float(np.median(rest))}
    if clocks:
        detail["gpu_sm_clock_mhz"] = {r: round(v) for r, v in clocks.items()}
    steady_ids = steady.get(straggler, set())
    compiles = _compiles_on(run, straggler, steady_ids)
    if compiles and top in ("compile", "autotune"):
        detail["straggler_compiles_in_steady_steps"] = compiles
    label = (
        ("a slower GPU clock" if slower_gpu else CAUSES.get(top, "unknown work"))
        if top
        else "no measured line (py-spy or the torch.profiler window name the code)"
    )
    detail["cause_label"] = label
    if slower_gpu:
        detail["slower_gpu"] = slower_gpu
    if top in ("forward_backward", "host", "unexplained"):
        doing = _trace_doing(run, straggler, cost) or _pyspy_doing(run, straggler)
        if doing:
            detail["straggler_does"] = doing
    return _straggler_finding(run, ranks, straggler, cost, share, detail, top, label)


def _trace_doing(run, rank, cost):
    waits = _trace_waits(run, [rank])
    if rank not in waits:
        return None
    _, _, coll, rows, all_rows = waits[rank]
    return _what_straggler_does(run, rank, rows, all_rows, coll, cost)


def _pyspy_doing(run, rank):
    spy = _pyspy_waits(run, [rank])
    if rank not in spy:
        return None
    hot = ev.hottest_frames(spy[rank][1], keep=lambda s: not _in_collective(s))
    frames = ev.frames_evidence(hot) if hot else []
    # the job's own code first (py-spy's thread root and library frames are not what it does)
    frames = sorted(frames, key=lambda f: not f.get("file") or ev.is_library_path(f["file"]))
    return {"hottest_frames": frames} if frames else None


def _prescriptions(run, straggler, top, cost, slower_gpu):
    out = []
    if top in ("compile", "autotune"):
        out.append(
            Prescription(
                kind="precompile",
                summary=f"rank {straggler} compiles kernels during the steps: precompile them (see the "
                "jit finding) so no rank compiles while the others wait",
                change={"precompile": {"from_run": run.path}},
                expected_gain_s_per_step=cost,
            )
        )
    elif top == "gc":
        out.append(
            Prescription(
                kind="code",
                summary=f"rank {straggler} pauses in full garbage collections while the "
                "others wait: gc.collect(); gc.freeze() once after set-up (see the gc finding), or "
                "collect at the same point on every rank",
                expected_gain_s_per_step=cost,
            )
        )
    elif top == "data":
        out.append(
            Prescription(
                kind="code",
                summary=f"rank {straggler} waits for its batches: more DataLoader workers "
                "on it, or a faster shard/storage for it (the dataloader finding names the code)",
                expected_gain_s_per_step=cost,
            )
        )
    elif top == "io":
        out.append(
            Prescription(
                kind="code",
                summary=f"rank {straggler} writes files while the others wait: save "
                "asynchronously or from every rank's own shard (DCP), off the step",
                expected_gain_s_per_step=cost,
            )
        )
    elif slower_gpu:
        out.append(
            Prescription(
                kind="code",
                summary=f"rank {straggler}'s GPU runs at a lower SM clock: check it "
                "(nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER) or move the job off it",
                expected_gain_s_per_step=cost,
            )
        )
    out.append(
        Prescription(
            kind="code",
            summary=f"remove the extra work on rank {straggler} or balance it across ranks "
            "(same data volume per rank, rank-0-only logging/evaluation off the step)",
            expected_gain_s_per_step=cost,
        )
    )
    return tuple(out)


def _straggler_finding(run, ranks, straggler, cost, share, detail, top, label):
    because = detail.get("late_because_per_step_s") or {}
    why = " · ".join(
        f"{ledger_mod.LABELS.get(c, c)} +{v * 1000:.0f} ms" for c, v in list(because.items())[:3]
    )
    others = detail.get("others_wait_per_step_s") or {}
    waits = ", ".join(f"rank {r} {v * 1000:.0f} ms" for r, v in others.items())
    doing = detail.get("straggler_does") or {}
    code = f" Its hottest code: {doing['hottest_frames'][0]['frame']}." if doing.get("hottest_frames") else ""
    if detail.get("slower_gpu"):
        g = detail["slower_gpu"]
        code += (
            f" Its GPU's SM clock: {g['straggler_mhz']:.0f} MHz vs {g['others_mhz']:.0f} MHz on the others."
        )
    return Finding(
        id="ranks.straggler",
        title=f"Rank {straggler} arrives last at the collectives: the others wait "
        f"{cost * 1000:.0f} ms per step for it ({label})",
        severity=ev.severity_for_share(share),
        analyzer="ranks",
        summary=(
            f"At {detail['late_at']['points']} of {detail['meeting_points']} meeting points "
            f"in steady steps ({', '.join(detail['late_at']['ops'])}) rank {straggler} waited "
            f"least by a clear margin, so it arrived last; the others waited for it per "
            f"step: {waits}. "
            f"Before those arrivals rank {straggler}'s own ledger has, beyond the others'"
            f": {why or 'nothing measured'}.{code}"
        ),
        seconds_lost_per_step=cost,
        share_of_step=share,
        evidence=detail,
        prescriptions=_prescriptions(run, straggler, top, cost, detail.get("slower_gpu")),
        ranks=tuple(ranks),
    )


# -- pipeline bubbles: blocking send/recv -------------------------------------------------------
def _bubbles(run, ranks, spans):
    p2p = spans[sp.is_point_to_point(spans)] if len(spans) else spans
    if not len(p2p):
        return []
    steady = ev.steady_steps(run)
    per_rank = {}
    for rank, rows in p2p.groupby("rank"):
        st = steady[steady["rank"] == rank]
        if not len(st):
            continue
        wall = float(st["duration_s"].sum())
        idx = sp.step_of(
            run.steps.dropna(subset=["start_ns", "end_ns"]), rank, rows["start_ns"].to_numpy(np.int64)
        )
        rows = rows[np.isin(idx, st["step"].astype(int).to_numpy())]
        secs = ev.union_seconds(zip(rows["start_ns"], rows["end_ns"]))
        per_rank[rank] = {
            "share_of_step": round(secs / wall, 3) if wall else 0.0,
            "seconds_per_step": round(secs / len(st), 4),
            "ops": dict(Counter(rows["op"].astype(str))),
            "peers": sorted({int(p) for p in rows["peer"].dropna()}),
        }
    if not per_rank:
        return []
    share = float(np.mean([v["share_of_step"] for v in per_rank.values()]))
    worst = max(per_rank, key=lambda r: per_rank[r]["share_of_step"])
    if per_rank[worst]["share_of_step"] < MIN_SHARE:
        return []
    slow_stage = _slow_stage(run, per_rank, worst)
    text = "; ".join(
        f"rank {r}: {v['share_of_step']:.0%} ({v['seconds_per_step'] * 1000:.0f} ms) "
        f"in {'/'.join(v['ops'])} with rank {'/'.join(map(str, v['peers']))}"
        for r, v in sorted(per_rank.items())
    )
    return [
        Finding(
            id="ranks.pipeline_bubble",
            title=f"Pipeline bubbles: the stages wait {share:.0%} of each step for their neighbours "
            "(send/recv)",
            severity=ev.severity_for_share(share),
            analyzer="ranks",
            summary=(
                f"Blocking point-to-point waits per steady step: {text}. A stage waiting in recv "
                "for its upstream stage (or in send for its downstream one) is the pipeline "
                "schedule's idle time, not a straggler."
                + (
                    f" The stages are unbalanced: rank {worst} waits for rank "
                    f"{slow_stage['rank']}, whose own ledger has, beyond rank {worst}'s: "
                    + " · ".join(
                        f"{ledger_mod.LABELS.get(c, c)} +{v * 1000:.0f} ms"
                        for c, v in list(slow_stage["ledger_beyond_per_step_s"].items())[:3]
                    )
                    + "."
                    if slow_stage
                    else ""
                )
            ),
            seconds_lost_per_step=per_rank[worst]["seconds_per_step"],
            share_of_step=share,
            evidence={
                "per_rank": per_rank,
                "source": "shim send/recv spans",
                **({"slow_stage": slow_stage} if slow_stage else {}),
            },
            prescriptions=(
                Prescription(
                    kind="code",
                    summary="more micro-batches per step (bubble ≈ (stages − 1) / "
                    "micro-batches of the step), or an interleaved schedule (virtual pipeline stages)",
                ),
            ),
            ranks=tuple(ranks),
        )
    ]


def _slow_stage(run, per_rank, worst):
    """The neighbour the most-waiting stage waits for, when the stages are unbalanced (its bubble
    at least MIN_SHARE of the step below the waiting one's), with its ledger lines (waits left
    out) beyond the waiting stage's: what makes that stage slow."""
    peers = [str(p) for p in per_rank[worst]["peers"] if str(p) in per_rank]
    if not peers:
        return None
    slow = min(peers, key=lambda r: per_rank[r]["share_of_step"])
    if per_rank[worst]["share_of_step"] - per_rank[slow]["share_of_step"] < 2 * MIN_SHARE:
        return None
    led = _steady_ledger(run)
    cats = [c for c in list(ledger_mod.CATEGORIES) + ["unexplained"] if c not in ("sync", "collective")]
    means = led.groupby("rank")[[f"{c}_s" for c in cats]].mean()
    if slow not in means.index or worst not in means.index:
        return None
    beyond = (means.loc[slow] - means.loc[worst]).to_numpy()
    lines = {c: round(float(x), 4) for c, x in sorted(zip(cats, beyond), key=lambda kv: -kv[1]) if x > 0.0005}
    return {"rank": slow, "waited_for_by": worst, "ledger_beyond_per_step_s": lines} if lines else None


# -- 3. ranks that do not wait for each other --------------------------------------------------
def _by_step_time(run, ranks):
    step_s = {r: ev.median_step_s(run, r) for r in ranks}
    known = {r: v for r, v in step_s.items() if v}
    if len(known) < 2:
        return []
    slow = max(known, key=known.get)
    fast = min(known, key=known.get)
    diff = known[slow] - known[fast]
    if diff < MIN_WAIT_DIFF_S or diff / known[slow] < 0.2:
        return []
    return [
        Finding(
            id="ranks.straggler",
            title=f"Rank {slow} is {diff / known[fast]:.0%} slower per step than rank {fast}",
            severity=ev.severity_for_share(diff / known[slow]),
            analyzer="ranks",
            summary=f"Median steady step: rank {slow} {known[slow]:.3f} s, rank {fast} {known[fast]:.3f} s.",
            seconds_lost_per_step=diff,
            share_of_step=diff / known[slow],
            evidence={
                "source": "shim step times",
                "median_step_s": {r: round(v, 4) for r, v in known.items()},
            },
            ranks=tuple(ranks),
        )
    ]


def analyze(run: RunRecord) -> list[Finding]:
    steps = run.steps.dropna(subset=["duration_s"])
    ranks = sorted(set(steps["rank"]), key=lambda r: (len(str(r)), str(r)))
    if len(ranks) < 2:
        return []
    spans = sp.collective_spans(run)
    findings = _bubbles(run, ranks, spans)
    if findings:
        # a pipeline: the stage that makes the others wait is the bubble's slow stage (named in
        # it); the few ms by which the stages reach their all-reduce apart follow the schedule
        # and the machine's load, not a straggler
        return findings
    points = sp.meeting_points(run, spans)
    if len(points) and _syncs_every_step(run):
        # NCCL: the host does not wait in the collective; it waits in the step's syncs
        found = _straggler_from_points(run, ranks, _step_points(run), by_step=True)
        if found is None:
            found = _straggler_from_points(run, ranks, points)  # a CPU group (gloo) in a GPU job
        if found is None:
            # a rank slow on its GPU only: every host waits for its own GPU about as long, and
            # only the GPUs' NCCL kernels (the torch.profiler window) show who waited
            legacy = _by_smallest_wait(run, ranks, sources=("torch.profiler",))
            return findings + (legacy or [])
        return findings + ([found] if found else [])
    if len(points):
        # the ranks meet: the straggler, if any, is who they waited for (none: a healthy job)
        found = _straggler_from_points(run, ranks, points)
        return findings + ([found] if found else [])
    if len(spans) and sp.is_point_to_point(spans).all():
        return findings  # they only exchange point to point: bubbles, not stragglers
    legacy = _by_smallest_wait(run, ranks)
    if legacy is not None:
        return findings + legacy
    return findings + _by_step_time(run, ranks)


# -- 2. runs without spans: the smallest wait in the trace or in py-spy --------------------------
def _by_smallest_wait(run, ranks, sources=("torch.profiler", "py-spy")):
    """[finding] or [] from the trace / py-spy waits; None when neither has them."""
    step_s = {r: ev.median_step_s(run, r) for r in ranks}
    median_step = sorted(v for v in step_s.values() if v)[len(ranks) // 2] if any(step_s.values()) else None
    waits = _trace_waits(run, ranks)
    source, per_rank_wait, detail = None, {}, {}
    if len(waits) >= 2:
        source = "torch.profiler"
        per_rank_wait = {r: w[0] for r, w in waits.items()}
    elif "py-spy" in sources:
        spy = _pyspy_waits(run, ranks)
        if len(spy) >= 2 and median_step:
            source = "py-spy"
            per_rank_wait = {r: share * median_step for r, (share, _) in spy.items()}
    findings = []
    if source:
        straggler = min(per_rank_wait, key=per_rank_wait.get)
        others = [r for r in per_rank_wait if r != straggler]
        diff = sum(per_rank_wait[r] - per_rank_wait[straggler] for r in others) / len(others)
        share = diff / median_step if median_step else 0.0
        if diff >= MIN_WAIT_DIFF_S and share >= MIN_SHARE:
            steady_ids = {int(s) for s in ev.steady_steps(run, straggler)["step"]}
            if source == "torch.profiler":
                _, n, coll, rows, all_rows = waits[straggler]
                doing = _what_straggler_does(run, straggler, rows, all_rows, coll, diff)
            else:
                samples = _pyspy_waits(run, [straggler])[straggler][1]
                hot = ev.hottest_frames(samples, keep=lambda s: not _in_collective(s))
                doing = {"hottest_frames": ev.frames_evidence(hot)} if hot else None
            compiles = _compiles_on(run, straggler, steady_ids)
            detail = {
                "source": source,
                "method": "the rank with the smallest wait in "
                "collectives (point-to-point ops left out); no meeting points in this run",
                "wait_in_collectives_per_step_s": {r: round(w, 4) for r, w in per_rank_wait.items()},
                "median_step_s": {r: None if v is None else round(v, 4) for r, v in step_s.items()},
                "straggler": straggler,
            }
            if doing:
                detail["straggler_does"] = doing
            if compiles:
                detail["straggler_compiles_in_steady_steps"] = compiles
            what = ""
            if doing and doing.get("call"):
                fn = doing.get("in_function")
                what = (
                    f" Rank {straggler} spends that time in {doing['call']}"
                    + (f" in {fn['function']} ({fn['file']}:{fn['line']})" if fn else "")
                    + "."
                )
            elif doing and doing.get("hottest_frames"):
                what = f" Rank {straggler}'s hottest code: {doing['hottest_frames'][0]['frame']}."
            if compiles:
                what += (
                    f" It compiled {compiles['compiles']} kernels in steady steps ({compiles['seconds']} s)."
                )
            prescriptions = []
            if compiles:
                prescriptions.append(
                    Prescription(
                        kind="precompile",
                        summary=f"rank {straggler} compiles kernels during the steps: precompile "
                        "them (see the jit finding) so no rank compiles while others wait",
                        change={"precompile": {"from_run": run.path}},
                        expected_gain_s_per_step=diff,
                    )
                )
            prescriptions.append(
                Prescription(
                    kind="code",
                    summary=f"remove the extra work on rank {straggler} or balance it across ranks "
                    "(same data volume per rank, rank-0-only logging/evaluation off the step)",
                    expected_gain_s_per_step=diff,
                )
            )
            findings.append(
                Finding(
                    id="ranks.straggler",
                    title=f"Rank {straggler} stalls the others: they wait {diff * 1000:.0f} ms per step "
                    "in collectives",
                    severity=ev.severity_for_share(share),
                    analyzer="ranks",
                    summary=(
                        f"Per step, rank {straggler} waits {per_rank_wait[straggler] * 1000:.0f} ms "
                        f"in collectives and the other ranks {diff * 1000 + per_rank_wait[straggler] * 1000:.0f} ms "
                        f"on average ({source}).{what}"
                    ),
                    seconds_lost_per_step=diff,
                    share_of_step=share,
                    evidence=detail,
                    prescriptions=tuple(prescriptions),
                    ranks=tuple(ranks),
                )
            )
            return findings
    return findings if source else None
