"""What each analyzer says about itself, once: the one place of truth for the registry, the cause
chains and the live judgement.

An analyzer is a module of a family folder with a top-level `DECLARATION = Declaration(...)`.
`discover()` imports the package's modules whose source assigns DECLARATION at top level, no
other, and `Catalog` derives every table from the declarations (`traindx.analyzers`, `chains`,
`live` read them). This module imports no other of traindx: every analyzer imports it."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import pkgutil
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

PACKAGE = "traindx.analyzers"
# findings the package makes itself (a sampled analysis, an analyzer that raised): no cause
PACKAGE_NOT_CAUSES = ("traindx.", "analysis.")
# how discover() tells an analyzer's module without importing the others (live, fixplan, ...)
_DECLARES = re.compile(r"^DECLARATION\s*(:[^=\n]*)?=", re.MULTILINE)
# the name a declaration gives (read from the source when its module fails to import)
_DECLARED_NAME = re.compile(r"^DECLARATION\s*(?::[^=\n]*)?=\s*Declaration\(\s*name=[\"'](\w+)", re.MULTILINE)


@dataclass(frozen=True)
class Removes:
    """The ledger lines a finding's fix removes: chains prices its prescriptions with them."""

    lines: tuple[str, ...]
    in_steps: bool = False  # only in the steps the finding names (its steps_affected)
    fresh_graph_calls: bool = False  # and each fresh graph's first model call (a recompile)


@dataclass(frozen=True)
class Declaration:
    """One analyzer, declared by its module. Every id a role field names is one of `ids`."""

    name: str  # its findings' `analyzer` (the module's own name, the family folder left out)
    order: int  # when it runs among the analyzers (or among the judges): findings' order
    ids: tuple[str, ...]  # every finding id it makes
    judge: bool = False  # analyze(run, findings): runs last, over every other finding once priced
    cross_rank: bool = False  # reads every rank (the others the sampled ranks of a large job)
    # live: the cheap stage's trigger kinds judged by this analyzer alone (a compile), and the
    # ledger categories standing out in a trigger that route a pass to it (a GC pause)
    live_triggers: tuple[str, ...] = ()
    live_categories: tuple[str, ...] = ()
    capture: bool = False  # live: a stable finding of it asks for a deep capture (an anomaly)
    explains: tuple[str, ...] = ()  # symptom ids the cause chains may link under its findings
    not_causes: tuple[str, ...] = ()  # of ids: findings that are no cause of a slowdown
    # of ids: a compile or autotune paid again in the steady steps - proven as soon as found
    # (live), the root of a compiling thread's GIL hold or a launch-bound GPU (chains)
    recompiles: tuple[str, ...] = ()
    removes: Mapping[str, Removes] = field(default_factory=dict)  # id -> what its fix removes
    # ledger line -> the id that causes a straggler (or slow pipeline stage) late from that line
    straggler_lines: Mapping[str, str] = field(default_factory=dict)
    # ledger line -> the ids that take the job's explicit calls booked in it (a gc.collect())
    call_site_lines: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # of ids: a finding that names a line where time goes without knowing why (a symptom of a
    # specific finding at that line, when there is one)
    generic_at_line: tuple[str, ...] = ()
    # the dotted path of the declaring module (traindx.analyzers.jit.jit): set by discover()
    module: str = ""

    def __post_init__(self) -> None:
        named = {
            *self.not_causes,
            *self.recompiles,
            *self.removes,
            *self.straggler_lines.values(),
            *(i for ids in self.call_site_lines.values() for i in ids),
            *self.generic_at_line,
        }
        unknown = sorted(named - set(self.ids))
        if unknown:
            raise ValueError(f"analyzer '{self.name}' declares roles for ids it does not make: {unknown}")


def _merged(pairs: list[tuple[str, tuple[str, ...]]]) -> dict[str, tuple[str, ...]]:
    """key -> values, concatenated in the order given, each value once."""
    out: dict[str, tuple[str, ...]] = {}
    for key, values in pairs:
        out[key] = tuple(dict.fromkeys(out.get(key, ()) + values))
    return out


@dataclass(frozen=True)
class Catalog:
    """The declarations in the order they run, and every table derived from them."""

    declarations: tuple[Declaration, ...]
    # modules that declare an analyzer but failed to import: (name, the error) - reported as
    # that analyzer's failure, never as the whole analysis's
    broken: tuple[tuple[str, Exception], ...] = ()

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.declarations, key=lambda d: (d.judge, d.order, d.name)))
        object.__setattr__(self, "declarations", ordered)
        names = [d.name for d in ordered]
        twice = sorted({n for n in names if names.count(n) > 1})
        ids = [i for d in ordered for i in d.ids]
        shared = sorted({i for i in ids if ids.count(i) > 1})
        if twice or shared:
            raise ValueError(f"declared twice: analyzers {twice}, finding ids {shared}")

    # -- the registry ---------------------------------------------------------------------
    @property
    def registry(self) -> list[str]:
        """The analyzers, in the order they run: analyze(run) -> [Finding]."""
        return [d.name for d in self.declarations if not d.judge]

    @property
    def modules(self) -> dict[str, str]:
        """analyzer name -> the dotted path of the module that declares it (and runs it)."""
        return {d.name: d.module for d in self.declarations}

    @property
    def judges(self) -> list[str]:
        """Judged last, over every other finding once linked and priced."""
        return [d.name for d in self.declarations if d.judge]

    @property
    def cross_rank(self) -> set[str]:
        return {d.name for d in self.declarations if d.cross_rank}

    # -- the live judgement ---------------------------------------------------------------
    @property
    def trigger_analyzers(self) -> dict[str, tuple[str, ...]]:
        return _merged([(t, (d.name,)) for d in self.declarations for t in d.live_triggers])

    @property
    def category_analyzers(self) -> dict[str, tuple[str, ...]]:
        return _merged([(c, (d.name,)) for d in self.declarations for c in d.live_categories])

    @property
    def capture_analyzers(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.declarations if d.capture)

    @property
    def not_causes(self) -> tuple[str, ...]:
        """Id prefixes (an exact id among them) of the findings that are no cause."""
        return PACKAGE_NOT_CAUSES + tuple(i for d in self.declarations for i in d.not_causes)

    @property
    def recompiles(self) -> tuple[str, ...]:
        return tuple(i for d in self.declarations for i in d.recompiles)

    # -- the cause chains -----------------------------------------------------------------
    @property
    def compile_ids(self) -> frozenset[str]:
        """Every id of the analyzers that declare recompiles (a cold start's compile too)."""
        return frozenset(i for d in self.declarations if d.recompiles for i in d.ids)

    @property
    def symptoms(self) -> frozenset[str]:
        """The ids some analyzer's findings explain: the only ones the chains may link."""
        return frozenset(i for d in self.declarations for i in d.explains)

    @property
    def ledger_lines(self) -> dict[str, tuple[tuple[str, ...], bool]]:
        """finding id -> (the ledger categories its fix removes, in the steps it names only)."""
        return {i: (r.lines, r.in_steps) for d in self.declarations for i, r in d.removes.items()}

    @property
    def fresh_graph_calls(self) -> tuple[str, ...]:
        return tuple(i for d in self.declarations for i, r in d.removes.items() if r.fresh_graph_calls)

    @property
    def straggler_roots(self) -> dict[str, str]:
        return {line: i for d in self.declarations for line, i in d.straggler_lines.items()}

    @property
    def line_owners(self) -> dict[str, tuple[str, ...]]:
        return _merged([(line, ids) for d in self.declarations for line, ids in d.call_site_lines.items()])

    @property
    def generic_at_line(self) -> tuple[str, ...]:
        return tuple(i for d in self.declarations for i in d.generic_at_line)


def declaring_modules(folder: str, prefix: str = "") -> list[str]:
    """The modules under `folder` (its sub-folders included) whose source assigns DECLARATION at
    top level, by dotted name relative to `folder` (`jit.jit`)."""
    names = []
    for info in pkgutil.iter_modules([folder]):
        path = os.path.join(folder, info.name)
        if info.ispkg:
            names += declaring_modules(path, f"{prefix}{info.name}.")
            continue
        if not os.path.isfile(f"{path}.py"):
            continue
        with open(f"{path}.py", encoding="utf-8") as f:
            if _DECLARES.search(f.read()):
                names.append(prefix + info.name)
    return sorted(names)


def _declared_name(folder: str, relative: str) -> str:
    """The analyzer name a module's declaration gives, read from its source (the module's own name
    when the source does not say it plainly)."""
    with open(os.path.join(folder, *relative.split(".")) + ".py", encoding="utf-8") as f:
        found = _DECLARED_NAME.search(f.read())
    return found.group(1) if found else relative.rsplit(".", 1)[-1]


def discover(package: str = PACKAGE) -> Catalog:
    """The catalog of the analyzers under `package` (a folder of modules and family folders): each
    declaring module imported once; one that fails to import is kept as broken, the others stand."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    declared, broken = [], []
    for folder in folders:
        for relative in declaring_modules(folder):
            dotted = f"{package}.{relative}"
            try:
                module = importlib.import_module(dotted)
            except Exception as exc:  # one broken analyzer must not break the others
                broken.append((_declared_name(folder, relative), exc))
                continue
            declaration = getattr(module, "DECLARATION", None)
            if isinstance(declaration, Declaration):
                declared.append(dataclasses.replace(declaration, module=dotted))
    if not declared and not broken:  # an install without the sources would judge nothing
        raise RuntimeError(f"no analyzer declared under {package} ({folders}): its .py sources are missing")
    return Catalog(tuple(declared), tuple(broken))


@functools.cache
def catalog() -> Catalog:
    """traindx's own analyzers, discovered once per process."""
    return discover()
