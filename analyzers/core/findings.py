"""What analyzers return: findings with their evidence and prescriptions."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, NoReturn, cast

# the one severity order (least to most severe); everything that compares severities imports it
SEVERITIES = ("info", "low", "medium", "high", "critical")
# findings of this severity are notes: numbers worth knowing, nothing to change
NOTE = SEVERITIES[0]
# the judgement of the whole run (analyzers/core/verdict.py): one finding with this id prefix
VERDICT_PREFIX = "verdict."


def severity_index(severity: str) -> int:
    """0 for info up to 4 for critical."""
    return SEVERITIES.index(severity)


def is_problem(finding: Finding) -> bool:
    """Worth changing something for: above a note, and not the run's verdict itself."""
    return finding.severity != NOTE and not finding.id.startswith(VERDICT_PREFIX)


# -- a prescription's change: a tagged union -------------------------------------------------------
# Each kind is a frozen dataclass that is also a read-only dict: its JSON form, the one findings.json
# holds. Readers that index the change (the report, the fix loop, chains, tests) keep working, and the
# JSON stays byte-identical: a change read from a dict keeps that dict's keys in their order.
FlagValue = str | int | float | bool | None  # None: the flag removed; True: a bare switch
EnvValue = str | int | float | bool | None  # None: the variable unset (by hand)
JSON = dict[str, Any]


class _ChangeJSON(dict[str, Any]):
    """The JSON form of a change, read-only: a change is rebuilt, never edited in place."""

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is read-only: build a new change")

    __setitem__ = _read_only
    __delitem__ = _read_only
    __ior__ = _read_only
    clear = _read_only
    pop = _read_only
    popitem = _read_only
    setdefault = _read_only
    update = _read_only

    def _fill(self, data: Mapping[str, Any]) -> None:
        dict.clear(self)
        dict.update(self, data)

    def to_json(self) -> JSON:
        """The plain dict findings.json holds (shallow: the inner dicts are the change's own)."""
        return dict(self)

    def __reduce__(self) -> tuple[Any, ...]:  # pickle and deepcopy rebuild it from its JSON form
        return (change_from_json, (dict(self),))


@dataclass(frozen=True, eq=False, repr=False)
class NoChange(_ChangeJSON):
    """Nothing --fix can apply: the prescription says what to do in words."""

    kind: Literal["none"] = field(default="none", init=False)

    def __post_init__(self) -> None:
        self._fill({})


@dataclass(frozen=True, eq=False, repr=False)
class EnvChange(_ChangeJSON):
    """{"env": {"NAME": "value", ...}}: set environment variables."""

    env: Mapping[str, EnvValue]
    kind: Literal["env"] = field(default="env", init=False)

    def __post_init__(self) -> None:
        self._fill({"env": self.env})


@dataclass(frozen=True, eq=False, repr=False)
class ArgChange(_ChangeJSON):
    """{"arg": {"framework": ..., "set": {"--flag": value}, "remove": [...]}}: command-line flags of
    a framework ("argparse": the job's own parser)."""

    framework: str
    flags: Mapping[str, FlagValue]  # JSON "set"
    remove: tuple[str, ...] = ()
    kind: Literal["arg"] = field(default="arg", init=False)

    def __post_init__(self) -> None:
        arg: JSON = {"framework": self.framework, "set": self.flags}
        if self.remove:
            arg["remove"] = list(self.remove)
        self._fill({"arg": arg})


@dataclass(frozen=True, eq=False, repr=False)
class SourceEdit(_ChangeJSON):
    """{"code": {...}, "codes": [...]}: an edit of the job's own code (file, line, last_line, before,
    after, op; analyzers add their own keys: role, call_site, autotune_key, before_line, ...), and
    the edits made together with it. `code` None: only the edits made together are left (an
    unchecked first edit taken out, traindx.analyzers.codefix.checked): nothing to apply."""

    code: Mapping[str, Any] | None
    codes: tuple[Mapping[str, Any], ...] | None = None
    kind: Literal["code"] = field(default="code", init=False)

    def __post_init__(self) -> None:
        data: JSON = {} if self.code is None else {"code": self.code}
        if self.codes is not None:
            data["codes"] = list(self.codes)
        self._fill(data)

    @property
    def edits(self) -> tuple[Mapping[str, Any], ...]:
        """The edits applied together (all or none)."""
        return self.codes or ((self.code,) if self.code is not None else ())

    @property
    def file(self) -> str | None:
        return (self.code or {}).get("file")

    @property
    def line(self) -> int | None:
        return (self.code or {}).get("line")


@dataclass(frozen=True, eq=False, repr=False)
class PackageVersion(_ChangeJSON):
    """{"upgrade": {"package": ..., "min_version": ...}}: a fixed release (an overlay install)."""

    package: str
    min_version: str | None = None
    kind: Literal["upgrade"] = field(default="upgrade", init=False)

    def __post_init__(self) -> None:
        self._fill({"upgrade": {"package": self.package, "min_version": self.min_version}})

    @property
    def requirement(self) -> str:
        return f"{self.package}>={self.min_version}" if self.min_version else str(self.package)


@dataclass(frozen=True, eq=False, repr=False)
class CacheWarm(_ChangeJSON):
    """{"precompile": {"from_run": ..., ...}, "env": {...}}: `kernel-cache warm --from-run` first,
    then train with the cache variables `env` sets."""

    from_run: str | None
    env: Mapping[str, EnvValue] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)  # more precompile keys (triton_cache_dir)
    kind: Literal["precompile"] = field(default="precompile", init=False)

    def __post_init__(self) -> None:
        data: JSON = {"precompile": {"from_run": self.from_run, **self.options}}
        if self.env is not None:
            data["env"] = self.env
        self._fill(data)


@dataclass(frozen=True, eq=False, repr=False)
class RuntimePatch(_ChangeJSON):
    """{"runtime": {"patch": name}}: a shim patch at a library boundary (candidate arms only)."""

    patch: str | None
    kind: Literal["runtime"] = field(default="runtime", init=False)

    def __post_init__(self) -> None:
        self._fill({"runtime": {"patch": self.patch}})


Change = NoChange | EnvChange | ArgChange | SourceEdit | PackageVersion | CacheWarm | RuntimePatch
CHANGE_TYPES: tuple[type[_ChangeJSON], ...] = (
    NoChange,
    EnvChange,
    ArgChange,
    SourceEdit,
    PackageVersion,
    CacheWarm,
    RuntimePatch,
)
# the top-level key sets of a change's JSON form, by kind
_SHAPES = (
    (frozenset(), "none"),
    (frozenset({"env"}), "env"),
    (frozenset({"arg"}), "arg"),
    (frozenset({"code"}), "code"),
    (frozenset({"codes"}), "code"),
    (frozenset({"code", "codes"}), "code"),
    (frozenset({"upgrade"}), "upgrade"),
    (frozenset({"precompile"}), "precompile"),
    (frozenset({"precompile", "env"}), "precompile"),
    (frozenset({"runtime"}), "runtime"),
)


class UnknownChange(ValueError):
    """A change whose JSON form is none of the kinds --fix knows."""


def change_kind(data: Mapping[str, Any]) -> str:
    keys = frozenset(data)
    for shape, kind in _SHAPES:
        if keys == shape:
            return kind
    raise UnknownChange(
        f"unknown prescription change with keys {sorted(keys)}: a change is one of "
        "{}, env, arg, code (+codes), upgrade, precompile (+env), runtime"
    )


def _parsed(data: Mapping[str, Any]) -> Change:
    kind = change_kind(data)
    if kind == "none":
        return NoChange()
    if kind == "env":
        return EnvChange(env=data["env"])
    if kind == "arg":
        arg = data["arg"] or {}
        return ArgChange(
            framework=str(arg.get("framework", "")),
            flags=arg.get("set") or {},
            remove=tuple(arg.get("remove") or ()),
        )
    if kind == "code":
        codes = data.get("codes")
        return SourceEdit(code=data.get("code"), codes=None if codes is None else tuple(codes))
    if kind == "upgrade":
        up = data["upgrade"] or {}
        return PackageVersion(package=str(up.get("package")), min_version=up.get("min_version"))
    if kind == "precompile":
        pre = dict(data["precompile"] or {})
        return CacheWarm(from_run=pre.pop("from_run", None), env=data.get("env"), options=pre)
    return RuntimePatch(patch=(data["runtime"] or {}).get("patch"))


def change_from_json(data: Mapping[str, Any] | None) -> Change:
    """The typed change of a JSON dict (findings.json, an analyzer's literal); its JSON form stays
    that dict, keys in their order. Raises UnknownChange for keys no kind has."""
    if isinstance(data, CHANGE_TYPES):
        return cast(Change, data)
    data = data or {}
    change = _parsed(data)
    change._fill(data)  # the JSON form exactly as given, keys in their order
    return change


@dataclass(frozen=True, init=False)
class Prescription:
    """One concrete change. kind: env | arg | code | upgrade | precompile | backend.

    `change` is what `diagnose --fix` reads (traindx.fixing.plan.planner): one of the Change kinds
    above (EnvChange, ArgChange, SourceEdit, PackageVersion, CacheWarm, RuntimePatch, NoChange).
    A dict in the JSON form is accepted too (analyzers write literals) and becomes its kind:
      {"env": {"NAME": "value", ...}}                         set environment variables
      {"arg": {"framework": "megatron"|"ms-swift"|"hf"|"argparse"|..., "set": {"--flag": "value"},
               "remove": [...]}}                              set (or add) command-line flags;
                                                              "argparse": the job's own parser
      {"precompile": {"from_run": "<run dir>"}, "env": {...}} kernel-cache warm --from-run first
      {"upgrade": {"package": "flash-attn-4", "min_version": "4.0.0b26"}}   an overlay install
      {"runtime": {"patch": "<name>"}}                        a shim patch (candidate only)
      {"code": {"file": ..., "line": ..., "last_line": ... (a statement over several lines),
                "before": ..., "after": ..., "op": "replace" | "delete" | "insert_after"},
       "codes": [...] (edits made together, optional)}
          a concrete edit of the job's own code, applied on a scratch copy (fix.patch): replace
          `before` (the code at file:line..last_line) by `after`; delete it (a block left empty
          gets `pass`); or insert `after` after that statement, at its indentation. Built and
          checked by traindx.analyzers.codefix.code_change; the planner may turn it into the
          job's own flag (a keyword whose value reads `args.x` becomes `--x N`).
    Any other key raises UnknownChange. Every concrete change is measured by `--fix` as a
    candidate arm of its own, best predicted saving first.
    `automatic` says whether --fix may apply it by itself.
    """

    kind: str
    summary: str  # one line a user reads
    change: Change  # machine-readable, typed; its JSON form is the change itself (a read-only dict)
    expected_gain_s_per_step: float | None
    automatic: bool  # can `diagnose --fix` apply it by itself
    command: str | None  # a copyable command or diff, when there is one

    def __init__(
        self,
        kind: str,
        summary: str,
        change: Change | Mapping[str, Any] | None = None,
        expected_gain_s_per_step: float | None = None,
        automatic: bool = False,
        command: str | None = None,
    ) -> None:
        # written out (frozen): a dict in the JSON form becomes its typed change here
        set_field = object.__setattr__
        set_field(self, "kind", kind)
        set_field(self, "summary", summary)
        set_field(self, "change", change_from_json(change))
        set_field(self, "expected_gain_s_per_step", expected_gain_s_per_step)
        set_field(self, "automatic", automatic)
        set_field(self, "command", command)

    def to_dict(self) -> JSON:
        """The JSON form findings.json holds (not dataclasses.asdict: it would write a change's
        dataclass fields, not its JSON form)."""
        return {
            "kind": self.kind,
            "summary": self.summary,
            "change": copy.deepcopy(self.change.to_json()),
            "expected_gain_s_per_step": self.expected_gain_s_per_step,
            "automatic": self.automatic,
            "command": self.command,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Prescription:
        return cls(**data)


@dataclass(frozen=True)
class Finding:
    id: str  # stable: "<analyzer>.<what>", e.g. "jit.fa4_steady_recompile"
    title: str
    severity: str
    analyzer: str
    summary: str = ""
    steps_affected: tuple[Any, ...] = ()
    seconds_lost_per_step: float | None = None
    share_of_step: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    prescriptions: tuple[Prescription, ...] = ()
    ranks: tuple[Any, ...] = ()
    # causes and symptoms (linked after all analyzers ran, traindx.analyzers.core.chains): a symptom
    # names its root finding's id in `cause`; a root lists its symptoms' ids in `symptoms`
    cause: str | None = None
    symptoms: tuple[str, ...] = ()
    # the time-ledger lines the fix removes: {"categories": [...], "steps": [...] (optional),
    # "fraction": x (optional), "fresh_graph_calls": True (optional: a recompile's model calls
    # cost more than its compile events)}; traindx.analyzers.core.savings.predicted_step_time reads it
    removes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")

    @property
    def rank_key(self) -> tuple[bool, int, float]:
        """Ranking: root causes before symptoms, then severity, then seconds lost per step."""
        return (self.cause is None, severity_index(self.severity), self.seconds_lost_per_step or 0.0)

    def to_dict(self) -> JSON:
        """The JSON form findings.json holds (a prescription's change as its JSON dict)."""
        out = asdict(replace(self, prescriptions=()))
        out["prescriptions"] = tuple(p.to_dict() for p in self.prescriptions)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        data = dict(data)
        data["prescriptions"] = tuple(Prescription.from_dict(p) for p in data.get("prescriptions", ()))
        data["steps_affected"] = tuple(data.get("steps_affected", ()))
        data["ranks"] = tuple(data.get("ranks", ()))
        data["symptoms"] = tuple(data.get("symptoms", ()))  # absent in findings.json of older runs
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def rank_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: f.rank_key, reverse=True)


def reading_order(findings: Iterable[Finding]) -> list[Finding]:
    """The order a person reads findings in (report, terminal, the verdict's pick): root causes
    before symptoms (each symptom right under its cause), problems before notes, critical ones
    first (a run that will stop: the verdict's pick too), then by seconds lost per step, then by
    severity."""

    def key(f: Finding) -> tuple[bool, bool, float, int]:
        return (
            f.severity == NOTE,
            f.severity != "critical",
            -(f.seconds_lost_per_step or 0.0),
            -severity_index(f.severity),
        )

    roots = sorted((f for f in findings if getattr(f, "cause", None) is None), key=key)
    symptoms = sorted((f for f in findings if getattr(f, "cause", None) is not None), key=key)
    out: list[Finding] = []
    placed: set[int] = set()
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
