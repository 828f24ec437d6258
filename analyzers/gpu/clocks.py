"""GPU clock throttling and power capping during the steps, from NVML samples (nvml.csv).

Clock-event reason bits (NVML, FACTS §4): GpuIdle 0x1, ApplicationsClocksSetting 0x2,
SwPowerCap 0x4, HwSlowdown 0x8, SyncBoost 0x10, SwThermal 0x20, HwThermal 0x40,
HwPowerBrake 0x80. Thermal and hardware slowdowns are faults of the machine (cooling, power
delivery) and cost time; the software power cap is what a GPU under full load normally does
(an H200 under a bf16 matmul runs at 690 W with reason 0x4), so alone it is only reported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="gpu_clocks",
    order=80,
    ids=("gpu.throttle", "gpu.power_cap"),
    cross_rank=True,
    capture=True,
)

GPU_IDLE, SW_POWER_CAP, HW_SLOWDOWN = 0x1, 0x4, 0x8
SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x20, 0x40, 0x80
SLOWDOWN_BITS = {
    HW_SLOWDOWN: "HwSlowdown",
    SW_THERMAL: "SwThermalSlowdown",
    HW_THERMAL: "HwThermalSlowdown",
    HW_POWER_BRAKE: "HwPowerBrakeSlowdown",
}
SLOWDOWN_MASK = HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE
BUSY_UTIL = 50
MIN_SAMPLES = 5
MIN_THROTTLED_SHARE = 0.05


def steady_span(run: RunRecord) -> tuple[int, int] | None:
    """(start ns, end ns) of the steady window over all ranks, or None."""
    steady = ev.steady_steps(run, keep_profiled=True)
    if not len(steady):
        return None
    return int(steady["start_ns"].min()), int(steady["end_ns"].max())


def _reference_clock(
    run: RunRecord, index: Any, busy: Any, clean: Any, throttled: Any, clocks: Any
) -> tuple[float, str]:
    """(the SM clock a throttled GPU is compared with, how it was chosen). The busy samples that
    ran neither throttled nor capped; else the unthrottled busy ones' high clocks; a GPU throttled
    in every busy sample has none of its own, so its maximum SM clock from the run's GPU inventory
    (a slowdown then reads as no loss only when NVML could not say the maximum)."""
    if len(clean) >= MIN_SAMPLES:
        return float(pd.to_numeric(clean["sm_clock_mhz"], errors="coerce").median()), "otherwise"
    if len(throttled) < len(busy):
        unthrottled = busy.drop(index=throttled.index)
        return float(pd.to_numeric(unthrottled["sm_clock_mhz"], errors="coerce").quantile(0.9)), "otherwise"
    for gpu in run.manifest.get("gpus") or []:
        if gpu.get("index") == index and gpu.get("max_sm_clock_mhz"):
            return float(gpu["max_sm_clock_mhz"]), "(its maximum SM clock: it never ran unthrottled)"
    return float(clocks.quantile(0.9)), "at best (it never ran unthrottled)"


def analyze(run: RunRecord) -> list[Finding]:
    gpu = run.gpu
    if not len(gpu) or "clock_event_reasons" not in gpu:
        return []
    span = steady_span(run)
    if span is None:
        return []
    step_s = ev.median_step_s(run)
    findings = []
    window = gpu[(gpu["t"] >= span[0]) & (gpu["t"] <= span[1])]
    for index, samples in window.groupby("gpu"):
        samples = samples.dropna(subset=["clock_event_reasons"])
        reasons = samples["clock_event_reasons"].astype("int64")
        util = pd.to_numeric(samples["util"], errors="coerce")
        busy = samples[(util >= BUSY_UTIL) & ((reasons & GPU_IDLE) == 0)]
        if len(busy) < MIN_SAMPLES:
            continue
        busy_reasons = busy["clock_event_reasons"].astype("int64")
        throttled = busy[(busy_reasons & SLOWDOWN_MASK) != 0]
        capped = busy[(busy_reasons & SW_POWER_CAP) != 0]
        clean = busy[(busy_reasons & (SLOWDOWN_MASK | SW_POWER_CAP)) == 0]
        clocks = pd.to_numeric(busy["sm_clock_mhz"], errors="coerce")
        reference, against = _reference_clock(run, int(index), busy, clean, throttled, clocks)
        base = {
            "gpu": int(index),
            "busy_samples": len(busy),
            "reference_sm_clock_mhz": round(reference),
            "median_power_w": round(float(pd.to_numeric(busy["power_w"], errors="coerce").median()), 1),
        }
        share_throttled = len(throttled) / len(busy)
        if share_throttled >= MIN_THROTTLED_SHARE:
            findings.append(
                _throttle_finding(int(index), throttled, share_throttled, reference, against, base, step_s)
            )
        share_capped = len(capped) / len(busy)
        if share_capped >= 0.5:
            findings.append(_power_cap_finding(int(index), capped, share_capped, base))
    return findings


def _throttle_finding(
    index: int,
    throttled: pd.DataFrame,
    share_throttled: float,
    reference: float,
    against: str,
    base: dict[str, Any],
    step_s: float | None,
) -> Finding:
    """A GPU slowed down (thermal, hardware, power brake) in a share of its busy samples."""
    f_thr = float(pd.to_numeric(throttled["sm_clock_mhz"], errors="coerce").median())
    slow = max(0.0, 1 - f_thr / reference) if reference else 0.0
    share = share_throttled * slow
    bits = {
        name: int(((throttled["clock_event_reasons"].astype("int64") & bit) != 0).sum())
        for bit, name in SLOWDOWN_BITS.items()
    }
    bits = {k: v for k, v in bits.items() if v}
    severity = ev.severity_for_share(share)
    if severity == "info":
        severity = "low"  # a thermal or hardware slowdown is a fault even when small
    thermal = any("Thermal" in k for k in bits)
    return Finding(
        id="gpu.throttle",
        title=f"GPU {index} throttled ({', '.join(bits)}) in {share_throttled:.0%} of busy samples",
        severity=severity,
        analyzer="gpu_clocks",
        summary=(
            f"While busy, GPU {index} ran at {f_thr:.0f} MHz when throttled "
            f"against {reference:.0f} MHz {against}; about {share:.0%} of the step "
            "time is lost if the work is compute-bound."
        ),
        seconds_lost_per_step=share * step_s if step_s else None,
        share_of_step=share,
        evidence={
            **base,
            "throttled_samples": len(throttled),
            "throttled_share": round(share_throttled, 3),
            "median_throttled_sm_clock_mhz": round(f_thr),
            "reasons": bits,
        },
        prescriptions=(
            Prescription(
                kind="system",
                summary=(
                    "check the cooling of this GPU (nvidia-smi -q -d TEMPERATURE,PERFORMANCE); "
                    "move the job off a node whose GPU runs hot"
                    if thermal
                    else "check the node's power delivery (HW slowdown / power brake: "
                    "nvidia-smi -q -d PERFORMANCE); move the job to another node"
                ),
                command=f"nvidia-smi -i {index} -q -d PERFORMANCE,TEMPERATURE,POWER",
            ),
        ),
    )


def _power_cap_finding(
    index: int, capped: pd.DataFrame, share_capped: float, base: dict[str, Any]
) -> Finding:
    """A GPU at its power cap in most of its busy samples (info: a loaded GPU normally is)."""
    f_cap = float(pd.to_numeric(capped["sm_clock_mhz"], errors="coerce").median())
    return Finding(
        id="gpu.power_cap",
        title=f"GPU {index} runs at its power cap in {share_capped:.0%} of busy samples",
        severity="info",
        analyzer="gpu_clocks",
        summary=(
            f"SM clock {f_cap:.0f} MHz at {base['median_power_w']} W: the GPU is "
            "power-limited, as a fully loaded GPU normally is. If the power limit was "
            "lowered on purpose (nvidia-smi -pl), raising it buys clock."
        ),
        evidence={
            **base,
            "capped_samples": len(capped),
            "capped_share": round(share_capped, 3),
            "median_capped_sm_clock_mhz": round(f_cap),
        },
    )
