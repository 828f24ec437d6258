"""The savings model: what a finding's fix is expected to save, from the time ledger.

Judge layer: it prices findings (their `removes`: the ledger lines the fix takes away) against
the derived ledger (traindx.derive.ledger) and the shim's CPU evidence (traindx.derive.ledger.cpu_evidence).
`predicted_step_time` is what the --fix loop writes beside the measured candidate (the ledger,
a derive-layer module, does not import it).
"""

import numpy as np
import pandas as pd

from traindx.derive.ledger import CATEGORIES, SPAN_CATEGORY, cpu_evidence, rows, steady_rows


def workers_step_model(load_cpu, rest_cpu, rest_wall, workers, cores, others, load_wait=0.0, rest_wait=0.0):
    """The step time once `workers` DataLoader processes make the batches (num_workers=0 before).

    The loading work splits in two (measured on the training thread inside __next__ before the
    fix): `load_wait` seconds per batch off the CPU (a sleep, a blocking read: the thread was
    neither running nor runnable) and `load_cpu` seconds of CPU work. Moved into worker
    processes, each worker spends the wait and then the CPU work on a batch, and `workers` of
    them work on different batches at once: the wait part parallelises over all of them (each
    worker has at least one batch in flight, prefetch_factor >= 1), the CPU part only as far as
    the cores give each task a share. The rest of the step is `rest_cpu` CPU seconds per step
    on the training process, spread over a = max(1, rest_cpu / rest_wall) threads (its intra-op
    threads, as measured before the fix), plus `rest_wait` off-CPU seconds of the training
    thread. The share (per-task fair share, which is what Linux's CFS gives runnable tasks of
    equal weight): `others` runnable tasks of other processes compete for the `cores`; with the
    training process runnable a fraction u_m of the time and each worker u_w, every runnable
    task gets

        share = min(1, cores / (others + a * u_m + workers * u_w))

    and the steady step is the slower of the two stages of the pipeline,

        step = max((load_wait + load_cpu / share) / workers,  rest_wait + rest_cpu / (a * share))

    u_m and u_w are the stages' runnable fractions, solved by fixed-point iteration. What it
    leaves out, and why: the batch transfer from a worker (a tensor batch goes through shared
    memory: ~1 ms for 256 x 256 floats on the training thread; measured 0.1 ms per batch of
    8 x 32 floats, inside the noise of these steps); schedulers that weight groups of tasks
    (cgroups, autogroup, nice), which workers_step_capped and the range in predicted_step_time
    cover; and an intra-op thread pool (torch's default, a thread per core) that spins at its
    barriers: once the workers oversubscribe the cores its parallel regions wait for
    descheduled threads, and a step can end up slower than before - measured, not modelled
    (bench/ledger_predictions.py, case getitem-cpu)."""
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


def workers_step_capped(load_cpu, rest_cpu, rest_wall, workers, job_cores, load_wait=0.0, rest_wait=0.0):
    """The step time once `workers` processes make the batches when the job cannot get more
    cores than `job_cores` (what its training thread got while runnable, or what it used,
    plus the machine's idle cores): a scheduler that shares the cores between groups of tasks
    (cgroups, one per container; autogroup, one per session) gives a group the same share
    however many tasks it runs. All the CPU work of a step then has those cores, neither stage
    can go faster than one core per task, and the off-CPU waits (`load_wait` per batch,
    parallel over the workers; `rest_wait` on the training thread) take no core:

        step = max((load_cpu + rest_cpu) / job_cores,  (load_wait + load_cpu) / workers,
                   rest_wait + rest_cpu / a)"""
    a = max(1.0, rest_cpu / rest_wall) if rest_wall > 0 else 1.0
    cores = max(1e-9, min(job_cores, workers + a))
    return max((load_cpu + rest_cpu) / cores, (load_wait + load_cpu) / workers, rest_wait + rest_cpu / a)


def workers_step_measured(load_wait, load_run, rest_wait, rest_run, workers, cores, others, threads=1.0):
    """The step time once `workers` DataLoader processes make the batches, from the baseline's
    measured stage times: per batch `load_wait` seconds off the CPU and `load_run` seconds
    runnable (CPU time plus run-queue wait) inside __next__ on the training thread, and per
    step `rest_wait` off-CPU and `rest_run` runnable seconds of the rest of the step. Those
    runnable times were measured with the training process (`threads` runnable threads)
    sharing the `cores` with `others` runnable tasks (what its run-queue wait says:
    core_share_seen), a share of min(1, cores / (others + threads)) per task; after the fix
    each stage's runnable time grows by the contention its own workers add (per-task fair
    share, as CFS/EEVDF give runnable tasks of equal weight):

        main stage     rest_wait + rest_run * before / min(1, cores / (others + threads + N u_w))
        loader stage   (load_wait + load_run * before / min(1, cores / (others + 1 + threads u_m
                        + (N - 1) u_w))) / N
        step           max(main stage, loader stage)

    The wait part parallelises over the N workers (each has at least one batch in flight,
    prefetch_factor >= 1); the CPU part only as far as each worker's share of the cores goes
    (never more than a core each: with no other load and 2 cores, 4 CPU-bound workers beside a
    busy main thread get 0.4 of a core each). u_m and u_w are the stages' runnable fractions,
    by fixed-point iteration. Measured times keep what a formula of CPU seconds and shares
    misses: the run-queue wait at every wake-up of a thread that sleeps between short bursts
    (a storage wait per sample), which its CPU time alone does not show."""
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


def loader_time_split(evd):
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


def core_share_seen(evd):
    """The share of a core the training thread got while it was runnable over its steady
    steps (its CPU time / (CPU time + run-queue wait)): how contended the cores the job runs
    on are; None without the run-queue wait (an older shim, a kernel without schedstat)."""
    cpu, runq = evd.get("thread_cpu"), evd.get("thread_runq")
    if not cpu or runq is None or cpu <= 0:
        return None
    return cpu / (cpu + max(0.0, runq))


def _workers_prediction(run, finding, removes):
    """(predicted step, (low, high), cpu evidence) for a fix that moves the data line into
    `workers` DataLoader processes, from the shim's CPU evidence; None without it.

    The data line splits into its off-CPU wait and its runnable part, CPU work plus run-queue
    wait (loader_time_split): only the runnable part competes for cores once it moves. How many
    cores the job gets comes from the training thread's run-queue wait (core_share_seen: a
    thread that got a fraction f of a core while runnable shared the cores with cores / f - 1
    other runnable tasks, its own threads included), capped by the runnable tasks counted on
    the machine at the step ends. One baseline still allows two readings of the cores the job
    gets once it runs more processes, and the truth depends on how the kernel groups tasks
    (Linux autogroup shares the cores between sessions first, containers and Slurm between
    cgroups, and other users' load comes and goes):
      per task   workers_step_measured: every task takes its share of the cores, the stages
                 keep their measured times and grow by the contention the workers add;
      per group  workers_step_capped with the job held to the cores it had (the share its
                 training thread got, or the CPU it used if more, plus the idle cores): its
                 group's share does not grow with its task count.
    The range is [fastest, slowest] of these. For a loader that computes, the prediction is the
    middle of the range (one run cannot tell which regime the kernel applies). The more of the
    data line is off-CPU wait, the closer it moves to the per-task reading,

        predicted = per_task + (1 - wait / data) / 2 * (per_group - per_task)

    because a thread that sleeps between short bursts waits in the run queue at every wake-up:
    the share it shows is then mostly wake-up latency, below what the job gets once it blocks
    less often, and the group cap priced from it overshoots (measured: +70 % on one
    storage-wait job where the blend was +17 %; BENCHMARKS.md "--fix per fix class"). Without
    the run-queue wait (an older shim) the per-task reading is the CPU model
    (workers_step_model) with the other tasks counted at the step ends. Other ranks on the
    host add their own workers."""
    evd = cpu_evidence(run, finding.ranks)
    if evd is None or evd["data"] <= 0 or not evd.get("cores") or evd["wall"] <= 0:
        return None
    split = loader_time_split(evd)
    if split["cpu"] <= 0 and not split["runq_measured"]:
        return None  # no CPU on the data spans: a shim that did not record the split
    cores = float(evd["cores"])
    rest_wall = max(0.0, evd["wall"] - evd["data"])
    rest_cpu = max(0.0, evd["proc_cpu"] - split["cpu"])
    a = max(1.0, rest_cpu / rest_wall) if rest_wall > 0 else 1.0
    rest_runq = max(0.0, (evd.get("thread_runq") or 0.0) - split["runq"])
    rest_wait = max(0.0, rest_wall - rest_cpu / a - rest_runq)
    own_threads = 1.0
    if evd["thread_cpu"] is not None:
        own_threads += max(0.0, evd["proc_cpu"] - evd["thread_cpu"]) / evd["wall"]
    counted = max(0.0, evd["running"] - own_threads) if evd["running"] is not None else None
    share_seen = core_share_seen(evd)
    ranks = max(1, run.ledger["rank"].nunique()) if len(run.ledger) else 1
    workers = float(removes["workers"])
    extra = (ranks - 1) * workers
    if share_seen is not None:
        others = max(0.0, cores / share_seen - own_threads)
        if counted is not None:
            others = min(others, counted)
        per_task = workers_step_measured(
            split["wait"],
            split["cpu"] + split["runq"],
            rest_wait,
            max(0.0, rest_wall - rest_wait),
            workers,
            cores,
            others + extra,
            threads=own_threads,
        )
    else:
        others = counted or 0.0
        per_task = workers_step_model(
            split["cpu"],
            rest_cpu,
            rest_wall,
            workers,
            cores,
            others + extra,
            load_wait=split["wait"],
            rest_wait=rest_wait,
        )
    had = max(evd["proc_cpu"] / evd["wall"], share_seen or 0.0)
    job_cores = min(cores / ranks, had + (evd["idle"] or 0.0) / ranks)
    per_group = workers_step_capped(
        split["cpu"], rest_cpu, rest_wall, workers, job_cores, load_wait=split["wait"], rest_wait=rest_wait
    )
    low, high = min(per_task, per_group), max(per_task, per_group)
    cpu_bound = 1.0 - min(1.0, split["wait"] / evd["data"])
    point = per_task + cpu_bound / 2 * (per_group - per_task)
    evd.update(
        load_wait=split["wait"],
        load_runq=split["runq"],
        load_runq_measured=split["runq_measured"],
        rest_wait=rest_wait,
        rest_runq=rest_runq,
        share_seen=share_seen,
        others=others,
        job_cores=job_cores,
        workers=workers,
        per_task_s=per_task,
        per_group_s=per_group,
        group_weight=cpu_bound / 2,
    )
    return point, (low, high), evd


def _freezes_the_heap(finding):
    """True when the finding's first prescription is gc.freeze() (not Megatron's manual GC,
    which moves every collection out of the steps and so does remove the whole gc line)."""
    p = finding.prescriptions[0] if getattr(finding, "prescriptions", ()) else None
    return p is not None and "gc.freeze" in f"{p.command or ''} {p.summary}"


def gc_freeze_residual(run, rank, steps):
    """Seconds per step of the gc line that gc.freeze() leaves, from the baseline's own GC
    records on `rank` over `steps` (its steady steps); None when they cannot tell.

    What freeze removes: the objects alive at the freeze leave the collector's view, so a full
    (gen-2) collection stops walking them. What it leaves (measured: bench/ledger_predictions.py
    case gc, and tests/test_ledger.py): (1) the young collections (gen 0/1 pauses >= 1 ms in the
    gc line): they walk new objects, frozen or not; (2) the garbage the steps make that only a
    full collection frees (reference cycles that survived the young generations): the same
    amount per step is still found and freed, by more frequent and shorter full collections
    (the frozen heap no longer counts towards the 25 % rule that spaces them out). A baseline
    full collection costs a + b * collected (a: walking the surviving heap, which freeze
    removes; b: per object freed, which stays): b is the slope of the shortest pause against
    the objects freed, over the steady gen-2 collections of each haul size (the shim's per-step
    gcstats; the shortest, because CPU contention only lengthens a pause), and the residual is
    b * (objects freed by full collections per step). It needs collections that freed
    different numbers of objects; with one haul size only it is None."""
    steps = {int(s) for s in steps}
    g = run.gc
    if not steps or not len(g) or "collected" not in g or "generation" not in g:
        return None
    g = g[(g["rank"].astype(str) == str(rank)) & g["step"].isin(steps)]
    full = g[(g["generation"] == 2) & (g["count"] > 0)]
    young = 0.0
    sp = run.of_type("span")
    if len(sp) and "cat" in sp and "generation" in sp:
        sp = sp[(sp["rank"].astype(str) == str(rank)) & (sp["cat"] == "gc") & (sp["generation"] < 2)]
        led = rows(run, rank, steps).sort_values("start_ns")
        begin = led["start_ns"].astype("int64").to_numpy()
        end = led["end_ns"].astype("int64").to_numpy()
        s = sp["start"].astype("int64").to_numpy()
        e = sp["t"].astype("int64").to_numpy()
        if len(begin) and len(s):  # each young pause inside a step, clipped at its end
            i = np.clip(np.searchsorted(begin, s, side="right") - 1, 0, None)
            inside = (s >= begin[i]) & (s < end[i])
            young = float((np.minimum(e, end[i]) - s)[inside].sum()) / 1e9
    n = len(steps)
    if not len(full):
        return young / n
    count = full["count"].to_numpy(float)
    pause = pd.Series(full["total_s"].to_numpy(float) / count)  # per collection
    freed = full["collected"].to_numpy(float) / count
    # the lower envelope: the shortest pause of each haul size (a loaded machine preempts the
    # collector mid-pause, which only ever adds time), then the least-squares slope over them
    low = pause.groupby(freed).min()
    if len(low) < 2:
        return None
    x, y = low.index.to_numpy(float), low.to_numpy(float)
    slope = float(np.sum((x - x.mean()) * (y - y.mean())) / np.sum((x - x.mean()) ** 2))
    # a slope above the dearest collection's own pause per object would make the heap walk
    # negative; below zero is noise
    slope = min(max(0.0, slope), float(np.max(y / np.maximum(x, 1.0))))
    # objects freed per step: what the collections after the first freed, over the steps since
    # it (the first one's haul piled up before the window); one collection: its haul per step
    by_step = full.sort_values("step")
    if len(by_step) > 1:
        first, last = int(by_step["step"].iloc[0]), int(by_step["step"].iloc[-1])
        rate = float(by_step["collected"].iloc[1:].sum()) / max(1, last - first)
    else:
        rate = float(by_step["collected"].sum()) / n
    return young / n + slope * rate


def _gc_freeze_removed(run, led):
    """The gc line per step less what gc.freeze leaves (gc_freeze_residual), for the slowest
    rank; None when a rank's records cannot tell."""
    out = []
    for rank, rl in led.groupby("rank"):
        residual = gc_freeze_residual(run, rank, rl["step"])
        if residual is None:
            return None
        out.append(max(0.0, float(rl["gc_s"].mean()) - residual))
    return max(out) if out else None


def io_after_effect(led):
    """Seconds per step that the steps holding an I/O span (a save) and the step right after
    each lose beyond the span itself: their time outside the io line, less the mean of the
    other steps' (per rank, the slowest rank's; never below zero). None when every step or no
    step holds I/O (nothing to compare with).

    Why (measured: bench/ledger_predictions.py case checkpoint, tests/test_ledger.py): a
    torch.save of a large state dict leaves work behind it - the kernel writes the dirty pages
    back and the save's buffers have pushed the model out of the CPU caches - so the rest of
    the saving step and the next step are slower than the other steps, and removing the save
    removes that too. On a quiet 16-core host it is a few per cent of the save; on a loaded
    2-core machine, where the writeback competes with the job for the cores, the measured
    saving exceeded the io line by 30-35 %."""
    out = []
    for _, rl in led.sort_values("step").groupby("rank"):
        io = rl["io_s"].to_numpy() > 0
        if not io.any() or io.all():
            return None
        steps = rl["step"].to_numpy()
        after = np.isin(steps, steps[io] + 1) & ~io
        rest = (rl["wall_s"] - rl["io_s"]).to_numpy()
        clean = ~io & ~after
        if not clean.any():
            return None
        excess = float((rest[io | after] - rest[clean].mean()).sum()) / len(rl)
        out.append(max(0.0, excess))
    return max(out) if out else None


# a training step's forward does about a third of its model work, the backward two thirds (two
# gradient products per forward product): the usual 2N : 4N FLOPs per token
_FORWARD_PER_BACKWARD = 0.5
# the model calls: the spans the ledger books as fwd/bwd
_MODEL_CALLS = tuple(sorted(c for c, line in SPAN_CATEGORY.items() if line == "forward_backward"))


def _covered(start, end, s, e):
    """Nanoseconds of each [start, end) (arrays) covered by the union of the intervals [s, e):
    the union merged once, then a prefix sum of its lengths read at both ends."""
    start, end = np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64)
    s, e = np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64)
    keep = e > s
    if not keep.any():
        return np.zeros(len(start), dtype=np.int64)
    order = np.argsort(s[keep], kind="stable")
    s, e = s[keep][order], e[keep][order]
    reach = np.maximum.accumulate(e)
    # a new run of the union begins where an interval starts after every earlier one ended
    begins = np.concatenate([[True], s[1:] > reach[:-1]])
    first = np.flatnonzero(begins)
    us, ue = s[first], np.maximum.reduceat(reach, first)
    cum = np.concatenate([[0], np.cumsum(ue - us)])

    def below(x):  # length of the union before x
        i = np.searchsorted(us, x, side="right") - 1
        inside = np.where(
            i >= 0, np.clip(x - us[np.maximum(i, 0)], 0, ue[np.maximum(i, 0)] - us[np.maximum(i, 0)]), 0
        )
        return cum[np.maximum(i, 0)] * (i >= 0) + inside

    return below(end) - below(start)


def fresh_graph_calls(run, rank, steps) -> dict[int, float]:
    """{step: seconds} the recompiling steps of `rank` lose in their model calls beyond the
    compile events, from the shim's spans and compile events; {} without forward spans.

    Why (measured: docs/fix.md, the steady-recompile rows): a model call that holds a compile
    is the first call of a fresh graph. Outside the compile event it still pays for the guard
    check that failed and the cache lookup before it, and after it for the graph's first call
    (torch.fx generates the graph's Python code lazily, AOTAutograd checks the first call's
    inputs and outputs; likewise the first call of a backward graph compiled at the first
    backward), on a tiny model 5-40 ms against a steady call of 0.5-1 ms. A fix that stops the recompiles
    removes that too; what stays of the call is its steady cost: the same call's mean where
    it holds no compile (the steps that did not recompile), else, for a forward, half of a
    backward that holds none (the 1 : 2 forward : backward work of a training step), and for a
    backward twice such a forward; nothing where every call compiles (then the calls'
    steady cost is not in the record; on the models measured it was a tenth of the first call
    or less). GC pauses inside the call are their own
    ledger line and are left to it."""
    calls_df = run.cached(
        f"model_calls_outside_compile:{rank}", lambda: _model_calls_outside_compile(run, rank)
    )
    if not len(calls_df):
        return {}
    steady = {int(s) for s in steady_rows(run, rank)["step"]}
    clean = calls_df[~calls_df["compiles"] & calls_df["step"].isin(steady)]
    # the mean, as measured (a loaded machine's waits included): the prediction is a mean step
    steady_cost = {
        cat: float(clean[clean["cat"] == cat]["outside_s"].mean())
        for cat in _MODEL_CALLS
        if (clean["cat"] == cat).any()
    }
    if "forward" not in steady_cost and "backward" in steady_cost:
        steady_cost["forward"] = steady_cost["backward"] * _FORWARD_PER_BACKWARD
    elif "backward" not in steady_cost and "forward" in steady_cost:
        steady_cost["backward"] = steady_cost["forward"] / _FORWARD_PER_BACKWARD
    chosen = {int(s) for s in steps}
    first = calls_df[calls_df["compiles"] & calls_df["step"].isin(chosen)]
    if not len(first):
        return {}
    steady_of_call = first["cat"].map(steady_cost).fillna(0.0).astype(float)
    excess = (first["outside_s"].astype(float) - steady_of_call).clip(lower=0.0)
    per_step = excess.groupby(first["step"]).sum()
    # never more than the step's fwd/bwd line: the time is taken from it
    fb = rows(run, rank).drop_duplicates("step").set_index("step")["forward_backward_s"]
    per_step = np.minimum(per_step, fb.reindex(per_step.index).fillna(np.inf))
    return {int(k): float(v) for k, v in per_step.items()}


def _model_calls_outside_compile(run, rank):
    """One row per model call (forward/backward span) of `rank` inside a step: step, cat,
    outside_s (its seconds outside compile events and GC pauses), compiles (it holds a compile);
    empty without forward spans or compile events."""
    empty = pd.DataFrame(columns=["step", "cat", "outside_s", "compiles"])
    sp = run.spans
    if not len(sp) or "cat" not in sp or not (sp["cat"] == "forward").any():
        return empty
    sp = sp[(sp["rank"].astype(str) == str(rank)) & sp["cat"].isin(_MODEL_CALLS + ("gc",))]
    comp = run.compiles
    if len(comp):
        comp = comp[comp["rank"].astype(str) == str(rank)].dropna(subset=["start_ns", "end_ns"])
    led = rows(run, rank).sort_values("start_ns")
    if not len(comp) or not len(led):
        return empty
    cs = comp["start_ns"].astype("int64").to_numpy()
    ce = comp["end_ns"].astype("int64").to_numpy()
    gc = sp[sp["cat"] == "gc"]
    both_s = np.concatenate([cs, gc["start_ns"].astype("int64").to_numpy()])
    both_e = np.concatenate([ce, gc["end_ns"].astype("int64").to_numpy()])
    calls = sp[sp["cat"].isin(_MODEL_CALLS)]
    begin = led["start_ns"].astype("int64").to_numpy()
    end = led["end_ns"].astype("int64").to_numpy()
    s0 = calls["start_ns"].astype("int64").to_numpy()
    e0 = calls["end_ns"].astype("int64").to_numpy()
    i = np.clip(np.searchsorted(begin, s0, side="right") - 1, 0, None)
    inside = (s0 >= begin[i]) & (e0 <= end[i])
    if not inside.any():
        return empty
    a, b = s0[inside], e0[inside]
    return pd.DataFrame(
        {
            "step": led["step"].to_numpy().astype(np.int64)[i[inside]],
            "cat": calls["cat"].to_numpy()[inside],
            "outside_s": (b - a - _covered(a, b, both_s, both_e)) / 1e9,
            "compiles": _covered(a, b, cs, ce) > 0,
        }
    )


def _fresh_graph_removed(run, led, chosen):
    """Per ledger row of `led`: the fresh-graph seconds of fresh_graph_calls on the rows of the
    `chosen` steps (0 elsewhere); None when no rank's record can tell."""
    out = pd.Series(0.0, index=led.index)
    told = False
    for rank, rl in led.groupby("rank"):
        excess = fresh_graph_calls(run, rank, [s for s in rl["step"] if int(s) in chosen])
        if excess:
            told = True
            out.loc[rl.index] = [excess.get(int(s), 0.0) for s in rl["step"]]
    return out if told else None


def removed_seconds(run, finding):
    """Seconds per steady step the finding's fix removes: the ledger lines in finding.removes
    ({"categories": [...], "steps": [...] optional, "fresh_graph_calls": true optional: the
    model calls of those steps that hold a compile lose their time beyond a steady call too
    (fresh_graph_calls), "workers": N optional: the lines move to N
    processes beside the step, on "cpus": C cores per rank, "fraction": x optional}), over its
    ranks' steady steps (the slowest rank's mean); None when the finding names no ledger line.
    Lines that move into N worker processes: the CPU model of _workers_prediction where the shim
    recorded CPU evidence (a step can then also get slower than before: a negative saving),
    else the overlap bound below."""
    removes = getattr(finding, "removes", None) or {}
    cats = [c for c in removes.get("categories", ()) if c in CATEGORIES]
    if not cats or not len(run.ledger):
        return None
    led = steady_rows(run)
    ranks = [r for r in (finding.ranks or ()) if r in set(led["rank"])]
    if ranks:
        led = led[led["rank"].isin(ranks)]
    if not len(led):
        return None
    workers = removes.get("workers")
    if workers and cats == ["data"] and not removes.get("steps"):
        model = _workers_prediction(run, finding, removes)
        if model is not None:
            baseline = float(led.groupby("rank")["wall_s"].mean().max())
            return (baseline - model[0]) * float(removes.get("fraction", 1.0))
    if cats == ["gc"] and not removes.get("steps") and _freezes_the_heap(finding):
        removed = _gc_freeze_removed(run, led)
        if removed is not None:
            return removed * float(removes.get("fraction", 1.0))
    after = io_after_effect(led) if cats == ["io"] and not workers and not removes.get("steps") else None
    per_row = led[[f"{c}_s" for c in cats]].sum(axis=1)
    if after is not None:
        per_row = per_row + after
    if workers:
        # the lines move to `workers` processes that run beside the step: what stays is the
        # part of the work that a step's remaining time cannot hide, max(0, L / w - rest)
        rest = led["wall_s"] - per_row
        cpus = removes.get("cpus")
        parallel = min(float(workers), max(1.0, float(cpus) - 1)) if cpus else float(workers)
        per_row = per_row - (per_row / parallel - rest).clip(lower=0.0)
        if cpus:
            # the workers' CPU work competes with the step's on the same cores: a step cannot get
            # shorter than all of it spread over them
            per_row = per_row.clip(upper=led["wall_s"] * (1.0 - 1.0 / float(cpus)))
    if removes.get("steps"):
        chosen = {int(s) for s in removes["steps"]}
        per_row = per_row.where(led["step"].isin(chosen), 0.0)
        if removes.get("fresh_graph_calls"):
            fresh = _fresh_graph_removed(run, led, chosen)
            if fresh is not None:
                per_row = per_row + fresh
    fraction = float(removes.get("fraction", 1.0))
    return float(per_row.groupby(led["rank"]).mean().max()) * fraction


def gpu_work_per_step(run, ranks=()) -> float | None:
    """Seconds the GPU is busy (kernels, copies, memsets) in a mean profiled step, the largest
    over the ranks named (all when none): no change on the host shortens a step below it. None
    without a torch.profiler window holding GPU work."""
    from traindx.analyzers import gpu_window

    trace = run.torch_trace
    if not len(trace) or not trace["cat"].isin(gpu_window.GPU_WORK).any():
        return None
    busy = []
    for rank in ranks or sorted(set(trace["rank"])):
        measured = gpu_window.busy_per_step(run, rank, trace[(trace["rank"] == rank).to_numpy()])
        if measured is not None and measured[1] > 0:
            busy.append(measured[1])
    return max(busy) if busy else None


def predicted_step_time(run, finding, gain=None):
    """What the --fix loop writes beside the measured candidate: {"baseline_step_s": mean steady
    step, "removed_s": ledger seconds per step the fix removes, "predicted_step_s": baseline -
    removed, "categories": ..., "method": ...}; removed/predicted are None when the finding names
    no ledger line (then fall back to the prescription's expected_gain_s_per_step). A fix that
    moves the data line into DataLoader workers adds "predicted_range_s": [fast, slow] and the
    "cpu_evidence" it came from (_workers_prediction): its result depends on how many cores
    the job really gets beside the machine's other work, which one baseline run bounds but does
    not fix. `gain`: the candidate's own predicted saving, used where no ledger line prices it."""
    led = steady_rows(run)
    ranks = [r for r in (finding.ranks or ()) if r in set(led["rank"])]
    if ranks:
        led = led[led["rank"].isin(ranks)]
    baseline = float(led.groupby("rank")["wall_s"].mean().max()) if len(led) else None
    removed = removed_seconds(run, finding)
    spread = None
    if removed is None:
        # the candidate's own prescription where it says (a finding with several fixes, each
        # an arm: the launch-bound model's graph, its optimizer, both), else the first
        gains = [
            p.expected_gain_s_per_step
            for p in finding.prescriptions
            if p.expected_gain_s_per_step is not None
        ]
        removed = gain if gain is not None else gains[0] if gains else None
        method = "the prescription's expected gain (the finding names no ledger line)"
    else:
        method = "ledger lines the fix removes, mean per steady step"
        removes = getattr(finding, "removes", None) or {}
        model = (
            _workers_prediction(run, finding, removes)
            if removes.get("workers")
            and list(removes.get("categories", ())) == ["data"]
            and not removes.get("steps")
            else None
        )
        if (
            list(removes.get("categories", ())) == ["gc"]
            and _freezes_the_heap(finding)
            and not removes.get("steps")
            and _gc_freeze_removed(run, led) is not None
        ):
            method = (
                "gc line less what gc.freeze leaves: young collections and the cost of "
                "freeing each step's cyclic garbage (traindx.analyzers.savings.gc_freeze_residual)"
            )
        if (
            removes.get("fresh_graph_calls")
            and removes.get("steps")
            and _fresh_graph_removed(run, led, {int(s) for s in removes["steps"]}) is not None
        ):
            method = (
                "compile line plus the recompiling model calls' time outside it, down to "
                "their steady cost (traindx.analyzers.savings.fresh_graph_calls)"
            )
        if model is not None:
            spread = {
                "low_s": model[1][0],
                "high_s": model[1][1],
                "cpu_evidence": dict(model[2]),
            }
            method = (
                "CPU model of the DataLoader workers (traindx.analyzers.savings."
                "workers_step_measured, workers_step_model) from the shim's CPU evidence"
            )
    predicted = None if baseline is None or removed is None else max(0.0, baseline - removed)
    floor = gpu_work_per_step(run, ranks)
    if predicted is not None and floor is not None and floor > predicted:
        # host time removed from a step the GPU was busy through part of: the step cannot end
        # before the GPU's own work in it (the H200 seed job: 10.3 s of compile removed from a
        # 10.4 s step left 41 ms predicted against 76 ms of kernels per step)
        predicted = floor
        method += "; no shorter than the GPU's busy time per profiled step"
    out = {
        "baseline_step_s": baseline,
        "removed_s": removed,
        "predicted_step_s": predicted,
        "categories": list((getattr(finding, "removes", None) or {}).get("categories", ())),
        "method": method,
    }
    if floor is not None:
        out["gpu_busy_floor_s"] = floor
    if spread:
        out["predicted_range_s"] = [spread["low_s"], spread["high_s"]]
        out["cpu_evidence"] = spread["cpu_evidence"]
    return out
