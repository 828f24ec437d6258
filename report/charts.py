"""Inline SVG charts for the HTML report, drawn in Python from the report data (no JS, no CDN).

Every string that reaches the SVG goes through markupsafe.escape: frame names, thread names and
kernel names come from the job. Tooltips are SVG <title> elements, which browsers show natively.
The shared canvas, palettes and scales are in report/svg.py; the step chart in report/step_chart.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from markupsafe import Markup, escape

from traindx.report.svg import (
    CAUSE_COLOURS,
    FRAME_COLOURS,
    GPU_COLOURS,
    LEDGER_COLOURS,
    LEFT,
    RIGHT,
    STATE_COLOURS,
    WIDTH,
    LinearScale,
    coord,
    fmt_s,
    fmt_tick,
    nice_ticks,
    time_axis,
    y_grid,
)


def gpu_charts(gpu: Mapping[str, Any] | None, timeline: Mapping[str, Any]) -> list[Markup]:
    """One small chart per metric (utilization, SM clock, power), every GPU a line, on the step
    chart's time axis, with slow steps shaded so the two line up by eye."""
    if not gpu or not gpu.get("available"):
        return []
    end = timeline["end_s"]
    x = LinearScale(0.0, end, LEFT, WIDTH - RIGHT)
    ranks = timeline["ranks"]
    slow = [s for s in (ranks[next(iter(ranks))] if ranks else []) if s["cause"] != "normal"]
    if len(slow) > 60:
        slow = []  # shading that many steps would hide the lines it is meant to explain
    charts = []
    for metric in ("util", "sm_clock_mhz", "power_w"):
        lines = [(g["gpu"], g["metrics"][metric]) for g in gpu["series"] if metric in g["metrics"]]
        if lines:
            charts.append(_gpu_chart(metric, lines, x, end, slow))
    return charts


def _gpu_chart(
    metric: str, lines: list[tuple[str, Mapping[str, Any]]], x: LinearScale, end: float, slow: list[Any]
) -> Markup:
    label, unit = lines[0][1]["label"], lines[0][1]["unit"]
    vmax = max((v for _, m in lines for v in m["values"] if v is not None), default=1.0)
    vmax = 100.0 if metric == "util" else vmax * 1.1 or 1.0
    height, top, bottom = 128, 20, 104
    y = LinearScale(0.0, vmax, bottom, top)
    out = [
        f'<svg class="chart gpu-chart" data-metric="{metric}" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="GPU {escape(label)}">'
    ]
    out += [
        f'<rect x="{coord(x(s["start_s"]))}" y="{top}" '
        f'width="{coord(max(x(s["end_s"]) - x(s["start_s"]), 1))}" '
        f'height="{bottom - top}" fill="{CAUSE_COLOURS.get(s["cause"], "#999")}" opacity="0.12"/>'
        for s in slow
    ]
    out += y_grid(y, nice_ticks(0, vmax, 2), lambda t: f"{t:g}")
    out.append(f'<text x="{LEFT}" y="{top - 7}" class="chart-title">{escape(label)} ({escape(unit)})</text>')
    if len(lines) > 1:
        for i, (index, _) in enumerate(lines):
            lx = WIDTH - RIGHT - (len(lines) - i) * 52
            out.append(
                f'<rect x="{lx}" y="{top - 16}" width="10" height="10" '
                f'fill="{GPU_COLOURS[i % len(GPU_COLOURS)]}"/>'
                f'<text x="{lx + 13}" y="{top - 7}" class="tick">GPU {escape(index)}</text>'
            )
    for i, (index, m) in enumerate(lines):
        pts = " ".join(f"{coord(x(t))},{coord(y(v))}" for t, v in zip(m["t_s"], m["values"]) if v is not None)
        out.append(
            f'<polyline points="{pts}" fill="none" stroke="{GPU_COLOURS[i % len(GPU_COLOURS)]}" '
            f'stroke-width="1.5"><title>GPU {escape(index)} {escape(label)}</title></polyline>'
        )
    out.append(time_axis(x, bottom, 0.0, end))
    out.append("</svg>")
    return Markup("".join(out))


def icicle(tree: Mapping[str, Any], height_per_row: int = 17, max_rows: int = 32) -> Markup:
    """The GIL holder's stacks, root on top: a frame's width is its share of the GIL samples."""
    total = tree["value"] or 1
    rows = []

    def depth(node: Mapping[str, Any], d: int = 0) -> int:
        return max([d] + [depth(c, d + 1) for c in node["children"]]) if d < max_rows else d

    n_rows = depth(tree) + 1
    height = n_rows * height_per_row + 4
    inner = WIDTH - 2

    def walk(node: Mapping[str, Any], x0: float, d: int) -> None:
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
            f'<rect x="{coord(x0 + 1)}" y="{yy}" width="{coord(max(w - 1, 0.5))}" height="{height_per_row - 2}" '
            f'rx="2" fill="{colour}"/><text x="{coord(x0 + 3)}" y="{yy + 13}" class="frame-label">{escape(text)}</text>'
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


def thread_lanes(lanes: Mapping[str, Any] | None) -> Markup:
    """One row per thread: red while it held the GIL, amber while running without it, grey idle;
    compile events as outlined bars on the thread that ran them; the worst step highlighted."""
    if not lanes or not lanes["threads"]:
        return Markup("")
    label_w = 170
    row_h = 22
    threads = lanes["threads"]
    rows = len(threads) + (1 if lanes.get("steps") else 0)
    height = rows * row_h + 34
    x = LinearScale(lanes["start_s"], lanes["end_s"], label_w, WIDTH - RIGHT)
    out = [f'<svg class="chart lanes" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="thread lanes">']
    sx0, sx1 = x(max(lanes["step_start_s"], lanes["start_s"])), x(min(lanes["step_end_s"], lanes["end_s"]))
    out.append(
        f'<rect x="{coord(sx0)}" y="0" width="{coord(max(sx1 - sx0, 1))}" height="{rows * row_h + 4}" '
        f'class="worst-step"><title>{escape("step " + str(lanes["step"]) + " (the slowest)")}</title></rect>'
    )
    step_row = bool(lanes.get("steps"))
    if step_row:
        out.append(f'<text x="{label_w - 6}" y="16" class="tick" text-anchor="end">steps</text>')
        for n, s in enumerate(lanes["steps"]):
            a, b = x(max(s["start_s"], lanes["start_s"])), x(min(s["end_s"], lanes["end_s"]))
            colour = CAUSE_COLOURS.get(s["cause"], CAUSE_COLOURS["normal"])
            out.append(
                f'<rect x="{coord(a)}" y="6" width="{coord(max(b - a - 0.5, 0.5))}" height="12" fill="{colour}" '
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
                f'<rect class="seg" data-state="{seg["state"]}" x="{coord(a)}" y="{yy}" width="{coord(max(b - a, 1))}" '
                f'height="{row_h - 6}" fill="{STATE_COLOURS[seg["state"]]}"><title>{escape(tip)}</title></rect>'
            )
        for c in lanes["compiles"]:
            if c["thread"] and c["thread"] == th["name"]:
                a, b = x(max(c["start_s"], lanes["start_s"])), x(min(c["end_s"], lanes["end_s"]))
                out.append(
                    f'<rect x="{coord(a)}" y="{yy - 1}" width="{coord(max(b - a, 1))}" height="{row_h - 4}" '
                    f'class="lane-compile"><title>{escape("compiling " + c["kernel"] + ": " + fmt_s(c["end_s"] - c["start_s"]))}</title></rect>'
                )
    out.append(
        time_axis(x, rows * row_h + 8, lanes["start_s"], lanes["end_s"]).replace(
            f'x1="{LEFT}"', f'x1="{label_w}"'
        )
    )
    out.append("</svg>")
    return Markup("".join(out))


def rank_heatmap(timeline: Mapping[str, Any], max_cols: int = 300) -> Markup:
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
                f'<rect x="{coord(label_w + col_of[s["step"]] * cw)}" y="{yy}" width="{coord(max(cw - 0.5, 0.5))}" '
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


def ledger_chart(ledger: Mapping[str, Any] | None) -> Markup:
    """The time ledger: one stacked bar per step (its wall time split into the measured
    categories, unexplained on top) and under it one bar of the run total."""
    if not ledger or not ledger.get("available") or not ledger.get("bars"):
        return Markup("")
    bars, cats, labels = ledger["bars"], ledger["categories"], ledger["labels"]
    height, top, bottom = 300, 10, 200
    peak = max(b["wall_s"] for b in bars) or 1e-9
    ticks = nice_ticks(0.0, peak)
    y = LinearScale(0.0, max([peak] + ticks), bottom, top)
    bar_w = (WIDTH - RIGHT - LEFT) / len(bars)
    out = [
        f'<svg class="chart ledger" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="time ledger per step">'
    ]
    out += [  # x1 x2 y1 y2: this chart's grid has always named them in that order
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{coord(y(t))}" y2="{coord(y(t))}" class="grid"/>'
        f'<text x="{LEFT - 6}" y="{coord(y(t) + 4)}" class="tick" text-anchor="end">{escape(fmt_tick(t))}</text>'
        for t in ticks
    ]
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
                f'<rect x="{coord(x0)}" y="{coord(y1)}" width="{coord(max(bar_w - 0.6, 0.4))}" '
                f'height="{coord(max(y0 - y1, 0.2))}" fill="{LEDGER_COLOURS.get(c, "#999")}" '
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
            f'<rect x="{coord(x0)}" y="{ty}" width="{coord(max(w, 0.4))}" height="{th}" '
            f'fill="{LEDGER_COLOURS.get(c, "#999")}" data-cat="{escape(c)}"><title>{escape(tip)}</title></rect>'
        )
        if w > 70:
            out.append(
                f'<text x="{coord(x0 + 4)}" y="{ty + 15}" class="tick" fill="#fff">'
                f"{escape(labels[c])} {v / all_s:.0%}</text>"
            )
        x0 += w
    out.append("</svg>")
    return Markup("".join(out))
