"""Source patches for a `--fix` candidate, decided without touching any file: the edits resolved
against the job's source and checked to hold, the patched text and `fix.patch` (a unified diff,
paths relative to the tree's root, `git apply`-able there), the tree to copy (the job's working
directory, or the folder of its script when the patched file lies outside it) and the command and
PYTHONPATH pointed at the copy. The copy itself is made by traindx.fixing.run.scratch.

The job's own source is also read here to place an edit: its argparse flags, the guard that
makes a cost periodic, a Triton kernel's autotune key. The edits the planner builds from the line
a finding names are traindx.fixing.plan.derived's.
"""

from __future__ import annotations

import ast
import difflib
import os
import textwrap
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

from traindx.analyzers.codefix import keyword_sources as keyword_sources  # fix_options reads it here
from traindx.analyzers.core.evidence import python_files as python_files  # the planner reads it here

# an edit in its resolved form: {"file", "line", "last_line", "before", "after", "op", ...}
Edit = dict[str, Any]


class FlagSpec(TypedDict):
    """A flag of the job's own parser: as spelled (`--workers`), and its default."""

    flag: str
    default: Any


class PatchError(Exception):
    pass


def inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def script_dir(command: Sequence[str], cwd: str) -> str | None:
    for token in command[:4]:
        if token.endswith(".py") and not token.startswith("-"):
            return os.path.dirname(os.path.abspath(os.path.join(cwd, token)))
    return None


def tree_root(files: Sequence[str], command: Sequence[str], cwd: str) -> str | None:
    """The folder to copy: the cwd when it holds every patched file, else the script's folder."""
    for root in (cwd, script_dir(command, cwd)):
        if root and all(inside(f, root) for f in files):
            return os.path.realpath(root)
    return None


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines(keepends=True)
    except OSError as exc:
        raise PatchError(f"cannot read {path}: {exc.strerror}") from None


def normalized(edit: Mapping[str, Any]) -> Edit:
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


def resolve_edit(edit: Mapping[str, Any]) -> Edit:
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


def _holds(region: str, before: str) -> bool:
    """True when the region holds the code `before` (its layout over lines aside)."""
    if not before.strip():
        return False
    return before.strip() in region or " ".join(before.split()) in " ".join(region.split())


def _indent(text: str) -> str:
    return text[: len(text) - len(text.lstrip())]


def _apply_one(lines: list[str], e: Mapping[str, Any]) -> list[str]:
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


def patched_text(path: str, edits: Iterable[Mapping[str, Any]]) -> str:
    lines = _read_lines(path)
    for e in sorted((normalized(e) for e in edits), key=lambda e: -e["line"]):
        lines = _apply_one(lines, e)
    return "".join(lines)


def _bound_names(tree: ast.AST) -> dict[str, set[str]]:
    """{scope: the names it binds}: the module (""), each function and class by its dotted path;
    assignments, for/with/except/match targets, imports, defs, a function's parameters."""
    out: dict[str, set[str]] = {"": set()}

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.setdefault(scope, set()).add(child.name)
                inner = f"{scope}.{child.name}" if scope else child.name
                names = out.setdefault(inner, set())
                if not isinstance(child, ast.ClassDef):
                    names.update(a.arg for a in ast.walk(child.args) if isinstance(a, ast.arg))
                visit(child, inner)
                continue
            name = None
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                name = child.id
            elif isinstance(child, ast.alias) and child.name != "*":
                name = child.asname or child.name.split(".")[0]
            elif isinstance(child, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
                name = child.name
            if name:
                out.setdefault(scope, set()).add(name)
            visit(child, scope)

    visit(tree, "")
    return out


def check_bindings(path: str, edits: Iterable[Mapping[str, Any]]) -> None:
    """PatchError when the edits leave a name unassigned in a scope that assigned it (a statement
    moved into a thread's lambda, say): the program would then read a name it never bound, or
    another one of the same name. A patch may add bindings, never take one away."""
    if not path.endswith(".py"):
        return
    with open(path, encoding="utf-8") as f:
        old = f.read()
    try:
        before, after = _bound_names(ast.parse(old)), _bound_names(ast.parse(patched_text(path, edits)))
    except SyntaxError:
        return  # the parse check says so (make_scratch)
    for scope, names in before.items():
        lost = sorted(names - after.get(scope, set()))
        if lost:
            where = f"{scope}()" if scope else "the module"
            raise PatchError(
                f"the edit of {os.path.basename(path)} leaves {', '.join(lost)} unassigned in {where}, "
                "which assigned it: the program's meaning would change"
            )


def unified_diff(root: str, edits: Iterable[Mapping[str, Any]]) -> str:
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


def rebase_command(command: Sequence[str], root: str, dest: str, cwd: str | None = None) -> list[str]:
    """The command with paths inside the tree pointed at the copy: absolute ones, and (given
    the job's cwd) relative ones that name a file there, made absolute."""
    out = []
    for token in command:
        path = (
            token
            if os.path.isabs(token)
            else (os.path.join(cwd, token) if cwd and not token.startswith("-") else None)
        )
        if path and (os.path.isabs(token) or os.path.isfile(path)) and inside(path, root):
            token = os.path.join(dest, os.path.relpath(os.path.realpath(path), root))
        out.append(token)
    return out


def runs_a_script(command: Sequence[str]) -> bool:
    """True when the command runs a Python file (`python x.py`, `torchrun ... x.py`), not a
    module (`python -m pkg.train`) or a shell script."""
    for token in command[:6]:
        if token == "-m":
            return False
        if token.endswith(".py") and not token.startswith("-"):
            return True
    return False


def rebase_pythonpath(value: str | None, root: str, dest: str) -> str | None:
    if not value:
        return value
    parts = []
    for p in value.split(os.pathsep):
        if p and os.path.isabs(p) and inside(p, root):
            p = os.path.join(dest, os.path.relpath(os.path.realpath(p), root))
        parts.append(p)
    return os.pathsep.join(parts)


# -- Triton: an autotune key that changes every step ------------------------------------------------
def _autotune_key_node(tree: ast.AST, kernel: str | None) -> ast.List | ast.Tuple | None:
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


def autotune_key_edit(kernel: str | None, drop: Iterable[str], search_files: Iterable[str]) -> Edit | None:
    """The edit that takes the changing arguments out of `@triton.autotune(key=[...])` of
    `kernel`, found in the first of `search_files` that defines it; None when not found."""
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
def _parse(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None


def argparse_flags(path: str) -> dict[str, FlagSpec]:
    """{dest: {"flag": "--workers", "default": value or None}} of every
    `parser.add_argument("--x", ...)` in a Python file (argparse and HfArgumentParser-less
    scripts alike); {} when the file does not parse."""
    tree = _parse(path)
    out: dict[str, FlagSpec] = {}
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
        named = kw.get("dest")
        dest = str(named.value) if isinstance(named, ast.Constant) else longs[0][2:].replace("-", "_")
        given = kw.get("default")
        try:
            default = ast.literal_eval(given) if given is not None else None
        except ValueError:
            default = None
        out[dest] = {"flag": longs[0], "default": default}
    return out


def flag_of(expression: str | None, flags: Mapping[str, FlagSpec]) -> FlagSpec | None:
    """The job's flag an expression reads (`a.workers`, `int(args.num_workers)`), else None."""
    try:
        node = ast.parse((expression or "").strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        node = node.args[0]  # int(args.x), max(...) is not a flag
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr in flags:
        return flags[node.attr]
    return None


def _modulo_guards(path: str, line: int) -> Iterator[tuple[ast.If, ast.BinOp]]:
    """(if, `<expr> % <k>`) for each `if` whose body holds path:line and whose test takes a
    modulo: the guards that make the line run every k-th time."""
    tree = _parse(path)
    for node in ast.walk(tree) if tree is not None else ():
        if not isinstance(node, ast.If) or not node.body:
            continue
        if not node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
            continue
        for sub in ast.walk(node.test):
            if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mod):
                yield node, sub


def periodic_flag(path: str, line: int, flags: Mapping[str, FlagSpec]) -> FlagSpec | None:
    """The job's flag that sets how often the code at path:line runs: an enclosing
    `if <step> % args.every == ...:` (or `if (i + 1) % args.k == 0`), else None."""
    best = None
    for node, mod in _modulo_guards(path, line):
        if (
            isinstance(mod.right, ast.Attribute)
            and mod.right.attr in flags
            and (best is None or node.lineno > best[0])
        ):
            best = (node.lineno, flags[mod.right.attr])
    return best[1] if best else None


def periodic_literal(path: str, line: int) -> tuple[int, str, int] | None:
    """(the guard's line, its `<expr> % k` text, k) of an enclosing `if <expr> % k == ...:` with
    a literal k >= 2 (the innermost), else None: a cost that runs every k-th step by a number
    written in the job's own file."""
    best = None
    for node, mod in _modulo_guards(path, line):
        if (
            isinstance(mod.right, ast.Constant)
            and type(mod.right.value) is int
            and mod.right.value >= 2
            and mod.lineno == mod.end_lineno == node.lineno
            and (best is None or node.lineno > best[0])
        ):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = ast.get_source_segment(f.read(), mod)
            if text:
                best = (node.lineno, text, int(mod.right.value))
    return best


# -- edits the fix planner builds from the line a finding names ------------------------------------
def job_script_files(command: Sequence[str], cwd: str) -> list[str]:
    """The Python scripts the command runs (its first tokens), as absolute paths."""
    out = []
    for token in command[:6]:
        if token.endswith(".py") and not token.startswith("-"):
            path = os.path.abspath(os.path.join(cwd, token))
            if os.path.isfile(path):
                out.append(path)
    return out


def named_sites(value: object, depth: int = 0) -> list[tuple[str, int]]:
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
