"""The what-if across ranks on every run of several ranks: the run folder's op table
(`traindx.derive.optable_runs`), the replay (`traindx.derive.whatif`), judged by
`traindx.analyzers.ranks.whatif`, kept only where it matters: a stage, sequence lengths or an op
type at fault at the judged severity (no per-rank analyzer sees those), one worker as a note (the
ranks analyzer judges the late rank), nothing else (`--what-if` prints it in full)."""

from __future__ import annotations

from dataclasses import replace

from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding
from traindx.analyzers.ranks.whatif import judge
from traindx.derive import depmodel, whatif
from traindx.derive.optable_runs import from_run, nonblocking_sends, runq_share
from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="whatif_run",
    order=101,
    ids=("whatif.stage", "whatif.sequence_lengths", "whatif.optype", "whatif.one_worker"),
    cross_rank=True,
)
KEPT = {"whatif.stage", "whatif.sequence_lengths", "whatif.optype"}


def analyze(run: RunRecord) -> list[Finding]:
    table = from_run(run)
    if table.empty or table["rank"].nunique() < 2:
        return []
    try:
        result = whatif.analyze(table, serial=True, oneway_sends=nonblocking_sends(run))
    except (depmodel.ModelError, ValueError, KeyError, IndexError):  # ops of a shape the model cannot replay
        return []
    result.runq_share = runq_share(run)
    out = []
    for f in judge(result, source="this run"):
        if f.severity == "info":
            continue
        if f.id in KEPT:
            out.append(replace(f, analyzer=DECLARATION.name))
        elif f.id == "whatif.one_worker":
            out.append(replace(f, analyzer=DECLARATION.name, severity="info"))
    return out
