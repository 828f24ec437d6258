"""The shim's event schema names every event type the shim writes, and its bus keeps the shim's
modules from importing each other (steps never imports compiles)."""

import ast
import glob
import os

from traindx.profiler.shim._traindx_shim import bus, schema

SHIM = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiler", "shim", "_traindx_shim"
)


def _emitted_types():
    """(literal event types, schema names) passed as the first argument of emit() in the shim."""
    literals, names = set(), set()
    for path in glob.glob(os.path.join(SHIM, "*.py")):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if called in ("emit", "_emit_compile"):
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    literals.add((called, first.value, os.path.basename(path)))
                elif isinstance(first, ast.Attribute) and getattr(first.value, "id", "") == "schema":
                    names.add((called, first.attr))
    return literals, names


def test_every_event_type_the_shim_writes_is_in_the_schema():
    literals, names = _emitted_types()
    assert names, "the shim names its event types through the schema"
    for called, name in names:
        assert hasattr(schema, name), name
        value = getattr(schema, name)
        assert value in (schema.EVENT_TYPES if called == "emit" else schema.COMPILE_KINDS), name
    unknown = {
        (value, file)
        for called, value, file in literals
        if called == "emit" and value not in schema.EVENT_TYPES
    }
    assert not unknown, f"event types missing from schema.py: {sorted(unknown)}"
    assert not [x for x in literals if x[0] == "_emit_compile" and x[1] not in schema.COMPILE_KINDS]


def test_steps_does_not_import_compiles():
    tree = ast.parse(open(os.path.join(SHIM, "steps.py"), encoding="utf-8").read())
    imported = {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert "compiles" not in imported


def test_a_failing_subscriber_does_not_stop_the_others(monkeypatch):
    errors, seen = [], []
    monkeypatch.setattr(bus, "_subscribers", {})
    monkeypatch.setattr(bus, "report_error", lambda where, exc: errors.append((where, repr(exc))))

    def broken(step):
        raise RuntimeError("boom")

    bus.subscribe("topic", broken)
    bus.subscribe("topic", seen.append)
    bus.publish("topic", 7)
    assert seen == [7]
    assert len(errors) == 1 and "broken" in errors[0][0] and "boom" in errors[0][1]
