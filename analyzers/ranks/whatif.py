"""Judge a what-if analysis across ranks (`traindx.derive.whatif.WhatIf`): how much the stragglers
cost the job, which kind of problem it is (one worker, sequence lengths, a stage, an op type,
else spread: the first that holds, docs/what-if.md gives the thresholds), and what to change. On a
host whose training threads waited for a CPU, the host, not the op or the worker, varies. The op
table's own timer names are the only vocabulary: no job, file or flag of ours is keyed on."""

from __future__ import annotations

from traindx.analyzers.core.findings import Finding, NoChange, Prescription
from traindx.derive.whatif import WhatIf

ANALYZER = "whatif"
DECISIVE_SHARE = 0.5  # a mechanism that removes half the slowdown names the category
SPREAD_MIN = 0.05  # micro-batch compute times differing by 5 % (coefficient of variation)
CORRELATION_MIN = 0.5
OVERSUBSCRIBED = 0.05  # training threads runnable but off-CPU this share of the step: a busy host
BUSY_HOST_WORKER = 0.2  # ... where a worker is named only if it alone costs 20 % of the step
BUSY_HOST_STAGE = 0.1  # ... and a stage only if it computes 10 % more than the others
MODEL_FIT = 0.10  # replayed steps this far (relative) from the recorded ones: say the model may not fit
HEALTHY_BELOW = 1.05  # S under 5 %: no straggler finding above a note
OVER_ITS_TIME = 1.3  # an op type at fault: its share of the slowdown over 1.3 x its share of the work
TAIL_OVER_OTHERS = 2.0  # ... and its tail (mean / median - 1) twice that of every other type
MIN_TIME = 0.05  # that is at least 5 % of the work (a noisy host slows every type alike)
NOISY_TAIL = 0.25  # another type's tail over this: the host is noisy, no one type is at fault


def _severity(slowdown: float) -> str:
    if slowdown >= 1.3:
        return "high"
    if slowdown >= 1.1:
        return "medium"
    if slowdown >= HEALTHY_BELOW:
        return "low"
    return "info"


def _heaviest_stage(r: WhatIf) -> int | None:
    """The stage whose fix removes at least half the slowdown (the most), None if none does."""
    if not r.stage_share or r.layout.pp < 2:
        return None
    stage = max(r.stage_share, key=lambda s: r.stage_share[s])
    return stage if r.stage_share[stage] >= DECISIVE_SHARE else None


def category(r: WhatIf) -> tuple[str, str]:
    """(category, what it names): one_worker / sequence_lengths / stage / optype / spread.

    With one pipeline (DP 1) each stage is one worker: timing cannot tell a slow node from a
    stage that carries more work, and the stage's split, which the user controls, is named."""
    single = _heaviest_stage(r) if r.layout.dp == 1 else None
    if single is not None:
        return "stage", _stage_name(single, r.layout.pp)
    if r.m_w >= DECISIVE_SHARE:
        return "one_worker", _workers(r)
    if (
        r.m_q >= DECISIVE_SHARE
        and (r.mb_spread or 0.0) >= SPREAD_MIN
        and (r.mb_correlation or 0.0) >= CORRELATION_MIN
    ):
        return "sequence_lengths", "micro-batches of unequal length across DP ranks"
    stage = _heaviest_stage(r)
    if stage is not None:
        return "stage", _stage_name(stage, r.layout.pp)
    if r.optype_share:
        optype = max(r.optype_share, key=lambda o: r.optype_share[o])
        share = r.optype_share[optype]
        # an op type at fault costs more than its part of the work: noise costs each type in
        # proportion to its time
        tail = r.optype_tail.get(optype, 0.0)
        others = [
            v for o, v in r.optype_tail.items() if o != optype and r.optype_time.get(o, 0.0) >= MIN_TIME
        ]
        quiet_others = max(others, default=0.0) <= NOISY_TAIL
        heavier = quiet_others and tail >= TAIL_OVER_OTHERS * max(others, default=0.0)
        if share >= DECISIVE_SHARE and share >= OVER_ITS_TIME * r.optype_time.get(optype, 0.0) and heavier:
            return "optype", optype
    return "spread", "no single worker, stage or op type"


def _workers(r: WhatIf) -> str:
    """The worst worker, and how many more the top 3 % holds (equal scores: the same DP rank)."""
    stage, dp = r.top_workers[0]
    more = len(r.top_workers) - 1
    return f"stage {stage} DP rank {dp}" + (f" (+{more} more in the top 3 %)" if more else "")


def _stage_name(stage: int, pp: int) -> str:
    if pp > 1 and stage == pp - 1:
        return f"the last stage ({stage})"
    if pp > 1 and stage == 0:
        return "the first stage (0)"
    return f"stage {stage}"


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def _stage_excess(r: WhatIf, stage: int) -> float:
    """How much more the stage computes per step than the others' mean (0.5: 50 % more)."""
    loads = r.stage_compute
    others = [v for s, v in loads.items() if s != stage]
    return loads.get(stage, 0.0) / (sum(others) / len(others)) - 1 if others and sum(others) > 0 else 0.0


def _stage_prescription(r: WhatIf, stage: int, gain: float) -> Prescription:
    excess = _stage_excess(r, stage)
    keep = 1 / (1 + excess) if excess > 0 else 1.0
    if stage == r.layout.pp - 1:
        flag, extra = "--decoder-last-pipeline-num-layers", "--account-for-loss-in-pipeline-split"
    elif stage == 0:
        flag, extra = "--decoder-first-pipeline-num-layers", "--account-for-embedding-in-pipeline-split"
    else:
        flag, extra = "--pipeline-model-parallel-layout", ""
    summary = (
        f"Move layers off {_stage_name(stage, r.layout.pp)}: it computes {_pct(max(excess, 0.0))} more per "
        f"step than the other stages; give it about {_pct(keep)} of their layer count (Megatron: {flag}"
        + (f", or {extra}" if extra else "")
        + ")"
        + (
            "; with one pipeline a slow node on that stage reads the same: if the stages hold equal "
            "layers, check that node"
            if r.layout.dp == 1
            else ""
        )
    )
    return Prescription("arg", summary, NoChange(), expected_gain_s_per_step=gain, command=f"{flag} N")


def _prescriptions(kind: str, r: WhatIf) -> tuple[Prescription, ...]:
    gap = r.t_replayed - r.t_ideal
    if kind == "one_worker":
        workers = _workers(r)
        return (
            Prescription(
                "backend",
                f"Drain or repair the node of {workers} (check its GPU clocks, thermals, NIC and "
                "ECC errors), or restart the job without it; if that rank is given more data than "
                "the others (uneven shards or sequence lengths), balance the data instead",
                NoChange(),
                expected_gain_s_per_step=r.m_w * gap,
            ),
        )
    if kind == "sequence_lengths":
        return (
            Prescription(
                "code",
                "Balance sequence lengths across DP ranks: pack or bucket samples by token count "
                "so every rank's micro-batches carry about the same number of tokens (attention "
                "grows faster than linearly with length)",
                NoChange(),
                expected_gain_s_per_step=r.m_q * gap,
            ),
        )
    if kind == "stage":
        stage = max(r.stage_share, key=lambda s: r.stage_share[s])
        return (_stage_prescription(r, stage, r.stage_share[stage] * gap),)
    if kind == "optype":
        optype = max(r.optype_share, key=lambda o: r.optype_share[o])
        return (
            Prescription(
                "backend",
                f"Find why {optype} varies between ranks and steps (its slow instances cost the "
                "job); for a collective, the network path of the ranks that see it late",
                NoChange(),
                expected_gain_s_per_step=r.optype_share[optype] * gap,
            ),
        )
    return ()


def _model_fit(r: WhatIf) -> Finding:
    recorded = r.t_replayed * (1 + r.replay_error)
    title = (
        f"The replay is {_pct(abs(r.replay_error))} off the recorded steps ({recorded:.3f} s recorded, "
        f"{r.t_replayed:.3f} s replayed): time outside the recorded ops, or a schedule the model does not know"
    )
    return Finding(
        "whatif.model_fit",
        title,
        "info",
        ANALYZER,
        summary=title + "; S and the shares are relative to the replayed step (docs/what-if.md)",
        evidence={"replay_error": r.replay_error},
    )


def judge(r: WhatIf, source: str) -> list[Finding]:
    """The findings of a what-if analysis of `source` (a trace file or run folder)."""
    kind, what = category(r)
    severity = _severity(r.slowdown)
    oversubscribed = (r.runq_share or 0.0) >= OVERSUBSCRIBED
    top_cost = r.worker_score.get(r.top_workers[0], 1.0) - 1 if r.top_workers else 0.0
    host_noise = (
        kind in ("spread", "optype")
        or (kind == "one_worker" and top_cost < BUSY_HOST_WORKER)
        or (kind == "stage" and _stage_excess(r, _heaviest_stage(r) or 0) < BUSY_HOST_STAGE)
    )
    if oversubscribed and host_noise and severity != "info":
        kind, what = "spread", f"the host: ranks waited {_pct(r.runq_share or 0.0)} of each step for a CPU"
    if kind == "spread" and severity != "info":  # variation with no target: nothing to fix
        severity = "low"
    gap = r.t_replayed - r.t_ideal
    top_types = sorted(r.optype_share.items(), key=lambda kv: -kv[1])[:3]
    types = ", ".join(f"{o} {_pct(v)}" for o, v in top_types if v > 0.01)
    evidence = {"category": kind, "names": what, "source": source, **r.to_dict()}
    if severity == "info":
        title = f"No straggler cost: the steps are within {_pct(r.slowdown - 1)} of their ideal"
        healthy = [Finding("whatif.healthy", title, "info", ANALYZER, summary=title, evidence=evidence)]
        return healthy + ([_model_fit(r)] if abs(r.replay_error) > MODEL_FIT else [])
    label = {
        "one_worker": f"one worker ({what})",
        "sequence_lengths": "sequence lengths that differ between DP ranks",
        "stage": f"stage imbalance: {what}",
        "optype": f"op type {what}",
        "spread": f"stragglers spread over workers, stages and op types ({what})",
    }[kind]
    title = f"Stragglers cost {_pct(r.slowdown - 1)} of step time (S = {r.slowdown:.2f}): {label}"
    summary = (
        f"Replayed step {r.t_replayed:.3f} s vs ideal {r.t_ideal:.3f} s. Share of the slowdown removed by "
        f"fixing the worst workers M_W = {_pct(r.m_w)}, the last stage M_S = {_pct(r.m_s)}, compute "
        f"variation inside stages M_Q = {_pct(r.m_q)}. By op type: {types or 'none above 1 %'}."
    )
    findings = [
        Finding(
            f"whatif.{kind}",
            title,
            severity,
            ANALYZER,
            summary=summary,
            seconds_lost_per_step=gap,
            share_of_step=gap / r.t_replayed if r.t_replayed > 0 else None,
            evidence=evidence,
            prescriptions=_prescriptions(kind, r),
            ranks=tuple(f"stage{s}/dp{d}" for s, d in r.top_workers) if kind == "one_worker" else (),
        )
    ]
    if abs(r.replay_error) > MODEL_FIT:
        findings.append(_model_fit(r))
    if kind != "stage" and r.stage_share:  # a second mechanism worth naming: an unequal split
        stage = max(r.stage_share, key=lambda s: r.stage_share[s])
        share = r.stage_share[stage]
        worker_stages = {s for s, _ in r.top_workers} if kind == "one_worker" else set()
        noise = oversubscribed and _stage_excess(r, stage) < BUSY_HOST_STAGE
        if share >= DECISIVE_SHARE and r.layout.pp > 1 and stage not in worker_stages and not noise:
            findings.append(
                Finding(
                    "whatif.stage",
                    f"Also {_stage_name(stage, r.layout.pp)} is long: fixing it alone removes {_pct(share)}",
                    "low" if severity != "high" else "medium",
                    ANALYZER,
                    summary=f"Stage shares: {', '.join(f'{s}: {_pct(v)}' for s, v in r.stage_share.items())}",
                    seconds_lost_per_step=share * gap,
                    evidence={"stage_share": {str(k): v for k, v in r.stage_share.items()}},
                    prescriptions=(_stage_prescription(r, stage, share * gap),),
                )
            )
    return findings
