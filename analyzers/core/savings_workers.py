"""The savings model of a fix that moves the data line into DataLoader worker processes (judge
layer): the step time it predicts, from the shim's CPU evidence (traindx.derive.ledger.cpu_evidence)
and the cores the job gets beside the machine's other work. traindx.analyzers.core.savings prices the
other fixes and reads this one here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traindx.derive.ledger import cpu_evidence

if TYPE_CHECKING:  # annotations only
    from traindx.analyzers.core.findings import Finding
    from traindx.derive.run import RunRecord

# the shim's CPU evidence of a run's steady steps (traindx.derive.ledger.cpu_evidence)
Evidence = dict[str, Any]


def workers_step_model(
    load_cpu: float,
    rest_cpu: float,
    rest_wall: float,
    workers: float,
    cores: float,
    others: float,
    load_wait: float = 0.0,
    rest_wait: float = 0.0,
) -> float:
    """The step time once `workers` DataLoader processes make the batches (num_workers=0 before),
    from CPU seconds: each stage's runnable tasks get a per-task fair share of the cores (what CFS
    gives tasks of equal weight), the stages' runnable fractions solved by fixed-point iteration:

        share = min(1, cores / (others + a * u_m + workers * u_w))
        step = max((load_wait + load_cpu / share) / workers,  rest_wait + rest_cpu / (a * share))

    a: the rest of the step's threads (rest_cpu / rest_wall). Left out: the batch transfer from a
    worker (measured 0.1 ms a batch, inside the noise), schedulers that weight groups of tasks
    (workers_step_capped covers them) and an intra-op pool that spins at its barriers once the
    workers oversubscribe the cores (measured, not modelled: bench/ledger_predictions.py getitem-cpu)."""
    a = max(1.0, rest_cpu / rest_wall) if rest_wall > 0 else 1.0
    u_m = u_w = 1.0
    step = 0.0
    for _ in range(50):
        share = min(1.0, cores / max(1e-9, others + a * u_m + workers * u_w))
        runnable = load_cpu / share  # one worker's CPU part of a batch
        load = (load_wait + runnable) / workers
        main_cpu = rest_cpu / (a * share)
        main = rest_wait + main_cpu
        step = max(load, main)
        if step <= 0:
            return 0.0
        u_m, u_w = min(1.0, main_cpu / step), min(1.0, runnable / (workers * step))
    return step


def workers_step_capped(
    load_cpu: float,
    rest_cpu: float,
    rest_wall: float,
    workers: float,
    job_cores: float,
    load_wait: float = 0.0,
    rest_wait: float = 0.0,
) -> float:
    """The step time with the workers when the job cannot get more than `job_cores` cores: a scheduler
    that shares the cores between groups of tasks (cgroups, autogroup) gives a group the same share
    however many tasks it runs. Off-CPU waits take no core:

        step = max((load_cpu + rest_cpu) / job_cores,  (load_wait + load_cpu) / workers,
                   rest_wait + rest_cpu / a)"""
    a = max(1.0, rest_cpu / rest_wall) if rest_wall > 0 else 1.0
    cores = max(1e-9, min(job_cores, workers + a))
    return max((load_cpu + rest_cpu) / cores, (load_wait + load_cpu) / workers, rest_wait + rest_cpu / a)


def workers_step_measured(
    load_wait: float,
    load_run: float,
    rest_wait: float,
    rest_run: float,
    workers: float,
    cores: float,
    others: float,
    threads: float = 1.0,
) -> float:
    """The step time with the workers from the baseline's measured stage times (off-CPU wait and
    runnable time, per batch inside __next__ and per step for the rest), each runnable time grown by
    the contention the workers add under a per-task fair share (the `threads` of the process shared
    the `cores` with `others` before). Measured times keep what CPU seconds miss: the run-queue wait
    at every wake-up of a thread that sleeps between short bursts (a storage wait per sample)."""
    before = min(1.0, cores / max(1e-9, others + threads))
    u_m = u_w = 1.0
    step = 0.0
    for _ in range(50):
        main_share = min(1.0, cores / max(1e-9, others + threads + workers * u_w))
        worker_share = min(1.0, cores / max(1e-9, others + 1.0 + threads * u_m + (workers - 1.0) * u_w))
        run_w = load_run * before / worker_share
        run_m = rest_run * before / main_share
        load = (load_wait + run_w) / workers
        main = rest_wait + run_m
        step = max(load, main)
        if step <= 0:
            return 0.0
        u_m, u_w = min(1.0, run_m / step), min(1.0, run_w / (workers * step))
    return step


def loader_time_split(evd: Mapping[str, Any]) -> dict[str, Any]:
    """The data line's split on the training thread before the fix, from cpu_evidence `evd`:
    {"cpu": CPU seconds per step, "runq": seconds runnable but waiting for a core, "wait":
    seconds off the CPU (sleeping, blocked on storage), "runq_measured": whether runq came from
    the data spans (else it is estimated from the whole step's run-queue wait per CPU second of
    the thread, and 0 without that)}. Only the CPU part needs a core once it moves to workers."""
    cpu = evd["data_cpu"]
    runq, measured = evd.get("data_runq"), True
    if runq is None:
        measured = False
        thread_cpu, thread_runq = evd.get("thread_cpu"), evd.get("thread_runq")
        runq = cpu * thread_runq / thread_cpu if thread_cpu and thread_runq is not None else 0.0
    runq = max(0.0, min(runq, evd["data"] - cpu))
    return {"cpu": cpu, "runq": runq, "wait": max(0.0, evd["data"] - cpu - runq), "runq_measured": measured}


def core_share_seen(evd: Mapping[str, Any]) -> float | None:
    """The share of a core the training thread got while it was runnable over its steady
    steps (its CPU time / (CPU time + run-queue wait)): how contended the cores the job runs
    on are; None without the run-queue wait (an older shim, a kernel without schedstat)."""
    cpu, runq = evd.get("thread_cpu"), evd.get("thread_runq")
    if not cpu or runq is None or cpu <= 0:
        return None
    return float(cpu / (cpu + max(0.0, runq)))


def workers_prediction(
    run: RunRecord, finding: Finding, removes: Mapping[str, Any]
) -> tuple[float, tuple[float, float], Evidence] | None:
    """(predicted step, (low, high), cpu evidence) for a fix that moves the data line into `workers`
    DataLoader processes; None without the shim's CPU evidence.

    One baseline allows two readings of the cores the job gets once it runs more processes, and
    which holds depends on how the kernel groups tasks: per task (workers_step_measured, or the CPU
    model without a run-queue record) and per group (workers_step_capped, the job held to the cores
    it had). The range spans both; the point is their middle for a loader that computes and moves to
    the per-task reading as the data line's off-CPU wait grows, because a thread that sleeps between
    short bursts waits in the run queue at every wake-up and the group cap priced from that share
    overshoots (measured: +70 % against +17 % for the blend; docs/fix.md)."""
    evd = cpu_evidence(run, finding.ranks)
    if evd is None or evd["data"] <= 0 or not evd.get("cores") or evd["wall"] <= 0:
        return None
    split = loader_time_split(evd)
    if split["cpu"] <= 0 and not split["runq_measured"]:
        return None  # no CPU on the data spans: a shim that did not record the split
    rest = _rest_of_step(evd, split)
    ranks = max(1, run.ledger["rank"].nunique()) if len(run.ledger) else 1
    workers = float(removes["workers"])
    share_seen = core_share_seen(evd)
    per_task, others = _per_task_step(evd, split, rest, workers, (ranks - 1) * workers, share_seen)
    cores = float(evd["cores"])
    had = max(evd["proc_cpu"] / evd["wall"], share_seen or 0.0)
    job_cores = min(cores / ranks, had + (evd["idle"] or 0.0) / ranks)
    per_group = workers_step_capped(
        split["cpu"],
        rest.cpu,
        rest.wall,
        workers,
        job_cores,
        load_wait=split["wait"],
        rest_wait=rest.wait,
    )
    low, high = min(per_task, per_group), max(per_task, per_group)
    cpu_bound = 1.0 - min(1.0, split["wait"] / evd["data"])
    point = per_task + cpu_bound / 2 * (per_group - per_task)
    evd.update(
        load_wait=split["wait"],
        load_runq=split["runq"],
        load_runq_measured=split["runq_measured"],
        rest_wait=rest.wait,
        rest_runq=rest.runq,
        share_seen=share_seen,
        others=others,
        job_cores=job_cores,
        workers=workers,
        per_task_s=per_task,
        per_group_s=per_group,
        group_weight=cpu_bound / 2,
    )
    return point, (low, high), evd


@dataclass(frozen=True)
class _Rest:
    """The step outside the data line on the training process, seconds per step: its wall
    time, CPU time (over `threads` intra-op threads), run-queue wait and off-CPU wait; and the
    process's runnable threads besides the workers."""

    wall: float
    cpu: float
    runq: float
    wait: float
    threads: float
    own_threads: float


def _rest_of_step(evd: Evidence, split: Mapping[str, Any]) -> _Rest:
    rest_wall = max(0.0, evd["wall"] - evd["data"])
    rest_cpu = max(0.0, evd["proc_cpu"] - split["cpu"])
    a = max(1.0, rest_cpu / rest_wall) if rest_wall > 0 else 1.0
    rest_runq = max(0.0, (evd.get("thread_runq") or 0.0) - split["runq"])
    own_threads = 1.0
    if evd["thread_cpu"] is not None:
        own_threads += max(0.0, evd["proc_cpu"] - evd["thread_cpu"]) / evd["wall"]
    return _Rest(
        wall=rest_wall,
        cpu=rest_cpu,
        runq=rest_runq,
        wait=max(0.0, rest_wall - rest_cpu / a - rest_runq),
        threads=a,
        own_threads=own_threads,
    )


def _per_task_step(
    evd: Evidence,
    split: Mapping[str, Any],
    rest: _Rest,
    workers: float,
    extra: float,
    share_seen: float | None,
) -> tuple[float, float]:
    """(the per-task reading of the step with the workers, the other runnable tasks counted):
    from the measured stage times where the run-queue wait gives the cores' contention, else the
    CPU model with the tasks counted at the step ends. `extra`: the other ranks' workers."""
    cores = float(evd["cores"])
    counted = max(0.0, evd["running"] - rest.own_threads) if evd["running"] is not None else None
    if share_seen is not None:
        others = max(0.0, cores / share_seen - rest.own_threads)
        if counted is not None:
            others = min(others, counted)
        step = workers_step_measured(
            split["wait"],
            split["cpu"] + split["runq"],
            rest.wait,
            max(0.0, rest.wall - rest.wait),
            workers,
            cores,
            others + extra,
            threads=rest.own_threads,
        )
        return step, others
    others = counted or 0.0
    step = workers_step_model(
        split["cpu"],
        rest.cpu,
        rest.wall,
        workers,
        cores,
        others + extra,
        load_wait=split["wait"],
        rest_wait=rest.wait,
    )
    return step, others
