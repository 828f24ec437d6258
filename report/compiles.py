"""Compile events as the report shows them: one row per event with the key diff against the
previous compile of the same kernel, and per-kernel groups."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from traindx.derive.steptables import compile_span
from traindx.report.text import clip, frame_label, num, ranges, text_of

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord

MAX_COMPILE_ROWS = 200


def compile_events(run: RunRecord, t0: int) -> list[dict[str, Any]]:
    """Every compile event with a time, in start order, as render-ready dicts."""
    out: list[dict[str, Any]] = []
    df = run.compiles
    for c in df.itertuples() if len(df) else []:
        span = compile_span(c.start_ns, c.end_ns, c.duration_s, t0)
        if span is None:
            continue
        call_site = getattr(c, "fa4_call_site", None)
        out.append(
            {
                "rank": str(c.rank),
                "kind": str(c.kind),
                "kernel": clip(text_of(c.kernel) or "?", 300),
                "start_s": span[0],
                "end_s": span[1],
                "duration_s": num(c.duration_s) or span[1] - span[0],
                "thread": clip(text_of(c.thread), 100),
                # bool, numpy's bool_, or NaN where the event had no such field
                "is_main_thread": bool(c.is_main_thread)
                if type(c.is_main_thread).__name__ in ("bool", "bool_")
                else None,
                "step": int(c.step) if num(c.step) is not None else None,
                "caller": frame_label(c.caller) if isinstance(c.caller, dict) else "",
                "key_fields": c.key_fields if isinstance(c.key_fields, dict) else None,
                "key": clip(c.key, 600) if isinstance(c.key, str) else None,
                "call_site": frame_label(call_site) if isinstance(call_site, dict) else "",
            }
        )
    out.sort(key=lambda e: e["start_s"])
    # the key diff against the previous compile of the same kernel on the same rank: the field
    # that changes between recompiles is what a user has to fix
    previous: dict[tuple[str, str], dict[str, Any]] = {}
    for e in out:
        prev = previous.get((e["rank"], e["kernel"]))
        e["first"] = prev is None
        e["key_diff"] = []
        if prev is not None and prev["key_fields"] and e["key_fields"]:
            for name in list(dict.fromkeys(list(prev["key_fields"]) + list(e["key_fields"]))):
                before, after = prev["key_fields"].get(name), e["key_fields"].get(name)
                if before != after:
                    e["key_diff"].append(
                        {"field": clip(name, 100), "before": clip(before, 200), "after": clip(after, 200)}
                    )
        elif prev is not None and prev["key"] and e["key"] and prev["key"] != e["key"]:
            e["key_diff"].append({"field": "key", "before": prev["key"], "after": e["key"]})
        if prev is not None and not e["key_diff"]:
            # the same key text compiled again: the key holds objects compared by identity, such
            # as a tensor (a new one every call), so the in-memory cache can never hit
            for name, value in (e["key_fields"] or {}).items():
                if re.search(r"(?:\b|Fake|Functional)[Tt]ensor\(", str(value)):
                    e["key_diff"].append(
                        {
                            "field": clip(name, 100),
                            "before": clip(value, 200),
                            "after": "a new tensor object: the key never matches",
                        }
                    )
        previous[(e["rank"], e["kernel"])] = e
    for e in out:
        e.pop("key_fields")
    return out


def compile_groups(compiles: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Compile events per kernel: how often, how long, in which steps and threads, and which key
    fields changed between its compiles (what a user has to fix)."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for c in compiles:
        g = groups.setdefault(
            (c["rank"], c["kernel"]),
            {
                "rank": c["rank"],
                "kernel": c["kernel"],
                "kind": c["kind"],
                "count": 0,
                "total_s": 0.0,
                "steps": [],
                "threads": [],
                "changed": {},
                "call_site": c["call_site"] or c["caller"],
            },
        )
        g["count"] += 1
        g["total_s"] += c["duration_s"]
        if c["step"] is not None:
            g["steps"].append(c["step"])
        if c["thread"] and c["thread"] not in g["threads"]:
            g["threads"].append(c["thread"])
        for d in c["key_diff"]:
            g["changed"].setdefault(d["field"], d["after"])
    out = []
    for g in groups.values():
        g["steps"] = ranges(g["steps"])
        g["changed"] = [{"field": k, "example": v} for k, v in list(g["changed"].items())[:6]]
        g["mean_s"] = g["total_s"] / g["count"]
        out.append(g)
    out.sort(key=lambda g: -g["total_s"])
    return out
