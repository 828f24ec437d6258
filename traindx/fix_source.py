"""Source patches for a `--fix` candidate, without touching the user's files: the job's own
source tree is copied to a scratch folder inside the fix folder, the change is made there, the
candidate runs from the copy, and `fix.patch` (a unified diff, paths relative to the tree's root,
`git apply`-able there) is what the user applies after the proof.

The tree: the job's working directory, or the folder of its script when the patched file lies
outside the working directory. Python files and small files are copied; large files (data,
checkpoints) are linked, so the copy stays cheap. Version-control, virtual-environment, cache and
run folders are left out.
"""
import difflib
import os
import shutil

SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", "node_modules",
             ".pytest_cache", ".mypy_cache", "wandb", ".cache"}
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


def resolve_edit(edit):
    """Check an edit against the file as it is: {"file", "line", "before_line", "after_line"}.
    The line number is corrected when the text moved; raises PatchError when it is not there."""
    path = edit["file"]
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines(keepends=True)
    except OSError as exc:
        raise PatchError(f"cannot read {path}: {exc.strerror}") from None
    before = edit["before_line"].rstrip("\n")
    line = int(edit.get("line") or 0)
    if 1 <= line <= len(lines) and lines[line - 1].rstrip("\r\n") == before:
        return dict(edit, line=line)
    matches = [i + 1 for i, text in enumerate(lines) if text.rstrip("\r\n") == before]
    if len(matches) == 1:
        return dict(edit, line=matches[0])
    raise PatchError(f"{path}:{line} no longer reads `{before.strip()}`"
                     + (f" ({len(matches)} matching lines)" if matches else ""))


def patched_text(path, edits):
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    for e in edits:
        old = lines[e["line"] - 1]
        ending = old[len(old.rstrip("\r\n")):]
        lines[e["line"] - 1] = e["after_line"].rstrip("\n") + ending
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
        out.extend(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=f"a/{rel}", tofile=f"b/{rel}", n=3))
    text = "".join(out)
    return text if text.endswith("\n") or not text else text + "\n"


def copy_tree(root, dest, exclude=()):
    """Copy the job's tree (small files copied, big ones linked). Returns the number of files."""
    exclude = {os.path.realpath(p) for p in exclude if p}
    count = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                   and os.path.realpath(os.path.join(folder, d)) not in exclude]
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
        if os.path.islink(copy):
            os.unlink(copy)
        with open(copy, "w", encoding="utf-8") as f:
            f.write(text)
    return diff


def rebase_command(command, root, dest):
    """The command with absolute paths inside the tree pointed at the copy."""
    out = []
    for token in command:
        if os.path.isabs(token) and _inside(token, root):
            token = os.path.join(dest, os.path.relpath(os.path.realpath(token), root))
        out.append(token)
    return out


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
    import ast

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == kernel:
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and (
                        getattr(dec.func, "attr", None) == "autotune"
                        or getattr(dec.func, "id", None) == "autotune"):
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
        new_list = "[" + ", ".join(line[e.col_offset:e.end_col_offset] for e in keep) + "]"
        after = line[:node.col_offset] + new_list + line[node.end_col_offset:]
        return {"file": path, "line": node.lineno, "before_line": line, "after_line": after,
                "before": line.strip(), "after": after.strip()}
    return None


def python_files(root, limit=3000):
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        out += [os.path.join(folder, n) for n in files if n.endswith(".py")]
        if len(out) > limit:
            break
    return out
