"""jit from py-spy alone (attach mode, or a py-spy file): compiles found in the stacks through the
compiler's own code, counted per call (speedscope has no timestamps)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.jit import pyspy_signatures as sig
from traindx.analyzers.jit.common import FA4_BWD_FIXED, FA4_FIXED, FA4_PACKAGE
from traindx.analyzers.jit.fa4 import backend_switches

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord
    from traindx.profiler.speedscope import Recording


def analyze_recording(
    recording: Recording,
    source: str = "py-spy",
    run: RunRecord | None = None,
    rank: str = "0",
    recording_gil: Recording | None = None,
) -> list[Finding]:
    """Findings from one py-spy recording alone ({thread label: ThreadSamples}); with a --gil
    recording of the same process, also the compiling thread's hold on the GIL."""
    return [
        _site_finding(site, source, run, rank, recording_gil)
        for site in sig.summarize(recording)
        if site.count >= 2
    ]


def _site_finding(
    site: sig.SiteSummary,
    source: str,
    run: RunRecord | None,
    rank: str,
    recording_gil: Recording | None,
) -> Finding:
    """A call site py-spy saw compile again after its first call."""
    is_fa4 = "flash_attn" in site.site_label or (site.kernel_file or "").startswith("flash_attn")
    recompile_s = sum(c.seconds for c in site.recompiles)
    per = recompile_s / len(site.recompiles)
    share = recompile_s / site.recording_seconds if site.recording_seconds else None
    thread_text = (
        "the main thread"
        if site.is_main_thread
        else f"{site.thread} (not the main thread: the autograd thread, on a GPU job)"
    )
    # a compile whose stack starts inside the compiler has no caller to name it by
    function = site.function or site.kernel_file or f"a {site.kind} kernel"
    share_text = f"{share:.0%}" if share is not None else "an unknown share"
    calls = list(range(1, site.count))
    evidence = _site_evidence(site, source, recompile_s, share, calls)
    if recording_gil and not site.is_main_thread:
        held = sig.gil_share_compiling(recording_gil, site.thread)
        if held and held[1] > 0:
            evidence["gil_share_compiling"] = round(held[0] / held[1], 3)
    severity = "critical" if share and share >= 0.2 else "high" if share and share >= 0.05 else "medium"
    prescriptions: list[Prescription]
    if is_fa4:
        title, summary = _fa4_site_text(site, function, thread_text, per, share_text)
        prescriptions = _fa4_site_prescriptions(per)
        if run is not None:
            prescriptions += backend_switches(run)
        finding_id = "jit.fa4_steady_recompile"
    else:
        title = (
            f"{site.kind} compiles {function} again on every call after the first "
            f"({len(site.recompiles)} recompiles, ~{per:.1f} s each)"
        )
        summary = (
            f"py-spy shows {site.site_label} compiling {site.count} times on "
            f"{thread_text}; {share_text} of the recorded samples."
        )
        prescriptions = []
        finding_id = f"jit.{site.kind}_steady_recompile" if site.kind != "dynamo" else "jit.dynamo_recompile"
    return Finding(
        id=finding_id,
        title=title,
        severity=severity,
        analyzer="jit",
        summary=summary,
        steps_affected=tuple(calls),
        seconds_lost_per_step=per,
        share_of_step=None,
        evidence=evidence,
        prescriptions=tuple(prescriptions),
        ranks=(rank,),
    )


def _site_evidence(
    site: sig.SiteSummary, source: str, recompile_s: float, share: float | None, calls: list[int]
) -> dict[str, Any]:
    return {
        "source": source,
        "thread": site.thread,
        "is_main_thread": site.is_main_thread,
        "kind": site.kind,
        "call_site": site.site_label,
        "kernel_source": site.kernel_file,
        "compiles": site.count,
        "recompiles": len(site.recompiles),
        "seconds_each": [round(c.seconds, 3) for c in site.compiles],
        "recompile_seconds": round(recompile_s, 3),
        "share_of_recorded_samples": round(share, 3) if share is not None else None,
        "thread_seconds": round(site.thread_seconds, 3),
        "calls_that_recompiled": calls,
        "method": "py-spy stacks through the compiler's own code; one compile per run of "
        "consecutive samples, split where the call site changes or the compiler's "
        "pipeline starts again; speedscope has no timestamps, so compiles are "
        "counted per call, not placed in steps",
    }


def _fa4_site_text(
    site: sig.SiteSummary, function: str, thread_text: str, per: float, share_text: str
) -> tuple[str, str]:
    """(title, summary) of an FA4 function py-spy saw compile on every call."""
    fn = "backward" if "bwd" in function else "forward" if "fwd" in function else function
    title = (
        f"FA4 {fn} ({function}) compiles again on every call after the first, "
        f"on {site.thread if not site.is_main_thread else 'the main thread'}: "
        f"{len(site.recompiles)} recompiles, ~{per:.1f} s each"
    )
    summary = (
        f"py-spy shows {function} compiling {site.count} times on "
        f"{thread_text}: the first call (cold start) and then every later call "
        f"({len(site.recompiles)} of {len(site.recompiles)}), ~{per:.1f} s each, "
        f"{share_text} of the recorded samples. The kernel is built from "
        f"{site.kernel_file or '?'}. A compile on every call means its compile key "
        "changes every call; with flash-attn-4 < 4.0.0b22 (backward) / < 4.0.0b26 "
        "(forward) the known cause is max_seqlen passed as a tensor."
    )
    return title, summary


def _fa4_site_prescriptions(per: float) -> list[Prescription]:
    return [
        Prescription(
            kind="code",
            summary="pass max_seqlen to flash_attn as a Python int (find the "
            "call with `diagnose -- <cmd>`: the shim names its file:line)",
            change={
                "code": {
                    "file": None,
                    "line": None,
                    "before": "max_seqlen=cu_seqlens.diff().max()",
                    "after": "max_seqlen=int(cu_seqlens.diff().max())",
                }
            },
            expected_gain_s_per_step=per,
        ),
        Prescription(
            kind="upgrade",
            summary=f"upgrade flash-attn-4 to >= {FA4_FIXED} ({FA4_BWD_FIXED} fixes the backward only)",
            change={"upgrade": {"package": FA4_PACKAGE, "min_version": FA4_FIXED}},
            command=f"pip install -U '{FA4_PACKAGE}>={FA4_FIXED}'",
            expected_gain_s_per_step=per,
        ),
    ]


def analyze_pyspy_only(run: RunRecord) -> Any:
    findings = []
    pyspy = run.pyspy
    for (rank, source), recording in sorted(pyspy.items()):
        if source != "all" and (rank, "all") in pyspy:
            continue
        gil = pyspy.get((rank, "gil")) if source != "gil" else None
        findings.extend(
            analyze_recording(recording, source=f"py-spy ({source})", run=run, rank=rank, recording_gil=gil)
        )
    return findings
