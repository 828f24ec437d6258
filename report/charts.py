"""Inline SVG charts for the HTML report, drawn in Python from the report data (no JS, no CDN).

Every string that reaches the SVG goes through markupsafe.escape: frame names, thread names and
kernel names come from the job. Tooltips are SVG <title> elements, which browsers show natively.
"""

import math

from markupsafe import Markup, escape

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


fmt_s = units.fmt_s  # defined once (traindx/common/units.py): the terminal and findings use it too


def fmt_tick(seconds):
    """Axis labels: as short as they can be (5 s, 2.5 s, 500 ms, 1.5 min)."""
    s = float(seconds)
    if s == 0:
        return "0"
    if abs(s) >= 120:
        return f"{s / 60:g} min"
    if abs(s) >= 1:
        return f"{s:g} s"
    return f"{s * 1e3:g} ms"


def _f(x):
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _nice_ticks(lo, hi, count=5):
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


class _Scale:
    def __init__(self, d0, d1, r0, r1):
        self.d0, self.d1, self.r0, self.r1 = d0, d1, r0, r1

    def __call__(self, v):
        if self.d1 == self.d0:
            return self.r0
        return self.r0 + (v - self.d0) / (self.d1 - self.d0) * (self.r1 - self.r0)


def _time_axis(x, y, t0, t1):
    parts = [f'<line x1="{LEFT}" y1="{_f(y)}" x2="{WIDTH - RIGHT}" y2="{_f(y)}" class="axis"/>']
    for t in _nice_ticks(t0, t1, 8):
        px = x(t)
        parts.append(
            f'<line x1="{_f(px)}" y1="{_f(y)}" x2="{_f(px)}" y2="{_f(y + 4)}" class="axis"/>'
            f'<text x="{_f(px)}" y="{_f(y + 15)}" class="tick" text-anchor="middle">{escape(fmt_tick(t))}</text>'
        )
    return "".join(parts)


def step_chart(timeline, compiles, stats, causes, by="time"):
    """Step times over the run; under them a lane of compile events and GC.

    by="time": x = seconds since the run started; each bar spans its step, so start-up and gaps
    between steps show. by="step": one equal bar per step, for runs where those dominate."""
    ranks = timeline["ranks"]
    if not ranks:
        return Markup("")
    rank = next(iter(ranks))
    steps = ranks[rank]
    end = max(timeline["end_s"], max((s["end_s"] for s in steps), default=0))
    height, top, bottom = 260, 10, 200
    lane_y = bottom + 28
    x = _Scale(0.0, end, LEFT, WIDTH - RIGHT)
    bar_w = (WIDTH - RIGHT - LEFT) / len(steps)

    def span(i, s):
        if by == "step":
            return LEFT + i * bar_w, LEFT + (i + 1) * bar_w
        return x(s["start_s"]), x(s["end_s"])

    heights = [s.get("max_s", s["duration_s"]) for s in steps]
    ymax = max(heights) * 1.08
    # a first step far slower than all the others (warm-up) would flatten them: cut its bar
    clipped = len(steps) >= 3 and heights[0] > 3 * max(heights[1:])
    if clipped:
        ymax = max(heights[1:]) * 1.35
    y = _Scale(0.0, ymax, bottom, top)
    chart_id = "step-chart" if by == "time" else "step-chart-by-step"
    out = [
        f'<svg class="chart step-chart" id="{chart_id}" data-by="{by}" viewBox="0 0 {WIDTH} {height}" '
        f'role="img" aria-label="step time over the run">'
    ]
    for t in _nice_ticks(0, ymax, 4):
        py = y(t)
        out.append(
            f'<line x1="{LEFT}" y1="{_f(py)}" x2="{WIDTH - RIGHT}" y2="{_f(py)}" class="grid"/>'
            f'<text x="{LEFT - 6}" y="{_f(py + 4)}" class="tick" text-anchor="end">{escape(fmt_tick(t))}</text>'
        )
    first_start = min(s["start_s"] for s in steps)
    startup_s = stats.get("startup_s") or first_start  # the one start-up value (report.data)
    if by == "time" and first_start > 0:
        out.append(
            f'<rect x="{LEFT}" y="{top}" width="{_f(x(first_start) - LEFT)}" height="{bottom - top}" '
            f'class="startup"><title>{escape("before the first step (start-up, imports, model build): " + fmt_s(startup_s))}</title></rect>'
            f'<text x="{_f((LEFT + x(first_start)) / 2)}" y="{top + 14}" class="band-label" text-anchor="middle">'
            f"{'start-up ' + escape(fmt_s(startup_s)) if x(first_start) - LEFT > 90 else ''}</text>"
        )
    for g in timeline.get("gaps", []) if by == "time" else []:
        if g["rank"] != rank:
            continue
        gx0, gx1 = x(g["start_s"]), x(g["end_s"])
        tip = (
            f"{fmt_s(g['duration_s'])} between step {g['after_step']} and step {g['before_step']}: "
            "outside any step (evaluation, checkpointing, a profiler export, …)"
        )
        out.append(
            f'<rect x="{_f(gx0)}" y="{top}" width="{_f(max(gx1 - gx0, 1))}" height="{bottom - top}" '
            f'class="gap"><title>{escape(tip)}</title></rect>'
        )
        if gx1 - gx0 > 60:
            out.append(
                f'<text x="{_f((gx0 + gx1) / 2)}" y="{top + 14}" class="band-label" text-anchor="middle">'
                f"{escape(fmt_s(g['duration_s']))} between steps</text>"
            )
    for i, s in enumerate(steps):
        x0, x1 = span(i, s)
        w = max(x1 - x0 - (1 if x1 - x0 > 4 else 0), 0.8)
        py = max(min(y(s["duration_s"]), bottom - 1.5), top)
        label = s.get("label") or f"step {s['step']}"
        if s.get("binned"):
            # a bin of steps: its median as a normal bar, its slowest step on top in its cause's colour
            tip = f"{label}: median {fmt_s(s['duration_s'])}, slowest {fmt_s(s['max_s'])}"
            if s["slow_count"]:
                tip += f"; {s['slow_count']} slow ({causes.get(s['cause'], s['cause'])})"
            top_y = max(min(y(s["max_s"]), bottom - 1.5), top)
            out.append(
                f'<rect class="step" data-cause="normal" x="{_f(x0)}" y="{_f(py)}" width="{_f(w)}" '
                f'height="{_f(bottom - py)}" fill="{CAUSE_COLOURS["normal"]}"><title>{escape(tip)}</title></rect>'
            )
            if s["slow_count"] and py - top_y > 0.5:
                out.append(
                    f'<rect class="step-top" data-cause="{escape(s["cause"])}" x="{_f(x0)}" y="{_f(top_y)}" '
                    f'width="{_f(w)}" height="{_f(py - top_y)}" fill="{CAUSE_COLOURS.get(s["cause"], "#999")}">'
                    f"<title>{escape(tip)}</title></rect>"
                )
            continue
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
        explained = {"compile": "compile_s", "autotune": "compile_s", "dynamo": "compile_s", "gc": "gc_s"}
        part = min(s.get(explained.get(s["cause"], ""), 0.0) or 0.0, s["duration_s"])
        split_y = y(part) if part else bottom
        if part and split_y - py > 1:
            out.append(
                f'<rect class="step" data-cause="{escape(s["cause"])}" x="{_f(x0)}" y="{_f(py)}" '
                f'width="{_f(w)}" height="{_f(bottom - py)}" fill="{CAUSE_COLOURS["normal"]}"><title>{escape(tip)}</title></rect>'
                f'<rect class="step-part" x="{_f(x0)}" y="{_f(split_y)}" width="{_f(w)}" height="{_f(bottom - split_y)}" '
                f'fill="{colour}"><title>{escape(tip)}</title></rect>'
            )
        else:
            out.append(
                f'<rect class="step" data-cause="{escape(s["cause"])}" x="{_f(x0)}" y="{_f(py)}" '
                f'width="{_f(w)}" height="{_f(bottom - py)}" fill="{colour}"><title>{escape(tip)}</title></rect>'
            )
    if by == "step":
        # a gap between steps has no width here: a dashed line between the two bars says it
        after = {g["after_step"]: g for g in timeline.get("gaps", []) if g["rank"] == rank}
        for i, s in enumerate(steps):
            g = after.get(s["step"] + s.get("binned", 1) - 1)
            if g:
                gx = span(i, s)[1]
                tip = f"{fmt_s(g['duration_s'])} between step {g['after_step']} and step {g['before_step']}"
                out.append(
                    f'<line x1="{_f(gx)}" y1="{top}" x2="{_f(gx)}" y2="{bottom}" class="gap-line">'
                    f"<title>{escape(tip)}</title></line>"
                )
    if clipped:
        x0, x1 = span(0, steps[0])
        note = f"step {steps[0]['step']}: {fmt_s(steps[0]['duration_s'])} (bar cut)"
        # beside the bar, on whichever side has room for the note
        lx, anchor = (x1 + 4, "start") if x1 + 4 + 6.3 * len(note) < WIDTH - RIGHT else (x0 - 4, "end")
        out.append(
            f'<path d="M{_f(x0)},{top + 9} L{_f(x1)},{top + 3} L{_f(x1)},{top + 8} L{_f(x0)},{top + 14} Z" '
            f'fill="#fff"/><text x="{_f(lx)}" y="{top + 12}" class="median-label" text-anchor="{anchor}">'
            f"{escape(note)}</text>"
        )
    med = stats.get("steady_median_s")
    if med:
        out.append(
            f'<line x1="{LEFT}" y1="{_f(y(med))}" x2="{WIDTH - RIGHT}" y2="{_f(y(med))}" class="median"/>'
            f'<text x="{WIDTH - RIGHT - 2}" y="{_f(y(med) - 4)}" class="median-label" text-anchor="end">'
            f"median {escape(fmt_s(med))}</text>"
        )
    # event lane: compiles as bars over their real duration (by time) or on their step's bar
    # (by step), GC as dots on steps that spent a tenth of their time collecting
    out.append(
        f'<text x="{LEFT - 6}" y="{lane_y + 4}" class="tick" text-anchor="end">events</text>'
        f'<line x1="{LEFT}" y1="{lane_y}" x2="{WIDTH - RIGHT}" y2="{lane_y}" class="lane"/>'
    )
    rank_compiles = [c for c in compiles if c["rank"] == rank]
    if by == "time":
        for c in rank_compiles:
            x0 = x(c["start_s"])
            w = max(x(c["end_s"]) - x0, 2)
            tip = (
                f"{c['kind']} compile of {c['kernel']} on thread {c['thread'] or '?'}: "
                f"{fmt_s(c['duration_s'])} (step {c['step']})"
            )
            if c.get("key_diff"):
                tip += "; key changed: " + ", ".join(
                    f"{d['field']}: {d['before']} → {d['after']}" for d in c["key_diff"][:3]
                )
            out.append(
                f'<rect class="compile-mark" data-kind="{escape(c["kind"])}" x="{_f(x0)}" y="{lane_y - 7}" '
                f'width="{_f(w)}" height="14" fill="{COMPILE_COLOURS.get(c["kind"], "#e4572e")}">'
                f"<title>{escape(tip)}</title></rect>"
            )
    else:
        index = {}
        for i, s in enumerate(steps):
            for n in range(s["step"], s["step"] + s.get("binned", 1)):
                index[n] = i
        per_bar = {}
        for c in rank_compiles:
            if c["step"] in index:
                per_bar.setdefault(index[c["step"]], []).append(c)
        for i, cs in per_bar.items():
            x0, x1 = span(i, steps[i])
            kernels = sorted({c["kernel"] for c in cs})
            tip = (
                f"{len(cs)} compile{'s' if len(cs) > 1 else ''}, {fmt_s(sum(c['duration_s'] for c in cs))}: "
                + ", ".join(kernels[:4])
                + (" …" if len(kernels) > 4 else "")
            )
            out.append(
                f'<rect class="compile-mark" data-kind="{escape(cs[0]["kind"])}" x="{_f(x0)}" y="{lane_y - 7}" '
                f'width="{_f(max(x1 - x0 - 1, 1))}" height="14" fill="{COMPILE_COLOURS.get(cs[0]["kind"], "#e4572e")}">'
                f"<title>{escape(tip)}</title></rect>"
            )
    for i, s in enumerate(steps) if len(steps) <= 300 else []:  # denser than that, the bars' colours say it
        if s.get("gc_s") and s["gc_s"] >= 0.1 * s["duration_s"]:
            x0, x1 = span(i, s)
            tip = f"step {s['step']}: garbage collection {fmt_s(s['gc_s'])}"
            out.append(
                f'<circle class="gc-mark" cx="{_f((x0 + x1) / 2)}" cy="{lane_y}" r="4" fill="{CAUSE_COLOURS["gc"]}">'
                f"<title>{escape(tip)}</title></circle>"
            )
    if by == "time":
        out.append(_time_axis(x, bottom, 0.0, end))
    else:
        out.append(f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" class="axis"/>')
        stride = max(1, math.ceil(len(steps) / 10))
        for i in range(0, len(steps), stride):
            x0, x1 = span(i, steps[i])
            out.append(
                f'<text x="{_f((x0 + x1) / 2)}" y="{bottom + 15}" class="tick" text-anchor="middle">'
                f"{escape(str(steps[i]['step']))}</text>"
            )
        out.append(f'<text x="{WIDTH - RIGHT}" y="{bottom + 15}" class="tick" text-anchor="end">step</text>')
    out.append("</svg>")
    return Markup("".join(out))


def gpu_charts(gpu, timeline):
    """One small chart per metric (utilization, SM clock, power), every GPU a line, on the step
    chart's time axis, with slow steps shaded so the two line up by eye."""
    if not gpu or not gpu.get("available"):
        return []
    end = timeline["end_s"]
    x = _Scale(0.0, end, LEFT, WIDTH - RIGHT)
    ranks = timeline["ranks"]
    slow = [s for s in (ranks[next(iter(ranks))] if ranks else []) if s["cause"] != "normal"]
    if len(slow) > 60:
        slow = []  # shading that many steps would hide the lines it is meant to explain
    charts = []
    for metric in ("util", "sm_clock_mhz", "power_w"):
        lines = [(g["gpu"], g["metrics"][metric]) for g in gpu["series"] if metric in g["metrics"]]
        if not lines:
            continue
        label, unit = lines[0][1]["label"], lines[0][1]["unit"]
        vmax = max((v for _, m in lines for v in m["values"] if v is not None), default=1.0)
        vmax = 100.0 if metric == "util" else vmax * 1.1 or 1.0
        height, top, bottom = 128, 20, 104
        y = _Scale(0.0, vmax, bottom, top)
        out = [
            f'<svg class="chart gpu-chart" data-metric="{metric}" viewBox="0 0 {WIDTH} {height}" role="img" '
            f'aria-label="GPU {escape(label)}">'
        ]
        for s in slow:
            out.append(
                f'<rect x="{_f(x(s["start_s"]))}" y="{top}" width="{_f(max(x(s["end_s"]) - x(s["start_s"]), 1))}" '
                f'height="{bottom - top}" fill="{CAUSE_COLOURS.get(s["cause"], "#999")}" opacity="0.12"/>'
            )
        for t in _nice_ticks(0, vmax, 2):
            out.append(
                f'<line x1="{LEFT}" y1="{_f(y(t))}" x2="{WIDTH - RIGHT}" y2="{_f(y(t))}" class="grid"/>'
                f'<text x="{LEFT - 6}" y="{_f(y(t) + 4)}" class="tick" text-anchor="end">{t:g}</text>'
            )
        out.append(
            f'<text x="{LEFT}" y="{top - 7}" class="chart-title">{escape(label)} ({escape(unit)})</text>'
        )
        if len(lines) > 1:
            for i, (index, _) in enumerate(lines):
                lx = WIDTH - RIGHT - (len(lines) - i) * 52
                out.append(
                    f'<rect x="{lx}" y="{top - 16}" width="10" height="10" fill="{GPU_COLOURS[i % len(GPU_COLOURS)]}"/>'
                    f'<text x="{lx + 13}" y="{top - 7}" class="tick">GPU {escape(index)}</text>'
                )
        for i, (index, m) in enumerate(lines):
            pts = " ".join(f"{_f(x(t))},{_f(y(v))}" for t, v in zip(m["t_s"], m["values"]) if v is not None)
            out.append(
                f'<polyline points="{pts}" fill="none" stroke="{GPU_COLOURS[i % len(GPU_COLOURS)]}" '
                f'stroke-width="1.5"><title>GPU {escape(index)} {escape(label)}</title></polyline>'
            )
        out.append(_time_axis(x, bottom, 0.0, end))
        out.append("</svg>")
        charts.append(Markup("".join(out)))
    return charts


def icicle(tree, height_per_row=17, max_rows=32):
    """The GIL holder's stacks, root on top: a frame's width is its share of the GIL samples."""
    total = tree["value"] or 1
    rows = []

    def depth(node, d=0):
        return max([d] + [depth(c, d + 1) for c in node["children"]]) if d < max_rows else d

    n_rows = depth(tree) + 1
    height = n_rows * height_per_row + 4
    inner = WIDTH - 2

    def walk(node, x0, d):
        w = node["value"] / total * inner
        if w < 0.5 or d >= max_rows:
            return
        share = node["value"] / total
        where = f"{node['file']}:{node['line']}" if node["file"] else ""
        tip = f"{node['name']}{'  ' + where if where else ''}\n{share:.1%} of GIL samples ({fmt_s(node['value'])})"
        colour = FRAME_COLOURS.get(node["kind"], "#c5cbd3")
        yy = d * height_per_row + 2
        chars = int((w - 6) / 6.6)
        text = (
            ""
            if chars < 3
            else (node["name"] if len(node["name"]) <= chars else node["name"][: chars - 1] + "…")
        )
        # data-x/-w (shares of the whole) and data-d let the page's script zoom into a frame
        rows.append(
            f'<g class="frame" data-kind="{escape(node["kind"])}" data-x="{x0 / inner:.6f}" '
            f'data-w="{w / inner:.6f}" data-d="{d}" data-name="{escape(node["name"])}">'
            f'<rect x="{_f(x0 + 1)}" y="{yy}" width="{_f(max(w - 1, 0.5))}" height="{height_per_row - 2}" '
            f'rx="2" fill="{colour}"/><text x="{_f(x0 + 3)}" y="{yy + 13}" class="frame-label">{escape(text)}</text>'
            f"<title>{escape(tip)}</title></g>"
        )
        cx = x0
        for child in node["children"]:
            walk(child, cx, d + 1)
            cx += child["value"] / total * inner

    walk(tree, 0.0, 0)
    return Markup(
        f'<svg class="chart icicle" data-inner="{inner}" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="stacks of the thread holding the GIL">{"".join(rows)}</svg>'
    )


def thread_lanes(lanes):
    """One row per thread: red while it held the GIL, amber while running without it, grey idle;
    compile events as outlined bars on the thread that ran them; the worst step highlighted."""
    if not lanes or not lanes["threads"]:
        return Markup("")
    label_w = 170
    row_h = 22
    threads = lanes["threads"]
    rows = len(threads) + (1 if lanes.get("steps") else 0)
    height = rows * row_h + 34
    x = _Scale(lanes["start_s"], lanes["end_s"], label_w, WIDTH - RIGHT)
    out = [f'<svg class="chart lanes" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="thread lanes">']
    sx0, sx1 = x(max(lanes["step_start_s"], lanes["start_s"])), x(min(lanes["step_end_s"], lanes["end_s"]))
    out.append(
        f'<rect x="{_f(sx0)}" y="0" width="{_f(max(sx1 - sx0, 1))}" height="{rows * row_h + 4}" '
        f'class="worst-step"><title>{escape("step " + str(lanes["step"]) + " (the slowest)")}</title></rect>'
    )
    step_row = bool(lanes.get("steps"))
    if step_row:
        out.append(f'<text x="{label_w - 6}" y="16" class="tick" text-anchor="end">steps</text>')
        for n, s in enumerate(lanes["steps"]):
            a, b = x(max(s["start_s"], lanes["start_s"])), x(min(s["end_s"], lanes["end_s"]))
            colour = CAUSE_COLOURS.get(s["cause"], CAUSE_COLOURS["normal"])
            out.append(
                f'<rect x="{_f(a)}" y="6" width="{_f(max(b - a - 0.5, 0.5))}" height="12" fill="{colour}" '
                f'opacity="{0.95 if n % 2 else 0.7}"><title>{escape("step " + str(s["step"]))}</title></rect>'
            )
    for i, th in enumerate(threads):
        yy = i * row_h + 4 + (row_h if step_row else 0)
        name = th["name"] if len(th["name"]) <= 24 else th["name"][:23] + "…"
        out.append(
            f'<text x="{label_w - 6}" y="{yy + 14}" class="tick" text-anchor="end">{escape(name)}'
            f"<title>{escape(th['name'])}</title></text>"
        )
        for seg in th["segments"]:
            a, b = x(max(seg["start_s"], lanes["start_s"])), x(min(seg["end_s"], lanes["end_s"]))
            state = {"gil": "holds the GIL", "active": "running, without the GIL", "idle": "idle / waiting"}[
                seg["state"]
            ]
            tip = f"{th['name']}: {state}\n" + "\n".join(seg["stack"] or [seg["frame"]])
            out.append(
                f'<rect class="seg" data-state="{seg["state"]}" x="{_f(a)}" y="{yy}" width="{_f(max(b - a, 1))}" '
                f'height="{row_h - 6}" fill="{STATE_COLOURS[seg["state"]]}"><title>{escape(tip)}</title></rect>'
            )
        for c in lanes["compiles"]:
            if c["thread"] and c["thread"] == th["name"]:
                a, b = x(max(c["start_s"], lanes["start_s"])), x(min(c["end_s"], lanes["end_s"]))
                out.append(
                    f'<rect x="{_f(a)}" y="{yy - 1}" width="{_f(max(b - a, 1))}" height="{row_h - 4}" '
                    f'class="lane-compile"><title>{escape("compiling " + c["kernel"] + ": " + fmt_s(c["end_s"] - c["start_s"]))}</title></rect>'
                )
    out.append(
        _time_axis(x, rows * row_h + 8, lanes["start_s"], lanes["end_s"]).replace(
            f'x1="{LEFT}"', f'x1="{label_w}"'
        )
    )
    out.append("</svg>")
    return Markup("".join(out))


def rank_heatmap(timeline, max_cols=300):
    """Ranks as rows, steps as columns, colour = step time relative to the median of all ranks:
    one straggler rank or one bad step stands out at a glance."""
    ranks = timeline["ranks"]
    if len(ranks) < 2:
        return Markup("")
    all_steps = sorted({s["step"] for rows in ranks.values() for s in rows})
    if not all_steps:
        return Markup("")
    cols = all_steps if len(all_steps) <= max_cols else all_steps[:: math.ceil(len(all_steps) / max_cols)]
    col_of = {st: i for i, st in enumerate(cols)}
    durations = sorted(s["duration_s"] for rows in ranks.values() for s in rows)
    med = durations[len(durations) // 2] or 1e-9
    label_w, row_h = 70, 16
    cw = (WIDTH - RIGHT - label_w) / len(cols)
    height = len(ranks) * row_h + 20
    out = [
        f'<svg class="chart heatmap" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="step time per rank">'
    ]
    for i, (rank, rows) in enumerate(ranks.items()):
        yy = i * row_h
        out.append(
            f'<text x="{label_w - 6}" y="{yy + 12}" class="tick" text-anchor="end">rank {escape(rank)}</text>'
        )
        for s in rows:
            if s["step"] not in col_of:
                continue
            ratio = s["duration_s"] / med
            # 1× median: pale; 2× and more: full red
            level = max(0.0, min(1.0, (ratio - 1.0)))
            colour = f"rgb(235,{int(240 - 180 * level)},{int(245 - 200 * level)})"
            tip = f"rank {rank}, step {s['step']}: {fmt_s(s['duration_s'])} ({ratio:.2g}× the median)"
            out.append(
                f'<rect x="{_f(label_w + col_of[s["step"]] * cw)}" y="{yy}" width="{_f(max(cw - 0.5, 0.5))}" '
                f'height="{row_h - 2}" fill="{colour}"><title>{escape(tip)}</title></rect>'
            )
    if timeline.get("ranks_total", 0) > len(ranks):  # a large job: the ranks worth a look
        out.append(
            f'<text x="{WIDTH - RIGHT}" y="{height - 4 - 12}" class="tick" text-anchor="end">'
            f"{len(ranks)} of {timeline['ranks_total']} ranks: the first, the slowest step's "
            f"and the slowest by median step</text>"
        )
    out.append(
        f'<text x="{label_w}" y="{height - 4}" class="tick">step {cols[0]}</text>'
        f'<text x="{WIDTH - RIGHT}" y="{height - 4}" class="tick" text-anchor="end">step {cols[-1]}</text>'
    )
    out.append("</svg>")
    return Markup("".join(out))


LEDGER_COLOURS = {
    "compile": "#e4572e",
    "autotune": "#9c51b6",
    "gc": "#e3a21a",
    "io": "#8c564b",
    "sync": "#17a2b8",
    "collective": "#2ca58d",
    "data": "#f08a24",
    "optimizer": "#6f42c1",
    "forward_backward": "#5b8def",
    "host": "#7a8b99",
    "unexplained": "#c5cbd3",
}


def ledger_chart(ledger):
    """The time ledger: one stacked bar per step (its wall time split into the measured
    categories, unexplained on top) and under it one bar of the run total."""
    if not ledger or not ledger.get("available") or not ledger.get("bars"):
        return Markup("")
    bars, cats, labels = ledger["bars"], ledger["categories"], ledger["labels"]
    height, top, bottom = 300, 10, 200
    peak = max(b["wall_s"] for b in bars) or 1e-9
    ticks = _nice_ticks(0.0, peak)
    y = _Scale(0.0, max([peak] + ticks), bottom, top)
    bar_w = (WIDTH - RIGHT - LEFT) / len(bars)
    out = [
        f'<svg class="chart ledger" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="time ledger per step">'
    ]
    for t in ticks:
        out.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{_f(y(t))}" y2="{_f(y(t))}" class="grid"/>'
            f'<text x="{LEFT - 6}" y="{_f(y(t) + 4)}" class="tick" text-anchor="end">{escape(fmt_tick(t))}</text>'
        )
    for i, b in enumerate(bars):
        x0 = LEFT + i * bar_w
        base = 0.0
        name = (
            f"step {b['step']}"
            if b["step"] == b["last_step"]
            else f"steps {b['step']}–{b['last_step']} (mean)"
        )
        for c in cats:
            v = b["parts"].get(c, 0.0)
            if v <= 0:
                continue
            y1, y0 = y(base + v), y(base)
            tip = f"{name}: {labels[c]} {fmt_s(v)} of {fmt_s(b['wall_s'])}"
            out.append(
                f'<rect x="{_f(x0)}" y="{_f(y1)}" width="{_f(max(bar_w - 0.6, 0.4))}" '
                f'height="{_f(max(y0 - y1, 0.2))}" fill="{LEDGER_COLOURS.get(c, "#999")}" '
                f'data-cat="{escape(c)}"><title>{escape(tip)}</title></rect>'
            )
            base += v
    out.append(
        f'<text x="{LEFT}" y="{bottom + 14}" class="tick">step {bars[0]["step"]}</text>'
        f'<text x="{WIDTH - RIGHT}" y="{bottom + 14}" class="tick" text-anchor="end">'
        f"step {bars[-1]['last_step']}</text>"
    )
    # the run total: one horizontal bar, same colours
    total = ledger["total"]
    all_s = sum(total.values()) or 1e-9
    ty, th = bottom + 40, 22
    out.append(f'<text x="{LEFT - 6}" y="{ty + 15}" class="tick" text-anchor="end">total</text>')
    x0 = LEFT
    span = WIDTH - RIGHT - LEFT
    for c in cats:
        v = total.get(c, 0.0)
        if v <= 0:
            continue
        w = span * v / all_s
        tip = f"all steps: {labels[c]} {fmt_s(v)} ({v / all_s:.0%})"
        out.append(
            f'<rect x="{_f(x0)}" y="{ty}" width="{_f(max(w, 0.4))}" height="{th}" '
            f'fill="{LEDGER_COLOURS.get(c, "#999")}" data-cat="{escape(c)}"><title>{escape(tip)}</title></rect>'
        )
        if w > 70:
            out.append(
                f'<text x="{_f(x0 + 4)}" y="{ty + 15}" class="tick" fill="#fff">'
                f"{escape(labels[c])} {v / all_s:.0%}</text>"
            )
        x0 += w
    out.append("</svg>")
    return Markup("".join(out))
