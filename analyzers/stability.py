"""Step-time stability over the steady window: periodic slow steps (a checkpoint or a log every k
steps), named with their period and what the job did in them; and the coefficient of variation
of what remains."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers import evidence as ev
from traindx.analyzers.codefix import code_change, keyword_sources, set_keywords
from traindx.analyzers.declaration import Declaration
from traindx.analyzers.findings import Finding, Prescription
from traindx.analyzers.frameworks import data_sites, knob_owner, runs_megatron, user_site
from traindx.common.units import ordinal
from traindx.derive import ledger, periods
from traindx.profiler.logparse import parse_line

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="stability",
    order=110,
    ids=("steps.checkpoint_in_step", "steps.periodic_slow", "steps.instability"),
    live_categories=("io",),
    explains=("gpu_idle.host_starved", "host_work.code"),
    call_site_lines={"io": ("steps.periodic_slow",)},
)

MIN_STEPS = 8
SLOW_FACTOR = 2.0  # a step this much slower than the median is a slow step (1.5-1.9x
# recurs by chance on a busy machine, and then looks periodic)
MIN_EXCESS_S = 0.005  # ...and at least this much slower in absolute terms
MIN_OCCURRENCES = 3
# a periodic cost far above the machine's noise (a 0.25 s save in 10 ms steps) is looked for
# again among the steps this many times the median, when the 2x set holds too much noise for a
# period (a loaded machine makes one 10 ms step in five 2-3x slow)
RAISED_FACTORS = (4.0, 8.0, 16.0)
MIN_UNEXPLAINED = 5  # a period with no cause in the record needs this many slow steps
MIN_PRECISION = 0.75  # of the slow steps, the share that fall on the period
MIN_RECALL = 0.75  # of the steps on the period, the share that are slow
CV_INFO = 0.20
CV_LOW = 0.50


def find_period(steps: Sequence[int], durations: Sequence[float]) -> tuple[int, int, list[int]] | None:
    """(period, residue, slow step numbers) of the best periodic pattern, or None.

    A pattern (period p, residue r) covers the steps with step % p == r; it is kept when at least
    MIN_PRECISION of the slow steps fall on it and MIN_RECALL of its steps are slow; the best has
    the highest F1, then the shortest period. O(N log N) in steps: because more than half of the
    slow steps must share the residue, only the median residue of each period can qualify, and a
    period longer than span / (needed hits - 1) cannot hold enough slow steps; so one vectorised
    pass over (slow step, period) finds the few candidates, and each candidate's steps are counted
    by striding a per-step count array (N/p work for period p). Slow means SLOW_FACTOR x the
    median first, then each of RAISED_FACTORS: a period among the largest steps stands even where
    the machine's noise makes other steps 2x slow.
    """
    median = float(pd.Series(durations).median())
    for factor in (SLOW_FACTOR, *RAISED_FACTORS):
        slow = {s for s, d in zip(steps, durations) if d > factor * median and d - median > MIN_EXCESS_S}
        if len(slow) < MIN_OCCURRENCES:
            return None
        found = _period_of(steps, slow)
        if found is not None:
            return found
    return None


def _period_of(steps, slow):
    """find_period's search for one set of slow steps."""
    steps_arr = np.asarray(steps, dtype=np.int64)
    if len(np.unique(steps_arr)) != len(steps_arr):
        return _find_period_with_repeats(steps, slow)
    slow_arr = np.array(sorted(slow), dtype=np.int64)
    k = len(slow_arr)
    need = max(MIN_OCCURRENCES, math.ceil(MIN_PRECISION * k))
    span = int(slow_arr[-1] - slow_arr[0])
    # `need` distinct steps of one residue span at least (need - 1) * p
    last = min(len(steps) // MIN_OCCURRENCES, span // (need - 1))
    if last < 2:
        return None
    periods = np.arange(2, last + 1, dtype=np.int64)
    residues = slow_arr[:, None] % periods[None, :]
    # a residue shared by more than half of the slow steps is the column's median
    candidate = np.sort(residues, axis=0)[k // 2]
    hits = (residues == candidate[None, :]).sum(axis=0)
    lo = int(steps_arr.min())
    per_step = np.bincount(steps_arr - lo)
    best = None
    for i in np.flatnonzero(hits >= need):
        period, residue, n_hits = int(periods[i]), int(candidate[i]), int(hits[i])
        on = int(per_step[(residue - lo) % period :: period].sum())
        precision, recall = n_hits / k, n_hits / on
        if precision < MIN_PRECISION or recall < MIN_RECALL:
            continue
        score = (2 * precision * recall / (precision + recall), -period)
        if best is None or score > best[0]:
            best = (score, period, residue)
    if best is None:
        return None
    _, period, residue = best
    return period, residue, [s for s in steps if s % period == residue and s in slow]


def _find_period_with_repeats(steps, slow):
    """find_period for step lists that repeat a step number (a restarted step counter): each
    listed step counts, as in the definition; O(N) per period with per-residue counts."""
    steps_arr = np.asarray(steps, dtype=np.int64)
    is_slow = np.isin(steps_arr, np.array(sorted(slow), dtype=np.int64))
    best = None
    for period in range(2, len(steps) // MIN_OCCURRENCES + 1):
        res = steps_arr % period
        on = np.bincount(res, minlength=period)
        hits = np.bincount(res[is_slow], minlength=period)
        for residue in np.flatnonzero(hits >= MIN_OCCURRENCES):
            precision, recall = hits[residue] / len(slow), hits[residue] / on[residue]
            if precision < MIN_PRECISION or recall < MIN_RECALL:
                continue
            score = (2 * precision * recall / (precision + recall), -period)
            if best is None or score > best[0]:
                best = (score, period, int(residue))
    if best is None:
        return None
    _, period, residue = best
    return period, residue, [s for s in steps if s % period == residue and s in slow]


def _normalise(text):
    return re.sub(r"\d+", "N", text.strip())[:160]


_LOG_INDEX = [None, None]  # (the log DataFrame, its index): every rank asks about the same log


def _log_index(log):
    """(sorted t, normalised text) of the log lines other than per-step log lines."""
    if _LOG_INDEX[0] is not log:
        keep = [bool(text.strip()) and not parse_line(text) for text in log["text"]]
        kept = log[keep].sort_values("t", kind="stable")
        codes, names = pd.factorize(pd.Series([_normalise(t) for t in kept["text"]], dtype=object))
        _LOG_INDEX[:] = [log, (kept["t"].to_numpy(), (np.asarray(codes, np.int64), list(names)))]
    return _LOG_INDEX[1]


def _log_in_steps(run, step_rows):
    """Lines the job printed inside the given steps, other than its per-step log line.

    The log is sorted and filtered once; each step then takes its lines by binary search on t
    (O((lines + steps) log lines) instead of one scan of the whole log per step)."""
    log = run.log
    if not len(log):
        return Counter()
    times, keys = _log_index(log)
    found = Counter()
    rows = step_rows.dropna(subset=["start_ns", "end_ns"])  # a step without a begin holds no line
    # int64, not float: ns since the epoch lose ~256 ns in a float64
    starts = np.searchsorted(times, rows["start_ns"].to_numpy(dtype="int64"), side="left")
    ends = np.searchsorted(times, rows["end_ns"].to_numpy(dtype="int64"), side="right")
    n = np.maximum(ends - starts, 0)
    total = int(n.sum())
    if not total:
        return found
    codes, names = keys
    # every (step, line) pair at once; a line counts once per step however often it was printed
    step_of = np.repeat(np.arange(len(n)), n)
    line = np.arange(total) - np.repeat(np.cumsum(n) - n, n) + np.repeat(starts, n)
    pairs = np.unique(step_of * len(names) + codes[line])
    counts = np.bincount(pairs % len(names), minlength=len(names))
    for code in np.flatnonzero(counts):
        found[names[code]] = int(counts[code])
    return found


def _io_in_steps(run, rank, step_rows):
    """The checkpoint/file writes the shim timed inside the given steps, by call and caller:
    [{"call", "caller", "steps", "seconds_per_step"}], most time first."""
    spans = run.spans
    if not len(spans) or not len(step_rows):
        return []
    io = run.rank_rows("spans", rank)
    io = io[io["cat"] == "io"]
    if not len(io):
        return []
    starts = step_rows["start_ns"].to_numpy(np.int64)
    ends = step_rows["end_ns"].to_numpy(np.int64)
    order = np.argsort(starts)
    starts, ends = starts[order], ends[order]
    idx = np.searchsorted(starts, io["start_ns"].to_numpy(np.int64), side="right") - 1
    inside = (idx >= 0) & (io["start_ns"].to_numpy(np.int64) < ends[np.maximum(idx, 0)])
    groups = {}
    for row, step_i in zip(io[inside].itertuples(), idx[inside]):
        caller = row.caller if isinstance(row.caller, dict) else None
        key = (
            row.call if isinstance(row.call, str) else "file write",
            (caller or {}).get("file"),
            (caller or {}).get("line"),
        )
        g = groups.setdefault(
            key, {"call": key[0], "caller": caller, "steps": set(), "ns": 0, "cpu": 0.0, "timed_cpu": True}
        )
        g["steps"].add(int(step_i))
        g["ns"] += int(row.end_ns) - int(row.start_ns)
        cpu, runq = getattr(row, "cpu", None), getattr(row, "runq", None)
        if isinstance(cpu, (int, float)) and np.isfinite(cpu):
            # on the thread: running, or runnable and waiting for a core (not for the disk)
            g["cpu"] += float(cpu) + (
                float(runq) if isinstance(runq, (int, float)) and np.isfinite(runq) else 0.0
            )
        else:
            g["timed_cpu"] = False
    out = []
    for g in groups.values():
        item = {
            "call": g["call"],
            "caller": g["caller"],
            "steps": len(g["steps"]),
            "seconds_per_step": round(g["ns"] / 1e9 / len(g["steps"]), 4),
        }
        if g["timed_cpu"]:  # the thread's own CPU and run-queue wait (the rest: the disk)
            item["cpu_seconds_per_step"] = round(g["cpu"] / len(g["steps"]), 4)
        out.append(item)
    return sorted(out, key=lambda g: -g["seconds_per_step"] * g["steps"])


def _call_text(io):
    caller = io.get("caller") or {}
    where = f" at {caller.get('file')}:{caller.get('line')}" if caller.get("file") else ""
    return f"{io['call']}{where}"


# a checkpoint write: torch.save, torch.distributed.checkpoint, safetensors, HF save_pretrained
_SAVE_FRAME = re.compile(
    r"torch[/\\]serialization\.py$|torch[/\\]distributed[/\\]checkpoint[/\\]"
    r"|safetensors[/\\]|[/\\]modeling_utils\.py$"
)
_SAVE_FUNCTIONS = ("save", "_save", "save_file", "save_pretrained", "async_save", "save_state_dict")


def save_sites(run: RunRecord, rank: str) -> list[dict[str, Any]]:
    """[{file, line, function, seconds}] of the job's own lines that write checkpoints, from
    py-spy's main-thread samples inside a checkpoint writer (the job's frame that called it)."""
    recording = run.pyspy.get((rank, "all"))
    if not recording:
        return []
    main = ev.main_thread_id(recording, run.pyspy.get((rank, "gil")))
    threads = ev.merge_threads(recording)
    if main not in threads:
        return []
    samples = threads[main][1]
    sites = {}
    for stack, weight in zip(samples.stacks, samples.weights):
        inside = next(
            (
                i
                for i, f in enumerate(stack)
                if _SAVE_FRAME.search(f.file or "") and f.name.split(".")[-1] in _SAVE_FUNCTIONS
            ),
            None,
        )
        if inside is None:
            continue
        own = ev.user_frames(stack[:inside])
        if own:
            key = (own[-1].file, own[-1].line, own[-1].name)
            sites[key] = sites.get(key, 0.0) + weight
    return [
        {"file": f, "line": line, "function": fn, "seconds": round(sec, 3), "frame": f"{fn} ({f}:{line})"}
        for (f, line, fn), sec in sorted(sites.items(), key=lambda kv: -kv[1])[:3]
    ]


def _causes(run, rank, slow_rows, normal_rows):
    """What the slow steps have that the others do not: checkpoint/file writes (the shim's
    timed torch.save/DCP calls, with the job's line), log lines, gen-2 collections."""
    causes = {}
    io = [g for g in _io_in_steps(run, rank, slow_rows) if g["steps"] >= max(2, 0.6 * len(slow_rows))]
    if io:
        causes["io_in_slow_steps"] = io[:3]
    in_slow = _log_in_steps(run, slow_rows)
    in_normal = _log_in_steps(run, normal_rows)
    lines = [
        (text, n)
        for text, n in in_slow.most_common()
        if n >= max(2, 0.6 * len(slow_rows)) and in_normal.get(text, 0) <= 0.2 * len(normal_rows)
    ]
    if lines:
        causes["log_lines_in_slow_steps"] = [{"text": t, "steps": n} for t, n in lines[:3]]
    gc = run.gc
    if len(gc) and "generation" in gc:
        full = run.rank_rows("gc", rank)
        full = full[full["generation"] == 2]
        with_gc = {int(s) for s in full["step"]}
        n = sum(1 for s in slow_rows["step"] if int(s) in with_gc)
        if n >= 0.6 * len(slow_rows):
            causes["gen2_gc_in_slow_steps"] = n
    saves = save_sites(run, rank)
    if saves:
        causes["save_sites"] = saves
    return causes


def _run_queue_excess(run, rank, slow_rows, normal_rows):
    """Seconds the training thread waited for a core in a slow step beyond a normal one (the
    shim's per-step run-queue delay, median of each), or None where it was not recorded."""
    events = run.of_type("cpu")
    cpu = run.rank_rows("cpu_events", rank, events) if len(events) else None
    if (
        cpu is None
        or not len(cpu)
        or "thread_runq_s" not in cpu
        or not len(slow_rows)
        or not len(normal_rows)
    ):
        return None
    waits = cpu.dropna(subset=["thread_runq_s"]).groupby("step")["thread_runq_s"].sum()
    slow = waits.reindex([int(s) for s in slow_rows["step"]]).dropna()
    normal = waits.reindex([int(s) for s in normal_rows["step"]]).dropna()
    if not len(slow) or not len(normal):
        return None
    return round(max(0.0, float(slow.median() - normal.median())), 4)


def _periodic_prescriptions(run, causes, lost, period):
    text = " ".join(c["text"] for c in causes.get("log_lines_in_slow_steps", [])).lower()
    out = []
    io = causes.get("io_in_slow_steps")
    saves = causes.get("save_sites") or []
    if io and (io[0].get("caller") or {}).get("file"):
        # the shim timed the write: its caller is the job's own line
        caller = io[0]["caller"]
        saves = [
            {
                "file": caller.get("file"),
                "line": caller.get("line"),
                "call": io[0]["call"],
                "function": caller.get("function") or io[0]["call"],
                "seconds": io[0]["seconds_per_step"],
                "frame": f"{io[0]['call']} ({caller.get('file')}:{caller.get('line')})",
            }
        ] + saves
    if saves:
        out.extend(checkpoint_prescriptions(run, saves, lost, period))
    elif "checkpoint" in text or "saving" in text or "save" in text:
        if runs_megatron(run.command):
            out.append(
                Prescription(
                    kind="arg",
                    summary="Megatron: --async-save (with --ckpt-format torch_dist) writes "
                    "checkpoints in the background",
                    change={"arg": {"framework": "megatron", "set": {"--async-save": True}}},
                    expected_gain_s_per_step=lost,
                )
            )
        out.append(
            Prescription(
                kind="code",
                summary=f"the job writes a checkpoint every {period} steps on the critical path: save "
                "asynchronously (torch.distributed.checkpoint.async_save, or a background "
                "thread that writes a CPU copy), or less often",
                expected_gain_s_per_step=lost,
            )
        )
    if causes.get("gen2_gc_in_slow_steps"):
        out.append(
            Prescription(
                kind="code",
                summary="the slow steps hold full garbage collections: see gc.gen2_in_step "
                "(gc.freeze() after setup)",
                expected_gain_s_per_step=lost,
            )
        )
    out.append(
        Prescription(
            kind="code",
            summary=f"move the work done every {period} steps (evaluation, logging, checkpointing) off "
            "the training loop's critical path or do it less often",
            expected_gain_s_per_step=lost,
        )
    )
    return out


def _io_from_ledger(run, rank, steady, causes, lost, share):
    """With a timed write behind the slow steps, what removing it saves is the ledger's
    checkpoint/io seconds per steady step (exact, and unchanged by a busy machine); otherwise
    the slow steps' excess over the others stands."""
    if not causes.get("io_in_slow_steps"):
        return lost, share
    led = ledger.rows(run, rank, steady["step"])
    wall = float(led["wall_s"].sum()) if len(led) else 0.0
    if not wall:
        return lost, share
    io_lost = float(led["io_s"].mean())
    causes["io_seconds_per_step"] = round(io_lost, 4)
    if io_lost < 0.5 * lost:
        # the timed call is a small part of what the slow steps add (the job's own writes
        # around it, a copy to remote storage): the excess stands, the call is named
        causes["io_explains_share_of_excess"] = round(io_lost / lost, 3) if lost else None
        return lost, share
    return io_lost, float(led["io_s"].sum()) / wall


def checkpoint_prescriptions(
    run: RunRecord, saves: Sequence[dict[str, Any]], lost: float, period: int | None
) -> list[Prescription]:
    """A checkpoint every `period` steps, written at the job's own line: save asynchronously,
    in the framework's terms."""
    top = saves[0]
    where = f"{top['file']}:{top['line']}"
    framework = knob_owner(run)
    out = []
    if framework == "torchtitan":
        out.append(
            Prescription(
                kind="arg",
                summary='torchtitan: checkpoint.async_mode = "async" (or '
                '"async_with_pinned_mem") writes the checkpoint in the background; '
                "or a larger checkpoint.interval",
                change={"arg": {"framework": "torchtitan", "set": {"--checkpoint.async_mode": "async"}}},
                expected_gain_s_per_step=lost,
            )
        )
    elif framework == "megatron":
        out.append(
            Prescription(
                kind="arg",
                summary="Megatron: --async-save (with --ckpt-format torch_dist) writes "
                "checkpoints in the background",
                change={"arg": {"framework": "megatron", "set": {"--async-save": True}}},
                expected_gain_s_per_step=lost,
            )
        )
    elif framework == "hf_trainer":
        edit = _trainer_save_edit(run, period)
        if edit:
            out.append(
                Prescription(
                    kind="code",
                    summary=(
                        f"save {LESS_OFTEN}x less often: TrainingArguments("
                        f"save_steps={edit['save_steps']}) at {edit['file']}:"
                        f"{edit['line']} (the Trainer saves synchronously)"
                    ),
                    change={"code": {k: v for k, v in edit.items() if k != "save_steps"}},
                    expected_gain_s_per_step=lost * (1 - 1 / LESS_OFTEN),
                    automatic=True,
                )
            )
        out.append(
            Prescription(
                kind="code",
                summary='TrainingArguments(save_steps=...) larger, or save_strategy="no" '
                "with one save at the end: the Trainer saves synchronously",
                expected_gain_s_per_step=lost,
            )
        )
    how = (
        "save asynchronously (torch.distributed.checkpoint.async_save, or a background thread "
        "that writes a CPU copy), or less often"
    )
    when = f"every {period} steps" if period else "inside the steps"
    if top.get("call"):  # timed by the shim: the call, its line, what it cost each time
        summary = (
            f"{top['call']} at {where} runs {when} on the critical path "
            f"({top['seconds']:.2f} s each time): {how}"
        )
    else:
        summary = f"{top['function']} ({where}) writes a checkpoint {when} on the critical path: {how}"
    out.append(Prescription(kind="code", summary=summary, expected_gain_s_per_step=lost))
    return out


LESS_OFTEN = 10  # a periodic cost made this many times rarer (fixplan's flag arms too)


def _trainer_save_edit(run: RunRecord, period: int | None) -> dict[str, Any] | None:
    """The job's own `TrainingArguments(...)` call (the shim's data_site event: never a file
    under site-packages) with `save_steps` ten times the measured period (or its literal value),
    as a code change; None without such a call or a period to scale."""
    sites = [s for s in data_sites(run) if s.get("kind") == "TrainingArguments" and user_site(s)]
    if not sites:
        return None
    where = user_site(sites[-1]) or {}
    before = where.get("call_source") or (where.get("source") or "").strip()
    if not before:
        return None
    current = keyword_sources(before).get("save_steps")
    base = period
    if base is None and current is not None and current.strip().isdigit():
        base = int(current)
    if not base:
        return None
    after = set_keywords(before, {"save_steps": str(base * LESS_OFTEN)})
    first = where.get("call_first_line") or where.get("line")
    if not where.get("file") or not first or after is None:
        return None
    change = code_change(
        where["file"],
        int(first),
        before,
        after,
        last_line=where.get("call_last_line") if where.get("call_source") else None,
    )
    return dict(change, op="replace", save_steps=base * LESS_OFTEN) if change else None


def _period_of_timed_io(run, rank, steps):
    """The period of the shim-timed writes (torch.save, DCP) in the steps, when the step times
    are too noisy for one to show (a busy machine): the ledger's io seconds per step are
    measured, so their pattern does not depend on the load."""
    if not ledger.has_spans(run):
        return None
    led = ledger.rows(run, rank, steps)
    if not len(led) or not (led["io_s"] > 0).any():
        return None
    io = led.set_index("step")["io_s"].reindex(steps).fillna(0.0)
    return find_period(steps, [float(x) for x in io])


def _period_of_timed_io_past_warmup(run, rank, steady_steps):
    """The timed writes' period over every step after step 0, its hits in the steady window:
    the warm-up rule takes leading steps slower than 1.5x the later ones (up to half the run),
    and on a machine whose load fell mid-run that can be the half that held most of the saves
    (a save every 4th step of 16: steps 0-7 taken, 2 saves left, 3 needed). The shim times the
    writes themselves, so their pattern does not need steady steps to show."""
    every = sorted(int(s) for s in run.rank_steps(rank)["step"] if int(s) >= 1)
    if len(every) <= len(steady_steps):
        return None
    found = _period_of_timed_io(run, rank, every)
    if found is None:
        return None
    period, residue, hits = found
    steady = set(steady_steps)
    hits = [s for s in hits if s in steady]
    return (period, residue, hits) if hits else None


def _checkpoint_in_steps(run, rank):
    """Checkpoints written inside the steps when the step times are too noisy (a busy machine)
    for a period to show: py-spy's samples inside the writer, against the steps' time."""
    saves = save_sites(run, rank)
    total = ev.steps_seconds(run, rank)
    spent = sum(s["seconds"] for s in saves)
    share = spent / total if total else 0.0
    if not saves or share < 0.03:
        return None
    steps = len(run.rank_steps(rank))
    lost = spent / steps if steps else None
    return Finding(
        id="steps.checkpoint_in_step",
        title=f"Checkpoints are written inside the training steps on rank {rank} ({share:.0%} of step time)",
        severity=ev.severity_for_share(share),
        analyzer="stability",
        summary=(
            f"{spent:.2f} s of the main thread's time went to writing checkpoints at "
            f"{saves[0]['frame']}, inside the steps, {share:.0%} of their time."
        ),
        seconds_lost_per_step=lost,
        share_of_step=share,
        evidence={
            "rank": rank,
            "save_sites": saves,
            "seconds_saving": round(spent, 3),
            "method": "main-thread py-spy seconds inside a checkpoint writer (torch.save, "
            "torch.distributed.checkpoint, safetensors) / the rank's step time",
        },
        prescriptions=tuple(checkpoint_prescriptions(run, saves, lost, None)),
        ranks=(rank,),
    )


def _analyze_rank(run, rank):
    findings = []
    steady = ev.steady_steps(run, rank).sort_values("step")
    if len(steady) < MIN_STEPS:
        return findings
    steps = [int(s) for s in steady["step"]]
    durations = [float(d) for d in steady["duration_s"]]
    mean = float(pd.Series(durations).mean())
    periodic = (
        find_period(steps, durations)
        or _period_of_timed_io(run, rank, steps)
        or _period_of_timed_io_past_warmup(run, rank, steps)
    )
    rest = steady
    if periodic:
        period, residue, hits = periodic
        slow_rows = steady[steady["step"].isin(hits)]
        normal_rows = steady[~steady["step"].isin(hits)]
        normal_median = float(normal_rows["duration_s"].median())
        excess = float((slow_rows["duration_s"] - normal_median).sum())
        lost = excess / len(steady)
        share = lost / mean if mean else 0.0
        causes = _causes(run, rank, slow_rows, normal_rows)
        lost, share = _io_from_ledger(run, rank, steady, causes, lost, share)
        cause_text = ""
        if causes.get("io_in_slow_steps"):
            io = causes["io_in_slow_steps"][0]
            cause_text = (
                f" In them the job calls {_call_text(io)} "
                f"({io['seconds_per_step']:.2f} s each time, timed by the shim)."
            )
        elif causes.get("save_sites"):
            cause_text = f" They write a checkpoint at {causes['save_sites'][0]['frame']}."
        elif causes.get("log_lines_in_slow_steps"):
            cause_text = f" In them the job printed: '{causes['log_lines_in_slow_steps'][0]['text']}'."
        elif causes.get("gen2_gc_in_slow_steps"):
            cause_text = " They hold full (gen-2) garbage collections."
        severity = ev.severity_for_share(share)
        if not causes and len(hits) < MIN_UNEXPLAINED:
            # a few slow steps that happen to line up, with nothing in the record done in them:
            # on a busy machine that is chance as often as a cause
            severity = "info"
            cause_text = (
                f" Nothing the job did in them was recorded, and {len(hits)} "
                "occurrences can line up by chance on a busy machine."
            )
        findings.append(
            Finding(
                id="steps.periodic_slow",
                title=f"Every {ordinal(period)} step is slow on rank {rank} "
                f"(+{float(slow_rows['duration_s'].median()) - normal_median:.2f} s)",
                severity=severity,
                analyzer="stability",
                summary=(
                    f"Steps {', '.join(map(str, hits[:8]))}{'…' if len(hits) > 8 else ''} (period "
                    f"{period}) take {float(slow_rows['duration_s'].median()):.3f} s against "
                    f"{normal_median:.3f} s for the others.{cause_text}"
                ),
                steps_affected=tuple(hits),
                seconds_lost_per_step=lost,
                share_of_step=share,
                evidence={
                    "rank": rank,
                    "period": period,
                    "residue": residue,
                    "slow_steps": hits,
                    "median_slow_s": round(float(slow_rows["duration_s"].median()), 4),
                    "median_other_s": round(normal_median, 4),
                    **causes,
                },
                prescriptions=tuple(_periodic_prescriptions(run, causes, lost, period)),
                ranks=(rank,),
            )
        )
        rest = normal_rows
    else:
        found = _checkpoint_in_steps(run, rank)
        if found:
            findings.append(found)
    d = rest["duration_s"]
    cv = float(d.std(ddof=0) / d.mean()) if len(d) and d.mean() else 0.0
    if cv >= CV_INFO:
        lost = float(d.mean() - d.median())
        slowest = rest.sort_values("duration_s", ascending=False).head(5)
        slow_rows = rest[rest["duration_s"] > SLOW_FACTOR * float(d.median())]
        causes = _causes(run, rank, slow_rows, rest.drop(slow_rows.index)) if len(slow_rows) else {}
        # where the job saves checkpoints is a fact of the run, not of these slow steps (a
        # periodic save's steps are not among them): it explains nothing here
        causes.pop("save_sites", None)
        waited = _run_queue_excess(run, rank, slow_rows, rest.drop(slow_rows.index))
        if waited is not None:
            causes["run_queue_wait_in_slow_steps_s"] = waited
        cause_text = (
            "The slowest steps hold full (gen-2) garbage collections (see gc.gen2_in_step). "
            if causes.get("gen2_gc_in_slow_steps")
            else ""
        )
        if waited is not None and waited >= 0.5 * (
            float(slow_rows["duration_s"].median()) - float(d.median())
        ):
            # the slow steps waited for a core: the machine's other processes, not the job
            cause_text += (
                f"In the slowest steps the training thread waited {waited * 1000:.0f} ms "
                "more for a CPU core than in the others: other processes' load. "
            )
        job_causes = {k: v for k, v in causes.items() if k != "run_queue_wait_in_slow_steps_s"}
        findings.append(
            Finding(
                id="steps.instability",
                title=f"Step time varies (CV {cv:.2f}) on rank {rank}",
                # without a cause in the record, the machine (other processes) may be the reason:
                # say it, but do not rank it as the job's problem
                severity="low" if cv >= CV_LOW and job_causes else "info",
                analyzer="stability",
                summary=(
                    f"Over {len(rest)} steady steps: median {d.median():.3f} s, p90 "
                    f"{d.quantile(0.9):.3f} s, max {d.max():.3f} s. {cause_text}Variation "
                    "without a period; on a shared machine other processes cause it too."
                ),
                seconds_lost_per_step=max(0.0, lost),
                share_of_step=max(0.0, lost) / float(d.mean()),
                evidence={
                    "rank": rank,
                    "cv": round(cv, 3),
                    "median_s": round(float(d.median()), 4),
                    "p90_s": round(float(d.quantile(0.9)), 4),
                    "max_s": round(float(d.max()), 4),
                    "slowest_steps": [
                        {"step": int(r.step), "duration_s": round(float(r.duration_s), 4)}
                        for r in slowest.itertuples()
                    ],
                    **causes,
                },
                ranks=(rank,),
            )
        )
    return findings


def analyze(run: RunRecord) -> list[Finding]:
    findings = []
    for rank in sorted(set(run.steps["rank"])) if len(run.steps) else []:
        findings.extend(_analyze_rank(run, rank))
    return findings


# -- line by line: a ledger line that is dearer every k-th step (k = 2 included) ----------------
LINE_PERIOD_MAX = periods.LINE_PERIOD_MAX
LINE_MIN_EXCESS_SHARE = periods.LINE_MIN_EXCESS_SHARE


def line_periods(led, step_s):
    """[{line, label, period, residue, steps, excess_s, slow_s, other_s}] of the ledger lines
    (one rank's steady rows) whose value depends on the step number modulo a period: each line
    is compared across steps on its own, so +50 % on odd steps - which never makes a step 2x the
    median, the slow-step search's bar - is found on the line that carries it. The shortest
    period that explains a line wins (a period-2 pattern also fits 4, 6, 8)."""
    from traindx.derive import ledger

    if len(led) < 6 or step_s <= 0:
        return []
    led = led.sort_values("step")
    steps = led["step"].astype(int).to_numpy()
    cols = [c for c in led.columns if c.endswith("_s") and c not in ("wall_s",)]
    out = []
    for col in cols:
        values = led[col].to_numpy(float)
        if values.mean() < LINE_MIN_EXCESS_SHARE * step_s / LINE_PERIOD_MAX:
            continue
        found = periods.period_of(steps, values, step_s)
        if found:
            name = col[:-2]
            found.update(line=name, label=ledger.LABELS.get(name, name))
            out.append(found)
    return out
