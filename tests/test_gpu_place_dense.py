"""A lookup table whose gradient is dense (derive/place_params.py, analyzers/gpu/place_dense.py):
its forward reads a few rows, its backward zeroes the whole table and the optimizer updates every
row. A real torch.profiler window of an nn.Embedding on the CPU, with one synthetic GPU kernel
per op that computes (as test_gpu_places does: the window's own ops, sizes and stacks)."""

import os

import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from test_gpu_places import H100, spans_of, with_kernels  # noqa: E402

from traindx.analyzers.gpu import place_dense  # noqa: E402
from traindx.derive import places as P  # noqa: E402
from traindx.profiler.opargs import read_op_args  # noqa: E402
from traindx.profiler.torchtrace import load_trace  # noqa: E402

ROWS, DIM = 20_000, 16
KERNELS = {  # the ops a GPU runs kernels for in this step: the table's fill and update, the lookups
    name: [("elementwise_kernel", 2e-4)]
    for name in ("aten::fill_", "aten::_foreach_add_", "aten::index_select", "aten::embedding_dense_backward")
}


class _Bag(torch.nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.embed = torch.nn.Embedding(ROWS, DIM)
        self.tied = tied

    def forward(self, idx):
        assert int(idx.max()) < ROWS  # an op that records the sequence number the lookup's node gets
        pooled = self.embed(idx).mean(1)
        return pooled @ self.embed.weight.t() if self.tied else pooled


def _view(tmp_path, tied):
    torch.manual_seed(0)
    model = _Bag(tied)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    idx = torch.randint(0, ROWS, (64, 4))

    def step():
        model(idx).sum().backward()
        opt.step()
        opt.zero_grad()

    step()  # autograd's and the optimizer's first call, out of the window
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True, with_flops=True
    ) as prof:
        step()
    path = os.path.join(str(tmp_path), f"bag-{int(tied)}.json")
    prof.export_chrome_trace(path)
    args = read_op_args(path)
    rows = with_kernels(load_trace(path, "0"), args, extra=KERNELS)
    view = P.rank_places(rows, spans_of(rows), args, H100)
    view.wall_s = view.busy_s = float(view.events["seconds"].sum()) / view.steps
    return view


def test_a_dense_gradient_of_a_table_the_forward_read_a_few_rows_of_is_named_at_its_module(tmp_path):
    view = _view(tmp_path, tied=False)
    # the lookup's backward is the Embedding's, though an op before it recorded its sequence number
    backward = view.events[(view.events["phase"] == "backward").to_numpy()]
    fills = backward[backward["name"].notna() & backward["module"].str.endswith("Embedding_0")]
    assert len(fills), set(backward["module"])
    (table,) = view.tables.itertuples(index=False)
    assert table.shape == (ROWS, DIM) and table.rows_read == 64 * 4
    assert set(table.phases) == {"backward", "optimizer"}  # the table's zero fill and its update
    found = place_dense.dense_places(view, lambda s: s, lambda share: "medium")
    assert len(found) == 1
    f = found[0]
    assert f.id == "gpu.place_slow" and f.evidence["bound"] == "dense"
    assert f.evidence["module"].endswith("Embedding_0") and "test_gpu_place_dense.py" in f.evidence["line"]
    assert f.seconds_lost_per_step == pytest.approx(table.gpu_s * (1 - 256 / ROWS))
    assert "sparse" in f.prescriptions[0].summary


def test_a_table_another_forward_op_reads_whole_is_not_a_dense_gradient_finding(tmp_path):
    """A tied output layer multiplies by the whole table: every row's gradient is needed."""
    view = _view(tmp_path, tied=True)
    assert view.tables.empty
    assert place_dense.dense_places(view, lambda s: s, lambda share: "medium") == []
    assert isinstance(view.tables, pd.DataFrame)
