"""The device's peak math rate per precision (dense, no structured sparsity), matched from the GPU
name NVML records in the manifest ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe").

Figures are NVIDIA's datasheet rates at the boost clock, in TFLOP/s, dense (the datasheets print
the 2:4-sparse rate for tensor cores; dense is half of it); each entry names its datasheet. B200
and B300: the HGX datasheets' 8-GPU totals divided by 8; torchtitan's `get_peak_flops` uses the
same BF16 figure (reference/FACTS.md §6).

The clock matters: the rates are at the maximum boost clock; a GPU held at a lower SM clock
(power cap, thermal) peaks lower. NVML's sm_clock_mhz is recorded beside them (nvml.csv).
No judgement here: the table and the arithmetic only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DevicePeak:
    key: str  # "H200", "H100 PCIe", ...
    tflops: dict[str, float]  # precision -> dense TFLOP/s
    boost_mhz: int | None  # the SM clock the rates are quoted at
    source: str


_TABLE = (
    DevicePeak(
        "A100",
        {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        1410,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4; dense rates)",
    ),
    DevicePeak(
        "H100 PCIe",
        {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
        1755,
        "NVIDIA H100 Tensor Core GPU datasheet (PCIe; sparse tensor rates halved)",
    ),
    DevicePeak(
        "H100",
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
        1980,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5; sparse tensor rates halved)",
    ),
    DevicePeak(
        "H200 NVL",
        {"fp32": 60.0, "tf32": 417.0, "bf16": 835.0, "fp16": 835.0, "fp8": 1671.0},
        None,
        "NVIDIA H200 Tensor Core GPU datasheet (NVL; sparse tensor rates halved)",
    ),
    DevicePeak(
        "H200",
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
        1980,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM; sparse tensor rates halved)",
    ),
    DevicePeak(
        "GB200",
        {"fp32": 80.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0},
        None,
        "NVIDIA GB200 NVL72 datasheet (per GPU; sparse tensor rates halved)",
    ),
    DevicePeak(
        "B300",
        {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
        None,
        "NVIDIA HGX B300 datasheet (8-GPU totals / 8; sparse tensor rates halved)",
    ),
    DevicePeak(
        "B200",
        {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
        None,
        "NVIDIA HGX B200 datasheet (8-GPU totals / 8; sparse tensor rates halved)",
    ),
)
PEAKS = {p.key: p for p in _TABLE}
# the order names are tried in: the longer, more specific names first (GB200 before B200,
# "H100 PCIe" before H100)
_MATCH_ORDER = sorted(PEAKS, key=len, reverse=True)


def match_device(name: str | None) -> DevicePeak | None:
    """The table's row for a GPU name ('NVIDIA H200', 'h100 pcie', 'NVIDIA B200 180GB'); None
    when unknown."""
    if not name:
        return None
    upper = re.sub(r"[\s_-]+", " ", str(name).upper())
    for key in _MATCH_ORDER:
        model, _, variant = key.partition(" ")
        if not re.search(rf"(?<![A-Z0-9]){model}(?![0-9])", upper):
            continue
        if variant and variant.upper() not in upper:
            continue
        return PEAKS[key]
    return None


def peak_flops(name: str | None, precision: str) -> float | None:
    """Dense FLOP/s of a device at one precision; None when the device or precision is unknown."""
    peak = match_device(name)
    if peak is None or precision not in peak.tflops:
        return None
    return peak.tflops[precision] * 1e12


def device_name(manifest: dict[str, object] | None) -> str | None:
    """The first GPU's name in a run's manifest (NVML's name), None for a CPU run."""
    gpus = (manifest or {}).get("gpus")
    if isinstance(gpus, list):
        for g in gpus:
            if isinstance(g, dict) and g.get("name"):
                return str(g["name"])
    return None


# memory bandwidth, TB/s (HBM, the same datasheets: A100 80GB SXM4 2.039, H100 SXM5 3.35, H100
# PCIe 2.0, H200 4.8 (SXM and NVL), B200/B300 8 per GPU, GB200 8 per GPU): the roofline of the
# kernels that move bytes rather than multiply (elementwise, normalisation, reductions, copies)
_BANDWIDTH_TBS = {
    "A100": 2.039,
    "H100 PCIe": 2.0,
    "H100": 3.35,
    "H200 NVL": 4.8,
    "H200": 4.8,
    "GB200": 8.0,
    "B300": 8.0,
    "B200": 8.0,
}


def bandwidth(name: str | None) -> float | None:
    """Bytes/s of the device's memory (datasheet), None when the device is unknown."""
    peak = match_device(name)
    tbs = _BANDWIDTH_TBS.get(peak.key) if peak is not None else None
    return tbs * 1e12 if tbs else None
