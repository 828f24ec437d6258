"""A parameter worked on whole while its forward read a few rows of it (gpu_places' test of a
table's gradient and update against what the step's work needs, derive/place_params.py): a
lookup table (an embedding) whose forward gathers some rows, while every step its gradient is
made dense (the whole table zeroed, the rows scattered in) and the optimizer reads and writes
every row. The step's work needs only the rows read; nothing here knows what the table is for.

A table whose rows are ≥ MIN_NEED_RATIO × the rows its gathers named in a step, and whose
whole-table backward and optimizer work takes ≥ MIN_PLACE_SHARE of the step, is named at the
gather's module and line, priced at that work's time for the rows no gather read.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.gpu.place_host import MIN_NEED_RATIO, MIN_PLACE_SHARE
from traindx.common.units import fmt_s
from traindx.derive import places as P


def dense_places(
    view: P.RankPlaces, saving_of: Callable[[float], float], severity_of: Callable[[float], str]
) -> list[Finding]:
    """The tables whose whole-table gradient and update cost ≥ MIN_PLACE_SHARE of the step while
    their forward read ≤ 1/MIN_NEED_RATIO of their rows."""
    t = view.tables
    if not len(t) or not view.wall_s:
        return []
    out = []
    for r in t.itertuples(index=False):
        rows, read, gpu_s = float(r.rows), float(r.rows_read), float(r.gpu_s)
        if not read > 0 or rows < MIN_NEED_RATIO * read or gpu_s / view.wall_s < MIN_PLACE_SHARE:
            continue
        spared = 1.0 - read / rows  # the rows at most as many as the indices named
        saving = saving_of(gpu_s * spared)
        line = P.frame_text(r.line) if isinstance(r.line, str) else None
        shape = "×".join(str(x) for x in r.shape)
        phases = ", ".join(f"{p} {fmt_s(s)}" for p, s in sorted(r.phases.items(), key=lambda kv: -kv[1]))
        out.append(
            Finding(
                id="gpu.place_slow",
                title=(
                    f"{r.module}: its {shape} table's gradient and update cover all {rows:,.0f} rows "
                    f"each step ({fmt_s(gpu_s)} of GPU a step, {gpu_s / view.wall_s:.0%} of the step) "
                    f"while its forward read at most {read:,.0f} ({read / rows:.0%})"
                ),
                severity=severity_of(saving / view.wall_s),
                analyzer="gpu_places",
                summary=(
                    f"At {line or r.module} a lookup reads at most {read:,.0f} rows of a "
                    f"{rows:,.0f}-row table a step, but the table's gradient is dense: every step it "
                    "is zeroed whole, the rows read are scattered in, and the optimizer reads and "
                    f"writes every row ({phases}). A sparse gradient (nn.Embedding(sparse=True) / "
                    "F.embedding(..., sparse=True) with an optimizer that takes sparse gradients: "
                    "SGD, SparseAdam, Adagrad) makes and applies only the rows read; a smaller table "
                    "(fewer ids, hashing) shrinks both. Saving: that work's time for the rows no "
                    "lookup read, less the GPU's idle."
                ),
                seconds_lost_per_step=saving,
                share_of_step=gpu_s / view.wall_s,
                ranks=(view.rank,),
                evidence={
                    "bound": "dense",
                    "module": str(r.module),
                    "line": line,
                    "shape": list(r.shape),
                    "rows": rows,
                    "rows_read_per_step": read,
                    "table_bytes": float(math.prod(r.shape)) * float(r.item_bytes),
                    "gpu_s_per_step": gpu_s,
                    "phases": dict(r.phases),
                },
                prescriptions=(
                    Prescription(
                        kind="code",
                        summary=(
                            f"give the table at {line or r.module} a sparse gradient (sparse=True) and "
                            "an optimizer that takes one (SGD without momentum, SparseAdam, Adagrad)"
                        ),
                        change={},
                        expected_gain_s_per_step=saving,
                        automatic=False,
                    ),
                ),
                removes={"gpu_work": True},
            )
        )
    return sorted(out, key=lambda f: -(f.seconds_lost_per_step or 0.0))[:3]


__all__ = ["dense_places"]
