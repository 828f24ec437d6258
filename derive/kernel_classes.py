"""Every GPU second named: the torch.profiler window's GPU time split by kernel class.

A class is (family, label, precision). Families: matmul, conv, attention, communication, copy,
memset, elementwise, reduction, other. Read from the kernel's name (the names cuBLAS, cuBLASLt,
CUTLASS, cuDNN, FlashAttention, NCCL, ATen and Inductor give their kernels) and, for copies,
Kineto's "Memcpy DtoH (Device -> Pageable)" labels:

- matmul/conv precision: fp8 (`e4m3`, `e5m2`, `fp8`), bf16 (`bf16`, `bfloat16`, cuBLASLt's
  `nvjet_…tst…` type code), fp16 (`f16f16`, `fp16`, `h16816`/`h1688`, `hmma`, `nvjet_hsh`), tf32
  (`tf32`, CUTLASS's `tensorop_s1688gemm`/`s16816gemm` with no other type), fp32 on the CUDA
  cores (`sgemm`, `simt`, `ffma`, `f32f32_f32f32`, cuBLAS's float gemv): see
  docs/gpu-judgement.md for the names seen on the H200 and where the others are documented;
- attention backend: FlashAttention 4 (CuTe DSL kernels: `flash` and `cute`), 3 (`Sm90`
  FlashAttn kernels), 2 (`flash_fwd_kernel`, `flash_bwd_…`, PyTorch's vendored `pytorch_flash`),
  cuDNN (`cudnn` with `sdpa`/`fmha`/`flash`), memory-efficient (`fmha_cutlass`,
  `efficient_attention`); SDPA's math path is bmm + softmax: every kernel launched inside the
  host op `aten::_scaled_dot_product_attention_math` (matched by Kineto's `correlation`) is
  labelled the math path's, its GEMMs included, and so is every kernel its backward nodes launch
  (the nodes that carry the sequence numbers of the ops inside it; without correlation, only
  its softmax kernels);
- autotune: kernels that ran inside a compile/autotune interval (Triton's, Inductor's benchmark
  launches) or inside cuDNN's algorithm search (a conv op that synchronised the host: cuDNN
  benchmark mode times its candidates with events and waits for them).

Derive layer: the table and its arithmetic, no judgement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SDPA_MATH_OP = "aten::_scaled_dot_product_attention_math"
SDPA_MATH_LABEL = "SDPA math path (bmm + softmax, unfused)"
CONV_OPS = ("aten::cudnn_convolution", "aten::convolution_backward", "aten::cudnn_convolution_transpose")
SYNC_CALLS = re.compile(
    r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cuStreamSynchronize|"
    r"cuCtxSynchronize|cuEventSynchronize)$"
)

_COMM = re.compile(
    r"^nccl|allreduce|all_reduce|allgather|all_gather|reducescatter|reduce_scatter|alltoall|"
    r"all_to_all|sendrecv|cross_device_reduce"
)
_CONV = re.compile(r"conv|fprop|dgrad|wgrad|winograd|implicit_gemm|nchwtonhwc|nhwctonchw")
_MATMUL = re.compile(
    r"gemm|gemv|nvjet|wgmma|cublas|splitkreduce|matmul|_mma_|ampere_(s|h|bf16|fp16)|"
    r"volta_(s|h)|turing_|maxwell_"
)
_FP8 = re.compile(r"e4m3|e5m2|fp8|f8f8")
_BF16 = re.compile(r"bf16|bfloat16|nvjet_(sm\d+_)?t[s]t")
_FP16 = re.compile(r"f16f16|fp16|h16816|h1688|h884|hmma|nvjet_(sm\d+_)?h[s]h|__half|c10::half|hgemm")
_TF32 = re.compile(r"tf32|tensorop_s1688|tensorop_s16816|_s1688gemm|_s16816gemm")
_FP32 = re.compile(
    r"sgemm|simt|ffma|f32f32_f32f32|gemv2t_kernel_val<int, int, float|gemvx::kernel<int, int, float|"
    r"gemmsn|convolve_sgemm"
)


@dataclass(frozen=True)
class KernelClass:
    family: str
    label: str
    precision: str | None  # of a matmul/conv: fp32 | tf32 | bf16 | fp16 | fp8 | None (unread)


def _precision(lower: str) -> str | None:
    for name, rule in (("fp8", _FP8), ("bf16", _BF16), ("fp16", _FP16), ("tf32", _TF32), ("fp32", _FP32)):
        if rule.search(lower):
            return name
    return None


def _copy_class(name: str) -> KernelClass:
    """'Memcpy DtoH (Device -> Pageable)' -> copy DtoH pageable."""
    m = re.search(r"Memcpy (\w+) \((\w+) -> (\w+)\)", name)
    if not m:
        return KernelClass("copy", "copy", None)
    direction, src, dst = m.groups()
    host = src if direction.startswith("H") else dst
    kind = host.lower() if direction in ("HtoD", "DtoH") else None
    return KernelClass("copy", f"copy {direction}" + (f" ({kind} host memory)" if kind else ""), None)


def _attention(lower: str, math_path: bool) -> KernelClass | None:
    if "flash" in lower and "cute" in lower:
        return KernelClass("attention", "FlashAttention 4 (CuTe DSL)", None)
    if "flash" in lower and ("sm90" in lower or "sm100" in lower or "hopper" in lower):
        return KernelClass("attention", "FlashAttention 3", None)
    if "cudnn" in lower and any(w in lower for w in ("sdpa", "fmha", "flash", "attn")):
        return KernelClass("attention", "cuDNN attention", None)
    if "flash_fwd" in lower or "flash_bwd" in lower or "flash::" in lower:
        return KernelClass("attention", "FlashAttention 2", None)
    if "fmha_cutlass" in lower or "efficient_attention" in lower or "attentionkernel" in lower:
        return KernelClass("attention", "memory-efficient attention (CUTLASS fmha)", None)
    if math_path and "softmax" in lower:
        return KernelClass("attention", "SDPA math path (softmax; its bmm GEMMs are matmuls)", None)
    return None


def classify(cat: Any, name: Any, math_path: bool = False) -> KernelClass:
    """The class of one GPU event (its trace category and name)."""
    text = str(name or "")
    if cat == "gpu_memcpy":
        return _copy_class(text)
    if cat == "gpu_memset":
        return KernelClass("memset", "memset", None)
    lower = text.lower()
    if _COMM.search(lower):
        return KernelClass("communication", "NCCL / collective", None)
    attention = _attention(lower, math_path)
    if attention is not None:
        return attention
    if _CONV.search(lower) and "elementwise" not in lower:
        precision = _precision(lower)
        return KernelClass("conv", f"convolution {precision or '(type not in name)'}", precision)
    if _MATMUL.search(lower):
        precision = _precision(lower)
        if precision == "fp32":
            label = "matmul fp32 (CUDA cores: SIMT/FFMA)"
        else:
            label = f"matmul {precision or '(type not in name)'}"
        return KernelClass("matmul", label, precision)
    if "multi_tensor_apply" in lower or "foreach" in lower:
        return KernelClass("elementwise", "multi-tensor apply (foreach optimizer / clip)", None)
    if "triton_red" in lower or "triton_per" in lower or re.search(r"reduce|norm|softmax|scan|argm", lower):
        return KernelClass("reduction", "reduction / norm / softmax", None)
    if "elementwise" in lower or "triton_poi" in lower or "fill" in lower or "copy_kernel" in lower:
        return KernelClass("elementwise", "elementwise", None)
    return KernelClass("other", "other kernels", None)


def _intervals_mask(starts: np.ndarray[Any, Any], spans: list[tuple[int, int]]) -> np.ndarray[Any, Any]:
    """Which start times fall inside any of the spans."""
    mask = np.zeros(len(starts), dtype=bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return mask


def cudnn_search_spans(trace: pd.DataFrame) -> list[tuple[Any, int, int]]:
    """[(tid, start_ns, end_ns)] of the conv ops (host side) in which the host waited on the
    device: cuDNN benchmark mode's algorithm search (it times candidates with events and
    synchronises)."""
    cpu = trace[trace["cat"].to_numpy() == "cpu_op"]
    convs = cpu[cpu["name"].isin(CONV_OPS).to_numpy()]
    if not len(convs):
        return []
    syncs = trace[
        (trace["cat"].to_numpy() == "cuda_runtime")
        & trace["name"].astype(str).str.match(SYNC_CALLS).to_numpy()
    ]
    if not len(syncs):
        return []
    t = syncs["start_ns"].to_numpy(np.int64)
    spans = []
    for tid, lo, hi in zip(
        convs["tid"], convs["start_ns"].to_numpy(np.int64), convs["end_ns"].to_numpy(np.int64)
    ):
        if ((t >= lo) & (t < hi)).any():
            spans.append((tid, int(lo), int(hi)))
    return spans


def launched_inside(
    gpu: pd.DataFrame, trace: pd.DataFrame, spans: list[tuple[Any, int, int]]
) -> np.ndarray[Any, Any]:
    """Which GPU events were launched (their cudaLaunchKernel/cudaMemcpy*, matched by Kineto's
    `correlation`) inside one of the host spans [(tid, start_ns, end_ns)]."""
    out = np.zeros(len(gpu), dtype=bool)
    if not spans or "correlation" not in gpu or "correlation" not in trace:
        return out
    host = trace[
        trace["cat"].isin(("cuda_runtime", "cuda_driver")).to_numpy()
        & trace["correlation"].notna().to_numpy()
    ]
    launch = {int(c): (t, tid) for c, t, tid in zip(host["correlation"], host["start_ns"], host["tid"])}
    by_tid: dict[Any, list[tuple[int, int]]] = {}
    for tid, lo, hi in spans:
        by_tid.setdefault(tid, []).append((int(lo), int(hi)))
    for i, c in enumerate(gpu["correlation"].to_numpy(float)):
        hit = launch.get(int(c)) if c == c else None
        if hit is not None:
            t, tid = hit
            out[i] = any(lo <= t < hi for lo, hi in by_tid.get(tid, ()))
    return out


def backward_spans(trace: pd.DataFrame, spans: list[tuple[Any, int, int]]) -> list[tuple[Any, int, int]]:
    """[(tid, start_ns, end_ns)] of the backward nodes of the forward ops run inside the host
    spans: autograd gives a node the sequence number of the forward op that made it (Kineto's
    "Sequence number"), and the backward's kernels are launched inside the node's op on the
    autograd thread, outside the forward op's span. [] without sequence numbers."""
    if not spans or "seq" not in trace:
        return []
    cpu = trace[(trace["cat"].to_numpy() == "cpu_op") & trace["seq"].notna().to_numpy()]
    if not len(cpu):
        return []
    starts = cpu["start_ns"].to_numpy(np.int64)
    tids = cpu["tid"].to_numpy(object)
    inside = np.zeros(len(cpu), dtype=bool)
    for tid, lo, hi in spans:
        inside |= (tids == tid) & (starts >= lo) & (starts < hi)
    made = set(cpu["seq"].to_numpy(float)[inside])
    # the backward side: the same numbers on ops that are not aten's forward ops
    nodes = cpu[
        ~inside
        & cpu["seq"].isin(made).to_numpy()
        & ~cpu["name"].astype(str).str.startswith("aten::").to_numpy()
    ]
    return [(tid, int(lo), int(hi)) for tid, lo, hi in zip(nodes["tid"], nodes["start_ns"], nodes["end_ns"])]


def op_spans(trace: pd.DataFrame, names: tuple[str, ...]) -> list[tuple[Any, int, int]]:
    """[(tid, start_ns, end_ns)] of the host ops (cpu_op events) with these names."""
    ops = trace[(trace["cat"].to_numpy() == "cpu_op") & trace["name"].isin(names).to_numpy()]
    return [(tid, int(lo), int(hi)) for tid, lo, hi in zip(ops["tid"], ops["start_ns"], ops["end_ns"])]


def class_rows(
    trace: pd.DataFrame,
    start_ns: int,
    end_ns: int,
    n_steps: int = 1,
    autotune_spans: list[tuple[int, int]] | None = None,
) -> pd.DataFrame:
    """One rank's GPU time in [start_ns, end_ns] by class: family, label, precision, calls and
    seconds per step (each event's own duration: kernels of two streams both count), share of
    the classes' total, bytes per step and GB/s of copies."""
    columns = ["family", "label", "precision", "calls", "seconds", "share", "bytes", "gb_per_s"]
    gpu = trace[trace["cat"].isin(GPU_CATS).to_numpy()]
    gpu = gpu[(gpu["end_ns"] > start_ns).to_numpy() & (gpu["start_ns"] < end_ns).to_numpy()]
    if not len(gpu):
        return pd.DataFrame(columns=columns)
    math_ops = op_spans(trace, (SDPA_MATH_OP,))
    in_math = launched_inside(gpu, trace, math_ops + backward_spans(trace, math_ops))
    classes = [
        KernelClass("attention", SDPA_MATH_LABEL, classify(c, n).precision)
        if m
        else classify(c, n, bool(math_ops))
        for c, n, m in zip(gpu["cat"], gpu["name"], in_math)
    ]
    searches = cudnn_search_spans(trace)
    tuned = _intervals_mask(gpu["start_ns"].to_numpy(np.int64), list(autotune_spans or []))
    if searches:  # kernels launched inside the search (by correlation), else started inside it
        by_launch = launched_inside(gpu, trace, [(t, lo, hi) for t, lo, hi in searches])
        tuned |= (
            by_launch
            if by_launch.any()
            else _intervals_mask(gpu["start_ns"].to_numpy(np.int64), [(lo, hi) for _, lo, hi in searches])
        )
    frame = pd.DataFrame(
        {
            "family": ["autotune" if t else k.family for k, t in zip(classes, tuned)],
            "label": [
                f"autotune / benchmark launches ({k.label})" if t else k.label for k, t in zip(classes, tuned)
            ],
            "precision": [k.precision for k in classes],
            "seconds": gpu["dur_s"].to_numpy(float),
            "bytes": np.nan_to_num(gpu["bytes"].to_numpy(float)),
        }
    )
    g = (
        frame.groupby(["family", "label", frame["precision"].fillna("")], sort=False)
        .agg(calls=("seconds", "size"), seconds=("seconds", "sum"), bytes=("bytes", "sum"))
        .reset_index()
    )
    g["precision"] = g["precision"].replace("", None)
    total = float(g["seconds"].sum()) or 1.0
    n = max(int(n_steps), 1)
    g["share"] = g["seconds"] / total
    g["gb_per_s"] = np.where(
        (g["family"] == "copy") & (g["seconds"] > 0),
        g["bytes"] / g["seconds"].where(g["seconds"] > 0, 1) / 1e9,
        np.nan,
    )
    g["calls"] = g["calls"] / n
    g["seconds"] = g["seconds"] / n
    g["bytes"] = g["bytes"] / n
    return g.sort_values("seconds", ascending=False).reset_index(drop=True)[columns]


def family_seconds(rows: pd.DataFrame) -> dict[str, float]:
    """{family: seconds per step} of a class table."""
    if not len(rows):
        return {}
    return {str(k): float(v) for k, v in rows.groupby("family")["seconds"].sum().items()}


def matmul_precision_seconds(rows: pd.DataFrame) -> dict[str, float]:
    """{precision: seconds per step} of the matmul and conv rows ('unread' when the name does
    not say)."""
    mm = rows[rows["family"].isin(("matmul", "conv")).to_numpy()] if len(rows) else rows
    out: dict[str, float] = {}
    for precision, seconds in zip(mm.get("precision", []), mm.get("seconds", [])):
        key = str(precision) if isinstance(precision, str) and precision else "unread"
        out[key] = out.get(key, 0.0) + float(seconds)
    return out
