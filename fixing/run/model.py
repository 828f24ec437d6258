"""What `diagnose --fix` takes and gives (FixOptions, FixEvent, FixResult) and the small helpers
its runner's parts share. The engine is fixing/run/loop.py."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from traindx.common import redact
from traindx.common.atomic import write_json

DEFAULT_TRIES = 3


@dataclass
class FixEvent:
    """One thing the loop has to say. kind: stage | plan | step | output | warning | info |
    summary (data: record, findings, report) | comparison (data: comparison, arm)."""

    kind: str
    text: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class Say(Protocol):
    """How the runner's parts report progress: say(kind, text, **data) -> a FixEvent."""

    def __call__(self, kind: str, text: str = "", **data: Any) -> None: ...


@dataclass
class FixOptions:
    """What `fix` needs. `record`: the launcher's Options of every arm (steps, samplers, window);
    `run_dir`: the fix folder (default: a new one under `out`); `tries`: arms at most;
    `reporter`: receives FixEvents; `run_job(command, run_dir, options) -> raw return code`
    records one arm (default: the launcher's Job, the job's output echoed)."""

    record: Any = None
    run_dir: str | None = None
    out: str = "runs"
    wheels: str | None = None
    tries: int = DEFAULT_TRIES
    cwd: str | None = None
    reporter: Callable[[FixEvent], None] | None = None
    run_job: Callable[..., int | None] | None = None
    # the baseline arm stops once its top finding is stable (run_job is then called with
    # until_diagnosed=True: the CLI's records it under the live judgement); every candidate arm
    # runs as many steps as the baseline did
    until_diagnosed: bool = False
    # a kept change whose own run still compiles kernels cold (FA4's, after the change made
    # their keys new) gets one more arm: the same change with those kernels warmed beforehand
    warm_up_after_fix: bool = True
    # an arm not proven faster (the interval spans no gain and a real one, or it missed a
    # predicted saving) is measured once more, candidate then baseline (A B B A), and each side
    # judged by its quicker run: a neighbour's load only adds time, so one disturbed run cannot
    # decide the search
    repeat_inconclusive: bool = True
    # where each arm's writes go (traindx.fixing.run.confine): "auto" (a private view where user
    # namespaces are allowed, else a private copy), "namespace", "copy"
    confine: str = "auto"
    # the kept arm's captured writes copied where the job wrote them, once --fix ends
    keep_outputs: bool = False


@dataclass
class FixResult:
    """What `fix` did: fix.json's content, typed. `arms`: one dict per candidate arm tried
    (dir, finding, mechanism, summary, predicted and measured step time, speedup, verdict,
    parity, significant, patch); `best`: the kept arm's folder or None."""

    root: str
    status: str
    exit_code: int | None
    baseline: str
    arms: list[dict[str, Any]] = field(default_factory=list)
    best: str | None = None
    comparison: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    apply: list[str] = field(default_factory=list)
    # the warm-up arm run after the kept one (FixOptions.warm_up_after_fix), when it won
    warm_up: str | None = None
    # how the arms' writes were confined, and where the kept arm's are (fix_confine.finish)
    confinement: dict[str, Any] | None = None
    # the ladder's rungs (fixing/plan/ladder.py): each offered one with what its arm measured and
    # whether it was kept, each skipped one with why
    ladder: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fix_json(self) -> str:
        return os.path.join(self.root, "fix.json")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def with_options(options: Any, **changes: Any) -> Any:
    """A copy of the launcher Options with some fields changed."""
    out = copy.copy(options)
    for k, v in changes.items():
        setattr(out, k, v)
    return out


def write_fix_json(path: str, data: Any) -> None:
    """fix.json and comparison.json: indented, anything not JSON as its str(), every secret
    (of the job's environment, of the commands it holds, by name and by shape) hidden."""
    document = json.loads(json.dumps(data, default=str))  # JSON values only, then redacted
    write_json(path, redact.redact_document(document, os.environ), indent=2)
