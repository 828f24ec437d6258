"""JIT compiles: cold starts, steady recompiles with the key field that changes, Triton
autotuning, torch.compile recompiles; and FA4's max_seqlen-as-tensor leak with the line that
passes the tensor.

Reads the shim's compile events when there are any; else detects compiles from py-spy stacks
(attach mode, or a py-spy file alone) and says what can be known from them.
"""
import collections
import os
import re

import pandas as pd

from traindx.findings import Finding, Prescription

from . import codefix
from . import evidence as ev
from . import pyspy_signatures as sig

FA4_PACKAGE = "flash-attn-4"
FA4_FIXED = "4.0.0b26"          # forward and backward (PR #2762); b22 fixed backward only (PR #2507)
FA4_BWD_FIXED = "4.0.0b22"
CACHE_ENABLE_VAR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
CACHE_DIR_VAR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
SINGLE_BLOCK_FIELDS = ("single_q_block", "single_k_block")
_TENSOR_REPR = re.compile(r"\b(Fake)?Tensor\(|\btensor\(")


# -- small helpers -----------------------------------------------------------------------------
def _where(frame, run=None):
    if not isinstance(frame, dict) or not frame.get("file"):
        return None
    cwd = (run.manifest.get("cwd") if run is not None else None)
    return f"{_display_path(frame['file'], cwd)}:{frame.get('line')}"


_MAX_SEQLEN_ARG = re.compile(r"\b(max_seqlen_[qk])\s*=\s*([A-Za-z_](?:[\w.]|\([^()]*\))*)")


def int_cast(source):
    """The FA4 call line with its max_seqlen arguments cast to int, or None if it has none."""
    if not source or not _MAX_SEQLEN_ARG.search(source):
        return None
    return _MAX_SEQLEN_ARG.sub(lambda m: m[0] if m[2].startswith("int(") else f"{m[1]}=int({m[2]})",
                               source)


def _display_path(path, cwd=None):
    """A path relative to the job's folder when it is inside it (what a user types)."""
    if cwd and path.startswith(cwd.rstrip(os.sep) + os.sep):
        return os.path.relpath(path, cwd)
    return path


def _release_number(version):
    """4.0.0b17 -> (4, 0, 0, 17); a final release sorts after every beta."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)(?:b(\d+))?", str(version or ""))
    if not m:
        return None
    return (int(m[1]), int(m[2]), int(m[3]), int(m[4]) if m[4] is not None else 10 ** 6)


def fa4_version_before(run, release):
    have = _release_number((run.manifest.get("packages") or {}).get(FA4_PACKAGE))
    return None if have is None else have < _release_number(release)


def _severity(share, steady=False):
    severity = ev.severity_for_share(share)
    if steady and share is not None and share >= 0.5:
        return "critical"
    return severity


def _is_tensor_field(value, type_name):
    return type_name == "Tensor" or bool(_TENSOR_REPR.search(str(value)))


def diff_keys(previous, current, previous_types=None, current_types=None):
    """(fields whose value changed, fields that compare equal by text but hold a tensor: the key
    differs by object identity) between two compile keys given as {field: repr}."""
    previous, current = previous or {}, current or {}
    changed = [k for k in current if k in previous and previous[k] != current[k]]
    changed += [k for k in current if k not in previous] + [k for k in previous if k not in current]
    identity = []
    if not changed:
        types = {**(previous_types or {}), **(current_types or {})}
        identity = [k for k, v in current.items() if _is_tensor_field(v, types.get(k))]
    return changed, identity


def _col(row, name):
    value = getattr(row, name, None)
    if isinstance(value, float) and value != value:
        return None
    return value


# -- the command's attention backend -------------------------------------------------------------
def backend_switches(run):
    """Prescriptions that switch the job off FA4 in its own framework, recognised from the
    command line and environment."""
    command = [str(t) for t in run.command]
    text = " ".join(command)
    env = run.manifest.get("env") or run.manifest.get("environment") or {}
    out = []
    flags = {t.split("=", 1)[0] for t in command if t.startswith("--")}
    if "megatron" in text.lower() or "pretrain_gpt" in text or "--attention-backend" in flags:
        out.append(Prescription(
            kind="arg", summary="Megatron: --attention-backend fused (cuDNN fused attention "
                                "through TransformerEngine instead of FA4)",
            change={"arg": {"framework": "megatron", "set": {"--attention-backend": "fused"}}},
            automatic=True))
    if "swift" in text.lower() or "--attention_backend" in flags:
        out.append(Prescription(
            kind="arg", summary="ms-swift: --attention_backend flash_2 (FlashAttention-2, no JIT)",
            change={"arg": {"framework": "ms-swift", "set": {"--attention_backend": "flash_2"}}},
            automatic=True))
    if "transformer_engine" in text.lower() or any(k.startswith("NVTE_") for k in env) \
            or (run.manifest.get("packages") or {}).get("transformer-engine"):
        out.append(Prescription(
            kind="env", summary="TransformerEngine: NVTE_FLASH_ATTN_V4=0 (do not route attention "
                                "to FA4)",
            change={"env": {"NVTE_FLASH_ATTN_V4": "0"}}, automatic=True))
    return out


def precompile_prescription(run, gain=None, note=""):
    env = run.manifest.get("env") or run.manifest.get("environment") or {}
    cache_dir = env.get(CACHE_DIR_VAR)
    if not cache_dir or cache_dir == "<redacted>":
        try:  # FA4's own default, so the warm-up and the training agree on one folder
            from traindx.kernel_cache.store import default_cache_dir

            cache_dir = str(default_cache_dir({}))
        except Exception:
            cache_dir = None
    change_env = {CACHE_ENABLE_VAR: "1"}
    if cache_dir:
        change_env[CACHE_DIR_VAR] = cache_dir
    return Prescription(
        kind="precompile",
        summary="precompile the FA4 kernels before training: kernel-cache warm --from-run "
                f"{run.path}, then train with {CACHE_ENABLE_VAR}=1 and {CACHE_DIR_VAR} set" + note,
        change={"precompile": {"from_run": run.path}, "env": change_env},
        command=f"kernel-cache warm --from-run {run.path} && export {CACHE_ENABLE_VAR}=1 "
                f"{CACHE_DIR_VAR}=$(kernel-cache env --dir)",
        expected_gain_s_per_step=gain, automatic=True)


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
            return {"caller": _col(row, "caller"), "source": _col(row, "source"),
                    "function": _col(row, "function"), "arg_types": types,
                    "thread": _col(row, "thread"), "step": _col(row, "step")}
    return None


def _steps_after(steps, first_step):
    return steps[steps["step"] > first_step]


def _kernel_rows(compiles):
    """{(kind, kernel): DataFrame of its compiles in time order}."""
    out = collections.OrderedDict()
    for (kind, kernel), group in compiles.sort_values("start_ns").groupby(["kind", "kernel"],
                                                                          sort=False):
        out[(kind, kernel)] = group
    return out


def _key_history(group):
    """Changed fields over consecutive compiles: Counter of field -> times it changed, Counter of
    identity-only tensor fields, an example of one change, and how many pairs had no visible
    change at all."""
    changed_count, identity_count = collections.Counter(), collections.Counter()
    example, identical_pairs = None, 0
    rows = list(group.itertuples())
    for a, b in zip(rows, rows[1:]):
        fa, fb = _col(a, "key_fields"), _col(b, "key_fields")
        if not isinstance(fa, dict) or not isinstance(fb, dict):
            if _col(a, "key") is not None and _col(a, "key") == _col(b, "key"):
                identical_pairs += 1
            continue
        changed, identity = diff_keys(fa, fb, _col(a, "key_types"), _col(b, "key_types"))
        changed_count.update(changed)
        identity_count.update(identity)
        if not changed:
            identical_pairs += 1
        if changed and example is None:
            example = {k: {"before": fa.get(k), "after": fb.get(k)} for k in changed[:4]}
    return changed_count, identity_count, example, identical_pairs


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


def wrap_in_int(line):
    """The source line with the expression that makes a 0-dim tensor max (`x.max()`,
    `x.diff().max()`, `x.amax()`, `torch.max(x)`) wrapped in int(...), or None when the line has
    none or the result would not parse. Handles `name = ...`, `"key": ...,` and `key=...,` lines."""
    import ast

    if not line or not line.strip():
        return None
    indent = line[:len(line) - len(line.lstrip())]
    body = line.strip()
    for prefix, suffix in (("", ""), ("{", "}"), ("f(", ")")):
        text = prefix + body + suffix
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        calls = [n for n in ast.walk(tree) if _is_max_call(n) and n.lineno == n.end_lineno == 1]
        wrapped = {id(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and isinstance(n.func, ast.Name) and n.func.id == "int" and n.args}
        if not calls or any(id(n) in wrapped for n in calls):
            return None
        node = min(calls, key=lambda n: n.col_offset)          # the outermost one
        a, b = node.col_offset, node.end_col_offset
        new_text = text[:a] + "int(" + text[a:b] + ")" + text[b:]
        try:
            ast.parse(new_text)
        except SyntaxError:
            return None
        return indent + new_text[len(prefix):len(new_text) - len(suffix)]
    return None


def _is_max_call(node):
    import ast

    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) \
            or node.func.attr not in ("max", "amax"):
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
            return {"origin": origin, "chain": _col(row, "chain") or [],
                    "candidates": _col(row, "candidates") or [],
                    "call_site": _col(row, "call_site"), "method": _col(row, "method"),
                    "arg": _col(row, "arg")}
    return None


RUNTIME_PATCH = "fa4_int_max_seqlen"


def _leak_prescriptions(run, where, caller, source, gain, backward_only, origin=None):
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
    call_code = {"file": caller.get("file") if caller else None, "line": call_line,
                 "before": source.strip() if source else source,
                 "after": call_after.strip() if call_after else call_after}
    made = (origin or {}).get("origin") or {}
    made_after = wrap_in_int(made.get("source")) if made.get("file") else None
    if made_after:
        made_where = f"{_display_path(made['file'], cwd)}:{made.get('line')}"
        out.append(Prescription(
            kind="code",
            summary=f"make max_seqlen a Python int where it is created, {made_where} "
                    f"(one host read per batch instead of a new FA4 compile key per call; "
                    f"it reaches FA4 at {where or 'the FA4 call'})",
            change={"code": {"file": made["file"], "line": made.get("line"),
                             "before": made["source"].strip(), "after": made_after.strip(),
                             "before_line": made["source"], "after_line": made_after,
                             "role": "origin", "call_site": caller,
                             "traced_by": origin.get("method")}},
            command=f"{made_where}: {made['source'].strip()}  ->  {made_after.strip()}",
            expected_gain_s_per_step=gain, automatic=True))
    if call_after and caller and caller.get("file"):
        out.append(Prescription(
            kind="code",
            summary=f"cast max_seqlen to int at the FA4 call, {where} (one host read per call)",
            change={"code": {**call_code, "before_line": source, "after_line": call_after,
                             "role": "call_site"}},
            command=f"{_display_path(caller['file'], cwd)}:{call_line}: {source.strip()}  ->  "
                    f"{call_after.strip()}",
            expected_gain_s_per_step=gain, automatic=True))
    elif not made_after:
        out.append(Prescription(
            kind="code", summary=f"pass max_seqlen as a Python int at {where or 'the FA4 call'} "
                                 "(the line that creates the tensor was not found: cast it there, "
                                 "once per batch)",
            change={"code": call_code}, expected_gain_s_per_step=gain, automatic=False))
    older = fa4_version_before(run, FA4_FIXED)
    if older is not False:
        out.append(Prescription(
            kind="runtime",
            summary="runtime patch at FA4's boundary: a tensor max_seqlen_q/k becomes a Python "
                    "int in _flash_attn_fwd/_flash_attn_bwd (proves the diagnosis without "
                    "editing code; not a lasting fix)",
            change={"runtime": {"patch": RUNTIME_PATCH}},
            command=f"TRAINDX_RUNTIME_PATCHES={RUNTIME_PATCH} diagnose -- <cmd>",
            expected_gain_s_per_step=gain, automatic=True))
        have = (run.manifest.get("packages") or {}).get(FA4_PACKAGE) or "this release"
        out.append(Prescription(
            kind="upgrade",
            summary=f"upgrade flash-attn-4 from {have} to >= {FA4_FIXED} (it keeps a tensor "
                    f"max_seqlen out of the compile key; {FA4_BWD_FIXED} fixes the backward only"
                    + (", which is what recompiles here)" if backward_only else ")"),
            change={"upgrade": {"package": FA4_PACKAGE, "min_version": FA4_FIXED}},
            command=f"pip install -U '{FA4_PACKAGE}>={FA4_FIXED}'",
            expected_gain_s_per_step=gain, automatic=True))
    for p in backend_switches(run):
        out.append(Prescription(kind=p.kind, summary=p.summary, change=p.change,
                                expected_gain_s_per_step=gain, automatic=p.automatic))
    return out


def _ledger_cost(run, rank, after, lost, share, category):
    """(seconds per step, share of the step) of a recompiling kernel, from the time ledger: its
    own compile seconds per step, but never more than the exclusive `category` seconds of the
    ledger over the same steps (nested or overlapping compile events count once), as a share
    of those steps' wall time. Unchanged when the ledger has none of these steps."""
    if lost is None or not len(after):
        return lost, share
    led = run.rank_rows("ledger", rank)
    led = led[led["step"].isin(set(int(s) for s in after["step"]))]
    if not len(led):
        return lost, share
    exclusive = float(led[f"{category}_s"].mean())
    wall = float(led["wall_s"].mean())
    lost = min(lost, exclusive)
    return lost, (min(1.0, lost / wall) if wall else share)


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
        isinstance(_col(r, "fa4"), dict) and any(
            (v or {}).get("type") == "Tensor" for v in (r.fa4.get("max_seqlen") or {}).values())
        for r in group.itertuples())
    fields = [f for f, _ in changed.most_common()] or [f for f, _ in identity.most_common()]
    single_block = [f for f in fields if f in SINGLE_BLOCK_FIELDS]
    leak = bool(fa4) and bool(tensor_fields or identity or identical_pairs or tensor_call
                              or tensor_in_args)
    steps_affected = tuple(sorted(int(s) for s in set(later["step"].dropna())))
    evidence = {
        "rank": rank, "kind": kind, "kernel": kernel, "compiles": int(len(group)),
        "recompiles": int(len(recompiles)), "steady_recompiles": int(len(later)),
        "first_step": first_step, "recompile_seconds": round(float(later["duration_s"].sum()), 3),
        "recompile_seconds_each": [round(float(x), 3) for x in later["duration_s"]],
        "changing_key_fields": fields, "key_change_example": example,
        "key_identical_by_text": identical_pairs, "tensor_key_fields": sorted(tensor_fields),
        "threads": dict(threads), "on_main_thread": on_main,
        "steps_after_first": int(n_after), "median_step_after_first_s": median_after,
    }
    caller = where = source = origin = None
    if fa4:
        evidence["fa4_function"] = fa4_function
        evidence["fa4_max_seqlen"] = fa4.get("max_seqlen")
        site = next((_col(r, "fa4_call_site") for r in group.itertuples()
                     if isinstance(_col(r, "fa4_call_site"), dict)), None)
        caller = (tensor_call or {}).get("caller") or site
        source = (tensor_call or {}).get("source")
        if caller is None:
            caller = next((_col(r, "caller") for r in group.itertuples()
                           if isinstance(_col(r, "caller"), dict)), None)
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
    thread_text = (f"on the main thread" if on_main else
                   f"on thread '{thread_name}' (not the main thread; the main thread waits)")
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
            why.append(f"py-spy: '{thread_name}' held the GIL in "
                       f"{evidence['gil_share_compiling']:.0%} of the GIL samples while compiling"
                       + (f", the main thread waiting in {evidence['dump_snapshots_main_thread_waiting']}"
                          f" of {evidence['dump_snapshots_compiling_with_gil']} snapshots"
                          if evidence.get("dump_snapshots_compiling_with_gil") else ""))
        title = (f"FA4 {fa4_function} recompiles every step: max_seqlen passed as a tensor "
                 f"leaks into its compile key ({field_text})")
        summary = (f"{kernel} compiled {len(later)} more time(s) after step {first_step} "
                   f"{thread_text}, {lost:.2f} s per step ({(share or 0):.0%} of a step). "
                   f"Why: {'; '.join(why)}. " + _origin_text(run, origin, where, source))
        backward_only = fa4_function == "_flash_attn_bwd"
        prescriptions = _leak_prescriptions(run, where, caller, source, lost, backward_only,
                                            origin)
        finding_id = "jit.fa4_steady_recompile"
    else:
        title = (f"{kernel} recompiles after warm-up ({kind}); changing key field(s): "
                 f"{field_text}")
        summary = (f"{kernel} compiled {len(later)} more time(s) after step {first_step} "
                   f"{thread_text}, {lost:.2f} s per step. Key field(s) that change: "
                   f"{field_text}" + (f" (e.g. {example})" if example else "") + ".")
        prescriptions = _generic_recompile_prescriptions(run, kind, kernel, fields, lost)
        finding_id = "jit.steady_recompile"  # the FA4 id is kept for the tensor leak
    return Finding(
        id=finding_id, title=title, severity=_severity(share, steady=True), analyzer="jit",
        summary=summary, steps_affected=steps_affected, seconds_lost_per_step=lost,
        share_of_step=share, evidence=evidence, prescriptions=tuple(prescriptions), ranks=(rank,))


def _origin_text(run, origin, where, source):
    """Both lines: where the tensor is made and where it reaches FA4."""
    passed = f"It reaches FA4 at {where or 'the FA4 call'}" + (f": `{source}`" if source else "")
    made = (origin or {}).get("origin") or {}
    if not made.get("file"):
        return passed + " (where the tensor is made was not found)."
    how = {"traced": "traced at run time", "static": "found in the job's source"}.get(
        origin.get("method"), origin.get("method") or "")
    text = (f"The tensor is made at {_display_path(made['file'], run.manifest.get('cwd'))}:"
            f"{made.get('line')}" + (f": `{str(made.get('source') or '').strip()}`" if made.get("source") else "")
            + (f" ({how})" if how else "") + f". {passed}.")
    return text


def _generic_recompile_prescriptions(run, kind, kernel, fields, gain):
    out = []
    field_text = ", ".join(fields) or "the key"
    if kind == "cute_dsl":
        out.append(precompile_prescription(run, gain, note=" (every key this run saw)"))
        out.append(Prescription(
            kind="code", summary=f"keep {field_text} of {kernel} constant across steps (pad or "
                                 "bucket the value that feeds it)",
            change={"code": {"file": None, "line": None, "before": field_text,
                             "after": "a value from a small fixed set"}},
            expected_gain_s_per_step=gain))
    else:
        out.append(Prescription(
            kind="env", summary="keep Triton's compiled kernels across runs (TRITON_CACHE_DIR on "
                                "a persistent disk)",
            change={"env": {"TRITON_CACHE_DIR": _beside_runs(run, "triton-cache")}},
            expected_gain_s_per_step=gain, automatic=True))
        out.append(Prescription(
            kind="code", summary=f"keep the specialised arguments of {kernel} ({field_text}) "
                                 "constant: pad shapes, or mark the argument do_not_specialize",
            expected_gain_s_per_step=gain))
    return out


def _cold_start_finding(run, rank, firsts, steps):
    """The first compile of every kernel: paid once per process (and per rank, per restart)."""
    if not len(firsts):
        return None
    total = float(firsts["duration_s"].sum())
    run_s = float(steps["duration_s"].sum()) if len(steps) else None
    share = (total / run_s) if run_s else None
    if share is not None:
        share = min(share, 1.0)
    kinds = collections.Counter(firsts["kind"])
    per_kernel = [{"kernel": r.kernel, "kind": r.kind, "seconds": round(float(r.duration_s), 3),
                   "step": _col(r, "step"), "thread": _col(r, "thread")}
                  for r in firsts.sort_values("duration_s", ascending=False).itertuples()][:12]
    severity = "medium" if (share or 0) >= 0.25 else "low" if (share or 0) >= 0.05 else "info"
    if set(kinds) == {"dynamo"} and not _inductor_caches_off(run):
        # torch.compile alone, its caches on (the default): a one-time cost with no lever the
        # job has not already pulled; a short diagnose run only makes its share look large
        severity = "info"
    # a one-time cost: not "per step" (it would outrank a recompile that costs every step)
    amortized = None
    prescriptions = []
    fa4 = firsts[firsts["kind"] == "cute_dsl"]
    if len(fa4):
        prescriptions.append(precompile_prescription(
            run, None, note=f" (saves ~{float(fa4['duration_s'].sum()):.1f} s at every start)"))
    if kinds.get("triton"):
        prescriptions.append(Prescription(
            kind="env", summary="keep Triton's compiled kernels on a persistent disk "
                                "(TRITON_CACHE_DIR) so later runs load them",
            change={"env": {"TRITON_CACHE_DIR": _beside_runs(run, "triton-cache")}},
            automatic=True, expected_gain_s_per_step=amortized))
    if kinds.get("dynamo"):
        prescriptions.append(_inductor_cache_prescription(run))
    kinds_text = ", ".join(f"{n} {k}" for k, n in kinds.most_common())
    return Finding(
        id="jit.cold_start",
        title=f"Cold start: {len(firsts)} kernel(s) compiled on first use, {total:.1f} s",
        severity=severity, analyzer="jit",
        summary=(f"First compiles ({kinds_text}) took {total:.1f} s on rank {rank}"
                 + (f", {share:.0%} of the {run_s:.1f} s of recorded steps" if share is not None else "")
                 + ". Paid once per process, on every rank and every restart."),
        steps_affected=tuple(sorted(int(s) for s in set(firsts["step"].dropna()))),
        seconds_lost_per_step=amortized, share_of_step=share,
        evidence={"rank": rank, "cold_compile_seconds": round(total, 3), "kernels": per_kernel,
                  "kinds": dict(kinds), "recorded_step_seconds": run_s},
        prescriptions=tuple(prescriptions), ranks=(rank,))


def _inductor_caches_off(run):
    env = run.manifest.get("env") or {}
    return [name for name in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")
            if str(env.get(name, "")).strip() == "0"]


def _inductor_cache_prescription(run):
    """torch.compile's cold start: its FX graph and AOTAutograd caches are on by default (torch
    2.13), so there is nothing to switch on. Never relocate a cache the user already placed (a
    fresh folder would make the next run cold); where none is set, the default folder is under
    /tmp, which restarts and new machines lose: a persistent one is worth it, but a single
    --fix run cannot show the gain (its first run fills the new folder), so it is not automatic."""
    env = run.manifest.get("env") or {}
    user_dir = env.get("TORCHINDUCTOR_CACHE_DIR")
    disabled = _inductor_caches_off(run)
    if disabled:
        return Prescription(
            kind="env", summary=f"torch.compile's caches are switched off here ({', '.join(n + '=0' for n in disabled)}): "
                                "unset them so later runs load the compiled graphs",
            change={"env": {name: "1" for name in disabled}}, automatic=True)
    if user_dir:
        return Prescription(
            kind="env", summary=f"torch.compile's FX graph cache is already on (the default) and kept in "
                                f"{user_dir}: a later run of the same code loads the graphs from "
                                "there; nothing to change")
    return Prescription(
        kind="env", summary="torch.compile's FX graph cache is already on (the default), in a "
                            "folder under /tmp: keep it on a persistent disk "
                            "(TORCHINDUCTOR_CACHE_DIR) so restarts and the job's other machines "
                            "reuse it",
        change={"env": {"TORCHINDUCTOR_CACHE_DIR": _beside_runs(run, "inductor-cache")}},
        automatic=False)


_FLA_PATH = re.compile(r"[/\\]fla[/\\]")


def _beside_runs(run, name):
    """A persistent cache folder next to the run folders (the runs' parent)."""
    return os.path.abspath(os.path.join(run.path, os.pardir, name))


def _autotune_finding(run, rank, kernel, group, steps):
    if len(group) < 2:
        return None
    changed, _, example, _ = _key_history(group)
    first_step = int(_col(next(group.itertuples()), "step") or 0)
    later = group[group["step"].fillna(-1) > first_step]
    if not len(later):
        return None
    after = _steps_after(steps, first_step)
    n_after = max(len(after), 1)
    lost = float(later["duration_s"].sum()) / n_after
    median_after = float(after["duration_s"].median()) if len(after) else None
    share = min(lost / median_after, 1.0) if median_after else None
    lost, share = _ledger_cost(run, rank, after, lost, share, "autotune")
    fields = [f for f, _ in changed.most_common()]
    # flash-linear-attention's own switches only when its code is the kernel's (module path),
    # not because the package is installed next to a kernel of the job's own
    is_fla = any(_FLA_PATH.search(str(_col(r, "kernel_file") or (_col(r, "caller") or {}).get("file", "")))
                 or str(_col(r, "module") or "").startswith("fla.") for r in group.itertuples())
    caller = next((_col(r, "caller") for r in group.itertuples()
                   if isinstance(_col(r, "caller"), dict)), None) or {}
    kernel_file = next((_col(r, "kernel_file") for r in group.itertuples()
                        if _col(r, "kernel_file")), None)
    key_names = next((_col(r, "key_names") for r in group.itertuples()
                      if isinstance(_col(r, "key_names"), list)), None)
    fields = [f for f in fields if not key_names or f in key_names] or fields
    prescriptions = []
    advice_evidence = {}
    if is_fla:
        # FLA's own settings, only those the installed releases read and that change something
        # (checked against their source: docs/autotune.md)
        from dataclasses import replace

        from . import autotune_advice

        advice = autotune_advice.advise(
            group.to_dict("records"), run.manifest.get("packages"),
            env=run.manifest.get("env") or run.manifest.get("environment"), run_path=run.path,
            cache_dir=_beside_runs(run, "triton-cache"), config_dir=_beside_runs(run, "fla-configs"))
        prescriptions.extend(p if p.expected_gain_s_per_step is not None
                             else replace(p, expected_gain_s_per_step=lost) for p in advice.steady)
        advice_evidence = advice.evidence()
    if not is_fla and fields:
        where = _where(caller, run)
        prescriptions.append(Prescription(
            kind="code",
            summary=f"take {', '.join(fields)} out of @triton.autotune(key=[...]) of {kernel} "
                    f"(launched at {where or '?'}): every new value benchmarks all "
                    f"{_col(next(group.itertuples()), 'configs') or ''} configs again; or bucket "
                    f"it at the launch (triton.next_power_of_2({fields[0]}))",
            change={"code": {"autotune_key": {"kernel": kernel, "drop": fields,
                                              "files": [f for f in (kernel_file, caller.get("file")) if f]},
                             "file": kernel_file or caller.get("file"), "line": None,
                             "before": f"key={fields!r}", "after": None}},
            expected_gain_s_per_step=lost, automatic=True))
    else:
        prescriptions.append(Prescription(
            kind="code", summary=f"take {', '.join(fields) or 'the changing argument'} out of the "
                                 f"autotune key of {kernel} (or bucket it): every new value tunes again",
            change={"code": {"file": None, "line": None, "before": f"key={fields}",
                             "after": None}},
            expected_gain_s_per_step=lost))
    prescriptions.append(Prescription(
        kind="env", summary="keep Triton's cache on a persistent disk (TRITON_CACHE_DIR)",
        change={"env": {"TRITON_CACHE_DIR": _beside_runs(run, "triton-cache")}},
        automatic=not is_fla, expected_gain_s_per_step=None))
    return Finding(
        id="jit.autotune", title=f"Triton autotunes {kernel} again after warm-up "
                                 f"(key field(s) changing: {', '.join(fields) or '?'})",
        severity=_severity(share, steady=True), analyzer="jit",
        summary=(f"{kernel} autotuned {len(later)} more time(s) after step {first_step}, "
                 f"{lost:.2f} s per step; the autotune key changes: {', '.join(fields) or '?'}"
                 + (f" (e.g. {example})" if example else "") + "."),
        steps_affected=tuple(sorted(int(s) for s in set(later["step"].dropna()))),
        seconds_lost_per_step=lost, share_of_step=share,
        evidence={"rank": rank, "kernel": kernel, "autotunes": int(len(group)),
                  "changing_key_fields": fields, "key_change_example": example,
                  "seconds_each": [round(float(x), 3) for x in group["duration_s"]],
                  **advice_evidence},
        prescriptions=tuple(prescriptions), ranks=(rank,))


_SIZE_MISMATCH = re.compile(r"tensor '(?P<name>[^']+)' (size|stride) mismatch at index (?P<dim>\d+)"
                            r"(\. expected (?P<expected>\d+), actual (?P<actual>\d+))?")


_COMPILE_ID = re.compile(r"(?P<frame>\d+)/(?P<count>\d+)")
# a guard on a mode, not on data: grad mode (no_grad evaluation before training), train/eval
# (module.training), autocast, deterministic algorithms. Each mode compiles its own graph once;
# switching back and forth reuses them, so it is never a steady cost.
_MODE_CHANGE = re.compile(r"GLOBAL_STATE changed|grad_mode|is_grad_enabled|___check_global_state"
                          r"|\.training\b|\btraining\b.*(?:mismatch|changed|==)|autocast"
                          r"|deterministic_algorithms", re.IGNORECASE)


def dynamo_compile_kind(row):
    """What one dynamo compile event is: 'first' (the frame's first graph), 'backward' (the
    backward graph AOTAutograd builds at the first backward: not a recompile), 'mode' (a graph
    for another grad/train/autocast mode: once per mode, not a recompile), or 'recompile' (a
    guard on the data failed: a shape, a dtype, a Python value).

    Read defensively: `graph`, `kernel`, `recompile_reason`, `compile_id` or `key` ('F/N')."""
    kernel = str(_col(row, "kernel") or "")
    if _col(row, "graph") == "backward" or kernel.endswith("(backward graph)") or kernel in ("", "None"):
        return "backward"  # (AOTAutograd's backward compile has no code object of its own)
    reason = _col(row, "recompile_reason")
    reason = reason if isinstance(reason, str) else ""
    m = _COMPILE_ID.search(str(_col(row, "compile_id") or _col(row, "key") or ""))
    again = bool(reason) or bool(m and int(m["count"]) > 0)
    if not again:
        return "first"
    if reason and _MODE_CHANGE.search(reason) and not _SIZE_MISMATCH.search(reason):
        return "mode"
    return "recompile"


def is_dynamo_recompile(row):
    """A dynamo compile of a frame it compiled before because a guard on the data failed (not a
    backward graph, not a graph for another grad/train mode)."""
    return dynamo_compile_kind(row) == "recompile"


_VALUES = re.compile(r"\. expected \d+, actual \d+")


def _strip_compile_id(reason):
    """"0/1: tensor 'x' size mismatch ..." -> "tensor 'x' size mismatch ..." (first line)."""
    return re.sub(r"^\s*\[?[\d/!]+\]?:\s*", "", str(reason).strip().splitlines()[0])


def _call_site(recompiles):
    """The job's line that calls the compiled function with the changing input: the shim's
    `call_site` (the caller when the compile started) when recorded, else the compiled
    function's own definition (`caller`)."""
    for name in ("call_site", "caller"):
        for r in recompiles.itertuples():
            value = _col(r, name)
            if isinstance(value, dict) and value.get("file") and not ev.is_library_path(value["file"]):
                return name, value
    return None, None


def _mark_dynamic_change(site, name, dim):
    """A real code change at the call site: mark the argument's dimension dynamic on the line
    before the call. Needs the call's source line; None otherwise."""
    source = (site or {}).get("source")
    if not source or not site.get("line"):
        return None, None
    import ast
    try:
        call = next((n for n in ast.walk(ast.parse(source.strip())) if isinstance(n, ast.Call)), None)
    except SyntaxError:
        return None, None
    if call is None:
        return None, None
    names = [a.id for a in call.args if isinstance(a, ast.Name)]
    arg = name if name in names else (names[0] if names else None)
    if arg is None:
        return None, None
    indent = source[: len(source) - len(source.lstrip())]
    after = f"{indent}torch._dynamo.mark_dynamic({arg}, {dim})\n{source.rstrip()}"
    return codefix.code_change(site["file"], int(site["line"]), source.rstrip(), after), arg


def dynamo_kinds(group):
    """dynamo_compile_kind of each row; the backward graph of a recompiled frame is
    'recompile_backward' (its cost is the recompile's, its count is not another one)."""
    kinds = [dynamo_compile_kind(r) for r in group.itertuples()]
    ids = [str(_col(r, "compile_id") or _col(r, "key") or "") for r in group.itertuples()]
    recompiled = {i for i, k in zip(ids, kinds) if k == "recompile" and i}
    return [("recompile_backward" if k == "backward" and i in recompiled else k)
            for i, k in zip(ids, kinds)]


def _dynamo_finding(run, rank, group, steps):
    kinds = dynamo_kinds(group)
    recompiles = group[[k == "recompile" for k in kinds]]
    costs = group[[k in ("recompile", "recompile_backward") for k in kinds]]
    not_recompiles = collections.Counter(k for k in kinds if k in ("backward", "mode"))
    if not len(recompiles):
        return None
    first_step = int(_col(next(group.itertuples()), "step") or 0)
    after = _steps_after(steps, first_step)
    later = recompiles[recompiles["step"].fillna(-1) > first_step]
    later_costs = costs[costs["step"].fillna(-1) > first_step]
    n_after = max(len(after), 1)
    lost = float(later_costs["duration_s"].sum()) / n_after if len(later) else 0.0
    median_after = float(after["duration_s"].median()) if len(after) else None
    share = min(lost / median_after, 1.0) if median_after else None
    if len(later):
        lost, share = _ledger_cost(run, rank, after, lost, share, "compile")
    raw = [_strip_compile_id(r) for r in recompiles["recompile_reason"] if isinstance(r, str) and r]
    reasons = collections.Counter(_VALUES.sub("", r) for r in raw)
    if not reasons:
        reasons["(no reason recorded)"] = len(recompiles)
    top_reason = reasons.most_common(1)[0][0]
    m = next((_SIZE_MISMATCH.search(r) for r in raw if _SIZE_MISMATCH.search(r)), None)
    changes = [f"{x['expected']} → {x['actual']}" for x in (_SIZE_MISMATCH.search(r) for r in raw)
               if x and x["expected"]]
    site_kind, caller = _call_site(recompiles)
    where = _where(caller, run)
    functions = collections.Counter(str(k) for k in recompiles["kernel"])
    prescriptions = []
    if m:
        name, dim = m["name"], m["dim"]
        short = re.sub(r"^L\['([^']+)'\].*$", r"\1", name)
        change, arg = _mark_dynamic_change(caller if site_kind == "call_site" else None, short, dim)
        at = (f" at {where}" if site_kind == "call_site" else
              f" (the compiled function: {where})" if where else "")
        passed = f" ({arg} is passed as {short})" if arg and arg != short else ""
        prescriptions.append(Prescription(
            kind="code", summary=f"mark dimension {dim} of {short} dynamic before the compiled call"
                                 f"{at}: torch._dynamo.mark_dynamic({arg or short}, {dim}){passed}; "
                                 "or compile with torch.compile(..., dynamic=None) (automatic "
                                 "dynamic shapes: one recompile, then symbolic) or dynamic=True",
            change={"code": change} if change else {}, expected_gain_s_per_step=lost))
    else:
        prescriptions.append(Prescription(
            kind="code", summary="make the guard that fails stable (the value it checks changes "
                                 f"between calls{(' at ' + where) if where else ''}): "
                                 f"{top_reason[:160]}",
            expected_gain_s_per_step=lost))
    steady = len(later) >= 2
    severity = _severity(share, steady=steady) if len(later) else "low"
    if severity == "info" and len(later):
        severity = "low"
    skipped = ", ".join(f"{n} {'backward graph(s)' if k == 'backward' else 'graph(s) for another grad/train mode'}"
                        for k, n in sorted(not_recompiles.items()))
    return Finding(
        id="jit.dynamo_recompile",
        title=(f"torch.compile recompiles {', '.join(functions)} {len(recompiles)} time(s): "
               f"{top_reason[:90]}" + (f" ({', '.join(changes[:4])})" if changes else "")),
        severity=severity, analyzer="jit",
        summary=(f"{', '.join(functions)} recompiled {len(recompiles)} time(s) on rank {rank}"
                 + (f" ({where})" if where else "") + f"; reason: {top_reason}"
                 + (f"; {lost:.2f} s per step after step {first_step}" if len(later) else "")
                 + (f". Not counted: {skipped} (compiled once each)" if skipped else "") + "."),
        steps_affected=tuple(sorted(int(s) for s in set(recompiles["step"].dropna()))),
        seconds_lost_per_step=lost if len(later) else None, share_of_step=share,
        evidence={"rank": rank, "recompiles": int(len(recompiles)), "reasons": dict(reasons),
                  "reasons_each": raw[:20], "size_changes": changes[:20],
                  "functions": dict(functions), "caller": caller, "caller_kind": site_kind,
                  "not_recompiles": dict(not_recompiles),
                  "seconds_each": [round(float(x), 3) for x in recompiles["duration_s"]]},
        prescriptions=tuple(prescriptions), ranks=(rank,))


def _analyze_rank(run, rank, compiles):
    findings = []
    steps = run.rank_steps(rank).dropna(subset=["duration_s"])
    compiles = compiles[compiles["ok"].fillna(True).astype(bool)] if "ok" in compiles else compiles
    kernels = _kernel_rows(compiles[compiles["kind"].isin(["cute_dsl", "triton"])])
    firsts = []
    for (kind, kernel), group in kernels.items():
        firsts.append(group.iloc[:1])
        found = _steady_finding(run, rank, kind, kernel, group, steps)
        if found:
            findings.append(found)
    tunes = compiles[compiles["kind"] == "triton_autotune"]
    for kernel, group in tunes.sort_values("start_ns").groupby("kernel", sort=False):
        found = _autotune_finding(run, rank, kernel, group, steps)
        if found:
            findings.append(found)
    dynamo = compiles[compiles["kind"] == "dynamo"].sort_values("start_ns")
    if len(dynamo):
        firsts.append(dynamo[[k in ("first", "backward", "mode") for k in dynamo_kinds(dynamo)]])
        found = _dynamo_finding(run, rank, dynamo, steps)
        if found:
            findings.append(found)
    if firsts:
        cold = _cold_start_finding(run, rank, pd.concat(firsts), steps)
        if cold:
            findings.append(cold)
    return _merge_fa4_steady(findings)


def _merge_fa4_steady(findings):
    """One FA4 leak finding per rank: the kernels it recompiles are listed inside."""
    steady = [f for f in findings if f.id == "jit.fa4_steady_recompile"]
    if len(steady) <= 1:
        return findings
    steady.sort(key=lambda f: -(f.seconds_lost_per_step or 0))
    top = steady[0]
    others = [{"kernel": f.evidence.get("kernel"), "seconds_lost_per_step": f.seconds_lost_per_step,
               "changing_key_fields": f.evidence.get("changing_key_fields")} for f in steady[1:]]
    total = sum(f.seconds_lost_per_step or 0 for f in steady)
    share = sum(f.share_of_step or 0 for f in steady)
    merged = Finding(
        id=top.id, title=top.title, severity=_severity(min(share, 1.0), steady=True),
        analyzer=top.analyzer, summary=top.summary + f" {len(others)} other FA4 kernel(s) "
        f"recompile too; together {total:.2f} s per step.",
        steps_affected=tuple(sorted(set().union(*[set(f.steps_affected) for f in steady]))),
        seconds_lost_per_step=total, share_of_step=min(share, 1.0),
        evidence={**top.evidence, "other_kernels": others},
        prescriptions=tuple(Prescription(**{**p.__dict__, "expected_gain_s_per_step": total})
                            for p in top.prescriptions), ranks=top.ranks)
    return [f for f in findings if f.id != "jit.fa4_steady_recompile"] + [merged]


# -- py-spy alone ---------------------------------------------------------------------------------
def analyze_recording(recording, source="py-spy", run=None, rank="0", recording_gil=None):
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
        thread_text = ("the main thread" if site.is_main_thread else
                       f"{site.thread} (not the main thread: the autograd thread, on a GPU job)")
        kernel = site.function + (f" [{site.kernel_file}]" if site.kernel_file else "")
        calls = list(range(1, site.count))
        evidence = {
            "source": source, "thread": site.thread, "is_main_thread": site.is_main_thread,
            "kind": site.kind, "call_site": site.site_label, "kernel_source": site.kernel_file,
            "compiles": site.count, "recompiles": len(site.recompiles),
            "seconds_each": each, "recompile_seconds": round(recompile_s, 3),
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
            fn = "backward" if "bwd" in site.function else "forward" if "fwd" in site.function else site.function
            title = (f"FA4 {fn} ({site.function}) compiles again on every call after the first, "
                     f"on {site.thread if not site.is_main_thread else 'the main thread'}: "
                     f"{len(site.recompiles)} recompiles, ~{per:.1f} s each")
            summary = (f"py-spy shows {site.function} compiling {site.count} times on "
                       f"{thread_text}: the first call (cold start) and then every later call "
                       f"({len(site.recompiles)} of {len(site.recompiles)}), ~{per:.1f} s each, "
                       f"{share:.0%} of the recorded samples. The kernel is built from "
                       f"{site.kernel_file or '?'}. A compile on every call means its compile key "
                       "changes every call; with flash-attn-4 < 4.0.0b22 (backward) / < 4.0.0b26 "
                       "(forward) the known cause is max_seqlen passed as a tensor.")
            prescriptions = [
                Prescription(kind="code",
                             summary="pass max_seqlen to flash_attn as a Python int (find the "
                                     "call with `diagnose -- <cmd>`: the shim names its file:line)",
                             change={"code": {"file": None, "line": None,
                                              "before": "max_seqlen=cu_seqlens.diff().max()",
                                              "after": "max_seqlen=int(cu_seqlens.diff().max())"}},
                             expected_gain_s_per_step=per),
                Prescription(kind="upgrade",
                             summary=f"upgrade flash-attn-4 to >= {FA4_FIXED} ({FA4_BWD_FIXED} "
                                     "fixes the backward only)",
                             change={"upgrade": {"package": FA4_PACKAGE, "min_version": FA4_FIXED}},
                             command=f"pip install -U '{FA4_PACKAGE}>={FA4_FIXED}'",
                             expected_gain_s_per_step=per),
            ]
            if run is not None:
                prescriptions += backend_switches(run)
            finding_id = "jit.fa4_steady_recompile"
        else:
            title = (f"{site.kind} compiles {site.function} again on every call after the first "
                     f"({len(site.recompiles)} recompiles, ~{per:.1f} s each)")
            summary = (f"py-spy shows {site.site_label} compiling {site.count} times on "
                       f"{thread_text}; {share:.0%} of the recorded samples.")
            prescriptions = []
            finding_id = f"jit.{site.kind}_steady_recompile" if site.kind != "dynamo" else "jit.dynamo_recompile"
        findings.append(Finding(
            id=finding_id, title=title, severity=severity, analyzer="jit", summary=summary,
            steps_affected=tuple(calls), seconds_lost_per_step=per, share_of_step=None,
            evidence=evidence, prescriptions=tuple(prescriptions), ranks=(rank,)))
    return findings


def _analyze_pyspy_only(run):
    findings = []
    pyspy = run.pyspy
    for (rank, source), recording in sorted(pyspy.items()):
        if source != "all" and (rank, "all") in pyspy:
            continue
        gil = pyspy.get((rank, "gil")) if source != "gil" else None
        for f in analyze_recording(recording, source=f"py-spy ({source})", run=run, rank=rank,
                                   recording_gil=gil):
            findings.append(f)
    return findings


def analyze(run):
    compiles = run.compiles
    findings = []
    ranks_with_events = set()
    if len(compiles):
        for rank, group in compiles.groupby("rank"):
            ranks_with_events.add(str(rank))
            findings.extend(_analyze_rank(run, rank, group))
    pyspy_only = [f for f in _analyze_pyspy_only(run) if str(f.ranks[0]) not in ranks_with_events]
    return findings + pyspy_only
