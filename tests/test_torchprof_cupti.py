"""The default profiler window must not slow the rest of the job: kineto keeps CUPTI's callbacks
subscribed after the profiler stops unless TEARDOWN_CUPTI=1 (pytorch/pytorch#144455; measured on
an H100, a launch-bound step ran 30-50 % slower after the window: BENCHMARKS.md). The shim asks
for the teardown where CUDA allows it (12.6 on: before, teardown breaks CUDA graphs' re-init) and
never overrides the job's own choice."""

import types

import pytest

from traindx.profiler.shim._traindx_shim import torchprof


def _torch(cuda):
    return types.SimpleNamespace(version=types.SimpleNamespace(cuda=cuda))


@pytest.mark.parametrize(
    ("cuda", "before", "after"),
    [
        ("13.0", None, "1"),  # the GPU machine's torch 2.11+cu130
        ("12.6", None, "1"),
        ("12.4", None, None),  # teardown crashes a CUDA graph's re-init there: left alone
        (None, None, None),  # a CPU build
        ("12.8", "0", "0"),  # the job (or torch.compile's cudagraphs) chose: kept
    ],
)
def test_the_window_asks_kineto_to_tear_cupti_down_where_cuda_allows(monkeypatch, cuda, before, after):
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    if before is not None:
        monkeypatch.setenv("TEARDOWN_CUPTI", before)
    torchprof._teardown_cupti_after(_torch(cuda))
    import os

    assert os.environ.get("TEARDOWN_CUPTI") == after
