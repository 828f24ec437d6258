"""Step-time stability over the steady window: periodic slow steps (a checkpoint or a log every k
steps), named with their period and what the job did in them; and the coefficient of variation
of what remains."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding
from traindx.analyzers.core.step_causes import (
    SLOW_FACTOR as SLOW_FACTOR,  # owned by the core: step causes read it
)
from traindx.analyzers.model.stability_causes import (
    call_text,
    io_from_ledger,
    run_queue_excess,
    save_sites,
    slow_step_causes,
)
from traindx.analyzers.model.stability_prescriptions import LESS_OFTEN as LESS_OFTEN  # re-exported: fixplan
from traindx.analyzers.model.stability_prescriptions import (
    checkpoint_prescriptions as checkpoint_prescriptions,
)
from traindx.analyzers.model.stability_prescriptions import periodic_prescriptions
from traindx.common.units import ordinal
from traindx.derive import ledger, periods

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
    MIN_PRECISION of the slow steps fall on it and MIN_RECALL of its steps are slow; the best has the
    highest F1, then the shortest period. O(N log N): more than half of the slow steps must share the
    residue, so only each period's median residue can qualify. Slow means SLOW_FACTOR x the median,
    then each of RAISED_FACTORS: a period among the largest steps stands where the machine's noise
    makes other steps 2x slow."""
    median = float(pd.Series(durations).median())
    for factor in (SLOW_FACTOR, *RAISED_FACTORS):
        slow = {s for s, d in zip(steps, durations) if d > factor * median and d - median > MIN_EXCESS_S}
        if len(slow) < MIN_OCCURRENCES:
            return None
        found = _period_of(steps, slow)
        if found is not None:
            return found
    return None


def _period_of(steps: Sequence[int], slow: Any) -> tuple[int, int, list[int]] | None:
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
    _, best_period, best_residue = best
    return best_period, best_residue, [s for s in steps if s % best_period == best_residue and s in slow]


def _find_period_with_repeats(steps: Sequence[int], slow: Any) -> tuple[int, int, list[int]] | None:
    """find_period for step lists that repeat a step number (a restarted step counter): each
    listed step counts, as in the definition; O(N) per period with per-residue counts."""
    steps_arr = np.asarray(steps, dtype=np.int64)
    is_slow = np.isin(steps_arr, np.array(sorted(slow), dtype=np.int64))
    best: tuple[tuple[float, int], int, int] | None = None
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
    _, best_period, best_residue = best
    return best_period, best_residue, [s for s in steps if s % best_period == best_residue and s in slow]


def _period_of_timed_io(run: RunRecord, rank: str, steps: list[int]) -> tuple[int, int, list[int]] | None:
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


def _period_of_timed_io_past_warmup(
    run: RunRecord, rank: str, steady_steps: list[int]
) -> tuple[int, int, list[int]] | None:
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


def _checkpoint_in_steps(run: RunRecord, rank: str) -> Finding | None:
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


def _analyze_rank(run: RunRecord, rank: str) -> list[Finding]:
    findings: list[Finding] = []
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
        normal_rows = steady[~steady["step"].isin(hits)]
        findings.append(_periodic_finding(run, rank, steady, period, residue, hits, mean))
        rest = normal_rows
    else:
        found = _checkpoint_in_steps(run, rank)
        if found:
            findings.append(found)
    found = _instability_finding(run, rank, rest)
    if found:
        findings.append(found)
    return findings


def _periodic_cause_text(causes: dict[str, Any]) -> str:
    """What the slow steps of a period hold, the strongest evidence first."""
    if causes.get("io_in_slow_steps"):
        io = causes["io_in_slow_steps"][0]
        return (
            f" In them the job calls {call_text(io)} "
            f"({io['seconds_per_step']:.2f} s each time, timed by the shim)."
        )
    if causes.get("save_sites"):
        return f" They write a checkpoint at {causes['save_sites'][0]['frame']}."
    if causes.get("log_lines_in_slow_steps"):
        return f" In them the job printed: '{causes['log_lines_in_slow_steps'][0]['text']}'."
    if causes.get("gen2_gc_in_slow_steps"):
        return " They hold full (gen-2) garbage collections."
    return ""


def _periodic_finding(
    run: RunRecord,
    rank: str,
    steady: pd.DataFrame,
    period: int,
    residue: int,
    hits: list[int],
    mean: float,
) -> Finding:
    """Every `period`-th steady step is slow: by how much, what those steps hold, the fixes."""
    slow_rows = steady[steady["step"].isin(hits)]
    normal_rows = steady[~steady["step"].isin(hits)]
    normal_median = float(normal_rows["duration_s"].median())
    excess = float((slow_rows["duration_s"] - normal_median).sum())
    lost = excess / len(steady)
    share = lost / mean if mean else 0.0
    causes = slow_step_causes(run, rank, slow_rows, normal_rows)
    lost, share = io_from_ledger(run, rank, steady, causes, lost, share)
    cause_text = _periodic_cause_text(causes)
    severity = ev.severity_for_share(share)
    if not causes and len(hits) < MIN_UNEXPLAINED:
        # a few slow steps that happen to line up, with nothing in the record done in them:
        # on a busy machine that is chance as often as a cause
        severity = "info"
        cause_text = (
            f" Nothing the job did in them was recorded, and {len(hits)} "
            "occurrences can line up by chance on a busy machine."
        )
    return Finding(
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
        prescriptions=tuple(periodic_prescriptions(run, causes, lost, period)),
        ranks=(rank,),
    )


def _instability_finding(run: RunRecord, rank: str, rest: pd.DataFrame) -> Finding | None:
    """Step times that vary without a period (the periodic steps left out), or None below CV_INFO."""
    d = rest["duration_s"]
    cv = float(d.std(ddof=0) / d.mean()) if len(d) and d.mean() else 0.0
    if cv < CV_INFO:
        return None
    lost = float(d.mean() - d.median())
    slowest = rest.sort_values("duration_s", ascending=False).head(5)
    slow_rows = rest[rest["duration_s"] > SLOW_FACTOR * float(d.median())]
    causes = slow_step_causes(run, rank, slow_rows, rest.drop(slow_rows.index)) if len(slow_rows) else {}
    # where the job saves checkpoints is a fact of the run, not of these slow steps (a
    # periodic save's steps are not among them): it explains nothing here
    causes.pop("save_sites", None)
    waited = run_queue_excess(run, rank, slow_rows, rest.drop(slow_rows.index))
    if waited is not None:
        causes["run_queue_wait_in_slow_steps_s"] = waited
    cause_text = (
        "The slowest steps hold full (gen-2) garbage collections (see gc.gen2_in_step). "
        if causes.get("gen2_gc_in_slow_steps")
        else ""
    )
    if waited is not None and waited >= 0.5 * (float(slow_rows["duration_s"].median()) - float(d.median())):
        # the slow steps waited for a core: the machine's other processes, not the job
        cause_text += (
            f"In the slowest steps the training thread waited {waited * 1000:.0f} ms "
            "more for a CPU core than in the others: other processes' load. "
        )
    job_causes = {k: v for k, v in causes.items() if k != "run_queue_wait_in_slow_steps_s"}
    return Finding(
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


def analyze(run: RunRecord) -> list[Finding]:
    findings = []
    for rank in sorted(set(run.steps["rank"])) if len(run.steps) else []:
        findings.extend(_analyze_rank(run, rank))
    return findings


# -- line by line: a ledger line that is dearer every k-th step (k = 2 included) ----------------
LINE_PERIOD_MAX = periods.LINE_PERIOD_MAX
LINE_MIN_EXCESS_SHARE = periods.LINE_MIN_EXCESS_SHARE


def line_periods(led: pd.DataFrame, step_s: float) -> Any:
    """[{line, label, period, residue, steps, excess_s, slow_s, other_s}] of the ledger lines
    (one rank's steady rows) whose value depends on the step number modulo a period: each line
    is compared across steps on its own, so +50 % on odd steps - which never makes a step 2x the
    median, the slow-step search's bar - is found on the line that carries it. The shortest
    period that explains a line wins (a period-2 pattern also fits 4, 6, 8)."""
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
