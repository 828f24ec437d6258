"""Typed command-line values, defined once for every command line of traindx (`diagnose`,
`kernel-cache`).

Each is an argparse `type=` function: a value that is malformed or meaningless (a rate of 0, a
negative price, an output file in a folder that does not exist, a run folder under /proc) is
refused while the arguments are parsed, as one line and exit 2, before anything is created or
run. Engines then receive values that are already valid.
"""

import argparse
import ast
import importlib
import importlib.util
import math
import os
import pathlib
import re
import stat
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

# file systems that hold no files of ours (writes there fail, or are not files at all)
PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "fusectl",
        "mqueue",
        "hugetlbfs",
        "binfmt_misc",
        "autofs",
    }
)
# the default run root (./runs): a Path, so that argparse does not check it at parse time - it is
# not used when --run-dir is given, and may then be unwritable (a read-only checkout)
DEFAULT_RUNS = pathlib.Path("runs")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: `prog: error: what (see prog --help)`, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def one_line(message: object, limit: int = 600) -> str:
    """An error as the one line the CLI prints (an OS or library message may span several)."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fail(message: str) -> NoReturn:
    raise argparse.ArgumentTypeError(message)


# -- numbers ---------------------------------------------------------------------------------------
def _number(text: str, kind: type[int] | type[float]) -> Any:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        fail(f"{text!r} is not {'a whole number' if kind is int else 'a number'}")
    if kind is float and not math.isfinite(value):
        fail(f"{text!r} is not a finite number")
    return value


def whole(minimum: int, maximum: int | None = None, what: str = "a whole number") -> Callable[[str], int]:
    """int in [minimum, maximum]."""

    def parse(text: str) -> int:
        value: int = _number(text, int)
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            fail(f"{text} must be {what} {bound}")
        return value

    parse.__name__ = "whole number"  # argparse names the type in its own messages
    return parse


def real(
    minimum: float | None = None, above: float | None = None, what: str = "a number"
) -> Callable[[str], float]:
    """finite float >= minimum (or > above)."""

    def parse(text: str) -> float:
        value: float = _number(text, float)
        if minimum is not None and value < minimum:
            fail(f"{text} must be {what} >= {minimum:g}")
        if above is not None and value <= above:
            fail(f"{text} must be {what} > {above:g}")
        return value

    parse.__name__ = "number"
    return parse


positive_int = whole(1)
non_negative_int = whole(0)
positive = real(above=0)
non_negative = real(minimum=0)
pyspy_rate = whole(1, 10000, what="samples per second")
pid = whole(1, 4194304, what="a process id")  # the kernel's pid_max limit


# -- names and formats ---------------------------------------------------------------------------------
def name(text: str) -> str:
    """A label that becomes part of a file or folder name (a node, a rank)."""
    if not NAME.match(text or "") or text in (".", ".."):
        fail(f"{text!r}: use letters, digits and . _ - : @ + (no '/', at most 128)")
    return text


def checked_by(check: Callable[[str], object], text: str) -> str:
    """text, once check(text) accepts it; its ValueError is the one-line refusal."""
    try:
        check(text)
    except ValueError as exc:
        fail(str(exc))
    return text


def torch_profile(text: str) -> str:
    """N (steps from step 3), A-B, off, anomaly (None is the default window)."""
    m = re.fullmatch(r"(\d+)(?:-(\d+))?|off|default|anomaly", text)
    if not m or (m[1] and int(m[1]) == 0 and not m[2]) or (m[2] and int(m[2]) < int(m[1])):
        fail(
            f"{text!r}: give N >= 1 (steps from step 3), A-B with A <= B, anomaly (a window "
            "only on an anomaly) or off"
        )
    return text


def step_marker(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", text):
        fail(f"{text!r}: give MODULE:FUNCTION, e.g. train:log_step")
    return text


# -- paths -------------------------------------------------------------------------------------------
NAME_MAX, PATH_MAX = 255, 4096  # bytes: Linux's limits for one path component and a path


def _path(text: str) -> str:
    """The absolute path of a path argument the OS can take at all (no NUL, no name too long)."""
    if not text:
        fail("an empty path")
    if "\0" in text:
        fail(f"{text!r}: a path cannot hold a NUL character")
    encoded = os.fsencode(text)
    if len(encoded) > PATH_MAX or any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        fail(f"{text[:60]}...: a file name longer than {NAME_MAX} bytes or a path longer than {PATH_MAX}")
    return os.path.abspath(text)


def _filesystem_of(path: str) -> str | None:
    """The file system type of the mount holding `path` (None when unknown)."""
    best: str = ""
    kind: str | None = None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mount = parts[1].replace("\\040", " ")
                    if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(
                        best
                    ):
                        best, kind = mount, parts[2]
    except OSError:
        return None
    return kind


def _writable_folder(folder: str, text: str) -> None:
    """Refuse a folder we could not create files in (a file, a pseudo file system, no write
    permission, a read-only mount)."""
    real_folder = os.path.realpath(folder)
    if _filesystem_of(real_folder) in PSEUDO_FILESYSTEMS:
        fail(
            f"{text}: {real_folder} is on a {_filesystem_of(real_folder)} file system, not a place for files"
        )
    if not os.access(real_folder, os.W_OK | os.X_OK):
        fail(f"{text}: no permission to write in {real_folder}")
    try:
        if os.statvfs(real_folder).f_flag & os.ST_RDONLY:
            fail(f"{text}: {real_folder} is on a read-only file system")
    except OSError:
        pass


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def output_folder(text: str) -> str:
    """A folder to write into: it exists as a folder, or can be created (its nearest existing
    ancestor is a writable folder, not a file)."""
    path = _path(text)
    if os.path.exists(path):
        if not os.path.isdir(path):
            fail(f"{text} is a file, not a folder")
        _writable_folder(path, text)
        return text
    if os.path.islink(path):
        fail(f"{text} is a link to nothing ({os.readlink(path)})")
    ancestor = _existing_ancestor(path)
    if not os.path.isdir(ancestor):
        fail(f"{text}: {ancestor} is a file, not a folder")
    _writable_folder(ancestor, text)
    return text


def folder_path(text: str) -> str:
    """A folder that is read if it exists (nothing on its path is a file, nor on a pseudo file
    system); it need not be writable."""
    path = _path(text)
    ancestor = _existing_ancestor(path)
    if not os.path.isdir(ancestor):
        fail(f"{text}: {ancestor} is a file, not a folder")
    kind = _filesystem_of(os.path.realpath(ancestor))
    if kind in PSEUDO_FILESYSTEMS:
        fail(f"{text}: on a {kind} file system, not a place for files")
    return text


def output_file(text: str) -> str:
    """A file to write: not a folder, in a folder that exists and takes files."""
    path = _path(text)
    if os.path.isdir(path):
        fail(f"{text} is a folder; give a file path")
    if _written_through(path):  # /dev/stdout, /dev/null, a FIFO: written into as `>` would
        if not os.access(path, os.W_OK):
            fail(f"{text}: no permission to write it")
        return text
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        fail(
            f"{text}: the folder {folder} does not exist"
            if not os.path.lexists(folder)
            else f"{text}: {folder} is not a folder"
        )
    if os.path.exists(path) and not os.access(path, os.W_OK):
        fail(f"{text}: no permission to write it")
    _writable_folder(folder, text)
    return text


def _written_through(path: str) -> bool:
    """An existing link, character device or FIFO (traindx.common.atomic writes through it)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return os.path.islink(path) or stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)


def existing_folder(text: str) -> str:
    _path(text)
    if not os.path.exists(text):
        fail(f"no such folder: {text}")
    if not os.path.isdir(text):
        fail(f"{text} is a file, not a folder")
    if not os.access(text, os.R_OK | os.X_OK):
        fail(f"{text}: no permission to read it")
    return text


def existing_file(text: str) -> str:
    _path(text)
    if not os.path.exists(text):
        fail(f"no such file: {text}")
    if os.path.isdir(text):
        fail(f"{text} is a folder; give a file")
    if not os.access(text, os.R_OK):
        fail(f"{text}: no permission to read it")
    return text


def _module_docstring(module_name: str) -> str | None:
    """A module's docstring read from its source, without importing it: `diagnose -- cmd` builds
    this list at every start, and importing each subcommand's module would import pandas and the
    analyzers before the job starts."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return importlib.import_module(module_name).__doc__
    with open(spec.origin, encoding="utf-8") as source:
        return ast.get_docstring(ast.parse(source.read()))


def subcommand_list(commands: Mapping[str, str]) -> str:
    """The epilog of a parser with subcommands: one line each, from each module's docstring."""
    width = max(len(n) for n in commands)
    lines = []
    for cmd, module_name in commands.items():
        doc = (_module_docstring(module_name) or "").strip().split("\n\n")[0]
        first = re.split(r"(?<=\w)[.:](?:\s|$)", " ".join(doc.split()), maxsplit=1)[0]
        lines.append(f"  {cmd.ljust(width)}  {first}")
    return "\n".join(lines)
