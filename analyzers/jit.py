"""JIT compiles: cold starts, steady recompiles with the key field that changes, Triton
autotuning, torch.compile recompiles; and FA4's max_seqlen-as-tensor leak with the line that
passes the tensor.

Reads the shim's compile events when there are any; else detects compiles from py-spy stacks
(attach mode, or a py-spy file alone) and says what can be known from them.
"""

from __future__ import annotations

import ast
import collections
import re
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from traindx.analyzers import evidence as ev
from traindx.analyzers import pyspy_signatures as sig
from traindx.analyzers.declaration import Declaration, Removes
from traindx.analyzers.findings import Finding, Prescription
from traindx.analyzers.frameworks import runs_megatron
from traindx.analyzers.jit_autotune import (
    _autotune_finding,
    _beside_runs,
    _cold_start_finding,
    first_step_rows,
)
from traindx.analyzers.jit_common import (  # noqa: F401
    CACHE_DIR_VAR,
    CACHE_ENABLE_VAR,
    FA4_BWD_FIXED,
    FA4_FIXED,
    FA4_PACKAGE,
    SINGLE_BLOCK_FIELDS,
    _col,
    _display_path,
    _is_tensor_field,
    _kernel_rows,
    _key_history,
    _ledger_cost,
    _release_number,
    _severity,
    _steps_after,
    _where,
    diff_keys,
    fa4_version_before,
    precompile_prescription,
)
from traindx.analyzers.jit_dynamo import (  # noqa: F401
    _dynamo_finding,
    dynamo_compile_kind,
    dynamo_kinds,
    is_dynamo_recompile,
)

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord
    from traindx.profiler.speedscope import Recording

_STEADY = ("jit.fa4_steady_recompile", "jit.steady_recompile")
_BY_KIND = (  # a compile py-spy saw again (pyspy_signatures.SIGNATURES' kinds)
    "jit.inductor_steady_recompile",
    "jit.triton_autotune_steady_recompile",
    "jit.cute_dsl_steady_recompile",
    "jit.triton_steady_recompile",
)
DECLARATION = Declaration(
    name="jit",
    order=140,
    ids=(*_STEADY, *_BY_KIND, "jit.dynamo_recompile", "jit.autotune", "jit.cold_start"),
    live_triggers=("compile",),
    live_categories=("compile",),
    explains=(
        "gil.contention",
        "ranks.straggler",
        "gpu.launch_bound",
        "gpu_idle.host_starved",
        "host_work.code",
    ),
    recompiles=(*_STEADY, *_BY_KIND, "jit.dynamo_recompile", "jit.autotune"),
    removes={
        **{i: Removes(("compile",), in_steps=True) for i in _STEADY},
        "jit.dynamo_recompile": Removes(("compile",), in_steps=True, fresh_graph_calls=True),
        "jit.autotune": Removes(("autotune",), in_steps=True),
    },
)


# -- small helpers -----------------------------------------------------------------------------


_MAX_SEQLEN_ARG = re.compile(r"\b(max_seqlen_[qk])\s*=\s*([A-Za-z_](?:[\w.]|\([^()]*\))*)")


def int_cast(source: str) -> str | None:
    """The FA4 call line with its max_seqlen arguments cast to int, or None if it has none."""
    if not source or not _MAX_SEQLEN_ARG.search(source):
        return None
    return _MAX_SEQLEN_ARG.sub(lambda m: m[0] if m[2].startswith("int(") else f"{m[1]}=int({m[2]})", source)


def _call_cast_edits(where: dict | None) -> list[dict]:
    """The int casts of the call statement at `where` (a user frame: file, line), one edit per
    line of the call that passes max_seqlen_q/k (a call often spans several lines; the cast
    goes on the line that names the argument). [] when the file or the call cannot be read."""
    if not where or not where.get("file") or not where.get("line"):
        return []
    try:
        with open(where["file"], encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
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
def _fa4_calls(run, rank):
    calls = ev.events_of_type(run, "fa4_call")
    if not len(calls):
        return calls
    return calls[calls["rank"] == rank]


def _tensor_max_seqlen_call(calls):
    """The first recorded FA4 call that passed max_seqlen as a tensor, as a dict, or None."""
    for row in calls.itertuples():
        types = _col(row, "arg_types") or {}
        if any(k.startswith("max_seqlen") and "Tensor" in str(v) for k, v in types.items()):
            return {
                "caller": _col(row, "caller"),
                "source": _col(row, "source"),
                "function": _col(row, "function"),
                "arg_types": types,
                "thread": _col(row, "thread"),
                "step": _col(row, "step"),
            }
    return None


def _tensor_fields(group):
    out = set()
    for row in group.itertuples():
        fields, types = _col(row, "key_fields"), _col(row, "key_types") or {}
        if isinstance(fields, dict):
            out |= {k for k, v in fields.items() if _is_tensor_field(v, types.get(k))}
    return out


def _threads(group):
    names = collections.Counter(str(t) for t in group["thread"])
    main = bool(group["is_main_thread"].fillna(True).astype(bool).all())
    return names, main


def _gil_evidence(run, rank, thread_name):
    """What py-spy saw of the compiling thread: its GIL share while compiling, and dump
    snapshots where it held the GIL while the main thread did not run."""
    out = {}
    recording = run.pyspy.get((str(rank), "gil")) or run.pyspy.get((rank, "gil"))
    if recording:
        shares = sig.gil_share_compiling(recording, thread_name)
        if shares and shares[1] > 0:
            out["gil_seconds_compiling"] = round(shares[0], 3)
            out["gil_share_compiling"] = round(shares[0] / shares[1], 3)
    dumps = run.dumps
    if len(dumps):
        dumps = dumps[dumps["rank"] == str(rank)]
        held = waiting = 0
        for _, snap in dumps.groupby("t"):
            holder = snap[(snap["thread_name"] == thread_name) & (snap["owns_gil"] == True)]  # noqa: E712
            if not len(holder):
                continue
            frames = holder["frames"].iloc[0] or []
            if not any(sig.COMPILER_PATH.search(f.get("filename") or "") for f in frames):
                continue
            held += 1
            main = snap[snap["thread_name"] == "MainThread"]
            if len(main) and not bool(main["owns_gil"].iloc[0]):
                waiting += 1
        if held:
            out["dump_snapshots_compiling_with_gil"] = held
            out["dump_snapshots_main_thread_waiting"] = waiting
    return out


def wrap_in_int(line: str) -> str | None:
    """The source line with the expression that makes a 0-dim tensor max (`x.max()`,
    `x.diff().max()`, `x.amax()`, `torch.max(x)`) wrapped in int(...), or None when the line has
    none or the result would not parse. Handles `name = ...`, `"key": ...,` and `key=...,` lines."""
    import ast

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


def _is_max_call(node):
    import ast

    if (
        not isinstance(node, ast.Call)
        or not isinstance(node.func, ast.Attribute)
        or node.func.attr not in ("max", "amax")
    ):
        return False
    if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
        return len(node.args) == 1 and not node.keywords
    return not node.args and not node.keywords


def _tensor_origin(run, rank):
    """The shim's `tensor_origin` event for this rank (origins.py): where the tensor max_seqlen
    that reached FA4 was made, as {"origin": frame, "chain": [...], "call_site": frame, ...}."""
    rows = ev.events_of_type(run, "tensor_origin")
    if not len(rows):
        return None
    if "rank" in rows:
        rows = rows[rows["rank"].astype(str) == str(rank)]
    for row in rows.itertuples():
        origin = _col(row, "origin")
        if isinstance(origin, dict) and origin.get("file"):
            return {
                "origin": origin,
                "chain": _col(row, "chain") or [],
                "candidates": _col(row, "candidates") or [],
                "call_site": _col(row, "call_site"),
                "method": _col(row, "method"),
                "arg": _col(row, "arg"),
            }
    return None


RUNTIME_PATCH = "fa4_int_max_seqlen"


def _leak_prescriptions(run, where, caller, source, gain, backward_only, origin=None, kernel_sites=()):
    """Strongest first: the framework's own switch (config), the source line that makes the
    tensor (a real diff, applied to a scratch copy by --fix), the cast at the FA4 call, a runtime
    patch at FA4's boundary (proves the diagnosis, edits nothing), an overlay upgrade of FA4, a
    backend switch."""
    out = []
    cwd = run.manifest.get("cwd")
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
        made_where = f"{_display_path(made['file'], cwd)}:{made.get('line')}"
        out.append(
            Prescription(
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
        )
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
    if call_after and caller and caller.get("file"):
        first = {**call_code, "before_line": source, "after_line": call_after, "role": "call_site"}
        lines = [
            f"{_display_path(caller['file'], cwd)}:{call_line}: {source.strip()}  ->  {call_after.strip()}"
        ] + [f"{_display_path(e['file'], cwd)}:{e['line']}: {e['before']}  ->  {e['after']}" for e in own]
        sites = ", ".join(
            [where or "the FA4 call"] + [f"{_display_path(e['file'], cwd)}:{e['line']}" for e in own]
        )
        out.append(
            Prescription(
                kind="code",
                summary=(
                    f"cast max_seqlen to int at the FA4 call{'s' if own else ''}, {sites} "
                    "(one host read per call)"
                ),
                change={"code": first, "codes": [first] + own} if own else {"code": first},
                command="; ".join(lines),
                expected_gain_s_per_step=gain,
                automatic=True,
            )
        )
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
        out.append(
            Prescription(
                kind="runtime",
                summary="runtime patch at FA4's boundary: a tensor max_seqlen_q/k becomes a Python "
                "int in _flash_attn_fwd/_flash_attn_bwd (proves the diagnosis without "
                "editing code; not a lasting fix)",
                change={"runtime": {"patch": RUNTIME_PATCH}},
                command=f"TRAINDX_RUNTIME_PATCHES={RUNTIME_PATCH} diagnose -- <cmd>",
                expected_gain_s_per_step=gain,
                automatic=True,
            )
        )
        have = (run.manifest.get("packages") or {}).get(FA4_PACKAGE) or "this release"
        out.append(
            Prescription(
                kind="upgrade",
                summary=f"upgrade flash-attn-4 from {have} to >= {FA4_FIXED} (it keeps a tensor "
                f"max_seqlen out of the compile key; {FA4_BWD_FIXED} fixes the backward only"
                + (", which is what recompiles here)" if backward_only else ")"),
                change={"upgrade": {"package": FA4_PACKAGE, "min_version": FA4_FIXED}},
                command=f"pip install -U '{FA4_PACKAGE}>={FA4_FIXED}'",
                expected_gain_s_per_step=gain,
                automatic=True,
            )
        )
    for p in backend_switches(run):
        out.append(
            Prescription(
                kind=p.kind,
                summary=p.summary,
                change=p.change,
                expected_gain_s_per_step=gain,
                automatic=p.automatic,
            )
        )
    return out


def _steady_finding(run, rank, kind, kernel, group, steps):
    """A kernel compiled again after the step it first compiled in: a finding, or None."""
    # (one column, not itertuples: a namedtuple class per call costs ms on wide compile rows)
    first_step = group["step"].iloc[0] if "step" in group else None
    first_step = int(first_step) if first_step is not None and first_step == first_step else 0
    later = group[group["step"].fillna(-1) > first_step]
    recompiles = group.iloc[1:]
    if not len(later):
        return None
    after = _steps_after(steps, first_step)
    n_after = max(len(after), len(set(later["step"])))
    lost = float(later["duration_s"].sum()) / n_after if n_after else None
    median_after = float(after["duration_s"].median()) if len(after) else None
    if lost is not None and len(after):
        # a step cannot lose more than it lasted (nested or overlapping compile events)
        lost = min(lost, float(after["duration_s"].mean()))
    share = (lost / median_after) if lost is not None and median_after else None
    if share is not None:
        share = min(share, 1.0)
    lost, share = _ledger_cost(run, rank, after, lost, share, "compile")
    changed, identity, example, identical_pairs = _key_history(group)
    tensor_fields = _tensor_fields(group)
    threads, on_main = _threads(group)
    thread_name = threads.most_common(1)[0][0]
    fa4 = next((r.fa4 for r in group.itertuples() if isinstance(_col(r, "fa4"), dict)), None)
    fa4_function = fa4.get("function") if fa4 else None
    calls = _fa4_calls(run, rank)
    tensor_call = _tensor_max_seqlen_call(calls) if len(calls) else None
    tensor_in_args = any(
        isinstance(_col(r, "fa4"), dict)
        and any((v or {}).get("type") == "Tensor" for v in (r.fa4.get("max_seqlen") or {}).values())
        for r in group.itertuples()
    )
    fields = [f for f, _ in changed.most_common()] or [f for f, _ in identity.most_common()]
    single_block = [f for f in fields if f in SINGLE_BLOCK_FIELDS]
    leak = bool(fa4) and bool(tensor_fields or identity or identical_pairs or tensor_call or tensor_in_args)
    steps_affected = tuple(sorted(int(s) for s in set(later["step"].dropna())))
    evidence = {
        "rank": rank,
        "kind": kind,
        "kernel": kernel,
        "compiles": int(len(group)),
        "recompiles": int(len(recompiles)),
        "steady_recompiles": int(len(later)),
        "first_step": first_step,
        "recompile_seconds": round(float(later["duration_s"].sum()), 3),
        "recompile_seconds_each": [round(float(x), 3) for x in later["duration_s"]],
        "changing_key_fields": fields,
        "key_change_example": example,
        "key_identical_by_text": identical_pairs,
        "tensor_key_fields": sorted(tensor_fields),
        "threads": dict(threads),
        "on_main_thread": on_main,
        "steps_after_first": int(n_after),
        "median_step_after_first_s": median_after,
    }
    caller = where = source = origin = None
    if fa4:
        evidence["fa4_function"] = fa4_function
        evidence["fa4_max_seqlen"] = fa4.get("max_seqlen")
        site = next(
            (
                _col(r, "fa4_call_site")
                for r in group.itertuples()
                if isinstance(_col(r, "fa4_call_site"), dict)
            ),
            None,
        )
        caller = (tensor_call or {}).get("caller") or site
        source = (tensor_call or {}).get("source")
        if caller is None:
            caller = next(
                (_col(r, "caller") for r in group.itertuples() if isinstance(_col(r, "caller"), dict)), None
            )
        where = _where(caller, run)
        evidence["caller"] = caller
        evidence["caller_source"] = source
        origin = _tensor_origin(run, rank)
        if origin:
            evidence["tensor_origin"] = origin
        if tensor_call:
            evidence["fa4_call_arg_types"] = tensor_call["arg_types"]
    if thread_name:
        evidence.update(_gil_evidence(run, rank, thread_name))
    thread_text = (
        "on the main thread"
        if on_main
        else f"on thread '{thread_name}' (not the main thread; the main thread waits)"
    )
    field_text = ", ".join(fields) if fields else "no visible key field"
    if leak:
        why = []
        if tensor_fields:
            why.append(f"the key holds tensors ({', '.join(sorted(tensor_fields))})")
        if identical_pairs:
            why.append("consecutive keys differ only by object identity")
        if single_block:
            why.append(f"{'/'.join(single_block)} change on every call")
        if tensor_call or tensor_in_args:
            why.append("max_seqlen reaches FA4 as a Tensor")
        if "gil_share_compiling" in evidence:
            why.append(
                f"py-spy: '{thread_name}' held the GIL in "
                f"{evidence['gil_share_compiling']:.0%} of the GIL samples while compiling"
                + (
                    f", the main thread waiting in {evidence['dump_snapshots_main_thread_waiting']}"
                    f" of {evidence['dump_snapshots_compiling_with_gil']} snapshots"
                    if evidence.get("dump_snapshots_compiling_with_gil")
                    else ""
                )
            )
        title = (
            f"FA4 {fa4_function} recompiles every step: max_seqlen passed as a tensor "
            f"leaks into its compile key ({field_text})"
        )
        summary = (
            f"{kernel} compiled {len(later)} more time(s) after step {first_step} "
            f"{thread_text}, {lost:.2f} s per step ({(share or 0):.0%} of a step). "
            f"Why: {'; '.join(why)}. " + _origin_text(run, origin, where, source)
        )
        backward_only = fa4_function == "_flash_attn_bwd"
        kernel_sites = (
            list(
                {
                    (c.get("file"), c.get("line")): c
                    for c in group["caller"]
                    if isinstance(c, dict) and c.get("file")
                }.values()
            )
            if "caller" in group
            else []
        )
        prescriptions = _leak_prescriptions(
            run, where, caller, source, lost, backward_only, origin, kernel_sites
        )
        finding_id = "jit.fa4_steady_recompile"
    else:
        title = f"{kernel} recompiles after warm-up ({kind}); changing key field(s): {field_text}"
        summary = (
            f"{kernel} compiled {len(later)} more time(s) after step {first_step} "
            f"{thread_text}, {lost:.2f} s per step. Key field(s) that change: "
            f"{field_text}" + (f" (e.g. {example})" if example else "") + "."
        )
        prescriptions = _generic_recompile_prescriptions(run, kind, kernel, fields, lost)
        finding_id = "jit.steady_recompile"  # the FA4 id is kept for the tensor leak
    return Finding(
        id=finding_id,
        title=title,
        severity=_severity(share, steady=True),
        analyzer="jit",
        summary=summary,
        steps_affected=steps_affected,
        seconds_lost_per_step=lost,
        share_of_step=share,
        evidence=evidence,
        prescriptions=tuple(prescriptions),
        ranks=(rank,),
    )


def _origin_text(run, origin, where, source):
    """Both lines: where the tensor is made and where it reaches FA4."""
    passed = f"It reaches FA4 at {where or 'the FA4 call'}" + (f": `{source}`" if source else "")
    made = (origin or {}).get("origin") or {}
    if not made.get("file"):
        return passed + " (where the tensor is made was not found)."
    how = {"traced": "traced at run time", "static": "found in the job's source"}.get(
        origin.get("method"), origin.get("method") or ""
    )
    text = (
        f"The tensor is made at {_display_path(made['file'], run.manifest.get('cwd'))}:"
        f"{made.get('line')}"
        + (f": `{str(made.get('source') or '').strip()}`" if made.get("source") else "")
        + (f" ({how})" if how else "")
        + f". {passed}."
    )
    return text


def _generic_recompile_prescriptions(run, kind, kernel, fields, gain):
    out = []
    field_text = ", ".join(fields) or "the key"
    if kind == "cute_dsl":
        out.append(precompile_prescription(run, gain, note=" (every key this run saw)"))
        out.append(
            Prescription(
                kind="code",
                summary=f"keep {field_text} of {kernel} constant across steps (pad or "
                "bucket the value that feeds it)",
                change={
                    "code": {
                        "file": None,
                        "line": None,
                        "before": field_text,
                        "after": "a value from a small fixed set",
                    }
                },
                expected_gain_s_per_step=gain,
            )
        )
    else:
        out.append(
            Prescription(
                kind="env",
                summary="keep Triton's compiled kernels across runs (TRITON_CACHE_DIR on a persistent disk)",
                change={"env": {"TRITON_CACHE_DIR": _beside_runs(run, "triton-cache")}},
                expected_gain_s_per_step=gain,
                automatic=True,
            )
        )
        out.append(
            Prescription(
                kind="code",
                summary=f"keep the specialised arguments of {kernel} ({field_text}) "
                "constant: pad shapes, or mark the argument do_not_specialize",
                expected_gain_s_per_step=gain,
            )
        )
    return out


def _analyze_rank(run, rank, compiles):
    findings = []
    steps = run.rank_steps(rank).dropna(subset=["duration_s"])
    compiles = compiles[compiles["ok"].fillna(True).astype(bool)] if "ok" in compiles else compiles
    kernels = _kernel_rows(compiles[compiles["kind"].isin(["cute_dsl", "triton"])])
    tunes = compiles[compiles["kind"] == "triton_autotune"].sort_values("start_ns")
    tuned = set(tunes["kernel"]) if len(tunes) else set()
    firsts, cold_tunes, folded = [], [], {}
    for (kind, kernel), group in kernels.items():
        # a kernel's first step compiles every config its first tuning benchmarks: all cold
        firsts.append(first_step_rows(group) if kernel in tuned else group.iloc[:1])
        if kind == "triton" and kernel in tuned:
            # the compiles made while the kernel autotunes are the re-autotune's (one cause);
            # any other recompile of it stays a recompile
            while_tuning = _compiles_while_tuning(group, tunes[tunes["kernel"] == kernel])
            folded[kernel] = group[while_tuning]
            group = pd.concat(
                [
                    group.iloc[:1],
                    group[~while_tuning].iloc[1:] if not while_tuning[0] else group[~while_tuning],
                ]
            )
            if len(group) < 2:
                continue
        found = _steady_finding(run, rank, kind, kernel, group, steps)
        if found:
            findings.append(found)
    for kernel, group in tunes.groupby("kernel", sort=False):
        cold_tunes.append(first_step_rows(group))
        found = _autotune_finding(run, rank, kernel, group, steps, folded.get(kernel))
        if found:
            findings.append(found)
    dynamo = compiles[compiles["kind"] == "dynamo"].sort_values("start_ns")
    if len(dynamo):
        firsts.append(dynamo[[k in ("first", "backward", "mode") for k in dynamo_kinds(dynamo)]])
        found = _dynamo_finding(run, rank, dynamo, steps)
        if found:
            findings.append(found)
    if firsts or cold_tunes:
        cold = _cold_start_finding(
            run,
            rank,
            pd.concat(firsts) if firsts else compiles.iloc[0:0],
            steps,
            pd.concat(cold_tunes) if cold_tunes else None,
        )
        if cold:
            findings.append(cold)
    return _merge_fa4_steady(findings)


def _compiles_while_tuning(group, tunes):
    """Per compile of a Triton kernel: made while that kernel autotuned (the shim marks a
    compile inside an autotuner's run with `autotune_of`; without the mark, a compile inside one
    of the kernel's autotune intervals or in a step where it autotuned)."""
    marked = group["autotune_of"].notna().to_numpy() if "autotune_of" in group else np.zeros(len(group), bool)
    starts = group["start_ns"].to_numpy(np.int64) if "start_ns" in group else None
    inside = np.zeros(len(group), bool)
    if starts is not None and len(tunes) and "start_ns" in tunes and "end_ns" in tunes:
        for s, e in zip(tunes["start_ns"].astype("int64"), tunes["end_ns"].astype("int64")):
            inside |= (starts >= s) & (starts <= e)
    same_step = (
        group["step"].isin(set(tunes["step"].dropna())).to_numpy()
        if "step" in group
        else np.zeros(len(group), bool)
    )
    return marked | inside | same_step


def _merge_fa4_steady(findings):
    """One FA4 leak finding per rank: the kernels it recompiles are listed inside."""
    steady = [f for f in findings if f.id == "jit.fa4_steady_recompile"]
    if len(steady) <= 1:
        return findings
    steady.sort(key=lambda f: -(f.seconds_lost_per_step or 0))
    top = steady[0]
    others = [
        {
            "kernel": f.evidence.get("kernel"),
            "seconds_lost_per_step": f.seconds_lost_per_step,
            "changing_key_fields": f.evidence.get("changing_key_fields"),
        }
        for f in steady[1:]
    ]
    total = sum(f.seconds_lost_per_step or 0 for f in steady)
    share = sum(f.share_of_step or 0 for f in steady)
    merged = Finding(
        id=top.id,
        title=top.title,
        severity=_severity(min(share, 1.0), steady=True),
        analyzer=top.analyzer,
        summary=top.summary + f" {len(others)} other FA4 kernel(s) "
        f"recompile too; together {total:.2f} s per step.",
        steps_affected=tuple(sorted(set().union(*[set(f.steps_affected) for f in steady]))),
        seconds_lost_per_step=total,
        share_of_step=min(share, 1.0),
        evidence={**top.evidence, "other_kernels": others},
        prescriptions=tuple(
            Prescription(**{**p.__dict__, "expected_gain_s_per_step": total}) for p in top.prescriptions
        ),
        ranks=top.ranks,
    )
    return [f for f in findings if f.id != "jit.fa4_steady_recompile"] + [merged]


# -- py-spy alone ---------------------------------------------------------------------------------
def analyze_recording(
    recording: Recording,
    source: str = "py-spy",
    run: RunRecord | None = None,
    rank: str = "0",
    recording_gil: Recording | None = None,
) -> list[Finding]:
    """Findings from one py-spy recording alone ({thread label: ThreadSamples}); with a --gil
    recording of the same process, also the compiling thread's hold on the GIL."""
    findings = []
    for site in sig.summarize(recording):
        if site.count < 2:
            continue
        is_fa4 = "flash_attn" in site.site_label or (site.kernel_file or "").startswith("flash_attn")
        recompile_s = sum(c.seconds for c in site.recompiles)
        each = [round(c.seconds, 3) for c in site.compiles]
        per = recompile_s / len(site.recompiles)
        share = recompile_s / site.recording_seconds if site.recording_seconds else None
        thread_text = (
            "the main thread"
            if site.is_main_thread
            else f"{site.thread} (not the main thread: the autograd thread, on a GPU job)"
        )
        # a compile whose stack starts inside the compiler has no caller to name it by
        function = site.function or site.kernel_file or f"a {site.kind} kernel"
        share_text = f"{share:.0%}" if share is not None else "an unknown share"
        calls = list(range(1, site.count))
        evidence = {
            "source": source,
            "thread": site.thread,
            "is_main_thread": site.is_main_thread,
            "kind": site.kind,
            "call_site": site.site_label,
            "kernel_source": site.kernel_file,
            "compiles": site.count,
            "recompiles": len(site.recompiles),
            "seconds_each": each,
            "recompile_seconds": round(recompile_s, 3),
            "share_of_recorded_samples": round(share, 3) if share is not None else None,
            "thread_seconds": round(site.thread_seconds, 3),
            "calls_that_recompiled": calls,
            "method": "py-spy stacks through the compiler's own code; one compile per run of "
            "consecutive samples, split where the call site changes or the compiler's "
            "pipeline starts again; speedscope has no timestamps, so compiles are "
            "counted per call, not placed in steps",
        }
        if recording_gil and not site.is_main_thread:
            held = sig.gil_share_compiling(recording_gil, site.thread)
            if held and held[1] > 0:
                evidence["gil_share_compiling"] = round(held[0] / held[1], 3)
        severity = "critical" if share and share >= 0.2 else "high" if share and share >= 0.05 else "medium"
        if is_fa4:
            fn = "backward" if "bwd" in function else "forward" if "fwd" in function else function
            title = (
                f"FA4 {fn} ({function}) compiles again on every call after the first, "
                f"on {site.thread if not site.is_main_thread else 'the main thread'}: "
                f"{len(site.recompiles)} recompiles, ~{per:.1f} s each"
            )
            summary = (
                f"py-spy shows {function} compiling {site.count} times on "
                f"{thread_text}: the first call (cold start) and then every later call "
                f"({len(site.recompiles)} of {len(site.recompiles)}), ~{per:.1f} s each, "
                f"{share_text} of the recorded samples. The kernel is built from "
                f"{site.kernel_file or '?'}. A compile on every call means its compile key "
                "changes every call; with flash-attn-4 < 4.0.0b22 (backward) / < 4.0.0b26 "
                "(forward) the known cause is max_seqlen passed as a tensor."
            )
            prescriptions = [
                Prescription(
                    kind="code",
                    summary="pass max_seqlen to flash_attn as a Python int (find the "
                    "call with `diagnose -- <cmd>`: the shim names its file:line)",
                    change={
                        "code": {
                            "file": None,
                            "line": None,
                            "before": "max_seqlen=cu_seqlens.diff().max()",
                            "after": "max_seqlen=int(cu_seqlens.diff().max())",
                        }
                    },
                    expected_gain_s_per_step=per,
                ),
                Prescription(
                    kind="upgrade",
                    summary=f"upgrade flash-attn-4 to >= {FA4_FIXED} ({FA4_BWD_FIXED} "
                    "fixes the backward only)",
                    change={"upgrade": {"package": FA4_PACKAGE, "min_version": FA4_FIXED}},
                    command=f"pip install -U '{FA4_PACKAGE}>={FA4_FIXED}'",
                    expected_gain_s_per_step=per,
                ),
            ]
            if run is not None:
                prescriptions += backend_switches(run)
            finding_id = "jit.fa4_steady_recompile"
        else:
            title = (
                f"{site.kind} compiles {function} again on every call after the first "
                f"({len(site.recompiles)} recompiles, ~{per:.1f} s each)"
            )
            summary = (
                f"py-spy shows {site.site_label} compiling {site.count} times on "
                f"{thread_text}; {share_text} of the recorded samples."
            )
            prescriptions = []
            finding_id = (
                f"jit.{site.kind}_steady_recompile" if site.kind != "dynamo" else "jit.dynamo_recompile"
            )
        findings.append(
            Finding(
                id=finding_id,
                title=title,
                severity=severity,
                analyzer="jit",
                summary=summary,
                steps_affected=tuple(calls),
                seconds_lost_per_step=per,
                share_of_step=None,
                evidence=evidence,
                prescriptions=tuple(prescriptions),
                ranks=(rank,),
            )
        )
    return findings


def _analyze_pyspy_only(run):
    findings = []
    pyspy = run.pyspy
    for (rank, source), recording in sorted(pyspy.items()):
        if source != "all" and (rank, "all") in pyspy:
            continue
        gil = pyspy.get((rank, "gil")) if source != "gil" else None
        findings.extend(
            analyze_recording(recording, source=f"py-spy ({source})", run=run, rank=rank, recording_gil=gil)
        )
    return findings


def analyze(run: RunRecord) -> list[Finding]:
    compiles = run.compiles
    findings = []
    ranks_with_events = set()
    if len(compiles):
        for rank, group in compiles.groupby("rank"):
            ranks_with_events.add(str(rank))
            findings.extend(_analyze_rank(run, rank, group))
    pyspy_only = [f for f in _analyze_pyspy_only(run) if str(f.ranks[0]) not in ranks_with_events]
    return findings + pyspy_only
