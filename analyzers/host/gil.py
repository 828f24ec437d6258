"""GIL contention: a thread other than the main one holds the GIL for a large share of the time,
so the main thread (which drives the steps) waits for it.

Per-thread GIL share = seconds in py-spy's --gil recording ÷ wall seconds of the main thread in
the --idle recording (FACTS §4). py-spy's speedscope has no timestamps, so the window is the
whole recording minus start-up (samples inside imports); py-spy dump snapshots, which are
timestamped, confirm it inside the steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord
    from traindx.profiler.speedscope import Recording, ThreadSamples

DECLARATION = Declaration(
    name="gil",
    order=20,
    ids=("gil.contention",),
    live_triggers=("recording",),
    explains=("host_work.code", "host_work.periodic_line"),
)

MIN_SHARE = 0.10  # a helper thread holding the GIL 10 % of the time is worth a look
MIN_SAMPLES = 10
COMPILER_MARKERS = ("cutlass/base_dsl", "triton/compiler", "torch/_inductor", "torch/_dynamo")


def _dump_confirmation(run: RunRecord, rank: str, thread_name: str) -> Any:
    """From the timestamped py-spy dumps: {"in_steps": (held, snapshots), "in_steady_steps":
    (held, snapshots)}: how often the thread owned the GIL when a snapshot fell in a step, and
    in a step of the steady window (warm-up, such as a cold-start compile, left out)."""
    dumps = run.dumps
    if not len(dumps) or not thread_name:
        return None
    dumps = dumps[dumps["rank"] == rank]
    if "trigger" in dumps:  # a burst on an anomaly is not a uniform sample of the run's time
        dumps = dumps[dumps["trigger"].isna()]
    steps = run.rank_steps(rank).dropna(subset=["start_ns"])
    steady_ids = {int(s) for s in ev.steady_steps(run, rank)["step"]}
    counts = {"in_steps": [0, 0], "in_steady_steps": [0, 0]}
    for t, snap in dumps.groupby("t"):
        hit = steps[(steps["start_ns"] <= t) & (steps["end_ns"] >= t)]
        if not len(hit):
            continue
        holds = bool(len(snap[(snap["thread_name"] == thread_name) & (snap["owns_gil"] == True)]))  # noqa: E712
        keys = ["in_steps"] + (["in_steady_steps"] if int(hit["step"].iloc[0]) in steady_ids else [])
        for key in keys:
            counts[key][0] += holds
            counts[key][1] += 1
    return {k: {"holding": v[0], "snapshots": v[1]} for k, v in counts.items()}


MIN_STEADY_SNAPSHOTS = 3


def _steady_compile_fraction(run: RunRecord, rank: str, thread_name: str) -> Any:
    """(fraction of the thread's compile seconds that fall in steady steps, its compile seconds)
    from the shim's compile events, or None: a compiling thread's GIL time is its compile time,
    and the shim knows in which step each compile ran."""
    comp = run.compiles
    if not len(comp) or not thread_name:
        return None
    comp = comp[(comp["rank"] == rank) & (comp["thread"] == thread_name)]
    total = float(comp["duration_s"].sum()) if len(comp) else 0.0
    if total <= 0:
        return None
    steady_ids = {int(s) for s in ev.steady_steps(run, rank)["step"]}
    in_steady = float(comp[comp["step"].isin(steady_ids)]["duration_s"].sum())
    return in_steady / total, total


def _analyze_rank(
    run: RunRecord, rank: str, recording_all: Recording | None, recording_gil: Recording | None
) -> list[Finding]:
    findings: list[Finding] = []
    threads_all = ev.merge_threads(recording_all)
    threads_gil = ev.merge_threads(recording_gil)
    main = ev.main_thread_id(recording_all, recording_gil)
    if main is None or main not in threads_all:
        return findings
    wall_s = ev.training_weight(threads_all[main][1])
    if wall_s <= 0:
        return findings
    main_held_s = ev.training_weight(threads_gil[main][1]) if main in threads_gil else 0.0
    step_s = ev.median_step_s(run, rank)
    for tid, (name, samples) in threads_gil.items():
        if tid == main or ev.own_thread(name):
            continue
        found = _thread_finding(run, rank, tid, name, samples, wall_s, main_held_s, step_s)
        if found is not None:
            findings.append(found)
    return findings


def _thread_finding(
    run: RunRecord,
    rank: str,
    tid: str,
    name: str,
    samples: ThreadSamples,
    wall_s: float,
    main_held_s: float,
    step_s: float | None,
) -> Finding | None:
    """One thread that holds the GIL a share of the main thread's time, or None below MIN_SHARE."""
    held_s = ev.training_weight(samples)
    n_samples = sum(1 for s in samples.stacks if not ev.is_import_sample(s))
    # share of the training loop's time (the shim's steps) that it held the GIL; without
    # steps, of the main thread's time (imports excluded). Not of the thread's own life:
    # py-spy sees a thread only while it runs Python (an autograd thread waiting in C++ has
    # no Python stack, so its "life" would be its compiles alone)
    # of the main thread's sampled seconds (imports excluded): both sides are py-spy sample
    # counts, so the share holds when py-spy is starved of CPU on a busy machine (a share of
    # wall-clock step seconds would shrink with the samples taken); the seconds lost per
    # step are that share of the step's wall time from the shim
    window_s = wall_s
    share = min(1.0, held_s / window_s)
    if share < MIN_SHARE or n_samples < MIN_SAMPLES:
        return None
    hot = ev.hottest_frames(samples)
    leaves = ev.hottest_leaves(samples)
    label = name or f"thread {tid} (entered at {_entry(samples)})"
    top = hot[0][0] if hot else None
    where = ev.frame_label(top) if top else "?"
    compiling = any(m in f.file for s in samples.stacks[:500] for f in s for m in COMPILER_MARKERS)
    lost = share * step_s if step_s else None
    confirm = _dump_confirmation(run, rank, name)
    evidence: dict[str, Any] = {
        "rank": rank,
        "thread": label,
        "thread_id": tid,
        "gil_seconds": round(held_s, 3),
        "window_seconds": round(window_s, 3),
        "gil_share": round(share, 3),
        "compiling": compiling,
        "main_thread_gil_share": round(main_held_s / wall_s, 3),
        "hottest_frames": ev.frames_evidence(hot),
        "hottest_leaf_frames": ev.frames_evidence(leaves),
        "method": "py-spy --gil seconds of the thread / py-spy seconds of the main thread "
        "(--idle recording); imports excluded",
    }
    severity, lost, share_lost, warmup_only = _steady_hold(
        run, rank, name, compiling, held_s, share, lost, step_s, confirm, evidence
    )
    return Finding(
        id="gil.contention",
        title=f"Thread '{label}' holds the GIL {share_lost:.0%} of the steady steps' time on rank {rank}"
        if "steady_window" in evidence
        else f"Thread '{label}' holds the GIL {share:.0%} of the time on rank {rank}",
        severity=severity,
        analyzer="gil",
        summary=(
            f"'{label}' held the GIL for {held_s:.1f} s of the {window_s:.1f} s sampled "
            f"on the main thread ({share:.0%}); the main thread held it {main_held_s / wall_s:.0%}. "
            f"Its hottest code: {where}. The main thread waits for the GIL whenever it "
            "needs Python while this thread has it." + warmup_only
        ),
        seconds_lost_per_step=lost,
        share_of_step=share_lost,
        evidence=evidence,
        prescriptions=_gil_prescriptions(label, where, compiling, lost),
        ranks=(rank,),
    )


def _steady_hold(
    run: RunRecord,
    rank: str,
    name: str,
    compiling: bool,
    held_s: float,
    share: float,
    lost: float | None,
    step_s: float | None,
    confirm: dict[str, Any] | None,
    evidence: dict[str, Any],
) -> tuple[str, float | None, float, str]:
    """(severity, seconds lost per step, share of the step, a warm-up note): the thread's hold
    in the steady steps, by where its compiles ran or what py-spy's snapshots caught."""
    severity, share_lost = ev.severity_for_share(share), share
    warmup_only = ""
    if confirm:
        evidence["dump_snapshots"] = confirm
    apportion = _steady_compile_fraction(run, rank, name) if compiling else None
    steady_s = float(ev.steady_steps(run, rank)["duration_s"].sum())
    if apportion is not None and steady_s > 0:
        fraction, compile_s = apportion
        share_lost = min(1.0, held_s * fraction / steady_s)
        lost = share_lost * step_s if step_s else None
        severity = ev.severity_for_share(share_lost)
        evidence["steady_window"] = {
            "compile_seconds_of_thread": round(compile_s, 3),
            "share_of_them_in_steady_steps": round(fraction, 3),
            "gil_share_of_steady_steps": round(share_lost, 3),
            "method": "the thread's GIL seconds apportioned by where its compiles ran (shim compile events)",
        }
        if fraction == 0:
            warmup_only = (
                " All its compiles ran in warm-up steps (a cold start): the steady steps do not pay for it."
            )
    elif confirm:
        steady = confirm["in_steady_steps"]
        if steady["snapshots"] >= MIN_STEADY_SNAPSHOTS and steady["holding"] == 0:
            # py-spy's timestamped snapshots never caught it in the steady window: the hold
            # was warm-up (a cold-start compile, a first load), not what the steps pay
            severity, lost, share_lost = "info", 0.0, 0.0
            warmup_only = (
                f" py-spy snapshots never caught it holding the GIL in "
                f"{steady['snapshots']} snapshots of steady steps: warm-up only."
            )
    return severity, lost, share_lost, warmup_only


def _precompile(label: str, lost: float | None = None) -> Prescription:
    return Prescription(
        kind="precompile",
        summary=f"{label} holds the GIL while compiling kernels: precompile them before "
        "training or fix the recompile (see the jit finding)",
        expected_gain_s_per_step=lost,
    )


def _gil_prescriptions(
    label: str, where: str, compiling: bool, lost: float | None
) -> tuple[Prescription, ...]:
    prescriptions = [_precompile(label, lost)] if compiling else []
    prescriptions.append(
        Prescription(
            kind="code",
            summary=f"take the pure-Python work of {where} off the training process (a "
            "DataLoader worker or a subprocess), run it less often, or make it release "
            "the GIL (vectorise it with numpy/torch)",
            expected_gain_s_per_step=lost,
        )
    )
    return tuple(prescriptions)


def analyze(run: RunRecord) -> list[Finding]:
    findings = []
    pyspy = run.pyspy
    for (rank, source), recording in sorted(pyspy.items()):
        if source != "all" or (rank, "gil") not in pyspy:
            continue
        findings.extend(_analyze_rank(run, rank, recording, pyspy[(rank, "gil")]))
    return findings


def _entry(samples: Any) -> Any:
    """The outermost frame most samples of an unnamed thread start from (e.g. the autograd
    engine's BackwardCFunction.apply): what the thread is."""
    roots = {}
    for stack, weight in zip(samples.stacks, samples.weights):
        if stack:
            roots[stack[0].name] = roots.get(stack[0].name, 0.0) + weight
    return max(roots, key=roots.__getitem__) if roots else "?"


def analyze_recording(recording: Recording, source: str = "py-spy file") -> list[Finding]:
    """A py-spy recording made with --gil (as the seed report's user had), on its own: no step
    times, no --idle twin. Each thread's share is of the time anyone held the GIL."""
    threads = ev.merge_threads(recording)
    main = ev.main_thread_id(None, recording)
    total = sum(ev.training_weight(s) for _, s in threads.values())
    findings = []
    if not total or main is None:
        return findings
    for tid, (name, samples) in threads.items():
        if tid == main or ev.own_thread(name):
            continue
        held = ev.training_weight(samples)
        share = held / total
        if share < MIN_SHARE or len(samples.stacks) < MIN_SAMPLES:
            continue
        hot, leaves = ev.hottest_frames(samples), ev.hottest_leaves(samples)
        label = name or f"thread {tid} (entered at {_entry(samples)})"
        compiling = any(m in f.file for s in samples.stacks[:500] for f in s for m in COMPILER_MARKERS)
        where = ev.frame_label(hot[0][0]) if hot else "?"
        prescriptions = [_precompile(label)] if compiling else []
        prescriptions.append(
            Prescription(
                kind="code",
                summary=f"take the work of {where} off the training process or make it release the GIL",
            )
        )
        findings.append(
            Finding(
                id="gil.contention",
                title=f"Thread '{label}' holds the GIL {share:.0%} of the GIL-held time",
                severity=ev.severity_for_share(share),
                analyzer="gil",
                summary=(
                    f"In {source} (recorded with --gil), '{label}' holds the GIL for {held:.1f} s "
                    f"of {total:.1f} s{' while compiling' if compiling else ''}; its hottest "
                    f"code: {where}. The main thread waits for it whenever it needs Python."
                ),
                share_of_step=None,
                evidence={
                    "thread": label,
                    "thread_id": tid,
                    "gil_seconds": round(held, 3),
                    "gil_held_seconds_all_threads": round(total, 3),
                    "gil_share": round(share, 3),
                    "compiling": compiling,
                    "hottest_frames": ev.frames_evidence(hot),
                    "hottest_leaf_frames": ev.frames_evidence(leaves),
                    "source": source,
                    "method": "samples of the thread / samples of all threads in a --gil recording",
                },
                prescriptions=tuple(prescriptions),
            )
        )
    return findings
