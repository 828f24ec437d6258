"""A host place priced on a steady step (derive/place_cost.py): the profiled step is longer than a
steady one by the profiler's cost per recorded event, so a loop of many small ops, which records
many events, is priced at its profiled host time less its events' share of that excess."""

import os

import pytest

torch = pytest.importorskip("torch")

from test_gpu_places import H100, Net, _ema_loop, spans_of, with_kernels  # noqa: E402

from traindx.analyzers.gpu import place_host  # noqa: E402
from traindx.derive import place_cost as C  # noqa: E402
from traindx.derive import places as P  # noqa: E402
from traindx.profiler.opargs import read_op_args  # noqa: E402
from traindx.profiler.torchtrace import load_trace  # noqa: E402


def test_a_host_place_is_priced_on_a_steady_step_not_the_profiled_one(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net(checkpointed=False)
    params = [torch.randn(64) for _ in range(300)]
    shadow = [p.clone() for p in params]
    model(torch.randn(32, 64)).square().mean().backward()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, with_flops=True) as prof:
        model(torch.randn(32, 64)).square().mean().backward()
        _ema_loop(shadow, params)
    path = os.path.join(str(tmp_path), "ema.json")
    prof.export_chrome_trace(path)
    small = [("elementwise_kernel", 1e-6)]
    rows = with_kernels(
        load_trace(path, "0"),
        None,
        gemm_s=1e-6,
        other_s=1e-6,
        extra={"aten::mul_": small, "aten::add_": small},
    )
    view = P.rank_places(rows, spans_of(rows), read_op_args(path), H100)
    # the window is its own steady step here: nothing to take out
    assert view.profiler_s_per_event == 0.0
    (loop,) = [
        f for f in place_host.host_places(view, lambda s: "low") if "_ema_loop" in str(f.evidence["line"])
    ]
    assert loop.evidence["host_s_per_steady_step"] == pytest.approx(loop.evidence["host_s_per_step"])
    # a steady step of two thirds of the profiled one: the excess spread over every recorded event
    counts, per_step = C.event_counts(rows.reset_index(drop=True), view.host, spans_of(rows))
    assert per_step >= len(view.host) and min(counts) >= 1
    view.profiler_s_per_event = C.cost_per_event(view.window_s, view.window_s * 2 / 3, per_step)
    assert view.profiler_s_per_event == pytest.approx(view.window_s / 3 / per_step)
    (steady,) = [
        f for f in place_host.host_places(view, lambda s: "low") if "_ema_loop" in str(f.evidence["line"])
    ]
    runs = place_host.host_runs(view)
    (events,) = runs[runs["line"].astype(str).str.contains("_ema_loop").to_numpy()]["events"]
    assert events >= steady.evidence["ops_per_step"]  # each op, and the calls it recorded inside
    assert steady.evidence["host_s_per_steady_step"] == pytest.approx(
        loop.evidence["host_s_per_step"] - view.profiler_s_per_event * events
    )
    assert steady.seconds_lost_per_step < loop.seconds_lost_per_step
