"""What every inline SVG chart of the report shares: the canvas, the palettes, number and tick
formatting, linear scales and the time axis. Every string from the job that reaches an SVG goes
through markupsafe.escape (frame, thread and kernel names come from the job)."""

from __future__ import annotations

import math
from collections.abc import Callable

from markupsafe import escape

from traindx.common import units
from traindx.profiler.shim._traindx_shim import schema

WIDTH = 1000  # viewBox units; the SVG scales to the page width
LEFT = 56  # room for the y axis labels
RIGHT = 12

CAUSE_COLOURS = {
    "normal": "#5b8def",
    "compile": "#e4572e",
    "autotune": "#9c51b6",
    "dynamo": "#d6428f",
    "gc": "#e3a21a",
    "warmup": "#9aa5b1",
    "stopped": "#343a40",
    "unexplained": "#6c757d",
}
COMPILE_COLOURS = {
    schema.COMPILE_CUTE_DSL: "#e4572e",
    schema.COMPILE_TRITON: "#f08a24",
    schema.COMPILE_TRITON_AUTOTUNE: "#9c51b6",
    schema.COMPILE_DYNAMO: "#d6428f",
}
STATE_COLOURS = {"gil": "#e4572e", "active": "#f2b33d", "idle": "#dde2e8"}
FRAME_COLOURS = {
    "user": "#f4a259",
    "traindx": "#d9c7ef",
    "library": "#8ab6d6",
    "python": "#c5cbd3",
    "native": "#b8c1cc",
    "thread": "#7d8a99",
    "root": "#5c6773",
}
GPU_COLOURS = ["#2b7de9", "#e4572e", "#2ca58d", "#9c51b6", "#f2b33d", "#d6428f", "#6c757d", "#17a2b8"]
LEDGER_COLOURS = {
    "compile": "#e4572e",
    "autotune": "#9c51b6",
    "gc": "#e3a21a",
    "traindx": "#d9c7ef",
    "io": "#8c564b",
    "sync": "#17a2b8",
    "collective": "#2ca58d",
    "data": "#f08a24",
    "optimizer": "#6f42c1",
    "forward_backward": "#5b8def",
    "eval": "#a3c4f3",
    "gpu": "#1f4e9c",
    "host": "#7a8b99",
    "unexplained": "#c5cbd3",
}

fmt_s = units.fmt_s  # defined once (traindx/common/units.py): the terminal and findings use it too

Scale = Callable[[float], float]


def fmt_tick(seconds: float) -> str:
    """Axis labels: as short as they can be (5 s, 2.5 s, 500 ms, 1.5 min)."""
    s = float(seconds)
    if s == 0:
        return "0"
    if abs(s) >= 120:
        return f"{s / 60:g} min"
    if abs(s) >= 1:
        return f"{s:g} s"
    return f"{s * 1e3:g} ms"


def coord(x: float) -> str:
    """A coordinate with at most two decimals and no trailing zeros."""
    return f"{x:.2f}".rstrip("0").rstrip(".")


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    first = math.ceil(lo / step) * step
    ticks, t = [], first
    while t <= hi + 1e-12:
        ticks.append(round(t, 12))
        t += step
    return ticks


class LinearScale:
    """Maps the domain [d0, d1] onto the range [r0, r1] (a flat domain maps to r0)."""

    def __init__(self, d0: float, d1: float, r0: float, r1: float) -> None:
        self.d0, self.d1, self.r0, self.r1 = d0, d1, r0, r1

    def __call__(self, v: float) -> float:
        if self.d1 == self.d0:
            return self.r0
        return self.r0 + (v - self.d0) / (self.d1 - self.d0) * (self.r1 - self.r0)


def time_axis(x: Scale, y: float, t0: float, t1: float) -> str:
    parts = [f'<line x1="{LEFT}" y1="{coord(y)}" x2="{WIDTH - RIGHT}" y2="{coord(y)}" class="axis"/>']
    for t in nice_ticks(t0, t1, 8):
        px = x(t)
        parts.append(
            f'<line x1="{coord(px)}" y1="{coord(y)}" x2="{coord(px)}" y2="{coord(y + 4)}" class="axis"/>'
            f'<text x="{coord(px)}" y="{coord(y + 15)}" class="tick" text-anchor="middle">'
            f"{escape(fmt_tick(t))}</text>"
        )
    return "".join(parts)


def y_grid(y: Scale, ticks: list[float], label: Callable[[float], str]) -> list[str]:
    """A horizontal grid line and its label at the left for every tick."""
    return [
        f'<line x1="{LEFT}" y1="{coord(y(t))}" x2="{WIDTH - RIGHT}" y2="{coord(y(t))}" class="grid"/>'
        f'<text x="{LEFT - 6}" y="{coord(y(t) + 4)}" class="tick" text-anchor="end">{label(t)}</text>'
        for t in ticks
    ]
