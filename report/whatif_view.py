"""Present a what-if analysis across ranks: the terminal summary with a worker heat map, and the
recorded and ideal timelines as Perfetto (Chrome trace event) JSON."""

from __future__ import annotations

import gzip
import json
import os
import sys
from typing import Any

import numpy as np
from rich.text import Text

from traindx.analyzers.core.findings import Finding
from traindx.common.console import Console
from traindx.derive.whatif import WhatIf
from traindx.report.terminal import findings_table

SHADES = " .:-=+*#%@"


def heat_map(r: WhatIf) -> list[str]:
    """One line per stage, one cell per DP rank: each worker's score (the slowdown it alone
    causes) as a shade, ' ' = none, '@' = the worst worker."""
    scores = r.worker_score
    if not scores:
        return []
    excess = {w: max(0.0, v - 1.0) for w, v in scores.items()}
    top = max(excess.values()) or 1.0
    lines = [f"worker heat map (rows: stages, columns: DP ranks; '@' = {top * 100:.0f} % slower alone)"]
    for stage in range(r.layout.pp):
        cells = "".join(
            SHADES[min(len(SHADES) - 1, int(round(excess.get((stage, d), 0.0) / top * (len(SHADES) - 1))))]
            for d in range(r.layout.dp)
        )
        lines.append(f"  stage {stage:>2} |{cells}|")
    return lines


def print_summary(path: str, r: WhatIf, findings: list[Finding], console: Console | None = None) -> None:
    console = console or Console(file=sys.stderr)
    console.rule("traindx what-if across ranks")
    lay = r.layout
    console.print(
        f"{path}: DP {lay.dp} x PP {lay.pp} workers, {len(r.steps)} steps; step time recorded "
        f"{np.mean(r.recorded):.3f} s, replayed {r.t_replayed:.3f} s, ideal {r.t_ideal:.3f} s",
        markup=False,
        highlight=False,
    )
    console.print(findings_table(findings, "lost / step", digits=3))
    for f in findings[:1]:
        console.print(Text(f.summary, style="cyan"))
    if lay.dp * lay.pp <= 4096:
        for line in heat_map(r):
            console.print(line, markup=False, highlight=False)


def _events(r: WhatIf, which: int, max_steps: int) -> list[dict[str, Any]]:
    sim = r.sim
    model, cube, rep = sim["model"], sim["cube"], sim["replayed"]
    start = rep.start[:, which] if which >= 0 else cube.start
    end = rep.end[:, which] if which >= 0 else cube.start + cube.duration
    optypes = model.nodes["optype"].astype(str).to_numpy()
    stages = model.nodes["pp"].to_numpy()
    events: list[dict[str, Any]] = []
    offset = 0.0
    n_steps = min(max_steps, start.shape[1])
    for s in range(n_steps):
        for d in range(start.shape[2]):
            pid = d
            for i in range(start.shape[0]):
                st, en = float(start[i, s, d]), float(end[i, s, d])
                events.append(
                    {
                        "name": optypes[i],
                        "ph": "X",
                        "pid": pid,
                        "tid": int(stages[i]),
                        "ts": (offset + st) * 1e6,
                        "dur": max(0.0, en - st) * 1e6,
                        "args": {"step": int(r.steps[s])},
                    }
                )
        offset += float(np.nanmax(end[:, s, :])) if end.size else 0.0
    for d in range(start.shape[2]):
        events.append({"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"DP rank {d}"}})
        events.extend(
            {"name": "thread_name", "ph": "M", "pid": d, "tid": st, "args": {"name": f"stage {st}"}}
            for st in range(r.layout.pp)
        )
    return events


def write_timelines(r: WhatIf, folder: str, max_steps: int = 5) -> list[str]:
    """recorded.json.gz and ideal.json.gz under `folder` (open them in ui.perfetto.dev): the
    first `max_steps` steps, one process per DP rank, one track per stage."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, which in (("recorded", -1), ("replayed", 0), ("ideal", 1)):
        path = os.path.join(folder, f"{name}.json.gz")
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump({"traceEvents": _events(r, which, max_steps), "displayTimeUnit": "ms"}, f)
        paths.append(path)
    return paths
