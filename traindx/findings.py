"""What analyzers return: findings with their evidence and prescriptions."""
from dataclasses import asdict, dataclass, field
from typing import Optional

SEVERITIES = ("info", "low", "medium", "high", "critical")


@dataclass(frozen=True)
class Prescription:
    """One concrete change. kind: env | arg | code | upgrade | precompile | backend.

    `change` is what `diagnose --fix` reads (traindx.fixloop); its keys, any combination:
      {"env": {"NAME": "value", ...}}                         set environment variables
      {"arg": {"framework": "megatron"|"ms-swift"|"example"|..., "set": {"--flag": "value"}}}
                                                              set (or add) command-line flags
      {"precompile": {"from_run": "<run dir>"}}               kernel-cache warm --from-run first
      {"upgrade": {"package": "flash-attn-4", "min_version": "4.0.0b26"}}   printed, not applied
      {"code": {"file": ..., "line": ..., "before": ..., "after": ...}}       printed, not applied
    `automatic` says whether --fix may apply it by itself.
    """

    kind: str
    summary: str                       # one line a user reads
    change: dict = field(default_factory=dict)   # machine-readable: {"env": {...}} / {"arg": ...} / ...
    expected_gain_s_per_step: Optional[float] = None
    automatic: bool = False            # can `diagnose --fix` apply it by itself
    command: Optional[str] = None      # a copyable command or diff, when there is one


@dataclass(frozen=True)
class Finding:
    id: str                            # stable: "<analyzer>.<what>", e.g. "jit.fa4_steady_recompile"
    title: str
    severity: str
    analyzer: str
    summary: str = ""
    steps_affected: tuple = ()
    seconds_lost_per_step: Optional[float] = None
    share_of_step: Optional[float] = None
    evidence: dict = field(default_factory=dict)
    prescriptions: tuple = ()
    ranks: tuple = ()
    # causes and symptoms (linked after all analyzers ran, traindx.analyzers.chains): a symptom
    # names its root finding's id in `cause`; a root lists its symptoms' ids in `symptoms`
    cause: Optional[str] = None
    symptoms: tuple = ()
    # the time-ledger lines the fix removes: {"categories": [...], "steps": [...] (optional),
    # "fraction": x (optional)}; traindx.ledger.predicted_step_time reads it
    removes: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")

    @property
    def rank_key(self):
        """Ranking: root causes before symptoms, then severity, then seconds lost per step."""
        return (self.cause is None, SEVERITIES.index(self.severity),
                self.seconds_lost_per_step or 0.0)

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


def rank_findings(findings):
    return sorted(findings, key=lambda f: f.rank_key, reverse=True)
