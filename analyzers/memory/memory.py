"""Memory that grows step after step and does not level off.

A healthy job's memory grows during its warm-up (the allocator's cache, the optimizer's state)
and then levels off; a leak keeps growing at about the same rate. Its finding gives that rate,
the step at which the host's or the device's memory runs out at it, and where it is held: the
shim's census of graph-holding tensors names the container that gained some and this module
finds the line that adds to it and prescribes `.item()` or `.detach()` (automatic: `--fix`
judges the arm by the memory's slope). Without such a holder, tracemalloc's or the allocator's
surviving sites are named instead."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.derive import memory as mem
from traindx.derive.steady import perturbed_steps

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="memory",
    order=62,
    ids=("memory.growth",),
    cross_rank=False,
    not_causes=("memory.growth",),
)

MB = 1 << 20
MIN_RATE = {"host": 0.5 * MB, "device": 0.5 * MB}  # per step
MIN_GROWN = 8 * MB  # over the window
MIN_RANK_CORR = 0.8  # memory rises with the step number
MIN_HELD_RISES = 0.8  # ... or, with graph-holding tensors found kept, rose on this share of steps
LEVEL_OFF = 0.3  # the second half's rate under this share of the whole window's: it levels off
SERIES_LABEL = {
    "heap_bytes": "The heap's in-use memory (malloc)",
    "rss_bytes": "Resident memory (RSS)",
    "dev_alloc_bytes": "GPU memory allocated",
}
HUNT_SETTLE = 3  # steps after the hunt whose memory still holds its residue
MIN_POINTS_AFTER_HUNT = 10
WARMUP_SHARE = 0.25  # leading share of the recorded steps left out (and at least 2 steps)
CRITICAL_RUNWAY = 10_000  # steps until memory runs out: a run of hours crashes (the verdict's first)
HIGH_RUNWAY = 200_000
ADD_METHODS = ("append", "extend", "insert", "appendleft", "add", "put")


def _window(table: pd.DataFrame, column: str, hunted: set[int]) -> pd.DataFrame:
    """The series after its warm-up, less the steps the shim's own hunt perturbed and a few
    after them (tracemalloc's traces and the censuses are memory too, freed when the collector
    runs next): the steps after the hunt alone when there are enough of them."""
    rows = table.dropna(subset=[column])
    skip = max(2, int(len(rows) * WARMUP_SHARE))
    rows = rows.iloc[skip:]
    if not hunted:
        return rows
    settled = max(hunted) + HUNT_SETTLE
    after = rows[rows["step"] > settled]
    if len(after) >= MIN_POINTS_AFTER_HUNT:
        return after
    # each perturbed stretch left out with the steps that settle after it (a profiler window
    # early and a hunt late leave the steady steps between them)
    near = {step + k for step in hunted for k in range(HUNT_SETTLE + 1)}
    return rows[~rows["step"].isin(near)]


def _judge_series(rows: pd.DataFrame, column: str, where: str, held_graphs: bool) -> dict[str, Any] | None:
    """The growth of one series when it does not level off, else None: a large rate; or any
    steady rise when the shim's hunt found containers gaining graph-holding tensors (a loss kept
    with its graph nodes costs a few kB a step: the heap's in-use bytes show it exactly). With
    such a holder the rise is judged step by step, at the median step's rate: something else
    freed once (a transient of the job's or a thread's, released by a late collection) drops the
    series a level below its start without ending the leak, which a fit over the levels reads as
    no growth; a container emptied every few steps falls more than once."""
    g = mem.growth(rows["step"].tolist(), rows[column].tolist())
    if g is None:
        return None
    if held_graphs and min(g["rises"], g["last_rises"]) >= MIN_HELD_RISES and g["falls"] <= 1:
        return {**g, "rate": g["median_step"]}  # (rises on most steps: the median is a rise)
    if g["rate"] <= 0 or g["rank_corr"] < MIN_RANK_CORR:
        return None  # (not every step's RSS rises: malloc grows its heap in chunks)
    if g["last_rate"] < LEVEL_OFF * g["rate"]:
        return None  # levels off: a warm-up that lasted longer (the overall rate is the warm-up's)
    if g["rate"] >= MIN_RATE[where] and g["grew"] >= MIN_GROWN:
        return g
    return None


def _holds_graphs(held: pd.DataFrame) -> bool:
    """The hunt saw graph-holding tensors accumulate: more of them alive than at its start, and
    a container that gained two or more while holding older ones too (a step's own output and
    loss in a dict are new every step, and as many as before)."""
    for row in held.to_dict("records"):
        holders = row.get("holders")
        if isinstance(holders, list) and any(h.get("kind") == "graph" for h in holders):
            return True  # a variable's one tensor whose graph grew between the censuses
        before, after = row.get("graph_tensors_before"), row.get("graph_tensors")
        if isinstance(before, (int, float)) and isinstance(after, (int, float)) and after - before < 2:
            continue
        if isinstance(holders, list) and any(
            int(h.get("new") or 0) >= 2 and int(h.get("size") or 0) > int(h.get("new") or 0) for h in holders
        ):
            return True
    return False


def _assignment_targets(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)]
    return []


def adds_to(path: str, name: str, first: int | None = None, last: int | None = None) -> list[dict[str, Any]]:
    """The statements of `path` (between lines first..last) that add a value to the container
    `name` (`name.append(x)`, `.extend`, `.insert`, `name[k] = x`, `name += [x]`, and
    `self.name.append(x)`): [{line, last_line, source, value}], in file order."""
    tree, lines = codefix.source_tree(path)
    if tree is None:
        return []
    out = []
    for node in ast.walk(tree):
        lineno = getattr(node, "lineno", None)
        if lineno is None or (first and lineno < first) or (last and lineno > last):
            continue
        value = None
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ADD_METHODS
        ):
            owner = node.func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
            if owner_name == name and node.args:
                value = node.args[-1]
        elif (
            name in _assignment_targets(node)
            and isinstance(node, (ast.Assign, ast.AnnAssign))
            or isinstance(node, ast.AugAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == name
        ):
            value = node.value
        if value is None:
            continue
        end = getattr(node, "end_lineno", lineno) or lineno
        out.append(
            {
                "line": lineno,
                "last_line": end,
                "source": "\n".join(lines[lineno - 1 : end]),
                "value": ast.get_source_segment("\n".join(lines), value),
                # where the value sits on a one-line statement (the edit replaces it there:
                # `total_loss += loss` has `loss` inside `total_loss` too)
                "value_cols": (value.col_offset, value.end_col_offset)
                if value.lineno == lineno and value.end_lineno == lineno
                else None,
            }
        )
    return sorted(out, key=lambda e: e["line"])


def _function_end(path: str, first_line: int | None) -> int | None:
    tree, _ = codefix.source_tree(path)
    if tree is None or not first_line:
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if start == first_line or node.lineno == first_line:
                return node.end_lineno
    return None


def _atom(value: str) -> bool:
    """`value` takes `.item()` without parentheses: a name, attribute, call or subscript."""
    try:
        node = ast.parse(value, mode="eval").body
    except SyntaxError:
        return False
    return isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))


def _held_at(holder: dict[str, Any], gpu: bool = False) -> dict[str, Any] | None:
    """The line that adds the tensors to the holder's container, with its fix: `.item()` for a
    scalar, `.detach()` for a larger tensor."""
    owner = holder.get("owner") or {}
    name, path = owner.get("name"), owner.get("file")
    if not name or not path or ev.is_library_path(str(path)):
        return None
    first = owner.get("first_line") if owner.get("scope") == "local" else None
    adds = adds_to(str(path), str(name), first, _function_end(str(path), first) if first else None)
    if not adds:
        return None
    site = adds[0]
    value = site["value"]
    # a scalar as a Python number; on a GPU `.item()` waits for the device every step: `.detach()`
    method = "item" if holder.get("shape") == [] and not gpu else "detach"
    change = None
    if value and f".{method}()" not in value and "\n" not in value:
        after_value = f"{value}.{method}()" if _atom(value) else f"({value}).{method}()"
        line_text = site["source"]
        cols = site.get("value_cols")
        if site["line"] == site["last_line"] and cols and line_text[cols[0] : cols[1]] == value:
            after = (line_text[: cols[0]] + after_value + line_text[cols[1] :]).strip()
            change = codefix.code_change(str(path), site["line"], line_text.strip(), after)
    return {
        "file": path,
        "line": site["line"],
        "source": site["source"].strip(),
        "value": value,
        "method": method,
        "change": change,
    }


def _location(held: pd.DataFrame, gpu: bool = False) -> dict[str, Any]:
    """Where the growth is held: the container that gained graph-holding tensors (and the line
    that adds to it), else the allocation sites that grew, from the rank's last hunt."""
    if not len(held):
        return {}
    row = held.iloc[-1]
    holders = row["holders"] if isinstance(row["holders"], list) else []
    for holder in holders:
        at = _held_at(holder, gpu)
        if at is not None:
            return {"holder": holder, "at": at}
    if holders:
        return {"holder": holders[0]}
    for key in ("device_sites", "sites"):
        sites = row[key] if isinstance(row[key], list) else []
        user = [s for s in sites if s.get("file") and not ev.is_library_path(str(s["file"]))]
        if user or sites:
            return {key: (user or sites)[:3]}
    return {}


def _runway(last: pd.Series, where: str, rate: float) -> tuple[int | None, str | None]:
    """(steps until memory runs out at `rate`, what bounds it)."""
    bound: str | None
    if where == "device":
        room, bound = mem.device_headroom(last), "the device's memory"
    else:
        room, bound = mem.host_headroom(last)
    if room is None or rate <= 0:
        return None, None
    return int(room / rate), bound


def _size(n: float) -> str:
    return f"{n / MB:.1f} MB" if abs(n) >= MB else f"{n / 1024:.1f} kB"


def _title(where: str, g: dict[str, Any], loc: dict[str, Any]) -> str:
    what = "Host memory" if where == "host" else "GPU memory (allocated)"
    title = f"{what} grows {_size(g['rate'])} a step and does not level off"
    holder, at = loc.get("holder"), loc.get("at")
    if holder and holder.get("owner"):
        name = holder["owner"].get("name")
        kept = "a loss" if holder.get("shape") == [] else "tensors"
        title += f": `{name}` keeps {kept} with its autograd graph"
        if at:
            title += f" ({at['file'].rsplit('/', 1)[-1]}:{at['line']})"
    return title


def _prescriptions(loc: dict[str, Any]) -> list[Prescription]:
    at, holder = loc.get("at"), loc.get("holder") or {}
    if at:
        value, method = at["value"], at["method"]
        why = (
            "a Python number keeps no graph"
            if method == "item"
            else "the values without the graph that keeps every activation of the step alive"
        )
        return [
            Prescription(
                kind="code",
                summary=f"keep `{value}.{method}()` at {at['file']}:{at['line']} instead of `{value}`: {why}",
                change={"code": at["change"]} if at.get("change") else {},
                expected_gain_s_per_step=None,
                # --fix applies it and judges the arm by the memory's slope (ab_verdict.judge_arm)
                automatic=bool(at.get("change")),
            )
        ]
    if holder.get("owner"):
        name = holder["owner"].get("name")
        return [
            Prescription(
                kind="code",
                summary=f"store `.item()` or `.detach()` of what is added to `{name}`: it keeps "
                f"{holder.get('grad_fn') or 'a tensor'} with its autograd graph each step",
                change={},
                expected_gain_s_per_step=None,
                automatic=False,
            )
        ]
    return []


def _finding(
    rank: str,
    where: str,
    column: str,
    g: dict[str, Any],
    table: pd.DataFrame,
    held: pd.DataFrame,
    gpu: bool = False,
) -> Finding:
    read = table.dropna(subset=[column])  # the device's series is read on a clock: its last reading
    last = read.iloc[-1] if len(read) else table.iloc[-1]
    runway, bound = _runway(last, where, g["rate"])
    loc = _location(held[held["grew"] == where] if len(held) else held, gpu) or _location(held, gpu)
    if runway is not None and runway < CRITICAL_RUNWAY:
        severity = "critical"
    elif (runway is not None and runway < HIGH_RUNWAY) or g["rate"] >= MB:
        severity = "high"
    else:
        severity = "medium"
    runs_out = None if runway is None else int(g["last_step"]) + runway
    summary = (
        f"{SERIES_LABEL.get(column, column)} rose from {_size(g['last'] - g['grew'])} to {_size(g['last'])} over steps "
        f"{g['first_step']}-{g['last_step']} ({_size(g['rate'])} a step; first half "
        f"{_size(g['first_rate'])}, second half {_size(g['last_rate'])} a step: it does not level off)."
    )
    if runs_out is not None:
        summary += f" At that rate {bound} runs out at about step {runs_out}."
    return Finding(
        id="memory.growth",
        title=_title(where, g, loc),
        severity=severity,
        analyzer="memory",
        summary=summary,
        ranks=(rank,),
        evidence={
            "memory": where,
            "series": column,
            "rate_mb_per_step": round(g["rate"] / MB, 3),
            "first_rate_mb_per_step": round(g["first_rate"] / MB, 3),
            "last_rate_mb_per_step": round(g["last_rate"] / MB, 3),
            "grew_mb": round(g["grew"] / MB, 1),
            "steps": [g["first_step"], g["last_step"]],
            "runs_out_at_step": runs_out,
            "steps_left": runway,
            "bound": bound,
            **loc,
        },
        prescriptions=tuple(_prescriptions(loc)),
    )


def analyze(run: RunRecord) -> list[Finding]:
    table = mem.memory_table(run)
    if not len(table):
        return []
    held = mem.held_table(run)
    # the steps traindx itself grew memory in: the shim's hunt, a torch.profiler window's buffers
    hunted = perturbed_steps(run)
    out = []
    for rank, rows in table.groupby("rank", sort=False):
        rank_held = held[held["rank"] == rank] if len(held) else held
        # the heap's in-use bytes where the shim had them (RSS hides a leak in reused pages)
        host = "heap_bytes" if "heap_bytes" in rows and rows["heap_bytes"].notna().any() else "rss_bytes"
        for where, column in (("device", "dev_alloc_bytes"), ("host", host)):
            if column not in rows or not rows[column].notna().any():
                continue
            # traindx's perturbations (the hunt's tracemalloc and censuses, the profiler's
            # buffers) are host memory: the device series keeps those steps
            perturbed = hunted.get(str(rank), set()) if where == "host" else set()
            window = _window(rows, column, perturbed)
            g = _judge_series(window, column, where, _holds_graphs(rank_held))
            if g is not None:
                out.append(_finding(str(rank), where, column, g, rows, rank_held, bool(len(run.gpu))))
                break  # device growth also shows in the host's pages of a pinned copy: one finding
    return out


def steady_rate(run: RunRecord) -> dict[str, Any] | None:
    """The first rank's memory slope after its warm-up and the shim's hunt (bytes a step, of the
    series this module judges), for the A/B of a fix that keeps less: None without a record."""
    table = mem.memory_table(run)
    if not len(table):
        return None
    rank = str(table["rank"].iloc[0])
    rows = table[table["rank"] == rank]
    for column in ("dev_alloc_bytes", "heap_bytes", "rss_bytes"):
        if column in rows and rows[column].notna().any():
            # as analyze(): traindx's perturbations are host memory, the device series keeps them
            hunted = perturbed_steps(run).get(rank, set()) if column != "dev_alloc_bytes" else set()
            window = _window(rows, column, hunted)
            g = mem.growth(window["step"].tolist(), window[column].tolist())
            if g is not None:
                return {
                    "series": column,
                    "rate_bytes_per_step": round(float(g["rate"]), 1),
                    "points": g["points"],
                }
    return None
