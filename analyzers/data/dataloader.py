"""DataLoader starvation: the step waits for the next batch.

Evidence, best first: py-spy (the main thread's samples inside DataLoader.__next__, unperturbed),
the torch.profiler window (DataLoader's own record_function, slowed by the profiler's tracing).
The prescription is written at the job's own line that builds the loader, in the terms of the
framework that drives the run (analyzers/core/frameworks.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core import frameworks
from traindx.analyzers.core.declaration import Declaration, Removes
from traindx.analyzers.core.findings import Finding, Prescription, severity_index
from traindx.analyzers.host import threads
from traindx.derive import ledger

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="dataloader",
    order=30,
    ids=("dataloader.starvation",),
    live_categories=("data",),
    explains=("ranks.straggler", "ranks.pipeline_bubble", "gpu_idle.host_starved", "host_work.code"),
    removes={"dataloader.starvation": Removes(("data",))},
    straggler_lines={"data": "dataloader.starvation"},
)

MIN_SHARE = 0.10
EVERY_STEP_QUANTILE = 0.25  # on a loaded machine: the wait three steps in four have at least
# under this per step no change to the loader pays off (handing a batch over from a worker costs
# about as much), whatever its share of a tiny step
MIN_LOST_S = 0.001
# what a batch made by a worker process costs the training process at least: its tensors rebuilt
# from shared memory and the queue's message unpickled (measured: 1-2 ms a prefetched batch of
# two tensors, 8-256 kB, on a 2-core host, 2026-12-05; in-process 0.45-1 ms): a loader faster than that in-process
# (in-memory tensors indexed and stacked) gains nothing from workers
WORKER_BATCH_S = 0.001
DATALOADER_FILE = "torch/utils/data/dataloader.py"
TRACE_PREFIX = "enumerate(DataLoader)#"


def _hottest_inside_next(samples: Any, limit: Any = 5) -> Any:
    """[(Frame, seconds)] of the job's outermost function called from DataLoader.__next__ (its
    collate_fn or its Dataset.__getitem__), hottest first."""
    counts, line_of = {}, {}
    for stack, weight in zip(samples.stacks, samples.weights):
        if ev.is_import_sample(stack):
            continue
        inside = None
        for i, f in enumerate(stack):
            if f.file.endswith(DATALOADER_FILE) and f.name.endswith("__next__"):
                inside = stack[i + 1 :]
        if inside is None:
            continue
        own = ev.user_frames(inside)
        if not own:
            continue
        key = (own[0].name, own[0].file)
        counts[key] = counts.get(key, 0.0) + weight
        line_of.setdefault(key, own[0])
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return [(line_of[key], seconds) for key, seconds in ranked]


def _from_pyspy(run: RunRecord, rank: str) -> Any:
    recording_all = run.pyspy.get((rank, "all"))
    if not recording_all:
        return None
    main = ev.main_thread_id(recording_all, run.pyspy.get((rank, "gil")))
    threads = ev.merge_threads(recording_all)
    if main not in threads:
        return None
    samples = threads[main][1]
    waiting = ev.training_weight(
        samples,
        keep=lambda stack: any(
            f.file.endswith(DATALOADER_FILE) and f.name.endswith("__next__") for f in stack
        ),
    )
    total, method = ev.steps_seconds(run, rank), "/ the rank's step time (shim)"
    if not total:
        total, method = ev.training_weight(samples), "/ all its samples (imports excluded)"
    if total <= 0:
        return None
    return {
        "source": "py-spy",
        "share": min(1.0, waiting / total),
        "seconds": waiting,
        "hot": ev.frames_evidence(_hottest_inside_next(samples)),
        "method": f"main-thread py-spy seconds inside DataLoader.__next__ {method}",
    }


def _from_ledger(run: RunRecord, rank: str) -> Any:
    """The measured wait: the shim times every DataLoader iterator __next__ on the training
    thread (the `data` line of the time ledger), over the steady steps. Unlike py-spy's sample
    counts it does not shrink when py-spy is starved of CPU; py-spy still names the code."""
    if not ledger.has_spans(run):
        return None
    led = ledger.steady_rows(run, rank)
    if not len(led):
        led = ledger.rows(run, rank)
    wall = float(led["wall_s"].sum()) if len(led) else 0.0
    if wall <= 0:
        return None
    waiting = float(led["data_s"].sum())
    spy = _from_pyspy(run, rank) or {}
    out = {
        "source": "time ledger",
        "share": waiting / wall,
        "seconds": waiting,
        "per_step_s": waiting / len(led),
        "wall_per_step_s": wall / len(led),
        "every_step_s": float(led["data_s"].quantile(EVERY_STEP_QUANTILE)),
        "hot": spy.get("hot") or [],
        "method": "shim-timed DataLoader.__next__ seconds on the training thread / wall "
        "seconds of the steady steps (time ledger); py-spy names the code inside",
    }
    cpu = ledger.cpu_evidence(run, [rank])
    if cpu and cpu["data_cpu"] > 0:
        # the CPU the training thread spent inside __next__: the loading work the workers would
        # take over (the rest of the wait is the thread waiting for a core, or for I/O)
        out["cpu_per_step_s"] = cpu["data_cpu"]
    return out


def _judged_share(run: RunRecord, rank: str, measured: Any) -> Any:
    """(the share the finding is judged by, why): the measured share; on a loaded machine
    (threads.machine_loaded) the wait every step has (its lower quartile) or the loading work
    itself (the CPU inside __next__), whichever is larger. There a wait that comes and goes is
    the training thread waiting for a core (or for the GIL from a thread that waits for one),
    which no loader setting removes; a starving loader makes every step wait, whatever the load."""
    if measured["source"] != "time ledger" or not measured.get("wall_per_step_s"):
        return measured["share"], None
    facts = threads.thread_facts(run, rank)
    if not threads.machine_loaded(facts):
        return measured["share"], None
    held = max(measured["every_step_s"], measured.get("cpu_per_step_s") or 0.0)
    share = min(measured["share"], held / measured["wall_per_step_s"])
    return share, {
        "other_runnable_tasks": facts["other_runnable_tasks"],
        "cores": facts["cores"],
        "every_step_wait_s": round(measured["every_step_s"], 4),
        "judged_share": round(share, 3),
        "why": "a loaded machine: judged by the wait every step has (lower quartile) "
        "or the loading CPU, not the mean",
    }


def _from_trace(run: RunRecord, rank: str) -> Any:
    trace = run.torch_trace
    if not len(trace):
        return None
    trace = trace[trace["rank"] == rank]
    steps = ev.trace_steps(run, rank)
    loads = trace[trace["name"].str.startswith(TRACE_PREFIX)]
    if not len(steps) or not len(loads):
        return None
    start, end = steps["start_ns"].min(), steps["end_ns"].max()
    loads = loads[(loads["start_ns"] >= start) & (loads["end_ns"] <= end)]
    step_s = float(steps["duration_s"].sum())
    waiting = float(loads["dur_s"].sum())
    # the job's own function that takes the time inside __next__ (its collate, its dataset)
    py = trace[trace["cat"] == "python_function"]
    own = {}
    for load in loads.itertuples():
        inside = py[
            (py["tid"] == load.tid) & (py["start_ns"] >= load.start_ns) & (py["end_ns"] <= load.end_ns)
        ]
        for row in inside.itertuples():
            parsed = ev.parse_trace_frame(row.name)
            if parsed and not ev.is_library_trace_file(parsed[0]):
                own[parsed] = own.get(parsed, 0.0) + row.dur_s
    hot = sorted(own.items(), key=lambda kv: -kv[1])[:5]
    return {
        "source": "torch.profiler",
        "share": waiting / step_s if step_s else 0.0,
        "seconds": waiting,
        "steps": [int(s) for s in steps["step"]],
        "per_step_s": waiting / len(steps),
        "hot": [
            {
                "function": f,
                "file": file,
                "line": line,
                "seconds": round(s, 4),
                "frame": f"{f} ({file}:{line})",
            }
            for (file, line, f), s in hot
        ],
        "method": "DataLoader.__next__ record_function time / step time in the torch.profiler window",
    }


def _pick_loader(run: RunRecord, rank: str) -> Any:
    loaders = ev.events_of_type(run, "dataloader")
    if not len(loaders):
        return None
    loaders = loaders[loaders["rank"] == rank]
    if not len(loaders):
        return None
    starving = loaders[loaders["num_workers"] == 0]
    row = (starving if len(starving) else loaders).iloc[-1]
    return {k: frameworks.plain(v) for k, v in row.to_dict().items()}


def _worker_settings(run: RunRecord, loader: Any) -> Any:
    """num_workers (and friends) worth trying: a core per worker, leaving one to the rank."""
    cpus = (run.manifest.get("host") or {}).get("cpus") or 4
    ranks = max(1, len([r for r in run.ranks if r in set(run.steps["rank"])]))
    workers = max(2, min(8, (cpus // ranks) - 1))
    current = (loader or {}).get("num_workers")
    if current is not None and current > 0:
        workers = max(workers, 2 * int(current))
    settings = {"num_workers": workers, "persistent_workers": True, "prefetch_factor": 4}
    if run.manifest.get("gpus"):
        settings["pin_memory"] = True
    return settings


def loader_site_change(site: Any, name: Any, settings: Any) -> Any:
    """The code change that sets `settings` (source texts) on the call of `name` at the job's
    own construction line, or None when it is not a real, applicable edit."""
    where = frameworks.user_site(site)
    if not where:
        return None
    before = where.get("call_source") or where.get("source")
    first = where.get("call_first_line") or where.get("line")
    last = where.get("call_last_line") if where.get("call_source") else None
    if before and not where.get("call_source"):
        before = before.strip()
    after = codefix.set_keywords(before, settings) if before and name in before else None
    file = where.get("file")
    if not file or not isinstance(first, int) or not isinstance(before, str) or after is None:
        return None  # (code_change's own refusals, said before the call)
    change = codefix.code_change(file, first, before, after, last_line=last)
    return dict(change, op="replace") if change else None


def site_text(site: Any) -> str:
    where = frameworks.user_site(site)
    if not where:
        return ""
    first = where.get("call_first_line") or where.get("line")
    return f" at {where['file']}:{first}"


def _steps_served(run: RunRecord, rank: str | None) -> Any:
    """{site id: distinct steps in which that loader's __next__ delivered a batch} (the shim's
    data_use events): the loader the training loop iterates has the most."""
    uses = ev.events_of_type(run, "data_use")
    if not len(uses) or "site_id" not in uses:
        return {}
    if rank is not None and "rank" in uses:
        uses = uses[uses["rank"] == rank]
    return {int(k): int(v) for k, v in uses.groupby("site_id")["steps"].max().items()}


def starving_site(sites: Any, kind: str, served: Any = None) -> Any:
    """The job's own construction to change: the loader the steps iterate (data_use), else one
    built directly in its code (not re-wrapped by a framework's prepare()), the last one with
    num_workers=0 first."""
    chosen = [s for s in sites if s.get("kind") == kind and frameworks.user_site(s)]
    if served:
        used = [s for s in chosen if served.get(s.get("site_id")) and not s.get("via")] or [
            s for s in chosen if served.get(s.get("site_id"))
        ]
        if used:
            return max(used, key=lambda s: served[s["site_id"]])
    direct = [s for s in chosen if not s.get("via")] or chosen
    starving = [s for s in direct if not s.get("num_workers")]
    return (starving or direct or [None])[-1]


def _prescriptions(
    run: RunRecord,
    loader: dict[str, Any] | None,
    lost: float | None,
    hot_function: str | None,
    rank: str | None = None,
) -> list[Prescription]:
    """Best first: the DataLoader knob the user owns in the framework that drives the run."""
    framework = frameworks.knob_owner(run)
    settings = _worker_settings(run, loader)
    knob, names = frameworks.dataloader_knob(framework)
    named = {names[k]: v for k, v in settings.items() if k in names}
    setting_text = ", ".join(f"{k}={v}" for k, v in named.items())
    sites = frameworks.data_sites(run, rank)
    served = _steps_served(run, rank)
    out: list[Prescription] = []
    if knob == "TrainingArguments":
        out.extend(_trainer_fixes(run, sites, served, settings, named, setting_text, lost))
    elif knob == "torchtitan config":
        out.append(_torchtitan_fix(names, settings, setting_text, lost))
    elif knob == "Megatron flag":
        out.append(_megatron_fix(settings, lost))
    else:
        out.append(_dataloader_fix(loader, sites, served, named, setting_text, lost))
    out.extend(_hot_function_fixes(hot_function, lost))
    return out


def _trainer_fixes(
    run: RunRecord,
    sites: list[dict[str, Any]],
    served: Any,
    settings: dict[str, Any],
    named: dict[str, Any],
    setting_text: str,
    lost: float | None,
) -> list[Prescription]:
    """The HF Trainer's dataloader_num_workers: on the command line when the script parses
    TrainingArguments from it, and at the job's TrainingArguments(...) call."""
    out = []
    site = starving_site(sites, "TrainingArguments", served)
    change = loader_site_change(site, "TrainingArguments", {k: repr(v) for k, v in named.items()})
    command = [str(t) for t in run.command]
    if any(
        t.startswith("--per_device_train_batch_size")
        or t.startswith("--output_dir")
        or t.startswith("--dataloader_num_workers")
        for t in command
    ):
        # the script takes TrainingArguments from its command line (HfArgumentParser)
        out.append(
            Prescription(
                kind="arg",
                summary=f"load batches in worker processes: --dataloader_num_workers "
                f"{settings['num_workers']} (TrainingArguments)",
                change={
                    "arg": {
                        "framework": "hf",
                        "set": {"--dataloader_num_workers": str(settings["num_workers"])},
                    }
                },
                expected_gain_s_per_step=lost,
                automatic=True,
            )
        )
    out.append(
        Prescription(
            kind="code",
            summary=f"load batches in worker processes: TrainingArguments({setting_text}){site_text(site)}",
            change={"code": change} if change else {},
            expected_gain_s_per_step=lost,
            automatic=bool(change),
        )
    )
    return out


def _torchtitan_fix(
    names: dict[str, str], settings: dict[str, Any], setting_text: str, lost: float | None
) -> Prescription:
    return Prescription(
        kind="arg",
        summary=f"load batches in worker processes: set {setting_text} in the "
        "job's torchtitan config (TOML or --key=value overrides)",
        change={
            "arg": {
                "framework": "torchtitan",
                "set": {f"--{names['num_workers']}": str(settings["num_workers"])},
            }
        },
        expected_gain_s_per_step=lost,
        automatic=False,
    )


def _megatron_fix(settings: dict[str, Any], lost: float | None) -> Prescription:
    return Prescription(
        kind="arg",
        summary=f"load batches in more worker processes: --num-workers {settings['num_workers']}",
        change={"arg": {"framework": "megatron", "set": {"--num-workers": str(settings["num_workers"])}}},
        expected_gain_s_per_step=lost,
        automatic=True,
    )


def _dataloader_fix(
    loader: dict[str, Any] | None,
    sites: list[dict[str, Any]],
    served: Any,
    named: dict[str, Any],
    setting_text: str,
    lost: float | None,
) -> Prescription:
    """DataLoader(num_workers=...) at the job's construction line."""
    site = starving_site(sites, "DataLoader", served)
    change = loader_site_change(site, "DataLoader", {k: repr(v) for k, v in named.items()})
    if site is None and loader and not ev.is_library_path(str((loader.get("caller") or {}).get("file"))):
        # no data_site event (an older shim): the torchcalls event's line, when it is the job's
        legacy = {"site": {**(loader.get("caller") or {}), "source": loader.get("source")}}
        change = loader_site_change(legacy, "DataLoader", {k: repr(v) for k, v in named.items()})
        site = legacy
    return Prescription(
        kind="code",
        summary=f"load batches in worker processes: DataLoader({setting_text}){site_text(site)}",
        change={"code": change} if change else {},
        expected_gain_s_per_step=lost,
        automatic=bool(change),
    )


def _hot_function_fixes(hot_function: str | None, lost: float | None) -> list[Prescription]:
    out = []
    if hot_function and "__getitem__" in hot_function:
        out.append(
            Prescription(
                kind="code",
                summary=f"make {hot_function} cheaper: it runs once per sample, on the "
                "training process until workers take it over",
                expected_gain_s_per_step=lost,
            )
        )
    elif hot_function:
        out.append(
            Prescription(
                kind="code",
                summary=f"make {hot_function} cheaper or move it into Dataset.__getitem__ so the "
                "workers run it (vectorise the per-sample Python loop)",
                expected_gain_s_per_step=lost,
            )
        )
    return out


def _unless_workers_cost_more(
    run: RunRecord,
    rank: str,
    measured: dict[str, Any],
    workers: Any,
    evidence: dict[str, Any],
    prescriptions: list[Prescription],
    share: float,
) -> tuple[list[Prescription], str]:
    """(prescriptions, severity): where the training process makes a batch faster than a worker's
    batch costs it, the cost model says workers will not pay: no workers prescription, and the
    finding at most low (its size stays a note); `evidence` says why."""
    severity = ev.severity_for_share(share)
    per_batch = _in_process_per_batch(run, rank, measured)
    if per_batch is None or workers or per_batch > WORKER_BATCH_S:
        return prescriptions, severity
    evidence["workers_will_not_pay"] = {
        "in_process_per_batch_s": round(per_batch, 6),
        "worker_batch_s": WORKER_BATCH_S,
    }
    kept = [p for p in prescriptions if "worker" not in p.summary]
    return kept, ("low" if severity_index(severity) > severity_index("low") else severity)


def _in_process_per_batch(run: RunRecord, rank: str, measured: dict[str, Any]) -> float | None:
    """Seconds per batch the training process spends making a batch itself (the loader's CPU on
    the training thread or the wait every step has, whichever is larger, over the batches of the
    steady steps); None without the shim's data spans."""
    if measured.get("source") != "time ledger":
        return None
    led = ledger.steady_rows(run, rank)
    spans = run.spans
    if not len(led) or not len(spans):
        return None
    data = spans[(spans["rank"] == rank) & (spans["cat"] == "data")]
    data = data[(data["start_ns"] >= led["start_ns"].min()) & (data["end_ns"] <= led["end_ns"].max())]
    if not len(data):
        return None
    # the loading CPU, or the wait every step has (its lower quartile): a loader that waits on
    # storage spends little CPU, and workers overlap exactly that wait
    per_step = max(measured.get("cpu_per_step_s") or 0.0, measured.get("every_step_s") or 0.0)
    return float(per_step or measured.get("per_step_s") or 0.0) * len(led) / len(data)


_LOADER_SETTINGS = (
    "caller",
    "source",
    "num_workers",
    "batch_size",
    "pin_memory",
    "prefetch_factor",
    "persistent_workers",
    "dataset",
    "collate_fn",
)


def _evidence(
    rank: str,
    measured: dict[str, Any],
    hot: list[Any],
    loaded: Any,
    trace_view: dict[str, Any] | None,
    loader: dict[str, Any] | None,
) -> dict[str, Any]:
    """A starvation finding's evidence: the wait measured, where it was measured from, the
    loader's settings."""
    evidence: dict[str, Any] = {
        "rank": rank,
        "share_in_dataloader": round(measured["share"], 3),
        "seconds_in_dataloader": round(measured["seconds"], 3),
        "source": measured["source"],
        "method": measured["method"],
        "hottest_frames_inside": hot,
    }
    if measured.get("cpu_per_step_s") is not None:
        evidence["cpu_in_dataloader_per_step_s"] = round(measured["cpu_per_step_s"], 4)
    if loaded:
        evidence["machine_loaded"] = loaded
    if trace_view and measured["source"] != "torch.profiler":
        evidence["torch_profiler"] = {k: trace_view[k] for k in ("share", "per_step_s", "steps")}
    if loader:
        evidence["dataloader"] = {k: loader.get(k) for k in _LOADER_SETTINGS}
    return evidence


def analyze(run: RunRecord) -> list[Finding]:
    findings = []
    ranks = sorted(set(run.steps["rank"])) if len(run.steps) else []
    for rank in ranks:
        measured = _from_ledger(run, rank) or _from_pyspy(run, rank) or _from_trace(run, rank)
        trace_view = _from_trace(run, rank)
        if measured is None or measured["share"] < MIN_SHARE:
            continue
        judged, loaded = _judged_share(run, rank, measured)
        if judged < MIN_SHARE:
            continue
        step_s = ev.median_step_s(run, rank)
        share = measured["share"]
        lost = (
            measured.get("per_step_s")
            if measured["source"] == "time ledger"
            else (share * step_s if step_s else None)
        )
        if lost is not None and lost < MIN_LOST_S:
            continue
        loader = _pick_loader(run, rank)
        hot = measured["hot"] or (trace_view or {}).get("hot") or []
        hot_function = hot[0]["frame"] if hot else None
        evidence = _evidence(rank, measured, hot, loaded, trace_view, loader)
        workers = (loader or {}).get("num_workers")
        settings = "" if workers is None else f" (num_workers={int(workers)})"
        prescriptions, severity = _unless_workers_cost_more(
            run,
            rank,
            measured,
            workers,
            evidence,
            _prescriptions(run, loader, lost, hot_function, rank),
            share,
        )
        findings.append(
            Finding(
                id="dataloader.starvation",
                title=f"The step waits for the DataLoader {share:.0%} of the time on rank {rank}",
                severity=severity,
                analyzer="dataloader",
                summary=(
                    f"The main thread spends {share:.0%} of its time in DataLoader.__next__"
                    f"{settings}; the batches are made on the training process, between "
                    f"steps. Hottest code inside: {hot_function or 'unknown'}."
                ),
                seconds_lost_per_step=lost,
                share_of_step=share,
                evidence=evidence,
                prescriptions=tuple(prescriptions),
                ranks=(rank,),
            )
        )
    return findings
