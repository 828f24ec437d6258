"""Command-line values that read traindx's own knowledge (a step window, a log regex, a GPU
type); the generic ones (numbers, names, paths) are traindx.common.argtypes, re-exported here so
that a command reads every type from one module."""

from __future__ import annotations

from traindx.common.argtypes import (  # re-exported (__all__)
    DEFAULT_RUNS,
    NAME,
    PSEUDO_FILESYSTEMS,
    ArgumentParser,
    checked_by,
    existing_file,
    existing_folder,
    fail,
    folder_path,
    name,
    non_negative,
    non_negative_int,
    one_line,
    output_file,
    output_folder,
    pid,
    positive,
    positive_int,
    pyspy_rate,
    real,
    step_marker,
    subcommand_list,
    torch_profile,
    whole,
)

__all__ = [
    "ArgumentParser",
    "DEFAULT_RUNS",
    "NAME",
    "PSEUDO_FILESYSTEMS",
    "checked_by",
    "existing_file",
    "existing_folder",
    "fail",
    "folder_path",
    "gpu_type",
    "log_regex",
    "name",
    "non_negative",
    "non_negative_int",
    "one_line",
    "output_file",
    "output_folder",
    "pid",
    "positive",
    "positive_int",
    "pyspy_rate",
    "real",
    "step_marker",
    "step_window",
    "subcommand_list",
    "torch_profile",
    "whole",
]


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
