"""Every arm of `diagnose --fix` writes only into its own folder.

The job runs several times (the baseline, each candidate, repeats); run in the user's own
folder, every run would overwrite the user's outputs (checkpoints, result files) with an arm's
that may not be kept. So each arm runs in a private view of the file system:

- **namespace** (where the kernel allows unprivileged user namespaces with overlayfs, Linux
  5.11 and later; most desktops, CI runners and cluster nodes): the job starts through
  profiler/confine_exec.py in a user namespace owning a mount namespace of its own; every
  writable folder is an overlay mounted in place (the folder as it was, read-only below, the
  arm's writes kept in `<arm>/captured/`), /dev/shm an empty private tmpfs, what cannot be
  overlaid read-only (a write there fails: refused, never made), and the --fix folder bound back
  as itself (the arms' evidence is real). Paths mean what they meant: no copy, no link.
- **copy** (no user namespace here): the arm runs in a private copy of its working folder
  (reflinked where the file system can, real copies otherwise; never a link back), with a
  private TMPDIR; what it could still write elsewhere (an absolute path) is checked after the
  arm: the user's folder is compared file by file with its state before the first arm, and any
  change is said.

Network, databases and other machines cannot be confined: `notice` says so before the first
arm, with how many times the job will run. When --fix ends every arm's captured writes are
deleted, the kept arm's first copied to where the job wrote them on request (`keep_outputs`).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from traindx.common.copying import clone_or_copy
from traindx.common.errors import UserError
from traindx.fixing.run.captured import (  # noqa: F401  (re-exported: the arms' files live there)
    CAPTURED,
    COPY_LIMIT_BYTES,
    LINKED_DIRS,
    MAX_FILES,
    captured_files,
    changes,
    copy_tree,
    keep_captured,
    remove,
    snapshot,
)
from traindx.fixing.run.model import Say, with_options
from traindx.profiler.launcher import SHIM_DIR

EXEC = os.path.join(os.path.dirname(SHIM_DIR), "confine_exec.py")
# file systems that hold no user files: never overlaid, never made read-only
SPECIAL_FS = {
    "proc",
    "sysfs",
    "devtmpfs",
    "devpts",
    "cgroup",
    "cgroup2",
    "mqueue",
    "securityfs",
    "debugfs",
    "tracefs",
    "pstore",
    "bpf",
    "configfs",
    "fusectl",
    "hugetlbfs",
    "binfmt_misc",
    "autofs",
    "efivarfs",
    "rpc_pipefs",
    "nsfs",
    "selinuxfs",
}
# runtime folders hold the sockets and pid files of the machine's services: left read-only
# (a socket seen through an overlay refuses connections)
RUNTIME_DIRS = {"/run", "/var/run", "/var/lock"}
SOCKET_SCAN_ENTRIES = 20000
# a writable folder outside the working one with a mount below (/tmp): its own files are copied
# for each arm up to this size, else they stay read-only in the view (said before the first arm)
TOP_LIMITS = (256 * 1024**2, 10000)  # bytes, files
MAX_LISTED = 50  # fix.json lists at most this many of the kept arm's outputs

_probed: dict[str, str | None] = {}


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    writable: bool


def mounts(path: str = "/proc/self/mountinfo") -> list[Mount]:
    """The mounts this process sees, the visible one per mount point (the last mounted)."""
    out: dict[str, Mount] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or not tail:
            continue
        point = fields[4].encode().decode("unicode_escape")
        out.pop(point, None)
        out[point] = Mount(point, tail[0], "ro" not in fields[5].split(","))
    return list(out.values())


def _under(path: str, root: str) -> bool:
    return path != root and path.startswith(root.rstrip("/") + "/")


@dataclass
class Zones:
    """What the view makes of each folder: overlaid, private tmpfs, made read-only."""

    overlays: list[str] = field(default_factory=list)
    tmpfs: list[str] = field(default_factory=list)
    readonly: list[str] = field(default_factory=list)
    sockets: list[str] = field(default_factory=list)
    # folders covered child by child (a mount below them): a file directly in one is read-only,
    # unless the folder is a top: the working folder or one below it, whose own files get a
    # private copy bound over it (its mounts below bound back as they were: binds)
    partial: list[str] = field(default_factory=list)
    tops: list[str] = field(default_factory=list)
    binds: list[str] = field(default_factory=list)


def plan_zones(table: Sequence[Mount], tree: str | None = None) -> Zones:
    """Cover the file system with in-place overlays: a folder with no mount below it is one
    overlay; a folder with mounts below is covered child by child (its own files stay
    read-only). Special file systems are left alone; a tmpfs on one (/dev/shm) is replaced by a
    private tmpfs; every other writable mount is made read-only under the overlays."""
    zones = Zones()
    special = [m.point for m in table if m.fstype in SPECIAL_FS]
    visible = [m for m in table if not any(m.point == s or _under(m.point, s) for s in special)]
    # shared memory (/dev/shm) lies on a special file system: an empty one of the arm's own
    zones.tmpfs = [
        m.point
        for m in table
        if m.fstype == "tmpfs" and m.writable and m not in visible and os.path.basename(m.point) == "shm"
    ]

    def cover(path: str) -> None:
        if path in RUNTIME_DIRS:
            return
        inside = [m for m in table if _under(m.point, path)]
        if not inside:
            zones.overlays.append(path)
            return
        zones.partial.append(path)
        in_tree = tree is not None and (path == tree or _under(path, tree))
        # the working folder's own files get a private copy; so do those of any other writable
        # folder above a mount (/tmp with a tmpfs below it), when they are few and small
        top = (
            path != "/"
            and _writable(table, path)
            and _small_top(path, *((COPY_LIMIT_BYTES, MAX_FILES) if in_tree else TOP_LIMITS))
        )
        if top:
            zones.tops.append(path)
            zones.sockets.extend(_special_entries(path))
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            here = next((m for m in table if m.point == entry.path), None)
            if (
                entry.path in special
                or (here is not None and not here.writable)
                or any(entry.path == s or _under(entry.path, s) for s in special)
            ):
                if top:
                    zones.binds.append(entry.path)
                continue
            cover(entry.path)

    cover("/")
    zones.readonly = [m.point for m in visible if m.writable and m.point not in zones.overlays]
    found = sockets_in([tempfile.gettempdir(), "/tmp", "/var/tmp", os.environ.get("XDG_RUNTIME_DIR", "")])
    zones.sockets = sorted(set(zones.sockets) | set(found))
    return zones


def _writable(table: Sequence[Mount], path: str) -> bool:
    """Whether the mount that holds path is writable (a read-only one stays as it is)."""
    holder = max(
        (m for m in table if m.point == path or _under(path, m.point) or m.point == "/"),
        key=lambda m: len(m.point),
        default=None,
    )
    return holder is None or holder.writable


def _special_entries(folder: str) -> list[str]:
    """Sockets and pipes directly in a top: a placeholder in its copy, the real one bound back."""
    try:
        with os.scandir(folder) as entries:
            return [
                e.path
                for e in entries
                if not (e.is_dir(follow_symlinks=False) or e.is_file(follow_symlinks=False) or e.is_symlink())
            ]
    except OSError:
        return []


def _small_top(folder: str, limit: int = COPY_LIMIT_BYTES, max_files: int = MAX_FILES) -> bool:
    """True when the files directly in folder are few and small enough to copy for each arm."""
    total, count = 0, 0
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
                    count += 1
    except OSError:
        return False
    return total <= limit and count <= max_files


def make_top(folder: str, private: str) -> None:
    """The private copy of a top: its files cloned or copied, its links as they are, an empty
    folder in place of each subfolder (an overlay or a bind lands there in the view)."""
    os.makedirs(private)
    state: dict[str, list[int]] = {}  # the copies as made: what differs after the arm, it wrote
    with os.scandir(folder) as entries:  # closed also when a copy fails (a full disk)
        for entry in entries:
            dst = os.path.join(private, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), dst)
            elif entry.is_dir(follow_symlinks=False):
                os.mkdir(dst)
            elif entry.is_file(follow_symlinks=False):
                clone_or_copy(entry.path, dst)
            else:  # a socket, a pipe: the real one is bound back on this placeholder
                os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            if not entry.is_dir(follow_symlinks=False):
                made = os.lstat(dst)
                state[entry.name] = [made.st_size, made.st_mtime_ns]
    with open(private + ".json", "w", encoding="utf-8") as f:
        json.dump(state, f)


def sockets_in(folders: Iterable[str], limit: int = SOCKET_SCAN_ENTRIES) -> list[str]:
    """The Unix sockets in the temporary folders (a Ray cluster's, an X server's, a PMIx
    server's), bound back into the view so the job can still connect to them: those the kernel
    lists as bound (/proc/net/unix: every listening path, however deep), else a bounded walk."""
    roots = [os.path.realpath(f) for f in dict.fromkeys(folders) if f and os.path.isdir(f)]
    bound = _bound_sockets()
    if bound is not None:
        return sorted(p for p in bound if any(_under(p, r) for r in roots) and _is_socket(p))
    return _walk_for_sockets(roots, limit)


def _bound_sockets() -> set[str] | None:
    """The paths of the Unix sockets bound in this network namespace, or None where the kernel
    does not list them."""
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="surrogateescape") as table:
            rows = table.read().splitlines()[1:]
    except OSError:
        return None
    return {
        fields[7]
        for fields in (row.split(None, 7) for row in rows)
        if len(fields) == 8 and fields[7].startswith("/")
    }


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _walk_for_sockets(roots: list[str], limit: int) -> list[str]:
    """The sockets found walking the folders, at most `limit` entries seen."""
    out, seen, queue = [], 0, list(roots)
    while queue and seen < limit:
        folder = queue.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if stat.S_ISSOCK(mode):
                out.append(entry.path)
            elif stat.S_ISDIR(mode):
                queue.append(entry.path)
    return sorted(out)


def probe(where: str | None = None) -> str | None:
    """None when an unprivileged user namespace can mount an overlay whose writes go to a
    folder in `where` (the --fix folder), else why not."""
    key = os.path.realpath(where) if where else ""
    if key not in _probed:
        if not sys.platform.startswith("linux"):
            _probed[key] = "not Linux"
        else:
            try:
                proc = subprocess.run(
                    [sys.executable, "-I", "-S", EXEC, "--probe", *([key] if key else [])],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                reason = None if proc.returncode == 0 else (proc.stderr.strip() or "the probe failed")
            except (OSError, subprocess.TimeoutExpired) as exc:
                reason = str(exc)
            _probed[key] = " ".join((reason or "").split())[:300] or None
    return _probed[key]


class Confiner:
    """Makes each arm's view (namespace) or private copy (copy) and cleans up after --fix."""

    def __init__(self, root: str, cwd: str, method: str | None = None, why: str | None = None) -> None:
        self.root, self.cwd = os.path.realpath(root), os.path.realpath(cwd)
        self.why = why
        if method is None:
            os.makedirs(self.root, exist_ok=True)
            self.why = probe(self.root)
            method = "namespace" if self.why is None else "copy"
        self.method = method
        self.arms: list[str] = []
        self.before: dict[str, tuple[int, int]] | None = None
        self._views: dict[str, list[str]] = {}

    # -- before the first arm ---------------------------------------------------------------
    def notice(self, runs: int) -> list[tuple[str, str]]:
        """What the user is told before the first arm runs: (kind, line)."""
        if self.method == "namespace":
            how = (
                "each arm's file writes are confined to its own folder (a private overlay of "
                "every writable folder; a write where no overlay can go is refused)"
            )
        else:
            how = (
                f"this machine allows no user namespace ({self.why}): each arm runs in a "
                f"private copy of {self.cwd}; a write to an absolute path outside it is not "
                f"confined (a kernel-cache warm-up writes the job's cache itself; after each "
                f"arm, {self.cwd} is checked for changes)"
            )
        lines = []
        if self.method == "namespace":
            table = mounts()
            zones = plan_zones(table, self.cwd)
            mounted = [p for p in zones.partial if p != "/" and p not in zones.tops and _writable(table, p)]
            if mounted:
                lines.append(
                    (
                        "warning",
                        f"{', '.join(mounted[:3])} holds a mount below it and too many files to "
                        "copy for each arm: a file the job writes directly in it is refused "
                        "(read-only in the view, a job may fail there and not bare); its "
                        "subfolders are confined as usual",
                    )
                )
        return [
            (
                "info" if self.method == "namespace" else "warning",
                f"--fix runs the job up to {runs} times; {how}; the kept arm's writes are kept "
                "on request (--keep-outputs)",
            ),
            (
                "warning",
                "not confined: what the job sends over the network (a database, a remote store, "
                "an experiment tracker, a queue) and processes it starts on other machines "
                "happen at each run",
            ),
            *lines,
        ]

    # -- one arm -----------------------------------------------------------------------------
    def wrap_runner(self, run_job: Callable[..., int | None], say: Say) -> Callable[..., int | None]:
        """run_job, each call run in the arm's private view."""

        def confined(command: list[str], run_dir: str, options: Any, **kw: Any) -> int | None:
            try:
                arm_options = self.prepare(run_dir, options, say)
            except OSError as exc:  # a full disk, an unreadable file of the working folder
                raise UserError(
                    f"--fix: could not prepare the private view of {run_dir}: "
                    f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}; "
                    "the arm was not started"
                ) from None
            try:
                return run_job(command, run_dir, arm_options, **kw)
            finally:
                self.after(run_dir, say)

        # what runs before an arm in its name (the kernel-cache warm-up) runs in its view too
        confined.view_for = self.view_for  # type: ignore[attr-defined]
        return confined

    def view_for(self, run_dir: str) -> list[str]:
        """The argv prefix that runs a command in run_dir's private view (made once: the arm's
        job then sees what ran before it there, e.g. the kernels a warm-up compiled); [] in copy
        mode (a warm-up then writes the cache itself, as said before the first arm)."""
        if self.method != "namespace":
            return []
        if run_dir not in self._views:
            self._views[run_dir] = self._view(run_dir)
        return self._views[run_dir]

    def prepare(self, run_dir: str, options: Any, say: Say) -> Any:
        self.arms.append(run_dir)
        if self.method == "namespace":
            return with_options(options, wrap=self.view_for(run_dir), caller_fds=False)
        if self.before is None:
            self.before = snapshot(self.cwd, exclude=[self.root])
        cwd = os.path.realpath(options.cwd or self.cwd)
        copy = os.path.join(run_dir, CAPTURED, "tree")
        copy_tree(self.cwd, copy, exclude=[self.root])
        tmp = os.path.join(run_dir, CAPTURED, "tmp")
        os.makedirs(tmp, exist_ok=True)
        env = dict(options.extra_env or {}, TMPDIR=tmp)
        inside = cwd == self.cwd or _under(cwd, self.cwd)
        new_cwd = os.path.join(copy, os.path.relpath(cwd, self.cwd)) if inside else cwd
        return with_options(options, cwd=new_cwd, extra_env=env, caller_fds=False)

    def _view(self, run_dir: str) -> list[str]:
        zones = plan_zones(mounts(), self.cwd)
        captured = os.path.join(run_dir, CAPTURED)
        overlays, where, tops = [], {}, []
        for i, folder in enumerate(zones.tops):
            private = os.path.join(captured, f"top-{i}")
            make_top(folder, private)
            tops.append([folder, private])
            where[f"top-{i}"] = folder
        for i, path in enumerate(zones.overlays):
            upper, work = os.path.join(captured, str(i), "upper"), os.path.join(captured, str(i), "work")
            os.makedirs(upper)
            os.makedirs(work)
            overlays.append([path, upper, work])
            where[str(i)] = path
        with open(os.path.join(captured, "zones.json"), "w", encoding="utf-8") as f:
            json.dump(where, f, indent=1)
        spec = {
            "overlays": overlays,
            "tmpfs": zones.tmpfs,
            "real": [self.root],
            "readonly": zones.readonly,
            "sockets": zones.sockets,
            "tops": tops,
            "binds": zones.binds,
            "full_map": os.getuid() == 0,
        }
        # the spec goes in a file: as one argument it can pass the kernel's 128 kB limit on a
        # single argument (a machine with thousands of sockets under its temporary folders)
        view = os.path.join(captured, "view.json")
        with open(view, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        return [sys.executable, "-I", "-S", EXEC, "@" + view, "--"]

    def after(self, run_dir: str, say: Say) -> None:
        """Overlay work folders removed; in copy mode, the user's folder checked."""
        captured = os.path.join(run_dir, CAPTURED)
        for name in os.listdir(captured) if os.path.isdir(captured) else ():
            work = os.path.join(captured, name, "work")
            if os.path.isdir(work):
                remove(work)
            upper = os.path.join(captured, name, "upper")
            if os.path.isdir(upper) and not os.listdir(upper):
                remove(os.path.join(captured, name))
        if self.method == "copy":
            remove(os.path.join(captured, "tree"))
            if self.before is not None:
                changed = changes(self.before, snapshot(self.cwd, exclude=[self.root]))
                if changed:
                    say(
                        "warning",
                        f"{os.path.basename(run_dir)} changed {len(changed)} file(s) in {self.cwd} "
                        f"through an absolute path (not confinable here): {', '.join(changed[:5])}",
                    )

    # -- after the last arm ------------------------------------------------------------------
    def finish(self, kept: str | None, keep_outputs: bool, say: Say) -> dict[str, Any]:
        """Every arm's captured writes deleted (they are the job's outputs, its configs and
        tokens among them: none stays in the --fix folder); the kept arm's first listed and,
        with keep_outputs, copied to where the job wrote them. Returns fix.json's
        "confinement"."""
        out: dict[str, Any] = {"method": self.method, "why": self.why, "kept_outputs": None}
        files = captured_files(kept) if kept else []
        if kept:
            out["outputs"] = [real for real, _ in files[:MAX_LISTED]]
            out["outputs_count"] = len(files)
        if kept and keep_outputs:
            out["kept_outputs"] = keep_captured(files)
            say(
                "info",
                f"--keep-outputs: the writes of {os.path.basename(kept)} copied into place "
                f"({len(out['kept_outputs'])} file(s))",
            )
        elif files:
            shown = ", ".join(real for real, _ in files[:3]) + (", ..." if len(files) > 3 else "")
            say(
                "info",
                f"the writes of {os.path.basename(kept or '')} ({len(files)} file(s): {shown}) were "
                "discarded with every other arm's; --keep-outputs copies the kept arm's into place",
            )
        for arm in self.arms:
            remove(os.path.join(arm, CAPTURED))
        return out
