"""What an op's work needs: its FLOPs (matmul, bmm, convolution, attention) and the bytes its
inputs and output occupy, from the input sizes and dtypes torch.profiler records with
`with_flops` (profiler/opargs.py), and the seconds they need at the device's roofline
(device_peaks.py: the peak rate of the precision, the memory bandwidth). An estimate of the
floor: a convolution's output is taken the size of its input (stride 1), an elementwise op's
output the size of its largest input. Derive layer: arithmetic, no judgement.
"""

from __future__ import annotations

import math
from typing import Any

from traindx.derive import device_peaks

_ITEM_BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "bool": 1,
    "unsigned char": 1,
    "signed char": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}
_DTYPE_PRECISION = {
    "float": "fp32",
    "c10::BFloat16": "bf16",
    "c10::Half": "fp16",
    "c10::Float8_e4m3fn": "fp8",
}


# ops that read the rows of their first input (a table) their second input (indices) names
GATHERS = frozenset({"aten::embedding", "aten::embedding_bag", "aten::_embedding_bag"})
# ops that write the rows of their first input an index names (a sparse update, a scatter)
SCATTERS = frozenset(
    f"aten::{n}"
    for n in [
        "index_add_",
        "index_add",
        "index_put_",
        "_index_put_impl_",
        "index_copy_",
        "index_fill_",
        "scatter_",
        "scatter_add_",
    ]
)


def item_bytes(dtype: Any) -> int:
    """Bytes of one element of a profiler's dtype name (4 when unknown)."""
    return _ITEM_BYTES.get(str(dtype), 4)


def gathered(name: str, dims: Any, types: Any) -> tuple[tuple[int, ...], int, int] | None:
    """(table shape, bytes per element, rows named) of a gather op (an embedding lookup): it
    reads at most as many rows of its table as its indices have elements."""
    if name not in GATHERS or not dims or len(dims) < 2:
        return None
    table, idx = dims[0], dims[1]
    if not (isinstance(table, list) and len(table) >= 2 and isinstance(idx, list)):
        return None
    if not all(isinstance(x, int) for x in table + idx):
        return None
    return tuple(table), item_bytes(types[0] if types else None), math.prod(idx)


def op_work(name: str, dims: Any, types: Any) -> tuple[float, float, str | None]:
    """(FLOPs, bytes, precision from the dtype) of one op from its input sizes; an estimate:
    bytes are the inputs and an output the size of the largest input (a matmul's its own)."""
    tensors = [
        (d, t)
        for d, t in zip(dims or [], types or [])
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d)
    ]
    sizes = [math.prod(d) * _ITEM_BYTES.get(str(t), 4) for d, t in tensors]
    dtype = next((str(t) for _, t in tensors if str(t) in _DTYPE_PRECISION), None)
    precision = _DTYPE_PRECISION.get(dtype) if dtype else None
    flops, out_bytes = 0.0, max(sizes, default=0)
    shapes = [d for d, _ in tensors]
    item = _ITEM_BYTES.get(dtype or "", 4)
    try:
        if name in ("aten::mm", "aten::_scaled_mm") and len(shapes) >= 2:
            (m, k), n = shapes[0][-2:], shapes[1][-1]
            flops, out_bytes = 2.0 * m * k * n, m * n * item
        elif name == "aten::addmm" and len(shapes) >= 3:
            (m, k), n = shapes[1][-2:], shapes[2][-1]
            flops, out_bytes = 2.0 * m * k * n, m * n * item
        elif name in ("aten::bmm", "aten::baddbmm") and len(shapes) >= 2:
            a, b = shapes[-2], shapes[-1]
            flops, out_bytes = 2.0 * math.prod(a) * b[-1], math.prod(a[:-1]) * b[-1] * item
        elif "convolution_backward" in name and len(shapes) >= 3:
            grad, weight = shapes[0], shapes[2]
            flops = 2.0 * 2.0 * grad[0] * math.prod(grad[2:]) * math.prod(weight)
        elif "conv" in name and len(shapes) >= 2 and len(shapes[0]) >= 3:
            x, weight = shapes[0], shapes[1]  # the output's size taken as the input's (stride 1)
            flops = 2.0 * x[0] * math.prod(x[2:]) * math.prod(weight)
        elif "scaled_dot_product" in name and len(shapes) >= 3 and len(shapes[0]) == 4:
            q, k = shapes[0], shapes[1]
            flops = 4.0 * q[0] * q[1] * q[2] * k[2] * q[3] * (2.0 if "backward" in name else 1.0)
    except (ValueError, TypeError, IndexError):
        flops = 0.0
    moved = float(sum(sizes) + out_bytes)
    lookup = gathered(name, dims, types)
    if lookup is not None:  # the rows read and written out, and the indices; not the table
        shape, item, rows = lookup
        moved = float(2 * rows * math.prod(shape[1:]) * item + sum(sizes[1:]))
    if ("norm" in name and "batch" in name) or "group_norm" in name or "instance_norm" in name:
        # training normalisation reads its input twice (statistics, then normalisation): 3
        # passes forward, 5 backward (grad and input for the reductions, again for grad_input)
        moved *= 5.0 / 3.0 if "backward" in name else 1.5
    return float(flops), moved, precision


def need_s(flops: float, nbytes: float, precision: str | None, device: str | None) -> float:
    """Seconds the work needs at the device's roofline (NaN when the device is unknown)."""
    peak = device_peaks.peak_flops(device, precision or "fp32") if flops else None
    bw = device_peaks.bandwidth(device)
    if bw is None:
        return float("nan")
    return max(flops / peak if peak else 0.0, nbytes / bw)
