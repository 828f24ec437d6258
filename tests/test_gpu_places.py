"""Where the time goes by the model's structure (issue 46): each op and kernel of the profiler
window tied to its module, phase and line (derive/places.py), and the gpu_places mechanisms.

The host side is a real torch.profiler window recorded here on the CPU (with_stack, with_flops,
as the shim runs it) of a small model trained with and without activation checkpointing, then
evaluated under no_grad. The GPU side is synthesised on that trace: one kernel per launching
op, with names seen on the project's H100/H200 (FACTS.md §11, docs/gpu-judgement.md), each
launched by a cudaLaunchKernel inside its op (Kineto's correlation), as Kineto records them."""

import os

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from traindx.analyzers.gpu import place_host  # noqa: E402
from traindx.analyzers.gpu import places as gpu_places  # noqa: E402
from traindx.derive import opwork as W  # noqa: E402
from traindx.derive import places as P  # noqa: E402
from traindx.profiler.opargs import read_op_args  # noqa: E402
from traindx.profiler.torchtrace import load_trace  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"
BF16_GEMM = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.fc2 = torch.nn.Linear(256, 64)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self, checkpointed):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.head = torch.nn.Linear(64, 8)
        self.checkpointed = checkpointed

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return self.head(x)


def record(tmp_path, checkpointed):
    """A real window: one training step (forward, backward, AdamW) and one evaluation."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net(checkpointed)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=False, with_flops=True
    ) as p:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(x)
    path = os.path.join(str(tmp_path), f"trace-{int(checkpointed)}.json")
    p.export_chrome_trace(path)
    return path, load_trace(path, "0")


def with_kernels(rows, args, gemm_s=1e-3, other_s=1e-4, extra=None):
    """The trace with one GPU kernel per launching op (the innermost aten ops that compute),
    each launched from inside its op: a GEMM for the matmuls, an elementwise kernel otherwise.
    extra: {op name: [(kernel name, seconds)]} for more kernels under an op."""
    rows = rows.reset_index(drop=True)
    computing = ("aten::addmm", "aten::mm", "aten::clamp_min", "aten::add", "aten::threshold_backward")
    names = (*computing, *(extra or {}))
    ops = rows[(rows["cat"] == "cpu_op").to_numpy() & rows["name"].isin(names).to_numpy()]
    add, t_gpu, corr = [], int(rows["start_ns"].min()), 10_000_000
    for _, op in ops.iterrows():
        kernels = [
            (BF16_GEMM, gemm_s)
            if op["name"] in ("aten::addmm", "aten::mm")
            else ("elementwise_kernel", other_s)
        ]
        kernels += (extra or {}).get(op["name"], [])
        for name, seconds in kernels:
            corr += 1
            t = int(op["start_ns"]) + 1
            add.append(
                {**_row("cuda_runtime", "cudaLaunchKernel", t, 500), "tid": op["tid"], "correlation": corr}
            )
            add.append({**_row("kernel", name, t_gpu, int(seconds * 1e9)), "tid": 7, "correlation": corr})
            t_gpu += int(seconds * 1e9) + 1000
    return pd.concat([rows, pd.DataFrame(add)], ignore_index=True)


def _row(cat, name, start, dur_ns):
    return {
        "rank": "0",
        "cat": cat,
        "name": name,
        "start_ns": start,
        "end_ns": start + dur_ns,
        "dur_s": dur_ns / 1e9,
        "pid": 1,
        "seq": np.nan,
        "bytes": np.nan,
    }


def spans_of(rows):
    return [(int(rows["start_ns"].min()), int(rows["end_ns"].max()) + 1)]


def test_each_op_gets_its_module_phase_and_line(tmp_path):
    path, rows = record(tmp_path, checkpointed=True)
    rows = rows.reset_index(drop=True)
    contexts = P.attribute(rows)
    seen = {}
    for pos, ctx in contexts.items():
        if rows.at[pos, "name"] in ("aten::addmm", "aten::mm"):
            seen.setdefault(ctx.phase, set()).add(ctx.module)
    # forward: every Linear under its block; evaluation: the same modules under no_grad
    assert any(m.endswith("Block_0.Linear_0") for m in seen["forward"])
    assert any(m.endswith("Block_0.Linear_0") for m in seen["evaluation"])
    # the checkpointed blocks' forward runs again inside backward, named from the block down
    assert {m.split(".")[0] for m in seen["recompute"]} == {"Block_0", "Block_1", "Block_2"}
    # backward's matmuls take the module of the forward op that made their node
    assert any(m.endswith("Linear_0") for m in seen["backward"])
    assert any(m.endswith("Linear_6") for m in seen["backward"])  # the head
    phases = {ctx.phase for ctx in contexts.values()}
    assert "optimizer" in phases
    lines = {
        ctx.line
        for pos, ctx in contexts.items()
        if ctx.phase == "forward" and ctx.module.endswith("Linear_0")
    }
    assert any(line and line.startswith("test_gpu_places.py") and line.endswith("forward") for line in lines)


def test_the_op_sizes_give_flops_and_bytes(tmp_path):
    path, rows = record(tmp_path, checkpointed=False)
    args = read_op_args(path)
    mm = args[args["name"] == "aten::addmm"].iloc[0]
    flops, nbytes, precision = W.op_work("aten::addmm", mm["dims"], mm["types"])
    assert flops == 2 * 32 * 64 * 256  # the first Linear: [32, 64] x [64, 256]
    assert nbytes == 4 * (256 + 32 * 64 + 64 * 256 + 32 * 256) and precision == "fp32"
    # a training BatchNorm reads its input twice (statistics, then normalisation): 3 passes
    act = 8 * 4 * 16 * 16 * 2
    _, bn_bytes, bn_precision = W.op_work(
        "aten::native_batch_norm", [[8, 4, 16, 16], [4], [4], [4], [4]], ["c10::BFloat16"] + ["float"] * 4
    )
    assert bn_bytes == pytest.approx(1.5 * (2 * act + 4 * 4 * 4)) and bn_precision == "bf16"
    # every op with sizes lines up with the trace table's op (same thread, same start)
    cpu = rows[rows["cat"] == "cpu_op"]
    assert len(args.merge(cpu, on=["tid", "start_ns"])) == len(args)


def test_recompute_is_found_at_the_blocks_and_priced_by_its_gpu_time(tmp_path):
    found = {}
    for checkpointed in (True, False):
        path, rows = record(tmp_path, checkpointed)
        rows = with_kernels(rows, read_op_args(path))
        spans = spans_of(rows)
        view = P.rank_places(rows, spans, read_op_args(path), H100, wall_s=0.03, busy_s=0.03)
        found[checkpointed] = (view, gpu_places._recompute(_run_without_memory(), view))
    view, f = found[True]
    recompute_s = float(view.table[view.table["phase"] == "recompute"]["gpu_s"].sum())
    # the re-run forward: each block's two GEMMs (1 ms each) and its relu (the non-reentrant
    # checkpoint stops once the tensors backward needs are rebuilt: the residual add is not re-run)
    assert recompute_s == pytest.approx(3 * (2 * 1e-3 + 1e-4), rel=0.01)
    assert f is not None and f.id == "gpu.recompute"
    assert "Block" in f.title and f.seconds_lost_per_step == pytest.approx(recompute_s, rel=0.01)
    assert sorted(f.evidence["modules"]) == ["Block_0", "Block_1", "Block_2"]
    twin_view, twin = found[False]
    assert twin is None and "recompute" not in set(twin_view.table["phase"])


def test_nchw_layout_is_named_and_channels_last_prescribed(tmp_path):
    path, rows = record(tmp_path, checkpointed=False)
    transposes = [
        ("void cudnn::ops::nchwToNhwcKernel<__nv_bfloat16>", 3e-4),
        ("void cudnn::ops::nhwcToNchwKernel", 3e-4),
    ]
    extra = {
        "aten::addmm": [
            ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nchw", 2e-4),
            *transposes,
        ],
        "aten::clamp_min": [("void at::native::batch_norm_collect_statistics_kernel<__nv_bfloat16>", 1.5e-3)],
    }
    rows = with_kernels(rows, None, gemm_s=1e-4, extra=extra)
    view = P.rank_places(rows, spans_of(rows), read_op_args(path), H100, wall_s=0.05, busy_s=0.05)
    f = gpu_places._layout(view, H100)
    assert f is not None and "channels_last" in f.prescriptions[0].summary
    assert f.evidence["module"].split(".")[-1].startswith("Linear") or "Block" in f.evidence["module"]
    twin = with_kernels(record(tmp_path, False)[1], None, gemm_s=1e-4)
    twin_view = P.rank_places(twin, spans_of(twin), None, H100, wall_s=0.05, busy_s=0.05)
    assert gpu_places._layout(twin_view, H100) is None


def test_fp32_math_inside_a_bf16_step_is_a_cast_at_its_module(tmp_path):
    path, rows = record(tmp_path, checkpointed=False)
    rows = rows.reset_index(drop=True)
    head = [
        pos
        for pos, ctx in P.attribute(rows).items()
        if ctx.module.endswith("Linear_6")
        and ctx.phase == "forward"
        and rows.at[pos, "name"] == "aten::addmm"
    ]
    fp32 = "cutlass_80_simt_sgemm_64x64_8x5_tn_align1"
    rows.loc[head, "name"] = "aten::addmm_head"  # the head's op launches an fp32 GEMM below
    rows = with_kernels(rows, None, gemm_s=2e-4, extra={"aten::addmm_head": [(fp32, 4e-3)]})
    view = P.rank_places(rows, spans_of(rows), None, H100, wall_s=0.02, busy_s=0.02)
    f = gpu_places._cast(view, H100)
    assert f is not None and f.evidence["module"].endswith("Linear_6")
    assert f.seconds_lost_per_step == pytest.approx(4e-3 * (1 - 67.0 / 989.5), rel=0.01)


class _run_without_memory:
    """A run record with no memory events (the headroom is then not quoted)."""

    def of_type(self, type_):
        return pd.DataFrame()


def test_a_place_far_from_what_its_work_needs_is_named_at_its_module(tmp_path):
    """Every kernel at 1.5x its op's roofline time but the head's forward at 50x: the head's
    forward is the place named, with its dominant kernel; at 1.5x everywhere, nothing is."""
    path, rows = record(tmp_path, checkpointed=False)
    rows = with_kernels(rows, None)
    view = P.rank_places(rows, spans_of(rows), read_op_args(path), H100)
    events = view.events[np.isfinite(view.events["need_s"].to_numpy(float))].copy()
    assert len(events) and (events["need_s"] > 0).all()
    events["seconds"] = events["need_s"] * 1.5
    head = (events["module"].str.endswith("Linear_6") & (events["phase"] == "forward")).to_numpy()
    assert head.any()
    slow = events.copy()
    slow.loc[head, "seconds"] = slow.loc[head, "need_s"] * 50
    for frame, expect in ((slow, True), (events, False)):
        view.events = frame
        view.wall_s = view.busy_s = float(frame["seconds"].sum()) / view.steps
        found = gpu_places._slow_places(view, pd.Series(False, index=frame.index))
        if not expect:
            assert found == []
            continue
        assert [(f.evidence["module"].split(".")[-1], f.evidence["phase"]) for f in found] == [
            ("Linear_6", "forward")
        ]
        f = found[0]
        assert f.evidence["gpu_s_per_step"] / f.evidence["need_s_per_step"] == pytest.approx(50, rel=0.01)
        assert (
            f.evidence["top_kernels"][0]["name"] == BF16_GEMM and "needs" in f.title or "roofline" in f.title
        )


def test_a_recorded_h200_window_is_placed_by_module_and_phase(tmp_path):
    """The SDPA math-path job recorded on the H200 (tests/data/h200-sdpa-math.README): its GPU
    time sits in its attention module, forward and backward (the backward kernels on autograd's
    thread, placed through the sequence numbers), at the job's forward; the sizes price it."""
    import warnings

    from helpers import recorded_runs

    import traindx

    folder = recorded_runs("h200-sdpa-math", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = traindx.load_run(str(folder / "sdpa_math-bad"))
    view = P.cached_places(run)["0"]
    assert view.modules and view.sizes
    top = view.table.head(2)
    assert {m.split(".")[-1] for m in top["module"]} == {"Attention_0"}
    assert set(top["phase"]) == {"forward", "backward"}
    assert all(str(line).startswith("gpu_math_cases.py:") for line in top["line"])
    # every GPU second of the profiled steps is placed once: the places sum to the kernels' time
    assert view.table["gpu_s"].sum() == pytest.approx(view.events["seconds"].sum() / view.steps)
    assert view.table["gpu_s"].sum() == pytest.approx(view.busy_s, rel=0.05)
    assert (top["need_s"] > 0).all() and (top["need_s"] < top["gpu_s"]).all()
    note = next(f for f in gpu_places.analyze(run) if f.id == "gpu.places")
    assert "Attention_0 backward" in note.title and note.evidence["places"][0]["line"]


def test_host_time_blocked_on_a_busy_gpu_is_the_gpus(tmp_path):
    """A launch that waits for room in a full launch queue (and a sync) is host time that is the
    GPU's: booked as the place's wait, out of its host time; a launch of a few µs is not."""
    _, rows = record(tmp_path, checkpointed=False)
    rows = rows.reset_index(drop=True)
    contexts = P.attribute(rows)
    linear = next(
        pos
        for pos, ctx in contexts.items()
        if ctx.outermost and rows.at[pos, "name"] == "aten::linear" and ctx.phase == "forward"
    )
    lo, dur = int(rows.at[linear, "start_ns"]), int(rows.at[linear, "end_ns"] - rows.at[linear, "start_ns"])
    blocked, quick = dur // 2, 3_000
    add = [
        {**_row("cuda_runtime", "cudaLaunchKernel", lo + 10, blocked), "tid": rows.at[linear, "tid"]},
        {**_row("cuda_runtime", "cudaLaunchKernel", lo + 20 + blocked, quick), "tid": rows.at[linear, "tid"]},
    ]
    rows = pd.concat([rows, pd.DataFrame(add)], ignore_index=True)
    host = P.host_ops(rows, P.attribute(rows), spans_of(rows))
    module = contexts[linear].module
    mine = host[(host["module"] == module) & (host["phase"] == "forward")]
    assert mine["wait_s"].sum() == pytest.approx(blocked / 1e9)
    assert mine["host_s"].sum() + mine["wait_s"].sum() == pytest.approx(dur / 1e9)


def test_a_double_backward_is_not_a_recompute(tmp_path):
    """A gradient penalty (create_graph=True) runs forward ops with sequence numbers inside
    autograd nodes, but no module: backward, not a forward re-run."""
    torch.manual_seed(0)
    model = Net(checkpointed=False)
    x = torch.randn(16, 64)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True, with_flops=True) as p:
        loss = model(x).square().mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        (loss + sum(g.square().sum() for g in grads)).backward()
    path = os.path.join(str(tmp_path), "double.json")
    p.export_chrome_trace(path)
    phases = {ctx.phase for ctx in P.attribute(load_trace(path, "0")).values()}
    assert "backward" in phases and "recompute" not in phases


def _ema_loop(shadow, params):
    for e, p in zip(shadow, params):
        e.mul_(0.99).add_(p, alpha=0.01)


def _ema_foreach(shadow, params):
    torch._foreach_lerp_(shadow, params, 0.01)


def test_a_loop_of_small_ops_the_gpu_waits_for_is_named_at_its_line(tmp_path):
    """A weight average updated tensor by tensor in a Python loop (a training step, then the
    loop over 300 tensors), its kernels 1 µs each: the host's time there is several times the
    GPU's and the GPU idles, so the loop's line is named, priced at most at the GPU's idle and
    the loop's kernels; the same update as one foreach op is not."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net(checkpointed=False)
    params = [torch.randn(64) for _ in range(300)]
    found, idle = {}, {}
    model(torch.randn(32, 64)).square().mean().backward()  # autograd's first call, out of the window
    for update in (_ema_loop, _ema_foreach):
        shadow = [p.clone() for p in params]
        with profile(activities=[ProfilerActivity.CPU], with_stack=True, with_flops=True) as prof:
            model(torch.randn(32, 64)).square().mean().backward()
            update(shadow, params)
        path = os.path.join(str(tmp_path), f"{update.__name__}.json")
        prof.export_chrome_trace(path)
        rows = load_trace(path, "0")
        small = [("elementwise_kernel", 1e-6)]
        rows = with_kernels(
            rows, None, gemm_s=1e-6, other_s=1e-6, extra={"aten::mul_": small, "aten::add_": small}
        )
        view = P.rank_places(rows, spans_of(rows), read_op_args(path), H100)
        found[update.__name__] = [
            f for f in place_host.host_places(view, lambda share: "low") if f.evidence.get("bound") == "host"
        ]
        idle[update.__name__] = view.wall_s - view.busy_s
    loop = found["_ema_loop"]
    assert loop and "_ema_loop" in str(loop[0].evidence["line"])
    f = loop[0]
    assert f.evidence["host_s_per_step"] >= 2 * f.evidence["gpu_s_per_step"]
    assert f.evidence["ops_per_step"] >= 600  # a mul_ and an add_ per tensor
    assert f.evidence["gpu_s_per_step"] > 0  # the loop's own kernels, placed at its line
    assert 0 < f.seconds_lost_per_step <= idle["_ema_loop"] + f.evidence["gpu_s_per_step"]
    assert found["_ema_foreach"] == []


class _Norm(torch.nn.Module):
    """An RMS norm spelled out in tensor ops (upcast, pow, mean, add, rsqrt, mul, downcast,
    weight), or the same job done by one op (layer_norm: one kernel, as a fused norm is)."""

    def __init__(self, fused):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(256))
        self.fused = fused

    def forward(self, x):
        if self.fused:
            return torch.nn.functional.layer_norm(x, (256,))
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * y.to(x.dtype)


class _Normed(torch.nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.norms = torch.nn.ModuleList([_Norm(fused) for _ in range(2)])
        self.fc = torch.nn.Linear(256, 256)

    def forward(self, x):
        return self.norms[1](self.fc(self.norms[0](x)))


CHAIN_OPS = (
    "aten::copy_",
    "aten::pow",
    "aten::mean",
    "aten::rsqrt",
    "aten::mul",
    "aten::native_layer_norm",
    "aten::native_layer_norm_backward",
    "aten::pow_backward",
    "aten::div",
    "aten::sum",
)


def test_a_chain_of_elementwise_ops_is_named_by_its_passes_over_the_data(tmp_path):
    """The norm's ops one kernel each, back to back, every kernel at its roofline: the chain moves
    several times the bytes of its largest op, so its class path and phase are named with that
    many passes and priced at the time above one pass; the norm done by one op is not named."""
    from torch.profiler import ProfilerActivity, profile

    from traindx.analyzers.gpu import place_passes

    torch.manual_seed(0)
    found = {}
    for fused in (False, True):
        model = _Normed(fused)
        x = torch.randn(64, 256, dtype=torch.bfloat16)
        model(x.float()).sum().backward()  # autograd's first call, out of the window
        with profile(activities=[ProfilerActivity.CPU], with_stack=True, with_flops=True) as prof:
            model(x.float() if fused else x).float().sum().backward()
        path = os.path.join(str(tmp_path), f"norm-{int(fused)}.json")
        prof.export_chrome_trace(path)
        rows = with_kernels(load_trace(path, "0"), None, extra={name: [] for name in CHAIN_OPS})
        view = P.rank_places(rows, spans_of(rows), read_op_args(path), H100)
        known = np.isfinite(view.events["need_s"].to_numpy(float))
        view.events = view.events[known].assign(seconds=lambda e: e["need_s"] * 1.2)  # at the roofline
        view.wall_s = view.busy_s = float(view.events["seconds"].sum()) / view.steps
        found[fused] = place_passes.passes_places(
            view, pd.Series(False, index=view.events.index), lambda s: s, lambda share: "low"
        )
    # one finding per module class: its largest phase, priced with the other phases' bytes above
    # one pass (the fused op replaces the chain in forward and backward)
    named = [f for f in found[False] if f.evidence["place"].split(".")[-1] == "_Norm"]
    assert len(named) == 1
    f = named[0]
    assert f.evidence["passes"] >= 3 and f.evidence["calls_per_step"] == 2
    others = f.evidence["other_phases_above_one_pass_s"]
    assert set(others) == {"forward", "backward"} - {f.evidence["phase"]} and all(
        s > 0 for s in others.values()
    )
    assert f.seconds_lost_per_step == pytest.approx(
        f.evidence["gpu_s_per_step"] * (1 - 1 / f.evidence["passes"]) + sum(others.values())
    )
    assert found[True] == []
