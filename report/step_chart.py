"""The step chart of the HTML report: step times over the run and, under them, a lane of compile
events and GC. Two views: by time (each bar spans its step, so start-up and gaps between steps
show) and by step (one equal bar per step, for runs where those dominate)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup, escape

from traindx.report.svg import (
    CAUSE_COLOURS,
    COMPILE_COLOURS,
    LEFT,
    RIGHT,
    WIDTH,
    LinearScale,
    coord,
    fmt_s,
    fmt_tick,
    nice_ticks,
    time_axis,
    y_grid,
)

Row = Mapping[str, Any]

HEIGHT, TOP, BOTTOM = 260, 10, 200
LANE_Y = BOTTOM + 28
# the part of a step its cause explains, drawn at the bottom of its bar in the cause's colour
EXPLAINED_BY = {"compile": "compile_s", "autotune": "compile_s", "dynamo": "compile_s", "gc": "gc_s"}


@dataclass(frozen=True)
class _Frame:
    """One chart's geometry: the steps of the rank drawn, and where a step or a time falls."""

    by: str
    rank: str
    steps: Sequence[Row]
    end: float
    x: LinearScale
    y: LinearScale
    bar_w: float

    def span(self, i: int, s: Row) -> tuple[float, float]:
        if self.by == "step":
            return LEFT + i * self.bar_w, LEFT + (i + 1) * self.bar_w
        return self.x(s["start_s"]), self.x(s["end_s"])

    def bar_top(self, seconds: float) -> float:
        return max(min(self.y(seconds), BOTTOM - 1.5), TOP)


def step_chart(
    timeline: Mapping[str, Any],
    compiles: Sequence[Row],
    stats: Mapping[str, Any],
    causes: Mapping[str, str],
    by: str = "time",
) -> Markup:
    """Step times over the run; under them a lane of compile events and GC.

    by="time": x = seconds since the run started; each bar spans its step, so start-up and gaps
    between steps show. by="step": one equal bar per step, for runs where those dominate."""
    ranks = timeline["ranks"]
    if not ranks:
        return Markup("")
    rank = next(iter(ranks))
    steps = ranks[rank]
    end = max(timeline["end_s"], max((s["end_s"] for s in steps), default=0))
    heights = [s.get("max_s", s["duration_s"]) for s in steps]
    ymax = max(heights) * 1.08
    # a first step far slower than all the others (warm-up) would flatten them: cut its bar
    clipped = len(steps) >= 3 and heights[0] > 3 * max(heights[1:])
    if clipped:
        ymax = max(heights[1:]) * 1.35
    frame = _Frame(
        by=by,
        rank=rank,
        steps=steps,
        end=end,
        x=LinearScale(0.0, end, LEFT, WIDTH - RIGHT),
        y=LinearScale(0.0, ymax, BOTTOM, TOP),
        bar_w=(WIDTH - RIGHT - LEFT) / len(steps),
    )
    chart_id = "step-chart" if by == "time" else "step-chart-by-step"
    out = [
        f'<svg class="chart step-chart" id="{chart_id}" data-by="{by}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" aria-label="step time over the run">',
        *y_grid(frame.y, nice_ticks(0, ymax, 4), lambda t: escape(fmt_tick(t))),
    ]
    gaps = timeline.get("gaps", [])
    if by == "time":
        out += _startup_band(frame, stats)
        out += _gap_bands(frame, gaps)
    out += [_step_bar(frame, i, s, causes) for i, s in enumerate(steps)]
    if by == "step":
        out += _gap_lines(frame, gaps)
    if clipped:
        out.append(_clipped_note(frame))
    out += _median_line(frame, stats.get("steady_median_s"))
    out += _event_lane(frame, [c for c in compiles if c["rank"] == rank])
    out += _x_axis(frame)
    out.append("</svg>")
    return Markup("".join(out))


def _startup_band(frame: _Frame, stats: Mapping[str, Any]) -> list[str]:
    first_start = min(s["start_s"] for s in frame.steps)
    if first_start <= 0:
        return []
    startup_s = stats.get("startup_s") or first_start  # the one start-up value (report.data)
    x, width = frame.x(first_start), frame.x(first_start) - LEFT
    tip = "before the first step (start-up, imports, model build): " + fmt_s(startup_s)
    return [
        f'<rect x="{LEFT}" y="{TOP}" width="{coord(width)}" height="{BOTTOM - TOP}" '
        f'class="startup"><title>{escape(tip)}</title></rect>'
        f'<text x="{coord((LEFT + x) / 2)}" y="{TOP + 14}" class="band-label" text-anchor="middle">'
        f"{'start-up ' + escape(fmt_s(startup_s)) if width > 90 else ''}</text>"
    ]


def _gap_bands(frame: _Frame, gaps: Sequence[Row]) -> list[str]:
    out = []
    for g in gaps:
        if g["rank"] != frame.rank:
            continue
        gx0, gx1 = frame.x(g["start_s"]), frame.x(g["end_s"])
        tip = (
            f"{fmt_s(g['duration_s'])} between step {g['after_step']} and step {g['before_step']}: "
            "outside any step (evaluation, checkpointing, a profiler export, …)"
        )
        out.append(
            f'<rect x="{coord(gx0)}" y="{TOP}" width="{coord(max(gx1 - gx0, 1))}" height="{BOTTOM - TOP}" '
            f'class="gap"><title>{escape(tip)}</title></rect>'
        )
        if gx1 - gx0 > 60:
            out.append(
                f'<text x="{coord((gx0 + gx1) / 2)}" y="{TOP + 14}" class="band-label" text-anchor="middle">'
                f"{escape(fmt_s(g['duration_s']))} between steps</text>"
            )
    return out


def _step_bar(frame: _Frame, i: int, s: Row, causes: Mapping[str, str]) -> str:
    x0, x1 = frame.span(i, s)
    w = max(x1 - x0 - (1 if x1 - x0 > 4 else 0), 0.8)
    py = frame.bar_top(s["duration_s"])
    label = s.get("label") or f"step {s['step']}"
    if s.get("binned"):
        return _binned_bar(frame, s, label, x0, w, py, causes)
    colour = CAUSE_COLOURS.get(s["cause"], CAUSE_COLOURS["normal"])
    tip = f"{label}: {fmt_s(s['duration_s'])}"
    if s["cause"] != "normal":
        tip += f" — {causes.get(s['cause'], s['cause'])}"
    if s.get("compile_s"):
        tip += f"; compiling {fmt_s(s['compile_s'])}"
    if s.get("gc_s"):
        tip += f"; GC {fmt_s(s['gc_s'])}"
    # the part of the step its cause explains at the bottom, in the cause's colour; the
    # rest in the normal colour: how much a fix could take off is visible at once
    part = min(s.get(EXPLAINED_BY.get(s["cause"], ""), 0.0) or 0.0, s["duration_s"])
    split_y = frame.y(part) if part else BOTTOM
    if part and split_y - py > 1:
        return (
            f'<rect class="step" data-cause="{escape(s["cause"])}" x="{coord(x0)}" y="{coord(py)}" '
            f'width="{coord(w)}" height="{coord(BOTTOM - py)}" fill="{CAUSE_COLOURS["normal"]}">'
            f"<title>{escape(tip)}</title></rect>"
            f'<rect class="step-part" x="{coord(x0)}" y="{coord(split_y)}" width="{coord(w)}" '
            f'height="{coord(BOTTOM - split_y)}" fill="{colour}"><title>{escape(tip)}</title></rect>'
        )
    return (
        f'<rect class="step" data-cause="{escape(s["cause"])}" x="{coord(x0)}" y="{coord(py)}" '
        f'width="{coord(w)}" height="{coord(BOTTOM - py)}" fill="{colour}"><title>{escape(tip)}</title></rect>'
    )


def _binned_bar(
    frame: _Frame, s: Row, label: str, x0: float, w: float, py: float, causes: Mapping[str, str]
) -> str:
    """A bin of steps: its median as a normal bar, its slowest step on top in its cause's colour."""
    tip = f"{label}: median {fmt_s(s['duration_s'])}, slowest {fmt_s(s['max_s'])}"
    if s["slow_count"]:
        tip += f"; {s['slow_count']} slow ({causes.get(s['cause'], s['cause'])})"
    top_y = frame.bar_top(s["max_s"])
    out = (
        f'<rect class="step" data-cause="normal" x="{coord(x0)}" y="{coord(py)}" width="{coord(w)}" '
        f'height="{coord(BOTTOM - py)}" fill="{CAUSE_COLOURS["normal"]}"><title>{escape(tip)}</title></rect>'
    )
    if s["slow_count"] and py - top_y > 0.5:
        out += (
            f'<rect class="step-top" data-cause="{escape(s["cause"])}" x="{coord(x0)}" y="{coord(top_y)}" '
            f'width="{coord(w)}" height="{coord(py - top_y)}" fill="{CAUSE_COLOURS.get(s["cause"], "#999")}">'
            f"<title>{escape(tip)}</title></rect>"
        )
    return out


def _gap_lines(frame: _Frame, gaps: Sequence[Row]) -> list[str]:
    """By step, a gap between steps has no width: a dashed line between the two bars says it."""
    after = {g["after_step"]: g for g in gaps if g["rank"] == frame.rank}
    out = []
    for i, s in enumerate(frame.steps):
        g = after.get(s["step"] + s.get("binned", 1) - 1)
        if g:
            gx = frame.span(i, s)[1]
            tip = f"{fmt_s(g['duration_s'])} between step {g['after_step']} and step {g['before_step']}"
            out.append(
                f'<line x1="{coord(gx)}" y1="{TOP}" x2="{coord(gx)}" y2="{BOTTOM}" class="gap-line">'
                f"<title>{escape(tip)}</title></line>"
            )
    return out


def _clipped_note(frame: _Frame) -> str:
    first = frame.steps[0]
    x0, x1 = frame.span(0, first)
    note = f"step {first['step']}: {fmt_s(first['duration_s'])} (bar cut)"
    # beside the bar, on whichever side has room for the note
    lx, anchor = (x1 + 4, "start") if x1 + 4 + 6.3 * len(note) < WIDTH - RIGHT else (x0 - 4, "end")
    return (
        f'<path d="M{coord(x0)},{TOP + 9} L{coord(x1)},{TOP + 3} L{coord(x1)},{TOP + 8} L{coord(x0)},{TOP + 14} Z" '
        f'fill="#fff"/><text x="{coord(lx)}" y="{TOP + 12}" class="median-label" text-anchor="{anchor}">'
        f"{escape(note)}</text>"
    )


def _median_line(frame: _Frame, med: float | None) -> list[str]:
    if not med:
        return []
    my = frame.y(med)
    return [
        f'<line x1="{LEFT}" y1="{coord(my)}" x2="{WIDTH - RIGHT}" y2="{coord(my)}" class="median"/>'
        f'<text x="{WIDTH - RIGHT - 2}" y="{coord(my - 4)}" class="median-label" text-anchor="end">'
        f"median {escape(fmt_s(med))}</text>"
    ]


def _event_lane(frame: _Frame, compiles: Sequence[Row]) -> list[str]:
    """Compiles as bars over their real duration (by time) or on their step's bar (by step), GC
    as dots on steps that spent a tenth of their time collecting."""
    out = [
        f'<text x="{LEFT - 6}" y="{LANE_Y + 4}" class="tick" text-anchor="end">events</text>'
        f'<line x1="{LEFT}" y1="{LANE_Y}" x2="{WIDTH - RIGHT}" y2="{LANE_Y}" class="lane"/>'
    ]
    if frame.by == "time":
        out += [_compile_mark(frame, c) for c in compiles]
    else:
        out += _compile_marks_per_bar(frame, compiles)
    out += _gc_marks(frame)
    return out


def _compile_mark(frame: _Frame, c: Row) -> str:
    x0 = frame.x(c["start_s"])
    w = max(frame.x(c["end_s"]) - x0, 2)
    tip = (
        f"{c['kind']} compile of {c['kernel']} on thread {c['thread'] or '?'}: "
        f"{fmt_s(c['duration_s'])} (step {c['step']})"
    )
    if c.get("key_diff"):
        tip += "; key changed: " + ", ".join(
            f"{d['field']}: {d['before']} → {d['after']}" for d in c["key_diff"][:3]
        )
    return (
        f'<rect class="compile-mark" data-kind="{escape(c["kind"])}" x="{coord(x0)}" y="{LANE_Y - 7}" '
        f'width="{coord(w)}" height="14" fill="{COMPILE_COLOURS.get(c["kind"], "#e4572e")}">'
        f"<title>{escape(tip)}</title></rect>"
    )


def _compile_marks_per_bar(frame: _Frame, compiles: Sequence[Row]) -> list[str]:
    index = {}
    for i, s in enumerate(frame.steps):
        for n in range(s["step"], s["step"] + s.get("binned", 1)):
            index[n] = i
    per_bar: dict[int, list[Row]] = {}
    for c in compiles:
        if c["step"] in index:
            per_bar.setdefault(index[c["step"]], []).append(c)
    out = []
    for i, cs in per_bar.items():
        x0, x1 = frame.span(i, frame.steps[i])
        kernels = sorted({c["kernel"] for c in cs})
        tip = (
            f"{len(cs)} compile{'s' if len(cs) > 1 else ''}, {fmt_s(sum(c['duration_s'] for c in cs))}: "
            + ", ".join(kernels[:4])
            + (" …" if len(kernels) > 4 else "")
        )
        out.append(
            f'<rect class="compile-mark" data-kind="{escape(cs[0]["kind"])}" x="{coord(x0)}" y="{LANE_Y - 7}" '
            f'width="{coord(max(x1 - x0 - 1, 1))}" height="14" '
            f'fill="{COMPILE_COLOURS.get(cs[0]["kind"], "#e4572e")}"><title>{escape(tip)}</title></rect>'
        )
    return out


def _gc_marks(frame: _Frame) -> list[str]:
    if len(frame.steps) > 300:  # denser than that, the bars' colours say it
        return []
    out = []
    for i, s in enumerate(frame.steps):
        if s.get("gc_s") and s["gc_s"] >= 0.1 * s["duration_s"]:
            x0, x1 = frame.span(i, s)
            tip = f"step {s['step']}: garbage collection {fmt_s(s['gc_s'])}"
            out.append(
                f'<circle class="gc-mark" cx="{coord((x0 + x1) / 2)}" cy="{LANE_Y}" r="4" '
                f'fill="{CAUSE_COLOURS["gc"]}"><title>{escape(tip)}</title></circle>'
            )
    return out


def _x_axis(frame: _Frame) -> list[str]:
    if frame.by == "time":
        return [time_axis(frame.x, BOTTOM, 0.0, frame.end)]
    out = [f'<line x1="{LEFT}" y1="{BOTTOM}" x2="{WIDTH - RIGHT}" y2="{BOTTOM}" class="axis"/>']
    stride = max(1, math.ceil(len(frame.steps) / 10))
    for i in range(0, len(frame.steps), stride):
        x0, x1 = frame.span(i, frame.steps[i])
        out.append(
            f'<text x="{coord((x0 + x1) / 2)}" y="{BOTTOM + 15}" class="tick" text-anchor="middle">'
            f"{escape(str(frame.steps[i]['step']))}</text>"
        )
    out.append(f'<text x="{WIDTH - RIGHT}" y="{BOTTOM + 15}" class="tick" text-anchor="end">step</text>')
    return out
