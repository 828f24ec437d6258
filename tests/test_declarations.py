"""Each analyzer declares itself once (analyzers/core/declaration.py): the registry, the cause chains'
tables and the live judgement's are derived from the declarations, and the declarations are
true of what the analyzers make on the recorded runs of tests/data."""

import ast
import os
import sys
import textwrap
import warnings

import pytest

import traindx
from traindx import analyzers
from traindx.analyzers.core import chains
from traindx.analyzers.core.declaration import Catalog, Declaration, Removes, catalog, discover
from traindx.analyzers.live import live

DATA = os.path.join(os.path.dirname(__file__), "data")
# every recorded run: between them they cover all analyzers but step_causes, and links of
# the chains from four analyzers' causes
RECORDED = sorted(
    os.path.relpath(folder, DATA)
    for folder, _, files in os.walk(DATA)
    if "manifest.json" in files and "kernel_cache" not in folder
)


def _module_defines_analyze(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    return any(isinstance(n, ast.FunctionDef) and n.name == "analyze" for n in tree.body)


def test_every_analyzer_module_declares_itself_and_the_registry_keeps_its_order():
    folder = os.path.dirname(analyzers.__file__)
    defining = {
        "traindx.analyzers." + os.path.relpath(os.path.join(where, name), folder)[:-3].replace(os.sep, ".")
        for where, _, names in os.walk(folder)
        for name in names
        if name.endswith(".py")
        and name != "__init__.py"
        and _module_defines_analyze(os.path.join(where, name))
    }
    declared = {d.module for d in catalog().declarations}
    assert defining == declared, (
        "a module with analyze() needs a DECLARATION (docs/DESIGN.md, 'How to add an analyzer')"
    )
    assert not catalog().broken
    # findings' order: the registration order traindx has always had, the judges last
    assert analyzers.REGISTRY == [
        "steps",
        "gil",
        "dataloader",
        "gc_pauses",
        "host_sync",
        "allocator",
        "memory",
        "launch_bound",
        "gpu_clocks",
        "gpu_idle",
        "gpu_math",
        "gpu_places",
        "ranks",
        "whatif_run",
        "grad_sync",
        "evaluation",
        "stability",
        "hooks",
        "param_use",
        "host_work",
        "threads",
        "switches",
        "jit",
        "stopped",
    ]
    assert analyzers.JUDGES == ["step_causes", "verdict"]
    assert {"steps", "ranks", "gpu_clocks", "whatif_run", "grad_sync"} == analyzers.CROSS_RANK


@pytest.fixture(scope="module")
def recorded_findings():
    out = {}
    for name in RECORDED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = analyzers.analyze(traindx.load_run(os.path.join(DATA, name)))
    return out


@pytest.mark.slow
def test_declared_ids_cover_what_each_analyzer_makes_on_recorded_runs(recorded_findings):
    by_name = {d.name: d for d in catalog().declarations}
    seen = set()
    for name, findings in recorded_findings.items():
        for f in findings:
            if f.analyzer == "sampling" or f.id.startswith("traindx."):
                continue  # the package's own notes (analyzers/__init__.py)
            assert f.analyzer in by_name, (name, f.analyzer)
            assert f.id in by_name[f.analyzer].ids, (name, f.analyzer, f.id)
            seen.add(f.analyzer)
    assert len(seen) >= 15, seen  # every analyzer but step_causes


@pytest.mark.slow
def test_every_link_of_the_chains_is_declared_by_the_causes_analyzer(recorded_findings):
    by_name = {d.name: d for d in catalog().declarations}
    links = 0
    for findings in recorded_findings.values():
        by_id = {f.id: f for f in findings}
        for f in findings:
            if f.cause is None:
                continue
            root = by_id[f.cause]
            assert f.id in by_name[root.analyzer].explains, (root.id, f.id)
            links += 1
    assert links >= 6


def test_the_derived_tables_are_the_declarations():
    c = catalog()
    assert live.CATEGORY_ANALYZERS == {
        "compile": ("jit",),
        "data": ("dataloader",),
        "gc": ("gc_pauses",),
        "io": ("stability", "host_work"),
        "sync": ("host_sync",),
        "collective": ("ranks",),
        "other": ("host_work",),
    }
    assert live.TRIGGER_ANALYZERS == {"compile": ("jit",), "recording": ("gil",)}
    assert set(live.CAPTURE_ANALYZERS) == {"ranks", "gpu_idle", "gpu_clocks"}
    assert chains.LEDGER_LINES["gc.gen2_in_step"] == (("gc",), False)
    assert chains.LEDGER_LINES["jit.autotune"] == (("autotune",), True)
    assert chains.STRAGGLER_ROOTS == {
        "gc": "gc.gen2_in_step",
        "data": "dataloader.starvation",
        "host": "host_work.code",
    }
    assert chains.LINE_OWNERS["io"] == ("steps.periodic_slow",)
    assert set(chains.GENERIC_AT_A_LINE) == {"gpu_idle.host_starved", "host_work.code"}
    assert chains.FRESH_GRAPH_CALLS == ("jit.dynamo_recompile",)
    assert all(
        i.startswith(live.NOT_CAUSES)
        for i in ("verdict.cause", "evidence.missing", "traindx.analyzer_failed.x")
    )
    assert not "job.exit".startswith(live.NOT_CAUSES)
    assert c.recompiles == live.PROVEN_AT_ONCE and "jit.cold_start" not in c.recompiles


FAKE = """
from traindx.analyzers.core.declaration import Declaration, Removes

DECLARATION = Declaration(
    name="fake_io",
    order=115,
    ids=("fake_io.slow_save", "fake_io.note"),
    live_categories=("io", "fake_line"),
    live_triggers=("fake_trigger",),
    capture=True,
    explains=("ranks.straggler",),
    not_causes=("fake_io.note",),
    removes={"fake_io.slow_save": Removes(("io",), in_steps=True)},
    straggler_lines={"fake_line": "fake_io.slow_save"},
    call_site_lines={"io": ("fake_io.slow_save",)},
)


def analyze(run):
    return []
"""


def test_a_new_analyzers_declaration_reaches_every_derived_table(tmp_path, monkeypatch):
    """A package holding traindx's analyzers and one more: discover() finds it by its
    declaration alone, and every table the registry, chains and live read places it."""
    package = tmp_path / "fake_analyzers"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for d in catalog().declarations:
        # traindx's analyzers, declared again in the fake package (their modules stay traindx's)
        (package / f"{d.name}.py").write_text(
            f"import {d.module} as real\n\nDECLARATION = real.DECLARATION\n"
        )
    (package / "fake_io.py").write_text(textwrap.dedent(FAKE))
    (package / "helper.py").write_text(
        "raise RuntimeError('a helper without a declaration is never imported')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        c = discover("fake_analyzers")
    finally:
        for name in [m for m in sys.modules if m.startswith("fake_analyzers")]:
            del sys.modules[name]
    assert not c.broken
    orders = {d.name: d.order for d in catalog().declarations}
    at = sum(1 for name in analyzers.REGISTRY if orders[name] < 115)  # fake_io's order: 115
    assert c.registry == [*analyzers.REGISTRY[:at], "fake_io", *analyzers.REGISTRY[at:]]
    assert c.judges == analyzers.JUDGES
    assert c.category_analyzers["io"] == ("stability", "fake_io", "host_work")
    assert c.category_analyzers["fake_line"] == ("fake_io",)
    assert c.trigger_analyzers["fake_trigger"] == ("fake_io",)
    assert "fake_io" in c.capture_analyzers
    assert "fake_io.note" in c.not_causes
    assert c.ledger_lines["fake_io.slow_save"] == (("io",), True)
    assert c.straggler_roots["fake_line"] == "fake_io.slow_save"
    assert c.line_owners["io"] == ("steps.periodic_slow", "fake_io.slow_save")
    assert "fake_io" not in catalog().registry  # traindx's own catalog is as it was


def test_a_declaration_names_only_its_own_ids_and_each_once():
    with pytest.raises(ValueError, match="does not make"):
        Declaration(name="x", order=1, ids=("x.a",), removes={"x.b": Removes(("io",))})
    one = Declaration(name="x", order=1, ids=("x.a",))
    with pytest.raises(ValueError, match="declared twice"):
        Catalog((one, Declaration(name="y", order=2, ids=("x.a",))))
