"""Every repository path and module name the docs cite exists: README.md, BENCHMARKS.md and
docs/*.md, read for backticked spans; in each, a token that starts with one of the repository's
own top-level folders (`derive/steady.py`, `bench/`, `tests/test_x.py::test_y`, `examples/a.py:63`)
must be a file or folder of the checkout, and a dotted name under the package
(`traindx.derive.steady.perturbed_steps`) must resolve to a module (through pyproject.toml's
package-dir) and, when it names something in it, to a name that module defines. Conservative by
design: tokens with a placeholder (`<id>`, `*`, `{a,b}`, `$VAR`, `...`) and paths git ignores
(caches, venvs, run folders: made by running, not shipped) are not checked.

Known misses waiting for a rewrite are listed in .ci/docs_paths_pending.txt (`DOC TOKEN` a line);
an entry there that no longer misses fails too, so the list only shrinks. Prints each missing
path as `DOC:LINE: TOKEN` and exits 1."""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PENDING = ROOT / ".ci" / "docs_paths_pending.txt"
PACKAGE = "traindx"
SPAN = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"[<>*{}$…]|\.\.\.")
SEPARATORS = re.compile(r"[\s()\[\],;='\"|]+")
LINE_SUFFIX = re.compile(r"(::[\w\[\]-]+|:\d+(-\d+)?|#[\w-]+)$")
DOTTED = re.compile(rf"^{PACKAGE}(\.[A-Za-z_]\w*)+$")


def docs() -> list[pathlib.Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


@functools.cache
def tracked() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return tuple(out.splitlines())


@functools.cache
def top_folders() -> frozenset[str]:
    """The repository's own top-level folders: those git tracks files under."""
    return frozenset(line.split("/", 1)[0] for line in tracked() if "/" in line)


def ignored(path: str) -> bool:
    """True for a path git ignores (made by running: a cache, a venv, a run folder)."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


@functools.cache
def package_dirs() -> dict[str, str]:
    """{dotted package: folder} from pyproject.toml's package-dir (`traindx.derive` -> `derive`;
    read with a pattern: tomllib is 3.11+, the project supports 3.10)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    line = next((x for x in text.splitlines() if x.startswith("package-dir")), "")
    return dict(re.findall(r'"([\w.]+)"\s*=\s*"([\w./-]+)"', line))


def module_file(dotted: str) -> pathlib.Path | None:
    """The file of a dotted module name (a module or a package's __init__), or None."""
    dirs = package_dirs()
    base = max((p for p in dirs if dotted == p or dotted.startswith(p + ".")), key=len, default=None)
    if base is None:
        return None
    folder = ROOT / dirs[base] / pathlib.Path(*dotted[len(base) :].split(".")[1:])
    for candidate in (folder.with_suffix(".py"), folder / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def defined_names(path: pathlib.Path) -> frozenset[str] | None:
    """The names a module defines at its top level (None: it resolves names lazily, any goes)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return None if "__getattr__" in names else frozenset(names)


def dotted_exists(token: str) -> bool:
    """A dotted name resolves: its longest module prefix is a file, the next part a name in it
    (or a submodule)."""
    parts = token.split(".")
    for n in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:n]))
        if path is None:
            continue
        if n == len(parts):
            return True
        names = defined_names(path)
        return names is None or parts[n] in names
    return False


def path_exists(token: str) -> bool:
    """A cited path exists: a file or folder (`x/` a folder), `file.py:name` or `x/module.name` a
    name that file defines; or git ignores it."""
    file, _, name = token.partition(":")
    if not name and not token.endswith("/"):
        head, _, tail = token.rpartition("/")
        module, dot, attr = tail.partition(".")
        if dot and not (ROOT / token).exists() and (ROOT / head / f"{module}.py").is_file():
            file, name = f"{head}/{module}.py", attr
    path = ROOT / file
    if token.endswith("/"):
        return path.is_dir() or ignored(token)
    if not path.exists():
        return ignored(file)
    if name and path.suffix == ".py":
        names = defined_names(path)
        return names is None or name.split(".")[0] in names
    return True


def candidates(span: str) -> list[str]:
    """The tokens of a backticked span that cite a repository path or a module name."""
    out = []
    for raw in SEPARATORS.split(span):
        token = raw.strip(".,:;")
        if not token or PLACEHOLDER.search(token):
            continue
        token = LINE_SUFFIX.sub("", token).removeprefix("./").rstrip(".,:")
        if DOTTED.match(token) or (
            "/" in token
            and token.split("/", 1)[0] in top_folders()
            and re.fullmatch(r"[\w./+-]+(:[A-Za-z_][\w.]*)?", token)
        ):
            out.append(token)
    return out


def missing_in(doc: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for span in SPAN.findall(line):
            for token in candidates(span):
                ok = dotted_exists(token) if DOTTED.match(token) else path_exists(token)
                if not ok:
                    found.append((number, token))
    return found


def pending() -> set[tuple[str, str]]:
    if not PENDING.is_file():
        return set()
    rows = (line.split("#", 1)[0].split() for line in PENDING.read_text(encoding="utf-8").splitlines())
    return {(row[0], row[1]) for row in rows if len(row) == 2}


def main() -> int:
    allowed = pending()
    used: set[tuple[str, str]] = set()
    failures = []
    for doc in docs():
        name = doc.relative_to(ROOT).as_posix()
        for number, token in missing_in(doc):
            if (name, token) in allowed:
                used.add((name, token))
            else:
                failures.append(f"{name}:{number}: {token}")
    for name, token in sorted(allowed - used):
        failures.append(f"{PENDING.relative_to(ROOT)}: {name} {token}: no longer missing, remove it")
    for line in failures:
        print(line)
    if failures:
        print(f"{len(failures)} cited path(s) or name(s) that do not exist (docs/ README.md BENCHMARKS.md)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
