"""Command-line values that read traindx's own knowledge (a step window, a log regex, a GPU
type); the generic ones (numbers, names, paths) are traindx.common.argtypes, re-exported here so
that a command reads every type from one module."""

from __future__ import annotations

from traindx.common.argtypes import *  # noqa: F403  (one module for every command's types)
from traindx.common.argtypes import checked_by, fail


def step_window(text: str) -> str:
    """FIRST:LAST, both inclusive, 0-based (kept as text: recipes.stats.parse_window reads it)."""
    from traindx.derive.stats import parse_window  # lazy: numpy, not for `diagnose --help`

    checked: str = checked_by(parse_window, text)
    return checked


def log_regex(text: str) -> str:
    from traindx.profiler.logparse import compile_custom  # lazy: only when the flag is given

    checked: str = checked_by(compile_custom, text)
    return checked


def gpu_type(text: str) -> str:
    from traindx.derive.throughput import PEAK_BF16_TFLOPS, normalize_gpu  # lazy: numpy

    gpu = normalize_gpu(text)
    if gpu is None:
        fail(f"{text!r}: unknown GPU type (known: {', '.join(PEAK_BF16_TFLOPS)})")
    return text
