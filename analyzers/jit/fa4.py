"""jit's FA4 max_seqlen-as-tensor leak: the FA4 calls the shim recorded, where the tensor is made,
the int casts (at the line that makes it, at the call) and the other fixes (a runtime patch,
an upgrade, the framework's switch off FA4)."""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.findings import Prescription
from traindx.analyzers.core.frameworks import runs_megatron
from traindx.analyzers.jit.common import (
    FA4_BWD_FIXED,
    FA4_FIXED,
    FA4_PACKAGE,
    col,
    display_path,
    fa4_version_before,
)
from traindx.derive.sources import source_text

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord


# -- small helpers -----------------------------------------------------------------------------


_MAX_SEQLEN_ARG = re.compile(r"\b(max_seqlen_[qk])\s*=\s*([A-Za-z_](?:[\w.]|\([^()]*\))*)")


def int_cast(source: str | None) -> str | None:
    """The FA4 call line with its max_seqlen arguments cast to int, or None if it has none."""
    if not source or not _MAX_SEQLEN_ARG.search(source):
        return None
    return _MAX_SEQLEN_ARG.sub(lambda m: m[0] if m[2].startswith("int(") else f"{m[1]}=int({m[2]})", source)


def _call_cast_edits(where: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The int casts of the call statement at `where` (a user frame: file, line), one edit per
    line of the call that passes max_seqlen_q/k (a call often spans several lines; the cast
    goes on the line that names the argument). [] when the file or the call cannot be read."""
    if not where or not where.get("file") or not where.get("line"):
        return []
    text = source_text(where["file"])
    try:
        tree = ast.parse(text) if text is not None else None
    except (SyntaxError, ValueError):
        return []
    if text is None or tree is None:
        return []
    lines = text.splitlines(keepends=True)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno == where["line"]]
    if not calls:
        return []
    call = max(calls, key=lambda n: (n.end_lineno or n.lineno) - n.lineno)  # the outermost
    out = []
    for i in range(call.lineno, (call.end_lineno or call.lineno) + 1):
        before = lines[i - 1]
        after = int_cast(before)
        if after and after != before:
            out.append(
                {
                    "file": where["file"],
                    "line": i,
                    "before": before.strip(),
                    "after": after.strip(),
                    "before_line": before,
                    "after_line": after,
                    "role": "call_site",
                }
            )
    return out


# -- the command's attention backend -------------------------------------------------------------
def backend_switches(run: RunRecord) -> list[Prescription]:
    """Prescriptions that switch the job off FA4 in its own framework, recognised from the
    command line and environment."""
    command = [str(t) for t in run.command]
    text = " ".join(command)
    env = run.manifest.get("env") or run.manifest.get("environment") or {}
    out = []
    flags = {t.split("=", 1)[0] for t in command if t.startswith("--")}
    if runs_megatron(command) or "--attention-backend" in flags:
        out.append(
            Prescription(
                kind="arg",
                summary="Megatron: --attention-backend fused (cuDNN fused attention "
                "through TransformerEngine instead of FA4)",
                change={"arg": {"framework": "megatron", "set": {"--attention-backend": "fused"}}},
                automatic=True,
            )
        )
    if "swift" in text.lower() or "--attention_backend" in flags:
        out.append(
            Prescription(
                kind="arg",
                summary="ms-swift: --attention_backend flash_2 (FlashAttention-2, no JIT)",
                change={"arg": {"framework": "ms-swift", "set": {"--attention_backend": "flash_2"}}},
                automatic=True,
            )
        )
    if (
        "transformer_engine" in text.lower()
        or any(k.startswith("NVTE_") for k in env)
        or (run.manifest.get("packages") or {}).get("transformer-engine")
    ):
        out.append(
            Prescription(
                kind="env",
                summary="TransformerEngine: NVTE_FLASH_ATTN_V4=0 (do not route attention to FA4)",
                change={"env": {"NVTE_FLASH_ATTN_V4": "0"}},
                automatic=True,
            )
        )
    return out


# -- the shim's events ---------------------------------------------------------------------------
def fa4_calls(run: RunRecord, rank: str) -> Any:
    calls = ev.events_of_type(run, "fa4_call")
    if not len(calls):
        return calls
    return calls[calls["rank"] == rank]


def tensor_max_seqlen_call(calls: pd.DataFrame) -> Any:
    """The first recorded FA4 call that passed max_seqlen as a tensor, as a dict, or None."""
    for row in calls.itertuples():
        types = col(row, "arg_types") or {}
        if any(k.startswith("max_seqlen") and "Tensor" in str(v) for k, v in types.items()):
            return {
                "caller": col(row, "caller"),
                "source": col(row, "source"),
                "function": col(row, "function"),
                "arg_types": types,
                "thread": col(row, "thread"),
                "step": col(row, "step"),
            }
    return None


def wrap_in_int(line: str | None) -> str | None:
    """The source line with the expression that makes a 0-dim tensor max (`x.max()`,
    `x.diff().max()`, `x.amax()`, `torch.max(x)`) wrapped in int(...), or None when the line has
    none or the result would not parse. Handles `name = ...`, `"key": ...,` and `key=...,` lines."""
    if not line or not line.strip():
        return None
    indent = line[: len(line) - len(line.lstrip())]
    body = line.strip()
    for prefix, suffix in (("", ""), ("{", "}"), ("f(", ")")):
        text = prefix + body + suffix
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and _is_max_call(n) and n.lineno == n.end_lineno == 1
        ]
        wrapped = {
            id(n.args[0])
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "int" and n.args
        }
        if not calls or any(id(n) in wrapped for n in calls):
            return None
        node = min(calls, key=lambda n: n.col_offset)  # the outermost one
        a, b = node.col_offset, node.end_col_offset
        new_text = text[:a] + "int(" + text[a:b] + ")" + text[b:]
        try:
            ast.parse(new_text)
        except SyntaxError:
            return None
        return indent + new_text[len(prefix) : len(new_text) - len(suffix)]
    return None


def _is_max_call(node: Any) -> Any:
    if (
        not isinstance(node, ast.Call)
        or not isinstance(node.func, ast.Attribute)
        or node.func.attr not in ("max", "amax")
    ):
        return False
    if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
        return len(node.args) == 1 and not node.keywords
    return not node.args and not node.keywords


def tensor_origin_event(run: RunRecord, rank: str) -> Any:
    """The shim's `tensor_origin` event for this rank (origins.py): where the tensor max_seqlen
    that reached FA4 was made, as {"origin": frame, "chain": [...], "call_site": frame, ...}."""
    rows = ev.events_of_type(run, "tensor_origin")
    if not len(rows):
        return None
    if "rank" in rows:
        rows = rows[rows["rank"].astype(str) == str(rank)]
    for row in rows.itertuples():
        origin = col(row, "origin")
        if isinstance(origin, dict) and origin.get("file"):
            return {
                "origin": origin,
                "chain": col(row, "chain") or [],
                "candidates": col(row, "candidates") or [],
                "call_site": col(row, "call_site"),
                "method": col(row, "method"),
                "arg": col(row, "arg"),
            }
    return None


RUNTIME_PATCH = "fa4_int_max_seqlen"


def leak_prescriptions(
    run: RunRecord,
    where: str | None,
    caller: dict[str, Any] | None,
    source: str | None,
    gain: float | None,
    backward_only: bool,
    origin: dict[str, Any] | None = None,
    kernel_sites: Sequence[dict[str, Any]] = (),
) -> list[Prescription]:
    """Strongest first: the framework's own switch (config), the source line that makes the
    tensor (a real diff, applied to a scratch copy by --fix), the cast at the FA4 call, a runtime
    patch at FA4's boundary (proves the diagnosis, edits nothing), an overlay upgrade of FA4, a
    backend switch."""
    out = []
    call_line = caller.get("line") if caller else None
    call_after = int_cast(source)
    for arg_line in ((origin or {}).get("call_site") or {}).get("argument_lines") or []:
        if not call_after and int_cast(arg_line.get("source")):
            # the call spans several lines: the cast goes on the line naming max_seqlen
            call_line, source = arg_line["line"], arg_line["source"]
            call_after = int_cast(source)
    call_code = {
        "file": caller.get("file") if caller else None,
        "line": call_line,
        "before": source.strip() if source else source,
        "after": call_after.strip() if call_after else call_after,
    }
    made = (origin or {}).get("origin") or {}
    made_after = wrap_in_int(made.get("source")) if made.get("file") else None
    if made_after:
        out.append(_origin_cast(run, where, caller, origin or {}, made, made_after, gain))
    if call_after and caller and caller.get("file"):
        out.append(_call_cast(run, where, caller, source or "", call_after, call_code, gain, kernel_sites))
    elif not made_after:
        out.append(
            Prescription(
                kind="code",
                summary=f"pass max_seqlen as a Python int at {where or 'the FA4 call'} "
                "(the line that creates the tensor was not found: cast it there, "
                "once per batch)",
                change={"code": call_code},
                expected_gain_s_per_step=gain,
                automatic=False,
            )
        )
    older = fa4_version_before(run, FA4_FIXED)
    if older is not False:
        out.extend(_patch_and_upgrade(run, gain, backward_only))
    out.extend(
        Prescription(
            kind=p.kind,
            summary=p.summary,
            change=p.change,
            expected_gain_s_per_step=gain,
            automatic=p.automatic,
        )
        for p in backend_switches(run)
    )
    return out


def _origin_cast(
    run: RunRecord,
    where: str | None,
    caller: dict[str, Any] | None,
    origin: dict[str, Any],
    made: dict[str, Any],
    made_after: str,
    gain: float | None,
) -> Prescription:
    """The int cast at the line that makes the tensor max_seqlen."""
    made_where = f"{display_path(made['file'], run.manifest.get('cwd'))}:{made.get('line')}"
    return Prescription(
        kind="code",
        summary=f"make max_seqlen a Python int where it is created, {made_where} "
        f"(one host read per batch instead of a new FA4 compile key per call; "
        f"it reaches FA4 at {where or 'the FA4 call'})",
        change={
            "code": {
                "file": made["file"],
                "line": made.get("line"),
                "before": made["source"].strip(),
                "after": made_after.strip(),
                "before_line": made["source"],
                "after_line": made_after,
                "role": "origin",
                "call_site": caller,
                "traced_by": origin.get("method"),
            }
        },
        command=f"{made_where}: {made['source'].strip()}  ->  {made_after.strip()}",
        expected_gain_s_per_step=gain,
        automatic=True,
    )


def _call_cast(
    run: RunRecord,
    where: str | None,
    caller: dict[str, Any],
    source: str,
    call_after: str,
    call_code: dict[str, Any],
    gain: float | None,
    kernel_sites: Sequence[dict[str, Any]],
) -> Prescription:
    """The int cast at the FA4 call, and at the recompiling kernel's own calls where they
    differ from the public entry's."""
    cwd = run.manifest.get("cwd")
    call_line = call_code["line"]
    # the recompiling kernel's own call, where it differs from the public entry's (a job that
    # calls FA4's backward itself, with the max_seqlen its forward saved): cast there too, or
    # the cast at the entry leaves the backward's key a tensor
    own = [
        e
        for site in kernel_sites or ()
        for e in _call_cast_edits(site)
        if not (call_code["file"] and e["file"] == call_code["file"] and e["line"] == call_line)
    ]
    own = list({(e["file"], e["line"]): e for e in own}.values())
    first = {**call_code, "before_line": source, "after_line": call_after, "role": "call_site"}
    lines = [
        f"{display_path(caller['file'], cwd)}:{call_line}: {source.strip()}  ->  {call_after.strip()}"
    ] + [f"{display_path(e['file'], cwd)}:{e['line']}: {e['before']}  ->  {e['after']}" for e in own]
    sites = ", ".join(
        [where or "the FA4 call"] + [f"{display_path(e['file'], cwd)}:{e['line']}" for e in own]
    )
    return Prescription(
        kind="code",
        summary=(
            f"cast max_seqlen to int at the FA4 call{'s' if own else ''}, {sites} (one host read per call)"
        ),
        change={"code": first, "codes": [first] + own} if own else {"code": first},
        command="; ".join(lines),
        expected_gain_s_per_step=gain,
        automatic=True,
    )


def _patch_and_upgrade(run: RunRecord, gain: float | None, backward_only: bool) -> list[Prescription]:
    """The runtime patch at FA4's boundary and the upgrade past the fix, for an FA4 without it."""
    have = (run.manifest.get("packages") or {}).get(FA4_PACKAGE) or "this release"
    return [
        Prescription(
            kind="runtime",
            summary="runtime patch at FA4's boundary: a tensor max_seqlen_q/k becomes a Python "
            "int in _flash_attn_fwd/_flash_attn_bwd (proves the diagnosis without "
            "editing code; not a lasting fix)",
            change={"runtime": {"patch": RUNTIME_PATCH}},
            command=f"TRAINDX_RUNTIME_PATCHES={RUNTIME_PATCH} diagnose -- <cmd>",
            expected_gain_s_per_step=gain,
            automatic=True,
        ),
        Prescription(
            kind="upgrade",
            summary=f"upgrade flash-attn-4 from {have} to >= {FA4_FIXED} (it keeps a tensor "
            f"max_seqlen out of the compile key; {FA4_BWD_FIXED} fixes the backward only"
            + (", which is what recompiles here)" if backward_only else ")"),
            change={"upgrade": {"package": FA4_PACKAGE, "min_version": FA4_FIXED}},
            command=f"pip install -U '{FA4_PACKAGE}>={FA4_FIXED}'",
            expected_gain_s_per_step=gain,
            automatic=True,
        ),
    ]


def tensor_origin_text(run: RunRecord, origin: Any, where: Any, source: Any) -> Any:
    """Both lines: where the tensor is made and where it reaches FA4."""
    passed = f"It reaches FA4 at {where or 'the FA4 call'}" + (f": `{source}`" if source else "")
    made = (origin or {}).get("origin") or {}
    if not made.get("file"):
        return passed + " (where the tensor is made was not found)."
    how = {"traced": "traced at run time", "static": "found in the job's source"}.get(
        origin.get("method"), origin.get("method") or ""
    )
    text = (
        f"The tensor is made at {display_path(made['file'], run.manifest.get('cwd'))}:"
        f"{made.get('line')}"
        + (f": `{str(made.get('source') or '').strip()}`" if made.get("source") else "")
        + (f" ({how})" if how else "")
        + f". {passed}."
    )
    return text
