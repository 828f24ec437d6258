"""Edits the `--fix` planner builds from the line a finding names, where the analyzer's
prescription is prose (judge layer, fix planning): host reads kept on the device, pinned
non_blocking copies, torch.compile's dynamic=/mode=, mark_dynamic, multi-tensor optimizers, a
checkpoint written on a thread. Each is read with ast from the job's own files: generic, never
per file name. `derived_edit_options` is the planner's entry (traindx.fixing.plan.planner)."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from traindx.analyzers import codefix
from traindx.analyzers.core.findings import Finding, Prescription, SourceEdit
from traindx.fixing.plan import compile_edits as codefix_compile
from traindx.fixing.plan import optim_edits as codefix_optim
from traindx.fixing.plan import save_edits as codefix_save
from traindx.fixing.plan.compile_edits import CompileCall
from traindx.fixing.plan.source import job_script_files, named_sites, python_files, tree_root

# -- concrete edits the planner builds from a finding's named line ---------------------------------
# (an analyzer writes the most concrete change it can; where its prescription is prose, the
# planner reads the line it names with ast and builds the edit: generic, never per file name)
HOST_TIME_FINDINGS = ("sync.", "gpu_idle.host_starved", "gpu_idle.between_steps", "host_work.")


def _code_of(p: Prescription) -> Mapping[str, Any]:
    """The prescription's (first) code edit, {} when it has none."""
    return (p.change.code if isinstance(p.change, SourceEdit) else None) or {}


def _job_sites(finding: Finding, command: Sequence[str], cwd: str) -> list[tuple[str, int]]:
    """(absolute path, line) of every site the finding names inside the job's own tree."""
    out = []
    for site in named_sites(finding.evidence) + [
        (c.get("file"), c.get("line")) for c in map(_code_of, finding.prescriptions)
    ]:
        if not site or not site[0] or not isinstance(site[1], int):
            continue
        path = os.path.abspath(os.path.join(cwd, site[0]))
        if (
            os.path.isfile(path)
            and tree_root([path], command, cwd) is not None
            and (path, site[1]) not in out
        ):
            out.append((path, site[1]))
    return out


def _edit_key(change: Mapping[str, Any]) -> tuple[str, Any, Any]:
    return (os.path.abspath(change["file"]), change["line"], change.get("after"))


def _known_edits(finding: Finding) -> set[tuple[str, Any, Any]]:
    return {_edit_key(c) for c in map(_code_of, finding.prescriptions) if c.get("file") and c.get("line")}


def _edits_prescription(
    summary: str, changes: Iterable[Mapping[str, Any]], gain: float | None
) -> Prescription:
    edits = tuple(changes)
    return Prescription(
        kind="code",
        summary=summary,
        change=SourceEdit(code=edits[0], codes=edits),
        expected_gain_s_per_step=gain,
        automatic=True,
    )


def host_read_options(finding: Finding, command: Sequence[str], cwd: str) -> list[Prescription]:
    """A finding about the training thread's time (a host-device sync, the GPU waiting for host
    work) at a loop that reads tensors to the host each step only to keep them (`total +=
    loss.item()`, `losses.append(float(loss))`): one arm that keeps them on the device
    (`.detach()`), read once where they are printed."""

    if not finding.id.startswith(HOST_TIME_FINDINGS):
        return []
    known, edits = _known_edits(finding), []
    for path, line in _job_sites(finding, command, cwd):
        # host_work measured its very line; a sync or GPU-idle finding names a function's
        # first line or the loop (a profiler's frame, the GPU clock's stretch): widened
        for change in codefix.device_accumulations(path, line, widen=not finding.id.startswith("host_work.")):
            if _edit_key(change) not in known and change not in edits:
                edits.append(change)
    if not edits:
        return []
    where = ", ".join(f"{os.path.basename(c['file'])}:{c['line']} `{c['after']}`" for c in edits[:3])
    return [
        _edits_prescription(
            f"keep the per-step values on the device instead of reading them to the host each step "
            f"({where}); they are read once, where they are printed",
            edits,
            finding.seconds_lost_per_step,
        )
    ]


def async_copy_options(finding: Finding, command: Sequence[str], cwd: str) -> list[Prescription]:
    """A host-to-device copy from pageable memory at the finding's line: the copy made
    asynchronous from pinned memory. With the DataLoader's pin_memory=True edit among the
    finding's prescriptions, both go into one arm (neither pays alone); else the host tensor
    pinned once where it is made, or a pinned copy at the line."""

    evidence = finding.evidence or {}
    if not (finding.id.endswith("pageable_copy") or "pageable_h2d_s_per_step" in evidence):
        return []
    file, line = evidence.get("file"), evidence.get("line")
    if not file or not isinstance(line, int):
        return []
    path = os.path.abspath(os.path.join(cwd, file))
    if not os.path.isfile(path) or tree_root([path], command, cwd) is None:
        return []
    gain = finding.seconds_lost_per_step
    pin = next(
        (
            c
            for c in map(_code_of, finding.prescriptions)
            if "pin_memory=True" in str(c.get("after") or "")
            and "pin_memory=True" not in str(c.get("before") or "")
        ),
        None,
    )
    out = []
    if pin:
        out = [
            _edits_prescription(
                f"DataLoader(pin_memory=True) and .to(device, non_blocking=True) at "
                f"{os.path.basename(path)}:{line}, together",
                [pin, *changes],
                gain,
            )
            for changes in codefix.async_copy_edits(path, line, pinned_by_loader=True)
        ]
    for changes in codefix.async_copy_edits(path, line):
        pinned = [c for c in changes if c["line"] != line]
        how = (
            f"pin the host tensor once where it is made ({os.path.basename(path)}:"
            f"{pinned[0]['line']}) and copy with non_blocking=True"
            if pinned
            else "copy through pinned memory: .pin_memory().to(device, non_blocking=True)"
        )
        out.append(_edits_prescription(f"{how} at {os.path.basename(path)}:{line}", changes, gain))
    return out


def _compile_call_for(finding: Finding, files: Sequence[str]) -> tuple[str, CompileCall] | None:
    """(path, call) of the torch.compile that made the recompiling graph: the one whose compiled
    object the call site calls (`logits = compiled(x)` -> `compiled = torch.compile(...)`), or
    the decorated function that recompiled; else the only one in the job's files."""

    calls = [(path, c) for path in files for c in codefix_compile.compile_calls(path)]
    if len(calls) <= 1:
        return calls[0] if calls else None
    evidence = finding.evidence or {}
    caller = evidence.get("caller") or {}
    called = set()
    source = caller.get("source") or ""
    try:
        for node in ast.walk(ast.parse(source.strip())):
            if isinstance(node, ast.Call):
                called.add(ast.unparse(node.func))
    except SyntaxError:
        pass
    functions = {str(k).split(".")[-1].split(" ")[0] for k in (evidence.get("functions") or {})}
    named = [(p, c) for p, c in calls if c["target"] and (c["target"] in called or c["target"] in functions)]
    # a steady recompile on shapes is a static compile's (automatic dynamic shapes would have
    # turned the dimension symbolic after one recompile): the one that says dynamic=False
    static = [(p, c) for p, c in named if c["dynamic"] == "False"]
    if static or named:
        return (static or named)[0]
    same = [
        (p, c)
        for p, c in calls
        if caller.get("file") and os.path.abspath(p) == os.path.abspath(caller["file"])
    ]
    return same[0] if len(same) == 1 else None


def compile_options(finding: Finding, command: Sequence[str], cwd: str) -> list[Prescription]:
    """A steady dynamo recompile because a shape changes: the torch.compile call that made the
    recompiling graph compiled with dynamic=True (and, where it says dynamic=False, with
    dynamic=None: automatic dynamic shapes), one arm each."""

    evidence = finding.evidence or {}
    if finding.id.startswith(LAUNCH_BOUND_FINDINGS):
        return launch_bound_options(finding, command, cwd)
    if not finding.id.startswith("jit.dynamo") or not (
        evidence.get("size_changes")
        or any(
            "size mismatch" in str(r) or "stride mismatch" in str(r) for r in evidence.get("reasons") or {}
        )
    ):
        return []
    files = [p for p, _ in _job_sites(finding, command, cwd)] + job_script_files(command, cwd)
    files = list(dict.fromkeys(os.path.abspath(f) for f in files))
    found = _compile_call_for(finding, files)
    if found is None:
        roots = {r for f in files if (r := tree_root([f], command, cwd)) is not None}
        tree_files = [f for r in roots for f in python_files(r, limit=300)]
        found = _compile_call_for(finding, list(dict.fromkeys(files + tree_files)))
    if found is None:
        return []
    path, call = found
    out = []
    lost = finding.seconds_lost_per_step
    for label, change in codefix_compile.compile_arg_edits(path, call):
        automatic = label == "dynamic=None"
        out.append(
            _edits_prescription(
                f"torch.compile(..., {label}) at {os.path.basename(path)}:{call['line']}"
                + (
                    " (automatic dynamic shapes: one recompile, then symbolic)"
                    if automatic
                    else " (symbolic shapes from the first compile: no recompile when the length changes)"
                ),
                [change],
                lost * 0.95 if automatic and lost else lost,
            )
        )
    return out + _mark_dynamic_options(finding, files, call, lost)


_GUARD = re.compile(
    r"tensor '(?:L\['(?P<quoted>[^']+)'\]|(?P<name>[^']+))' (?:size|stride) mismatch "
    r"at index (?P<dim>\d+)"
)


def _mark_dynamic_options(
    finding: Finding, files: Sequence[str], call: CompileCall, lost: float | None
) -> list[Prescription]:
    """torch._dynamo.mark_dynamic(x, dim) before the calls of the compiled object, where the
    analyzer named the compiled function's definition (no call site of its own): the guard's
    tensor is that function's parameter, passed by position at the calls in the job's loops."""

    evidence = finding.evidence or {}
    caller = evidence.get("caller") or {}
    if evidence.get("caller_kind") == "call_site" or not caller.get("file") or not call.get("target"):
        return []  # at a call site the analyzer's own mark_dynamic edit is already a candidate
    m = next((_GUARD.search(str(r)) for r in evidence.get("reasons") or {} if _GUARD.search(str(r))), None)
    if m is None:
        return []
    index = codefix_compile.parameter_index(
        caller["file"], int(caller.get("line") or 0), m["quoted"] or m["name"]
    )
    if index is None:
        return []
    edits = [
        e
        for path in files
        for e in codefix_compile.mark_dynamic_edits(path, call["target"], index, int(m["dim"]))
    ]
    if not edits:
        return []
    return [
        _edits_prescription(
            f"torch._dynamo.mark_dynamic({m['quoted'] or m['name']}, {m['dim']}) before "
            f"{call['target']}(...) at {os.path.basename(edits[0]['file'])}:{edits[0]['line']} (that "
            "dimension symbolic from the first compile)",
            edits,
            lost * 0.9 if lost else lost,
        )
    ]


LAUNCH_BOUND_FINDINGS = ("gpu.launch_bound",)


def _launch_bound_files(finding: Finding, command: Sequence[str], cwd: str) -> list[str]:
    return list(
        dict.fromkeys(
            os.path.abspath(f)
            for f in [p for p, _ in _job_sites(finding, command, cwd)] + job_script_files(command, cwd)
        )
    )


def launch_bound_options(finding: Finding, command: Sequence[str], cwd: str) -> list[Prescription]:
    """A launch-bound step: the model's launches replayed by a CUDA graph, the optimizer's made
    multi-tensor where the analyzer found it launching a share of its own, and both in one arm
    (each priced by the share of the host's time it removes: the analyzer's evidence)."""
    evidence = finding.evidence or {}
    lost = finding.seconds_lost_per_step or 0.0
    graph = _compile_mode_options(finding, command, cwd, gain=evidence.get("cuda_graph_saving_s", lost))
    optimizer = _multi_tensor_optimizer_options(finding, command, cwd)
    out = graph + optimizer
    if graph and optimizer:
        changes = [*_edits_of(graph[0]), *_edits_of(optimizer[0])]
        out.insert(
            0,
            _edits_prescription(
                f"{optimizer[0].summary}; and {graph[0].summary}",
                changes,
                (graph[0].expected_gain_s_per_step or 0.0) + (optimizer[0].expected_gain_s_per_step or 0.0),
            ),
        )
    return out


def _edits_of(p: Prescription) -> tuple[Mapping[str, Any], ...]:
    return p.change.edits if isinstance(p.change, SourceEdit) else ()


def _multi_tensor_optimizer_options(finding: Finding, command: Sequence[str], cwd: str) -> list[Prescription]:
    """The optimizer the analyzer saw stepping one parameter at a time (torch.optim's class from
    its profiler range) made multi-tensor at the job's own calls that make it."""

    optimizer = (finding.evidence or {}).get("optimizer") or {}
    name, gain = optimizer.get("class"), optimizer.get("saving_s")
    if not name or not gain or not any(p.expected_gain_s_per_step == gain for p in finding.prescriptions):
        return []  # the analyzer did not prescribe it (its share too small)
    files = _launch_bound_files(finding, command, cwd)
    edits = [e for f in files for e in codefix_optim.multi_tensor_edits(f, name)]
    if not edits:
        roots = {r for f in files if (r := tree_root([f], command, cwd)) is not None}
        tree_files = [f for r in roots for f in python_files(r, limit=300) if f not in files]
        edits = [e for f in tree_files for e in codefix_optim.multi_tensor_edits(f, name)]
    if not edits:
        return []
    keyword = codefix_optim.multi_tensor_keyword(name)
    where = ", ".join(f"{os.path.basename(e['file'])}:{e['line']}" for e in edits[:3])
    return [
        _edits_prescription(
            f"{name}(..., {keyword}=True) at {where} (the optimizer's step in a few kernels, not "
            "one per parameter)",
            edits,
            gain,
        )
    ]


def _compile_mode_options(
    finding: Finding, command: Sequence[str], cwd: str, gain: float | None = None
) -> list[Prescription]:
    """mode="reduce-overhead" (CUDA graphs) at the job's torch.compile call where one is found
    (the job's files); in a job that compiles nothing, torch.compile of the model it trains,
    after the line that makes it."""

    gain = finding.seconds_lost_per_step if gain is None else gain
    files = _launch_bound_files(finding, command, cwd)
    found = _compile_call_for(finding, files)
    if found is None:
        # a job that compiles nothing: its model compiled where it is made, in CUDA-graph mode
        edits = [e for f in files for e in codefix_compile.compile_model_edits(f)]
        if not edits:
            return []
        names = ", ".join(
            f"{e['after'].split('.compile')[0]} at {os.path.basename(e['file'])}:"
            f"{e.get('last_line') or e['line']}"
            for e in edits
        )
        return [
            _edits_prescription(
                f'<model>.compile(mode="reduce-overhead") where the model is made ({names}; '
                "CUDA graphs: the step's kernels replayed by one launch, compiled at the first steps)",
                edits,
                gain,
            )
        ]
    path, call = found
    change = codefix_compile.compile_mode_edit(path, call)
    if change is None:
        return []
    return [
        _edits_prescription(
            f'torch.compile(..., mode="reduce-overhead") at {os.path.basename(path)}:{call["line"]}'
            " (CUDA graphs: the step's kernels replayed by one launch)",
            [change],
            gain,
        )
    ]


def async_checkpoint_options(finding: Finding, command: Sequence[str], cwd: str) -> list[Prescription]:
    """A checkpoint written on the critical path by the job's own `torch.save(...)` statement:
    one arm that serializes it into memory at the call and writes the file on a thread (the
    training goes on while the disk writes; the bytes are the step's own state; one write per
    file at a time; the thread joined at exit, so no checkpoint is lost)."""

    by_file: dict[str, list[int]] = {}
    for path, line in _job_sites(finding, command, cwd):
        by_file.setdefault(path, []).append(line)
    evidence = finding.evidence or {}
    lost = finding.seconds_lost_per_step
    other = evidence.get("median_other_s")
    timed = (evidence.get("io_in_slow_steps") or [{}])[0]
    wall, cpu = timed.get("seconds_per_step"), timed.get("cpu_seconds_per_step")
    if lost and isinstance(wall, (int, float)) and wall > 0 and isinstance(cpu, (int, float)):
        # the calling thread's own CPU in the save (serializing, copying into the page cache)
        # stays on it; only its wait for the disk moves to the thread
        lost *= max(0.0, 1.0 - cpu / wall)
    # the writes overlap the steps' own work, no more: a disk slower than the steps keeps
    # them waiting (the next write of a file waits for the last), so what the thread saves
    # per step is the smaller of the write time and the rest of the step
    gain = min(lost, other) if lost and isinstance(other, (int, float)) and other > 0 else lost
    out = []
    for path, lines in by_file.items():
        edits = codefix_save.background_save_edits(path, lines)
        if edits:
            where = ", ".join(f"{os.path.basename(path)}:{e['line']}" for e in edits[1:])
            out.append(
                _edits_prescription(
                    f"write the checkpoint file on a background thread (serialized in memory at the call) "
                    f"(torch.save at {where})",
                    edits,
                    gain,
                )
            )
    return out


def derived_edit_options(finding: Finding, command: Sequence[str], cwd: str) -> list[Prescription]:
    """The concrete edits the planner builds for a finding from the line it names."""
    out = []
    for build in (host_read_options, async_copy_options, compile_options, async_checkpoint_options):
        try:
            out += build(finding, command, cwd)
        except Exception:  # a line the planner cannot read is no candidate, never a crash
            continue
    return out
