"""A torch.profiler window without Python stacks (the shim's retry of a window that stood down
for its cost) names no module and no line; the shim's samples of the training thread name the
line of each place outside backward (derive/place_lines.py), so the host test can still name a
loop of small ops at its line."""

import os
import sys
import threading
import time

import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from test_gpu_places import H100, Net, _ema_loop, spans_of, with_kernels  # noqa: E402

from traindx.analyzers.gpu import place_host  # noqa: E402
from traindx.derive import place_lines as L  # noqa: E402
from traindx.derive import places as P  # noqa: E402
from traindx.profiler.opargs import read_op_args  # noqa: E402
from traindx.profiler.torchtrace import load_trace  # noqa: E402


def _sample(thread_id, stop, out):
    """The innermost frame of this test file on the training thread, every 0.5 ms (what the
    shim's sampler records: the job's own frame)."""
    here = {os.path.abspath(__file__), os.path.abspath(sys.modules[_ema_loop.__module__].__file__)}
    while not stop.is_set():
        frame = sys._current_frames().get(thread_id)
        while frame is not None and os.path.abspath(frame.f_code.co_filename) not in here:
            frame = frame.f_back
        if frame is not None:
            code = frame.f_code
            out.append((time.time_ns(), code.co_qualname, code.co_filename, frame.f_lineno))
        time.sleep(0.0005)


def test_a_window_without_stacks_names_its_loop_by_the_samples(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net(checkpointed=False)
    params = [torch.randn(64) for _ in range(300)]
    shadow = [p.clone() for p in params]
    model(torch.randn(32, 64)).square().mean().backward()  # autograd's first call, out of the window
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=_sample, args=(threading.get_ident(), stop, samples), daemon=True)
    with profile(activities=[ProfilerActivity.CPU], with_stack=False, with_flops=True) as prof:
        sampler.start()
        model(torch.randn(32, 64)).square().mean().backward()
        with torch.no_grad():
            for _ in range(5):
                _ema_loop(shadow, params)
    stop.set()
    sampler.join()
    path = os.path.join(str(tmp_path), "window.json")
    prof.export_chrome_trace(path)
    rows = load_trace(path, "0")
    small = [("elementwise_kernel", 1e-6)]
    rows = with_kernels(
        rows, None, gemm_s=1e-6, other_s=1e-6, extra={"aten::mul_": small, "aten::add_": small}
    )
    cols = ["t_ns", "function", "file", "line"]
    frames = L.sample_frames(pd.DataFrame(samples, columns=cols), os.getcwd())
    bare = P.rank_places(rows, spans_of(rows), read_op_args(path), H100)
    named = P.rank_places(rows, spans_of(rows), read_op_args(path), H100, frames=frames)
    assert not named.modules and bare.host["line"].isna().all()
    # without the samples the loop has no line to be named at; with them it is named there
    assert not place_host.host_places(bare, lambda share: "low")
    found = place_host.host_places(named, lambda share: "low")
    assert found and "_ema_loop" in found[0].evidence["line"]
    assert found[0].evidence["ops_per_step"] >= 3000  # a mul_ and an add_ per tensor, 5 times
    # backward's ops run where the samples see the backward call, not the line that made them
    back = named.host[(named.host["phase"] == "backward").to_numpy()]
    assert back["line"].isna().all()
