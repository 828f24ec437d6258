"""The recipe-card schema: the sections and fields of the reference cards (reference/003_*.txt),
their types and which are required, and `validate`, which names every problem by its field path."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from traindx.common.errors import UserError

SCHEMA_VERSION = 1
STATUSES = ("verified", "measured", "draft", "unverified")
CHECK_RESULTS = ("pass", "fail", "not run", "skipped")


class CardError(UserError):
    """A card that does not follow the schema: every problem, one per line."""

    def __init__(self, problems: Iterable[str], source: str | None = None) -> None:
        self.problems = list(problems)
        where = f"{source}: " if source else ""
        lines = "; ".join(self.problems)
        super().__init__(f"{where}invalid recipe card: {lines}")


# -- the schema --------------------------------------------------------------------------------
# A spec is a type name, or a dict of {field: (spec, required)} for a mapping, or
# ("list", spec) / ("map", spec) / ("enum", values) / ("nullable", spec).
NUM = "number"
INT = "integer"
STR = "string"
BOOL = "boolean"
DATE = "date"
ANY = "any"
SCALAR = "scalar"

_CONVERGENCE = {
    "steps": (INT, True),
    "result": (("enum", CHECK_RESULTS), True),
    "correlation": (("nullable", NUM), False),
    "final_loss_difference": (("nullable", NUM), False),
    "pointwise_failures": (("nullable", INT), False),
    "note": (("nullable", STR), False),
}
_COMPONENT_TEST = {
    "test": (STR, True),
    "shape": (STR, False),
    "gpu": (STR, False),
    "date": (DATE, False),
    "result": (("enum", CHECK_RESULTS), True),
    "detail": (STR, False),
    "note": (STR, False),
}
SCHEMA = {
    "schema_version": (INT, True),
    "model": (STR, True),
    "gpu": (
        {
            "type": (STR, True),
            "memory_gb": (("nullable", NUM), False),
            "count": (INT, True),
            "per_node": (("nullable", INT), False),
            "instance": (("nullable", STR), False),
        },
        True,
    ),
    "author": ({"name": (STR, True), "url": (("nullable", STR), False)}, True),
    "status": (("enum", STATUSES), False),
    "stack": (("map", ("nullable", SCALAR)), True),
    "workload": (("map", ANY), True),
    "layout": (
        {
            "label": (STR, False),
            "summary": (STR, False),
            "highlights": (STR, False),
            "tp": (INT, False),
            "pp": (INT, False),
            "vpp": (INT, False),
            "cp": (INT, False),
            "ep": (INT, False),
            "etp": (INT, False),
            "dp": (INT, False),
            "sequence_parallel": (BOOL, False),
        },
        True,
    ),
    "result": (
        {
            "tokens_per_s_per_gpu": (NUM, True),
            "usd_per_million_tokens": (("nullable", NUM), False),
            "step_time_cv_percent": (("nullable", NUM), False),
            "mfu": (("nullable", NUM), False),
            "mfu_note": (("nullable", STR), False),
            "active_params": (
                (
                    "nullable",
                    {
                        "count": (INT, True),
                        "source": (("nullable", STR), False),
                        "revision": (("nullable", STR), False),
                    },
                ),
                False,
            ),
            "measured": (DATE, True),
            "steps_per_run": (INT, False),
            "window": (("list", INT), False),
            "window_tokens": (("nullable", INT), False),
            "steps_measured": (("list", INT), False),
            "steps_left_out": (("list", {"steps": (("list", INT), True), "why": (STR, True)}), False),
            "runs": (INT, False),
            "profiler": (BOOL, False),
            "gpu_hours": (("nullable", NUM), False),
            "gpu_hours_note": (("nullable", STR), False),
        },
        True,
    ),
    "correctness": (
        {
            "result": (("enum", CHECK_RESULTS), True),
            "summary": (STR, False),
            "reference": (("nullable", STR), False),
            "configuration": (("nullable", STR), False),
            "component_tests": (("list", _COMPONENT_TEST), False),
            "convergence": (("nullable", _CONVERGENCE), False),
            "rules": (("nullable", STR), False),
        },
        True,
    ),
    "env": (("map", ("nullable", SCALAR)), False),
    "patches": (("list", STR), False),
    "run": (STR, True),
    "notes": (("nullable", STR), False),
}


def _type_name(value: object) -> str:
    return type(value).__name__ if value is not None else "null"


def _check(value: Any, spec: Any, path: str, problems: list[str]) -> None:
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {_type_name(value)}")
            return
        for key, (sub, required) in spec.items():
            if key not in value:
                if required:
                    problems.append(f"{path}.{key}: required" if path else f"{key}: required")
                continue
            _check(value[key], sub, f"{path}.{key}" if path else key, problems)
        return
    if isinstance(spec, tuple):
        kind, sub = spec
        if kind == "nullable":
            if value is not None:
                _check(value, sub, path, problems)
        elif kind == "enum":
            if value not in sub:
                problems.append(f"{path}: {value!r} is not one of {', '.join(sub)}")
        elif kind == "list":
            if not isinstance(value, list):
                problems.append(f"{path}: expected a list, got {_type_name(value)}")
            else:
                for i, item in enumerate(value):
                    _check(item, sub, f"{path}[{i}]", problems)
        elif kind == "map":
            if not isinstance(value, dict):
                problems.append(f"{path}: expected a mapping, got {_type_name(value)}")
            else:
                for key, item in value.items():
                    _check(item, sub, f"{path}.{key}", problems)
        return
    ok = {
        NUM: isinstance(value, (int, float)) and not isinstance(value, bool),
        INT: isinstance(value, int) and not isinstance(value, bool),
        STR: isinstance(value, str),
        BOOL: isinstance(value, bool),
        DATE: isinstance(value, datetime.date) or (isinstance(value, str) and _is_iso_date(value)),
        SCALAR: isinstance(value, (str, int, float, bool)),
        ANY: True,
    }[spec]
    if not ok:
        want = {DATE: "a date (YYYY-MM-DD)", SCALAR: "a scalar", INT: "an integer"}.get(spec, f"a {spec}")
        problems.append(f"{path}: expected {want}, got {_type_name(value)} ({value!r})"[:200])


def _is_iso_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
        return True
    except ValueError:
        return False


def validate(data: Any) -> list[str]:
    """Every problem of a card's data (a dict), as 'path: what is wrong' lines; [] when valid."""
    if not isinstance(data, dict):
        return [f"a card is a mapping of sections, got {_type_name(data)}"]
    problems: list[str] = []
    _check(data, SCHEMA, "", problems)
    if data.get("schema_version") not in (None, SCHEMA_VERSION) and isinstance(
        data.get("schema_version"), int
    ):
        problems.append(
            f"schema_version: {data['schema_version']} is not supported (this traindx reads {SCHEMA_VERSION})"
        )
    result = data["result"] if isinstance(data.get("result"), dict) else {}
    window = result.get("window")
    if isinstance(window, list) and (
        len(window) != 2 or (all(isinstance(x, int) for x in window) and window[0] > window[1])
    ):
        problems.append(f"result.window: expected [FIRST, LAST] with FIRST <= LAST, got {window}")
    mfu = result.get("mfu")
    if isinstance(mfu, (int, float)) and not 0 <= mfu <= 1:
        problems.append(f"result.mfu: {mfu} is a fraction between 0 and 1 (27.4 % is 0.274)")
    gpu = data["gpu"] if isinstance(data.get("gpu"), dict) else {}
    if isinstance(gpu.get("count"), int) and gpu["count"] < 1:
        problems.append(f"gpu.count: must be at least 1, got {gpu['count']}")
    return problems
