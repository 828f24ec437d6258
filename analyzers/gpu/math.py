"""GPU busy time judged against the device: math in a slower precision than the device offers,
device-to-host copies that move too much inside the step, cuDNN benchmark mode searching again
for new shapes, and how far the busy GPU is from the device's peak (the verdict's "efficient").

A GPU second saved turns into a step second only where the GPU is the bottleneck: each saving is
the GPU time removed less the GPU's idle in the step (the host sets the pace of that part)."""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING, Any

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core import gpu_window
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import NOTE, Finding, Prescription
from traindx.common.units import fmt_s
from traindx.derive import device_peaks
from traindx.derive import gpu_efficiency as G
from traindx.derive import kernel_classes as K
from traindx.derive.ledger import host_code, steady_rows
from traindx.derive.steady import events_of_type

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="gpu_math",
    order=95,
    ids=(
        "gpu.fp32_math",
        "gpu.dtoh_copy",
        "gpu.cudnn_retune",
        "gpu.matmul_below_peak",
        "gpu.attention_math_path",
        "gpu.efficiency",
    ),
    not_causes=("gpu.efficiency",),
    explains=("sync.host_device",),
)

FP32_PATCH = "fp32_matmul_high"
CUDNN_PATCH = "cudnn_benchmark_off"
MIN_FP32_SHARE = 0.2  # of the busy GPU time: fp32 CUDA-core math worth a precision switch
MIN_DTOH_BYTES = 16e6  # per step: a device-to-host copy larger than a metric or a loss
MIN_DTOH_SHARE = 0.05  # of the step
MIN_ON_HOST_SHARE = 0.02  # of the step: the host's work on the copy named in the title
MIN_SEARCH_SHARE = 0.05  # of the step: host time in cuDNN algorithm searches
MIN_ATTENTION_SHARE = 0.05  # of the step: SDPA's math path worth a fused backend
MIN_MATMUL_SHARE = 0.2  # of the step: matmul time worth judging against its peak
LOW_FRACTION = 0.3  # of the precision's peak: a matmul this slow has a shape problem
ODD_SHARE = 0.25  # the unaligned kernels' share of the matmul time that names odd shapes
REACHABLE = 0.6  # of the peak a well-shaped GEMM reaches (H200 bf16 8192^3: ~0.8, FACTS.md §6)
EFFICIENT_MFU = 0.35  # model FLOP/s over the BF16 peak a well-fed training step reaches
EFFICIENT_MATH_SHARE = 0.6  # without an MFU: tensor-core math's share of the step


def _severity(share: float) -> str:
    sev = ev.severity_for_share(share)
    return "low" if sev == NOTE else sev


def _step_saving(view: G.RankGpu, gpu_saved_s: float) -> float:
    """Step seconds a cut of GPU time saves: the part of it the GPU's idle does not absorb."""
    idle = max(0.0, view.wall_s - view.busy_s)
    return max(0.0, gpu_saved_s - idle)


def _settings(run: RunRecord, rank: str) -> dict[str, Any]:
    """The math settings the shim read as the window started (empty for older records)."""
    starts = events_of_type(run, "torch_profile_start")
    for e in starts.to_dict("records") if len(starts) else []:
        if str(e.get("rank")) == str(rank) and e.get("float32_matmul_precision"):
            return {str(k): v for k, v in e.items()}
    return {}


def _fp32_finding(run: RunRecord, view: G.RankGpu, device: str | None) -> Finding | None:
    fp32_s = view.precisions.get("fp32", 0.0)
    peak = device_peaks.match_device(device)
    if not view.busy_s or fp32_s / view.busy_s < MIN_FP32_SHARE or peak is None:
        return None
    fp32, tf32, bf16 = (peak.tflops.get(p) for p in ("fp32", "tf32", "bf16"))
    if not fp32 or not tf32 or tf32 <= fp32:
        return None
    settings = _settings(run, view.rank)
    already_high = settings.get("float32_matmul_precision") in ("high", "medium")
    gain_tf32 = _step_saving(view, fp32_s * (1.0 - fp32 / tf32))
    gain_bf16 = _step_saving(view, fp32_s * (1.0 - fp32 / (bf16 or tf32)))
    share = fp32_s / view.wall_s if view.wall_s else 0.0
    title = (
        f"{fmt_s(fp32_s)} of matmul per step in fp32 on the CUDA cores ({share:.0%} of the step): "
        f"the {peak.key} does {fp32:g} TFLOP/s there, {tf32:g} in TF32 and {bf16:g} in BF16"
    )
    prescriptions = []
    if not already_high:
        prescriptions.append(
            Prescription(
                kind="code",
                summary="run float32 matmuls on TF32 tensor cores: "
                'torch.set_float32_matmul_precision("high") before the model runs',
                change={"runtime": {"patch": FP32_PATCH}},
                expected_gain_s_per_step=gain_tf32,
                automatic=True,
                command='torch.set_float32_matmul_precision("high")',
            )
        )
    prescriptions.append(
        Prescription(
            kind="code",
            summary='run the forward under torch.autocast("cuda", dtype=torch.bfloat16) (the loss '
            "outside it): BF16 tensor cores",
            expected_gain_s_per_step=gain_bf16,
            command='with torch.autocast("cuda", dtype=torch.bfloat16):\n    out = model(x)',
        )
    )
    return Finding(
        id="gpu.fp32_math",
        title=title,
        severity=_severity(share),
        analyzer="gpu_math",
        summary=(
            "The busy GPU multiplies matrices in full fp32 (SIMT/FFMA kernels): PyTorch's default "
            'float32 matmul precision is "highest". TF32 keeps fp32 storage and range; BF16 '
            "autocast halves the bytes too. Predicted from the device's peak ratios, less the "
            "GPU's idle in the step."
        ),
        seconds_lost_per_step=gain_bf16,
        share_of_step=share,
        ranks=(view.rank,),
        evidence={
            "fp32_matmul_s_per_step": fp32_s,
            "busy_s_per_step": view.busy_s,
            "wall_s_per_step": view.wall_s,
            "device": device,
            "peaks_tflops": dict(peak.tflops),
            "peak_source": peak.source,
            "float32_matmul_precision": settings.get("float32_matmul_precision"),
            "kernels": _rows_of(view, lambda r: r["precision"] == "fp32"),
        },
        prescriptions=tuple(prescriptions),
        removes={"gpu_work": True},  # GPU time, no ledger line: priced by the prescriptions
    )


def _rows_of(view: G.RankGpu, keep: Any) -> list[dict[str, Any]]:
    rows = view.rows.to_dict("records") if len(view.rows) else []
    return [{k: r[k] for k in ("label", "calls", "seconds", "bytes")} for r in rows if keep(r)][:5]


def _copy_site(run: RunRecord, rank: str) -> dict[str, Any] | None:
    """The job's line that made the device-to-host copy: the job's function around the host's
    copy call (torch.profiler's Python frames), its statement from py-spy's samples."""
    trace = run.torch_trace
    mine = trace[(trace["rank"] == rank).to_numpy()]
    calls = mine[
        (mine["cat"] == "cuda_runtime").to_numpy()
        & mine["name"].astype(str).str.startswith("cudaMemcpy").to_numpy()
    ]
    copies = mine[
        (mine["cat"] == "gpu_memcpy").to_numpy() & mine["name"].astype(str).str.contains("DtoH").to_numpy()
    ]
    if not len(calls) or not len(copies):
        return None
    big = copies.sort_values("dur_s").iloc[-1]
    call = calls[
        (calls["start_ns"] <= big["end_ns"]).to_numpy() & (calls["end_ns"] >= big["start_ns"]).to_numpy()
    ]
    call = call if len(call) else calls[(calls["start_ns"] <= big["start_ns"]).to_numpy()].tail(1)
    if not len(call):
        return None
    row = call.iloc[0]
    py = mine[(mine["cat"] == "python_function").to_numpy()]
    where = ev.enclosing_user_function(py, row["tid"], int(row["start_ns"])) if len(py) else None
    if where is None:
        return None
    method = _copying_method(ev.enclosing_frames(py, row["tid"], int(row["start_ns"])))
    line = gpu_window.line_in_function(run, rank, where[0], where[2], calling=method)
    return {
        "file": line[0] if line else where[0],
        "line": line[1] if line else where[1],
        "function": where[2],
    }


_BUILTIN_METHOD = re.compile(r"^<built-in method (\w+) of ")


def _copying_method(frames: list[str]) -> str | None:
    """The tensor method the copy ran in ('cpu', 'item', 'tolist', 'numpy', 'to'), from the
    profiler's frames around it (innermost first)."""
    for name in frames:
        m = _BUILTIN_METHOD.match(str(name))
        if m:
            return m.group(1)
        parsed = ev.parse_trace_frame(str(name))
        if parsed and parsed[2] in ("numpy", "tolist", "cpu", "to"):
            return parsed[2]
    return None


def _names_stored_at(tree: ast.AST, line: int) -> set[str]:
    return {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.lineno == line
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }


def _readers_of_copy(path: str, line: int) -> set[int]:
    """The lines after the copy's in its function that read the name it was assigned to, up to
    that name's next assignment (the host's work on the copied value; the copy's own line is
    left out: what else it does, a forward whose output it copies, is no work on the copy)."""
    tree, _ = codefix.source_tree(path)
    if tree is None:
        return set()
    names = _names_stored_at(tree, line)
    scopes = [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.lineno <= line <= (n.end_lineno or n.lineno)
    ]
    scope: ast.AST = min(scopes, key=lambda n: (n.end_lineno or n.lineno) - n.lineno) if scopes else tree
    out: set[int] = set()
    for name in names:
        uses = [
            n
            for n in ast.walk(scope)
            if isinstance(n, ast.Name) and n.id == name and getattr(n, "lineno", 0) > line
        ]
        stores = [n.lineno for n in uses if isinstance(n.ctx, ast.Store)]
        until = min(stores) if stores else None
        out |= {n.lineno for n in uses if isinstance(n.ctx, ast.Load) and (until is None or n.lineno < until)}
    return out


def _host_work_on_copy(run: RunRecord, rank: str, site: dict[str, Any]) -> tuple[float, list[int]]:
    """(seconds per steady step, lines) the training thread works on the host on what it
    copied (the ledger's host code at the lines that read its value: an argmax over logits
    copied to take an accuracy), all of it gone once the value is reduced on the device."""
    lines = _readers_of_copy(str(site["file"]), int(site["line"]))
    if not lines:
        return 0.0, []
    table = host_code(run)
    steady = steady_rows(run, rank)
    if not len(table) or not len(steady):
        return 0.0, sorted(lines)
    mine = table[
        (table["rank"].astype(str) == str(rank)).to_numpy()
        & table["step"].isin(steady["step"]).to_numpy()
        & (table["file"].astype(str) == str(site["file"])).to_numpy()
        & table["line"].isin(lines).to_numpy()
    ]
    return float(mine["seconds"].sum()) / len(steady), sorted(lines)


def _dtoh_finding(run: RunRecord, view: G.RankGpu) -> Finding | None:
    rows = view.rows
    dtoh = rows[rows["label"].astype(str).str.startswith("copy DtoH").to_numpy()] if len(rows) else rows
    if not len(dtoh):
        return None
    nbytes, seconds = float(dtoh["bytes"].sum()), float(dtoh["seconds"].sum())
    waited = view.sync.get("copy_s", 0.0)
    cost = max(seconds, waited)
    share = cost / view.wall_s if view.wall_s else 0.0
    if nbytes < MIN_DTOH_BYTES or share < MIN_DTOH_SHARE:
        return None
    pageable = float(dtoh[dtoh["label"].str.contains("pageable").to_numpy()]["bytes"].sum())
    site = _copy_site(run, view.rank)
    at = f" at {site['file']}:{site['line']}" if site else ""
    on_host, host_lines = _host_work_on_copy(run, view.rank, site) if site else (0.0, [])
    title = (
        f"{nbytes / 1e6:.0f} MB copied from the device to the host every step{at}: "
        f"{fmt_s(cost)} ({share:.0%} of the step) the host waits for"
        + (
            f", and {fmt_s(on_host)} it works on the copy"
            if on_host >= MIN_ON_HOST_SHARE * view.wall_s
            else ""
        )
    )
    cost += on_host
    share = cost / view.wall_s if view.wall_s else 0.0
    return Finding(
        id="gpu.dtoh_copy",
        title=title,
        severity=_severity(share),
        analyzer="gpu_math",
        summary=(
            f"The host blocks {fmt_s(view.sync.get('blocked_s', 0.0))} per step in syncs; "
            f"{fmt_s(waited)} of that is device-to-host copying"
            + (f" ({pageable / 1e6:.0f} MB into pageable memory, staged by the driver)" if pageable else "")
            + (
                f"; then it works {fmt_s(on_host)} per step on the copy (line "
                + ", ".join(str(n) for n in host_lines)
                + ")"
                if on_host
                else ""
            )
            + ". Compute the value on the device and copy only the result (a scalar, a count), "
            "or copy asynchronously into pinned memory and read it steps later."
        ),
        seconds_lost_per_step=cost,
        share_of_step=share,
        ranks=(view.rank,),
        evidence={
            "bytes_per_step": nbytes,
            "pageable_bytes_per_step": pageable,
            "copy_s_per_step": seconds,
            "host_on_copy_s_per_step": round(on_host, 6),
            "host_lines": host_lines,
            "sync": dict(view.sync),
            **({"file": site["file"], "line": site["line"], "function": site["function"]} if site else {}),
        },
        removes={"gpu_work": True},
        prescriptions=(
            Prescription(
                kind="code",
                summary="keep the tensor on the device: reduce it there (e.g. "
                "(logits.argmax(-1) == y).sum()) and read one number per step"
                + (f" at {site['file']}:{site['line']}" if site else ""),
                expected_gain_s_per_step=cost,
            ),
        ),
    )


def _cudnn_finding(run: RunRecord, view: G.RankGpu) -> Finding | None:
    trace = run.torch_trace
    mine = trace[(trace["rank"] == view.rank).to_numpy()]
    spans = K.cudnn_search_spans(mine)
    if not spans:
        return None
    host_s = sum(hi - lo for _, lo, hi in spans) / 1e9 / max(view.steps, 1)
    share = host_s / view.wall_s if view.wall_s else 0.0
    if share < MIN_SEARCH_SHARE:
        return None
    tuned = view.families.get("autotune", 0.0)
    return Finding(
        id="gpu.cudnn_retune",
        title=(
            f"cuDNN benchmark mode searches again for new input shapes: {len(spans) / max(view.steps, 1):.0f} "
            f"convolutions a step wait {fmt_s(host_s)} ({share:.0%} of the step) timing candidate algorithms"
        ),
        severity=_severity(share),
        analyzer="gpu_math",
        summary=(
            "With torch.backends.cudnn.benchmark = True each new input shape makes cuDNN time every "
            "algorithm (its syncs are these, not the job's); with shapes that change every step the "
            "search never ends. Bucket or pad the inputs to a few shapes, or turn benchmarking off."
        ),
        seconds_lost_per_step=host_s,
        share_of_step=share,
        ranks=(view.rank,),
        evidence={"searches_per_step": len(spans) / max(view.steps, 1), "autotune_gpu_s_per_step": tuned},
        prescriptions=(
            Prescription(
                kind="code",
                summary="turn cuDNN benchmark mode off (torch.backends.cudnn.benchmark = False)",
                change={"runtime": {"patch": CUDNN_PATCH}},
                expected_gain_s_per_step=host_s,
                automatic=True,
                command="torch.backends.cudnn.benchmark = False",
            ),
            Prescription(
                kind="code",
                summary="pad or bucket the input shapes to a few sizes (then benchmark mode pays once per size)",
                expected_gain_s_per_step=host_s,
            ),
        ),
    )


def _below_peak_finding(run: RunRecord, view: G.RankGpu) -> Finding | None:
    """Matmuls far under the device's rate at their precision (the profiler's FLOP counts over
    their kernels' time): tiny or odd shapes. Unaligned kernels (CUTLASS/cuBLAS `align1`,
    `align2`: a leading dimension not a multiple of 8) are named."""
    got = _achieved(view, device_peaks.device_name(run.manifest))
    mm_s = sum(s for p, s in view.precisions.items() if p != "fp32")
    if not got or not got["fraction_of_peak"] or not view.wall_s or mm_s / view.wall_s < MIN_MATMUL_SHARE:
        return None
    if got["fraction_of_peak"] >= LOW_FRACTION or not view.matmul_flops:
        return None
    saving = _step_saving(view, mm_s - view.matmul_flops / (REACHABLE * got["peak_flops"]))
    unaligned = _rows_of(view, lambda r: r["family"] in ("matmul", "conv"))
    names = run.torch_trace
    mine = names[(names["rank"] == view.rank).to_numpy() & (names["cat"] == "kernel").to_numpy()]
    aligned_off = mine["name"].astype(str).str.contains(r"align[12](?!\d)", regex=True).to_numpy()
    odd_s = float(mine["dur_s"].to_numpy(float)[aligned_off].sum()) / max(view.steps, 1)
    # odd shapes carry the loss only where the unaligned kernels are a good part of the matmul
    # time (a 10-class head's align1 GEMM beside a conv net's convolutions is not why it is slow)
    odd = sorted({str(n)[:120] for n in mine["name"][aligned_off]})[:3] if odd_s >= ODD_SHARE * mm_s else []
    return Finding(
        id="gpu.matmul_below_peak",
        title=(
            f"Matmuls run at {got['fraction_of_peak']:.0%} of the device's {got['precision']} peak "
            f"({got['flops_per_s'] / 1e12:.0f} TFLOP/s): {fmt_s(mm_s)} a step"
            + (" in unaligned kernels" if odd else "")
        ),
        # without unaligned kernels to show odd shapes, small matmuls or convolutions (a 3-channel
        # first layer, a 10-class head) are what the model is: a note, not a cause to pad
        severity=_severity(saving / view.wall_s) if odd else "low",
        analyzer="gpu_math",
        summary=(
            "The profiler's FLOP counts over the matmul kernels' time are far under the device's rate: "
            "tiny or odd shapes (dimensions not multiples of 8, small batches) keep the tensor cores "
            "idle. Pad hidden sizes, vocabularies and batch dimensions to multiples of 64, or batch "
            f"small matmuls together. Saving: down to {REACHABLE:.0%} of the peak."
        ),
        seconds_lost_per_step=saving,
        share_of_step=mm_s / view.wall_s,
        ranks=(view.rank,),
        evidence={"achieved": got, "matmul_s_per_step": mm_s, "unaligned_kernels": odd, "kernels": unaligned},
        prescriptions=(
            Prescription(
                kind="code",
                summary="pad the matmul dimensions (hidden size, vocabulary, batch x sequence) to multiples of 64",
                expected_gain_s_per_step=saving,
            ),
        ),
        removes={"gpu_work": True},
    )


def _math_path_finding(view: G.RankGpu, device: str | None) -> Finding | None:
    """SDPA's unfused math path (bmm, scale, mask, softmax, bmm: the T x T scores go through
    memory), forward and backward: its kernels' time, priced by its kernels that are not GEMMs
    (a fused kernel does them in registers) and, where its GEMMs ran in fp32 on the CUDA cores
    (a float mask or fp32 inputs upcast the math path), their time a fused bf16 kernel does on
    the tensor cores (the device's peak ratio)."""
    rows = view.rows
    math = rows[(rows["label"] == K.SDPA_MATH_LABEL).to_numpy()] if len(rows) else rows
    seconds = float(math["seconds"].sum()) if len(math) else 0.0
    if not view.wall_s or seconds / view.wall_s < MIN_ATTENTION_SHARE:
        return None
    gemm = float(math[math["precision"].notna().to_numpy()]["seconds"].sum())
    fp32_gemm = float(math[(math["precision"] == "fp32").to_numpy()]["seconds"].sum())
    peak = device_peaks.match_device(device)
    fp32, bf16 = (peak.tflops.get("fp32"), peak.tflops.get("bf16")) if peak else (None, None)
    on_tensor_cores = fp32_gemm * (1.0 - fp32 / bf16) if fp32 and bf16 and bf16 > fp32 else 0.0
    saving = _step_saving(view, seconds - gemm + on_tensor_cores)
    share = seconds / view.wall_s
    return Finding(
        id="gpu.attention_math_path",
        title=f"Attention runs on SDPA's unfused math path: {fmt_s(seconds)} a step ({share:.0%} of the step)",
        severity=_severity(share),
        analyzer="gpu_math",
        summary=(
            "scaled_dot_product_attention fell back to its math path (no fused kernel took the "
            "inputs: a head size not a multiple of 8, fp32 inputs, an attention mask the fused "
            "kernels do not take, dropout on an old backend). The scores go through memory as "
            "separate kernels. Saving: the math path's kernels that are not GEMMs, and its fp32 GEMMs "
            "at the tensor cores' rate."
        ),
        seconds_lost_per_step=saving,
        share_of_step=share,
        ranks=(view.rank,),
        evidence={
            "math_path_s_per_step": seconds,
            "gemm_s_per_step": gemm,
            "fp32_gemm_s_per_step": fp32_gemm,
        },
        prescriptions=(
            Prescription(
                kind="code",
                summary="let a fused SDPA backend take the attention: bf16/fp16 inputs (autocast), a "
                "head size that is a multiple of 8, is_causal=True instead of a float mask; check with "
                "torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)",
                expected_gain_s_per_step=saving,
            ),
        ),
        removes={"gpu_work": True},
    )


def _math_path_seconds(view: G.RankGpu) -> float:
    rows = view.rows
    return float(rows[(rows["label"] == K.SDPA_MATH_LABEL).to_numpy()]["seconds"].sum()) if len(rows) else 0.0


def _holds_back(view: G.RankGpu) -> list[dict[str, Any]]:
    """What the step's time goes to besides tensor-core math, largest first."""
    fam = view.families
    parts = {
        "GPU idle (the host sets the pace)": max(0.0, view.wall_s - view.busy_s),
        "fp32 math on the CUDA cores": view.precisions.get("fp32", 0.0),
        "copies": fam.get("copy", 0.0) + fam.get("memset", 0.0),
        "memory-bound kernels (elementwise, reductions, other)": fam.get("elementwise", 0.0)
        + fam.get("reduction", 0.0)
        + fam.get("other", 0.0),
        "communication": fam.get("communication", 0.0),
        "autotune / benchmark launches": fam.get("autotune", 0.0),
        "SDPA's unfused math path": _math_path_seconds(view),
    }
    wall = view.wall_s or 1.0
    return [
        {"what": k, "seconds": v, "share": v / wall}
        for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
        if v > 0.01 * wall
    ]


def _achieved(view: G.RankGpu, device: str | None) -> dict[str, Any] | None:
    """The matmuls' achieved FLOP/s (the profiler's counts over the matmul/conv kernels' time)
    against the device's peak at the precision most of that time ran in."""
    mm_s = sum(view.precisions.values())
    if not view.matmul_flops or not mm_s:
        return None
    precision = max(view.precisions, key=view.precisions.__getitem__)
    peak = device_peaks.peak_flops(device, precision if precision != "unread" else "bf16")
    rate = view.matmul_flops / mm_s
    return {
        "flops_per_s": rate,
        "precision": precision,
        "peak_flops": peak,
        "fraction_of_peak": rate / peak if peak else None,
    }


def _efficiency_finding(run: RunRecord, view: G.RankGpu, mfu: dict[str, Any] | None) -> Finding:
    unfused = _math_path_seconds(view)
    math_s = (
        view.families.get("attention", 0.0)
        - unfused
        + sum(s for p, s in view.precisions.items() if p != "fp32")
    )
    math_share = math_s / view.wall_s if view.wall_s else 0.0
    value = (mfu or {}).get("mfu")
    achieved = _achieved(view, device_peaks.device_name(run.manifest))
    efficient = value >= EFFICIENT_MFU if value is not None else math_share >= EFFICIENT_MATH_SHARE
    back = _holds_back(view)
    mfu_words = f"MFU {value:.1%}" if value is not None else "MFU unknown"
    if efficient:
        title = f"The GPU does tensor-core math {math_share:.0%} of the step ({mfu_words})"
    else:
        held = ", ".join(f"{b['what']} {b['share']:.0%}" for b in back[:3]) or "nothing measured"
        title = (
            f"The GPU is far from its peak: {mfu_words}, tensor-core math {math_share:.0%} of the step; "
            f"held back by {held}"
        )
    return Finding(
        id="gpu.efficiency",
        title=title,
        severity=NOTE,
        analyzer="gpu_math",
        summary=(mfu or {}).get("note") or "",
        share_of_step=math_share,
        ranks=(view.rank,),
        evidence={
            "efficient": bool(efficient),
            "mfu": value,
            "mfu_note": (mfu or {}).get("note"),
            "tensor_math_share": math_share,
            "busy_share": view.busy_s / view.wall_s if view.wall_s else None,
            "holds_back": back,
            "matmul_achieved": achieved,
            "rank": view.rank,
        },
    )


def analyze(run: RunRecord) -> list[Finding]:
    views = G.cached_rank_views(run)
    view = max(views.values(), key=lambda v: v.wall_s, default=None)
    if view is None:
        return []
    device = device_peaks.device_name(run.manifest)
    out: list[Finding] = []
    for v in views.values():
        made = (
            _dtoh_finding(run, v),
            _cudnn_finding(run, v),
            _fp32_finding(run, v, device),
            _below_peak_finding(run, v),
            _math_path_finding(v, device),
        )
        out.extend(f for f in made if f is not None)
    if device is not None:
        out.append(_efficiency_finding(run, view, G.model_flops_utilisation(run, views)))
    return out
