"""Source patches for a `--fix` candidate, without touching the user's files: the job's own
source tree is copied to a scratch folder inside the fix folder, the change is made there, the
candidate runs from the copy, and `fix.patch` (a unified diff, paths relative to the tree's root,
`git apply`-able there) is what the user applies after the proof.

The tree: the job's working directory, or the folder of its script when the patched file lies
outside the working directory. Python files and small files are copied; large files (data,
checkpoints) are linked, so the copy stays cheap. Version-control, virtual-environment, cache and
run folders are left out.

The job's own source is also read here to place an edit: its argparse flags, the guard that
makes a cost periodic, and the edits the planner builds from the line a finding names where the
analyzer's prescription is prose (`derived_edit_options`: host reads kept on the device, pinned
non_blocking copies, torch.compile's dynamic=/mode=, mark_dynamic).
"""

import ast
import difflib
import os
import re
import shutil
import textwrap

from traindx.analyzers.codefix import keyword_sources  # noqa: F401 (fixplan reads it here)
from traindx.analyzers.evidence import SKIP_DIRS, python_files  # noqa: F401 (fixplan reads them here)
from traindx.analyzers.findings import Prescription

COPY_LIMIT_BYTES = 2 * 1024 * 1024
MAX_FILES = 20000


class PatchError(Exception):
    pass


def _inside(path, root):
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def script_dir(command, cwd):
    for token in command[:4]:
        if token.endswith(".py") and not token.startswith("-"):
            return os.path.dirname(os.path.abspath(os.path.join(cwd, token)))
    return None


def tree_root(files, command, cwd):
    """The folder to copy: the cwd when it holds every patched file, else the script's folder."""
    for root in (cwd, script_dir(command, cwd)):
        if root and all(_inside(f, root) for f in files):
            return os.path.realpath(root)
    return None


def _read_lines(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines(keepends=True)
    except OSError as exc:
        raise PatchError(f"cannot read {path}: {exc.strerror}") from None


def normalized(edit):
    """One edit form: {"file", "line", "last_line", "before", "after", "op"}. Accepts the whole-
    line form ({"before_line", "after_line"}) and Prescription.change["code"] (a fragment of the
    lines file:line..last_line, op replace | delete | insert_after)."""
    if "before_line" in edit:
        return dict(
            edit,
            before=edit["before_line"].rstrip("\n"),
            after=(edit.get("after_line") or "").rstrip("\n"),
            op="replace",
            last_line=edit.get("line"),
        )
    op = edit.get("op") or ("delete" if not (edit.get("after") or "").strip() else "replace")
    return dict(edit, op=op, last_line=edit.get("last_line") or edit.get("line"))


def resolve_edit(edit):
    """Check an edit against the file as it is. The line number is corrected when the text
    moved (found once elsewhere); raises PatchError when it is not there."""
    edit = normalized(edit)
    path = edit["file"]
    lines = _read_lines(path)
    before = edit["before"]
    line = int(edit.get("line") or 0)
    span = int(edit["last_line"] or line) - line
    first = before.strip().splitlines()[0].strip() if before.strip() else ""
    if 1 <= line <= len(lines) and _holds("".join(lines[line - 1 : line + span]), before):
        return dict(edit, line=line, last_line=line + span)
    matches = [i + 1 for i, text in enumerate(lines) if first and first in text]
    if len(matches) == 1:
        return dict(edit, line=matches[0], last_line=matches[0] + span)
    raise PatchError(
        f"{path}:{line} no longer reads `{first}`" + (f" ({len(matches)} matching lines)" if matches else "")
    )


def _holds(region, before):
    """True when the region holds the code `before` (its layout over lines aside)."""
    if not before.strip():
        return False
    return before.strip() in region or " ".join(before.split()) in " ".join(region.split())


def _indent(text):
    return text[: len(text) - len(text.lstrip())]


def _apply_one(lines, e):
    """lines with one resolved edit made (a list of lines with their endings)."""
    first, last = e["line"] - 1, e["last_line"]
    region = "".join(lines[first:last])
    ending = region[len(region.rstrip("\r\n")) :] or "\n"
    before, after = e["before"], e.get("after") or ""
    if e["op"] == "insert_after":
        # at the statement's indentation, the inserted block's own indentation kept
        pad = _indent(lines[first])
        body = "".join(
            (pad + l if l.strip() else "").rstrip() + ending
            for l in textwrap.dedent(after).removeprefix("\n").rstrip().splitlines()
        )
        return lines[:last] + [body] + lines[last:]
    if e["op"] == "delete" and region.strip() == before.strip():
        edited = ""
    elif before in region:
        edited = region.replace(before, after, 1)
    elif before.strip() in region:
        edited = region.replace(before.strip(), after.strip(), 1)
    else:  # the same code, laid out over the lines differently: rewrite the region
        edited = _indent(region) + after.strip() + ending
    if e["op"] == "delete" and not edited.strip():
        edited = ""
    elif not edited.endswith(("\n", "\r")):
        edited += ending
    out = lines[:first] + ([edited] if edited else []) + lines[last:]
    if not edited:
        try:  # a removed statement that was a block's only one leaves `pass` in its place
            ast.parse("".join(out))
        except SyntaxError:
            out = lines[:first] + [_indent(region) + "pass" + ending] + lines[last:]
    return out


def patched_text(path, edits):
    lines = _read_lines(path)
    for e in sorted((normalized(e) for e in edits), key=lambda e: -e["line"]):
        lines = _apply_one(lines, e)
    return "".join(lines)


def unified_diff(root, edits):
    """The unified diff of all edits, paths relative to root (a/ b/ prefixes, git apply -p1)."""
    by_file = {}
    for e in edits:
        by_file.setdefault(os.path.realpath(e["file"]), []).append(e)
    out = []
    for path in sorted(by_file):
        with open(path, encoding="utf-8") as f:
            old = f.read()
        new = patched_text(path, by_file[path])
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        out.extend(
            difflib.unified_diff(
                old.splitlines(keepends=True),
                new.splitlines(keepends=True),
                fromfile=f"a/{rel}",
                tofile=f"b/{rel}",
                n=3,
            )
        )
    text = "".join(out)
    return text if text.endswith("\n") or not text else text + "\n"


def copy_tree(root, dest, exclude=()):
    """Copy the job's tree (small files copied, big ones linked). Returns the number of files."""
    exclude = {os.path.realpath(p) for p in exclude if p}
    count = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [
            d
            for d in dirs
            if d not in SKIP_DIRS
            and not d.endswith(".egg-info")
            and os.path.realpath(os.path.join(folder, d)) not in exclude
        ]
        rel = os.path.relpath(folder, root)
        target = os.path.join(dest, rel) if rel != "." else dest
        os.makedirs(target, exist_ok=True)
        for name in files:
            src = os.path.join(folder, name)
            dst = os.path.join(target, name)
            count += 1
            if count > MAX_FILES:
                raise PatchError(f"{root} holds over {MAX_FILES} files: too big to copy")
            try:
                if os.path.islink(src) or os.path.getsize(src) > COPY_LIMIT_BYTES:
                    os.symlink(os.path.realpath(src), dst)
                else:
                    shutil.copy2(src, dst)
            except OSError:
                continue
    return count


def make_scratch(root, dest, edits, exclude=()):
    """The scratch copy with the edits made; returns the diff (fix.patch's text)."""
    diff = unified_diff(root, edits)
    if os.path.exists(dest):
        shutil.rmtree(dest)
    copy_tree(root, dest, exclude)
    by_file = {}
    for e in edits:
        by_file.setdefault(os.path.realpath(e["file"]), []).append(e)
    for path, file_edits in by_file.items():
        copy = os.path.join(dest, os.path.relpath(path, root))
        text = patched_text(path, file_edits)
        if path.endswith(".py"):
            try:
                ast.parse(text)
            except SyntaxError as exc:
                raise PatchError(
                    f"the edited {os.path.basename(path)} does not parse: {exc.msg} at line {exc.lineno}"
                ) from None
        if os.path.islink(copy):
            os.unlink(copy)
        with open(copy, "w", encoding="utf-8") as f:
            f.write(text)
    return diff


def rebase_command(command, root, dest, cwd=None):
    """The command with paths inside the tree pointed at the copy: absolute ones, and (given
    the job's cwd) relative ones that name a file there, made absolute."""
    out = []
    for token in command:
        path = (
            token
            if os.path.isabs(token)
            else (os.path.join(cwd, token) if cwd and not token.startswith("-") else None)
        )
        if path and (os.path.isabs(token) or os.path.isfile(path)) and _inside(path, root):
            token = os.path.join(dest, os.path.relpath(os.path.realpath(path), root))
        out.append(token)
    return out


def runs_a_script(command):
    """True when the command runs a Python file (`python x.py`, `torchrun ... x.py`), not a
    module (`python -m pkg.train`) or a shell script."""
    for token in command[:6]:
        if token == "-m":
            return False
        if token.endswith(".py") and not token.startswith("-"):
            return True
    return False


def rebase_pythonpath(value, root, dest):
    if not value:
        return value
    parts = []
    for p in value.split(os.pathsep):
        if p and os.path.isabs(p) and _inside(p, root):
            p = os.path.join(dest, os.path.relpath(os.path.realpath(p), root))
        parts.append(p)
    return os.pathsep.join(parts)


# -- Triton: an autotune key that changes every step ------------------------------------------------
def _autotune_key_node(tree, kernel):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == kernel:
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and (
                    getattr(dec.func, "attr", None) == "autotune"
                    or getattr(dec.func, "id", None) == "autotune"
                ):
                    for kw in dec.keywords:
                        if kw.arg == "key" and isinstance(kw.value, (ast.List, ast.Tuple)):
                            return kw.value
    return None


def autotune_key_edit(kernel, drop, search_files):
    """The edit that takes the changing arguments out of `@triton.autotune(key=[...])` of
    `kernel`, found in the first of `search_files` that defines it; None when not found."""
    import ast

    for path in search_files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            tree = ast.parse(text)
        except (OSError, SyntaxError, ValueError):
            continue
        node = _autotune_key_node(tree, kernel)
        if node is None or node.lineno != node.end_lineno:
            continue
        line = text.splitlines()[node.lineno - 1]
        elts = [e for e in node.elts if isinstance(e, ast.Constant)]
        keep = [e for e in elts if e.value not in set(drop)]
        if len(keep) == len(elts):
            return None
        # the file's own spelling of the names that stay (quotes and all)
        new_list = "[" + ", ".join(line[e.col_offset : e.end_col_offset] for e in keep) + "]"
        after = line[: node.col_offset] + new_list + line[node.end_col_offset :]
        return {
            "file": path,
            "line": node.lineno,
            "before_line": line,
            "after_line": after,
            "before": line.strip(),
            "after": after.strip(),
        }
    return None


# -- the job's own flags: a value that comes from its argparse parser ---------------------------------
def _parse(path):
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None


def argparse_flags(path):
    """{dest: {"flag": "--workers", "default": value or None}} of every
    `parser.add_argument("--x", ...)` in a Python file (argparse and HfArgumentParser-less
    scripts alike); {} when the file does not parse."""
    tree = _parse(path)
    out = {}
    for node in ast.walk(tree) if tree is not None else ():
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        names = [
            a.value
            for a in node.args
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")
        ]
        longs = [n for n in names if n.startswith("--")]
        if not longs:
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        dest = (
            kw["dest"].value if isinstance(kw.get("dest"), ast.Constant) else longs[0][2:].replace("-", "_")
        )
        default = kw.get("default")
        try:
            default = ast.literal_eval(default) if default is not None else None
        except ValueError:
            default = None
        out[dest] = {"flag": longs[0], "default": default}
    return out


def flag_of(expression, flags):
    """The job's flag an expression reads (`a.workers`, `int(args.num_workers)`), else None."""
    try:
        node = ast.parse(expression.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        node = node.args[0]  # int(args.x), max(...) is not a flag
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr in flags:
        return flags[node.attr]
    return None


def periodic_flag(path, line, flags):
    """The job's flag that sets how often the code at path:line runs: an enclosing
    `if <step> % args.every == ...:` (or `if (i + 1) % args.k == 0`), else None."""
    tree = _parse(path)
    best = None
    for node in ast.walk(tree) if tree is not None else ():
        if not isinstance(node, ast.If) or not node.body:
            continue
        if not node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
            continue
        for sub in ast.walk(node.test):
            if (
                isinstance(sub, ast.BinOp)
                and isinstance(sub.op, ast.Mod)
                and isinstance(sub.right, ast.Attribute)
                and sub.right.attr in flags
            ):
                if best is None or node.lineno > best[0]:
                    best = (node.lineno, flags[sub.right.attr])
    return best[1] if best else None


# -- edits the fix planner builds from the line a finding names ------------------------------------
def job_script_files(command, cwd):
    """The Python scripts the command runs (its first tokens), as absolute paths."""
    out = []
    for token in command[:6]:
        if token.endswith(".py") and not token.startswith("-"):
            path = os.path.abspath(os.path.join(cwd, token))
            if os.path.isfile(path):
                out.append(path)
    return out


def named_sites(value, depth=0):
    """(file, line) pairs named anywhere in a finding's evidence (a few levels deep)."""
    if depth > 3:
        return []
    out = []
    if isinstance(value, dict):
        if isinstance(value.get("file"), str) and isinstance(value.get("line"), int):
            out.append((value["file"], value["line"]))
        for v in value.values():
            out += named_sites(v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value[:10]:
            out += named_sites(v, depth + 1)
    return out


# -- concrete edits the planner builds from a finding's named line ---------------------------------
# (an analyzer writes the most concrete change it can; where its prescription is prose, the
# planner reads the line it names with ast and builds the edit: generic, never per file name)
HOST_TIME_FINDINGS = ("sync.", "gpu_idle.host_starved", "gpu_idle.between_steps", "host_work.")


def _job_sites(finding, command, cwd):
    """(absolute path, line) of every site the finding names inside the job's own tree."""
    out = []
    for site in named_sites(finding.evidence) + [
        (c.get("file"), c.get("line"))
        for c in (((p.change or {}).get("code") or {}) for p in finding.prescriptions)
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


def _edit_key(change):
    return (os.path.abspath(change["file"]), change["line"], change.get("after"))


def _known_edits(finding):
    return {
        _edit_key(c)
        for c in (((p.change or {}).get("code") or {}) for p in finding.prescriptions)
        if c.get("file") and c.get("line")
    }


def _edits_prescription(summary, changes, gain):
    changes = list(changes)
    return Prescription(
        kind="code",
        summary=summary,
        change={"code": changes[0], "codes": changes},
        expected_gain_s_per_step=gain,
        automatic=True,
    )


def host_read_options(finding, command, cwd):
    """A finding about the training thread's time (a host-device sync, the GPU waiting for host
    work) at a loop that reads tensors to the host each step only to keep them (`total +=
    loss.item()`, `losses.append(float(loss))`): one arm that keeps them on the device
    (`.detach()`), read once where they are printed."""
    from traindx.analyzers import codefix

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


def async_copy_options(finding, command, cwd):
    """A host-to-device copy from pageable memory at the finding's line: the copy made
    asynchronous from pinned memory. With the DataLoader's pin_memory=True edit among the
    finding's prescriptions, both go into one arm (neither pays alone); else the host tensor
    pinned once where it is made, or a pinned copy at the line."""
    from traindx.analyzers import codefix

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
            for c in (((p.change or {}).get("code") or {}) for p in finding.prescriptions)
            if "pin_memory=True" in str(c.get("after") or "")
            and "pin_memory=True" not in str(c.get("before") or "")
        ),
        None,
    )
    out = []
    if pin:
        for changes in codefix.async_copy_edits(path, line, pinned_by_loader=True):
            out.append(
                _edits_prescription(
                    f"DataLoader(pin_memory=True) and .to(device, non_blocking=True) at "
                    f"{os.path.basename(path)}:{line}, together",
                    [pin] + changes,
                    gain,
                )
            )
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


def _compile_call_for(finding, files):
    """(path, call) of the torch.compile that made the recompiling graph: the one whose compiled
    object the call site calls (`logits = compiled(x)` -> `compiled = torch.compile(...)`), or
    the decorated function that recompiled; else the only one in the job's files."""
    import ast

    from traindx.analyzers import codefix_compile

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


def compile_options(finding, command, cwd):
    """A steady dynamo recompile because a shape changes: the torch.compile call that made the
    recompiling graph compiled with dynamic=True (and, where it says dynamic=False, with
    dynamic=None: automatic dynamic shapes), one arm each."""
    from traindx.analyzers import codefix_compile

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
        roots = {tree_root([f], command, cwd) for f in files} - {None}
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


def _mark_dynamic_options(finding, files, call, lost):
    """torch._dynamo.mark_dynamic(x, dim) before the calls of the compiled object, where the
    analyzer named the compiled function's definition (no call site of its own): the guard's
    tensor is that function's parameter, passed by position at the calls in the job's loops."""
    from traindx.analyzers import codefix_compile

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


def _launch_bound_files(finding, command, cwd):
    return list(
        dict.fromkeys(
            os.path.abspath(f)
            for f in [p for p, _ in _job_sites(finding, command, cwd)] + job_script_files(command, cwd)
        )
    )


def launch_bound_options(finding, command, cwd):
    """A launch-bound step: the model's launches replayed by a CUDA graph, the optimizer's made
    multi-tensor where the analyzer found it launching a share of its own, and both in one arm
    (each priced by the share of the host's time it removes: the analyzer's evidence)."""
    evidence = finding.evidence or {}
    lost = finding.seconds_lost_per_step or 0.0
    graph = _compile_mode_options(finding, command, cwd, gain=evidence.get("cuda_graph_saving_s", lost))
    optimizer = _multi_tensor_optimizer_options(finding, command, cwd)
    out = graph + optimizer
    if graph and optimizer:
        changes = list(graph[0].change["codes"]) + list(optimizer[0].change["codes"])
        out.insert(
            0,
            _edits_prescription(
                f"{optimizer[0].summary}; and {graph[0].summary}",
                changes,
                graph[0].expected_gain_s_per_step + optimizer[0].expected_gain_s_per_step,
            ),
        )
    return out


def _multi_tensor_optimizer_options(finding, command, cwd):
    """The optimizer the analyzer saw stepping one parameter at a time (torch.optim's class from
    its profiler range) made multi-tensor at the job's own calls that make it."""
    from traindx.analyzers import codefix_optim

    optimizer = (finding.evidence or {}).get("optimizer") or {}
    name, gain = optimizer.get("class"), optimizer.get("saving_s")
    if not name or not gain or not any(p.expected_gain_s_per_step == gain for p in finding.prescriptions):
        return []  # the analyzer did not prescribe it (its share too small)
    files = _launch_bound_files(finding, command, cwd)
    edits = [e for f in files for e in codefix_optim.multi_tensor_edits(f, name)]
    if not edits:
        roots = {tree_root([f], command, cwd) for f in files} - {None}
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


def _compile_mode_options(finding, command, cwd, gain=None):
    """mode="reduce-overhead" (CUDA graphs) at the job's torch.compile call where one is found
    (the job's files); in a job that compiles nothing, torch.compile of the model it trains,
    after the line that makes it."""
    from traindx.analyzers import codefix_compile

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


def async_checkpoint_options(finding, command, cwd):
    """A checkpoint written on the critical path by the job's own `torch.save(...)` statement:
    one arm that serializes it into memory at the call and writes the file on a thread (the
    training goes on while the disk writes; the bytes are the step's own state; one write per
    file at a time; the thread joined at exit, so no checkpoint is lost)."""
    from traindx.analyzers import codefix_save

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


def derived_edit_options(finding, command, cwd):
    """The concrete edits the planner builds for a finding from the line it names."""
    out = []
    for build in (host_read_options, async_copy_options, compile_options, async_checkpoint_options):
        try:
            out += build(finding, command, cwd)
        except Exception:  # a line the planner cannot read is no candidate, never a crash
            continue
    return out
