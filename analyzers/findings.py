"""What analyzers return: findings with their evidence and prescriptions."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

# the one severity order (least to most severe); everything that compares severities imports it
SEVERITIES = ("info", "low", "medium", "high", "critical")
# findings of this severity are notes: numbers worth knowing, nothing to change
NOTE = SEVERITIES[0]
# the judgement of the whole run (analyzers/verdict.py): one finding with this id prefix
VERDICT_PREFIX = "verdict."


def severity_index(severity: str) -> int:
    """0 for info up to 4 for critical."""
    return SEVERITIES.index(severity)


def is_problem(finding) -> bool:
    """Worth changing something for: above a note, and not the run's verdict itself."""
    return finding.severity != NOTE and not finding.id.startswith(VERDICT_PREFIX)


@dataclass(frozen=True)
class Prescription:
    """One concrete change. kind: env | arg | code | upgrade | precompile | backend.

    `change` is what `diagnose --fix` reads (traindx.analyzers.fixplan); its keys, any combination:
      {"env": {"NAME": "value", ...}}                         set environment variables
      {"arg": {"framework": "megatron"|"ms-swift"|"hf"|"argparse"|..., "set": {"--flag": "value"},
               "remove": [...]}}                              set (or add) command-line flags;
                                                              "argparse": the job's own parser
      {"precompile": {"from_run": "<run dir>"}}               kernel-cache warm --from-run first
      {"upgrade": {"package": "flash-attn-4", "min_version": "4.0.0b26"}}   an overlay install
      {"runtime": {"patch": "<name>"}}                        a shim patch (candidate only)
      {"code": {"file": ..., "line": ..., "last_line": ... (a statement over several lines),
                "before": ..., "after": ..., "op": "replace" | "delete" | "insert_after"}}
          a concrete edit of the job's own code, applied on a scratch copy (fix.patch): replace
          `before` (the code at file:line..last_line) by `after`; delete it (a block left empty
          gets `pass`); or insert `after` after that statement, at its indentation. Built and
          checked by traindx.analyzers.codefix.code_change; the planner may turn it into the
          job's own flag (a keyword whose value reads `args.x` becomes `--x N`).
    Every concrete change is measured by `--fix` as a candidate arm of its own, best predicted
    saving first.
    `automatic` says whether --fix may apply it by itself.
    """

    kind: str
    summary: str  # one line a user reads
    change: dict = field(default_factory=dict)  # machine-readable: {"env": {...}} / {"arg": ...} / ...
    expected_gain_s_per_step: float | None = None
    automatic: bool = False  # can `diagnose --fix` apply it by itself
    command: str | None = None  # a copyable command or diff, when there is one


@dataclass(frozen=True)
class Finding:
    id: str  # stable: "<analyzer>.<what>", e.g. "jit.fa4_steady_recompile"
    title: str
    severity: str
    analyzer: str
    summary: str = ""
    steps_affected: tuple = ()
    seconds_lost_per_step: float | None = None
    share_of_step: float | None = None
    evidence: dict = field(default_factory=dict)
    prescriptions: tuple = ()
    ranks: tuple = ()
    # causes and symptoms (linked after all analyzers ran, traindx.analyzers.chains): a symptom
    # names its root finding's id in `cause`; a root lists its symptoms' ids in `symptoms`
    cause: str | None = None
    symptoms: tuple = ()
    # the time-ledger lines the fix removes: {"categories": [...], "steps": [...] (optional),
    # "fraction": x (optional), "fresh_graph_calls": True (optional: a recompile's model calls
    # cost more than its compile events)}; traindx.analyzers.savings.predicted_step_time reads it
    removes: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")

    @property
    def rank_key(self):
        """Ranking: root causes before symptoms, then severity, then seconds lost per step."""
        return (self.cause is None, severity_index(self.severity), self.seconds_lost_per_step or 0.0)

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, data):
        data = dict(data)
        data["prescriptions"] = tuple(Prescription(**p) for p in data.get("prescriptions", ()))
        data["steps_affected"] = tuple(data.get("steps_affected", ()))
        data["ranks"] = tuple(data.get("ranks", ()))
        data["symptoms"] = tuple(data.get("symptoms", ()))  # absent in findings.json of older runs
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def rank_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: f.rank_key, reverse=True)


def reading_order(findings) -> list:
    """The order a person reads findings in (report, terminal, the verdict's pick): root causes
    before symptoms (each symptom right under its cause), problems before notes, then by
    seconds lost per step, then by severity."""

    def key(f):
        return (f.severity == NOTE, -(f.seconds_lost_per_step or 0.0), -severity_index(f.severity))

    roots = sorted((f for f in findings if getattr(f, "cause", None) is None), key=key)
    symptoms = sorted((f for f in findings if getattr(f, "cause", None) is not None), key=key)
    out, placed = [], set()
    for root in roots:
        out.append(root)
        for i, sym in enumerate(symptoms):
            if (
                i not in placed
                and sym.cause == root.id
                and (not root.ranks or not sym.ranks or set(root.ranks) & set(sym.ranks))
            ):
                out.append(sym)
                placed.add(i)
    return out + [sym for i, sym in enumerate(symptoms) if i not in placed]
