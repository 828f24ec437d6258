"""Runtime patches that change how the GPU does the job's math, applied only when `diagnose --fix`
asks for them in a candidate run (TRAINDX_RUNTIME_PATCHES, like runtime_patches.py):

- `fp32_matmul_high`: `torch.set_float32_matmul_precision("high")` as torch is imported (float32
  matmuls on TF32 tensor cores), kept there when the job later asks for "highest" (PyTorch's
  default, which most jobs never set: a job that set it asked for exactness the fix must not
  break is still run with the patch only as a candidate arm, whose losses are checked).
- `cudnn_benchmark_off`: cuDNN benchmark mode kept off (`torch.backends.cudnn.benchmark = True`
  in the job is ignored): no algorithm search for each new input shape.

Each is noted once in the events (`runtime_patch_installed`), so the arm proves it ran.
"""

from __future__ import annotations

from . import emit, importhooks, runtime_patches, schema

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

FP32_MATMUL_HIGH = "fp32_matmul_high"
CUDNN_BENCHMARK_OFF = "cudnn_benchmark_off"


def _fp32_high(torch: Any) -> None:
    original = torch.set_float32_matmul_precision
    original("high")

    def set_float32_matmul_precision(precision: str) -> None:
        original("high" if precision == "highest" else precision)

    torch.set_float32_matmul_precision = set_float32_matmul_precision
    emit(schema.RUNTIME_PATCH_INSTALLED, patch=FP32_MATMUL_HIGH)


def _benchmark_off(torch: Any) -> None:
    cudnn = torch.backends.cudnn
    cudnn.benchmark = False
    holder = type(cudnn)
    prop: Any = holder.__dict__.get("benchmark")
    if prop is not None and hasattr(prop, "__set__"):
        getter = prop.__get__

        class _Off:
            def __get__(self, obj: Any, objtype: Any = None) -> Any:
                return getter(obj, objtype)

            def __set__(self, obj: Any, value: Any) -> None:
                prop.__set__(obj, False)

        holder.benchmark = _Off()
    emit(schema.RUNTIME_PATCH_INSTALLED, patch=CUDNN_BENCHMARK_OFF)


def register() -> None:
    asked = runtime_patches.requested()
    if FP32_MATMUL_HIGH in asked:
        importhooks.on_import("torch", _fp32_high)
    if CUDNN_BENCHMARK_OFF in asked:
        importhooks.on_import("torch", _benchmark_off)
