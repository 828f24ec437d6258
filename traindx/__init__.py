"""traindx: finds why a training run is slow, prescribes the fix, applies it, proves it.

Notebook API: `run = traindx.load_run(path)`; `findings = traindx.analyze(run)`; the judged
document every output renders (findings, verdict, step causes, --fix plans): `traindx.judge_run(run)
-> Judgement`.
Engines, no argparse: `traindx.fix(command, traindx.FixOptions(...)) -> FixResult` (the --fix
loop), `traindx.merge(run_dir) -> RunRecord` (a multi-node run's parts), `traindx.card(run,
traindx.CardOptions(...)) -> Card` (a recipe card).
In a training loop: `traindx.step()` at the end of each iteration marks a step (see
docs/run-record.md, "What a step is"); it does nothing when the job is not run under `diagnose`.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the names below are loaded on first use
    from traindx.analyzers.core.findings import Finding
    from traindx.derive.run import RunRecord

__version__ = "0.1.0"


def step() -> None:
    """Mark the end of one training iteration for `diagnose` (a no-op when not recording).

    Use it where traindx cannot see an iteration by itself: no torch optimizer, several
    optimizers stepped at different rates, or a step that is not an optimizer step. Once called,
    only these calls end steps in the run. Call it after the iteration's own logging.
    """
    # the shim publishes itself in sys.modules only when it records this process; importing
    # traindx must not be needed by the job, and this call must stay cheap in every iteration
    steps = sys.modules.get("_traindx_shim.steps")
    if steps is not None:
        steps.marker()


def analyze(run: RunRecord | str | os.PathLike[str]) -> list[Finding]:
    """Ranked findings of every registered analyzer for a loaded run (or a run folder path)."""
    # lazy: the analyzers pull in pandas, and `import traindx` must stay light in a training job
    from traindx.analyzers import analyze as analyze_run
    from traindx.derive.run import RunRecord, load_run

    record = run if isinstance(run, RunRecord) else load_run(os.fspath(run))
    return analyze_run(record)


# the run record pulls in pandas: each name is loaded on first use, so `import traindx;
# traindx.step()` in a training job stays light
_LAZY = {
    "RunRecord": "traindx.derive.run",
    "load_run": "traindx.derive.run",
    "fix": "traindx.fixing.run.loop",
    "FixOptions": "traindx.fixing.run.loop",
    "FixResult": "traindx.fixing.run.loop",
    "FixEvent": "traindx.fixing.run.loop",
    "merge": "traindx.derive.multinode",
    "judge_run": "traindx.judgement",
    "Judgement": "traindx.judgement",
    "card": "traindx.recipes.card",
    "CardOptions": "traindx.recipes.card",
    "Card": "traindx.recipes.card",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'traindx' has no attribute {name!r}")


__all__ = [
    "Card",
    "CardOptions",
    "FixEvent",
    "FixOptions",
    "FixResult",
    "Judgement",
    "RunRecord",
    "analyze",
    "card",
    "fix",
    "judge_run",
    "load_run",
    "merge",
    "step",
]
