"""Runs a command in a private view of the file system, then becomes it (exec: same pid).

    python -I -S confine_exec.py SPEC_JSON -- command...

Run as a file, never imported from the package (importing traindx would load numpy's thread
pools, and a process with threads cannot enter a user namespace): it imports the standard
library only. SPEC (traindx.fixing.run.confine builds it):

    {"overlays": [[dir, upper, work], ...],   # dir seen as itself + its writes kept in upper
     "tmpfs": [dir, ...],                      # an empty private tmpfs over dir
     "real": [dir, ...],                       # dir bound back as itself, writes real (the run folder)
     "sockets": [path, ...],                   # Unix sockets of processes outside, bound back
     "tops": [[dir, private], ...],            # a folder with mounts below: its private copy
                                               # bound over it (its subfolders overlaid or bound)
     "binds": [path, ...],                     # a mount below a top, bound back as it was
     "readonly": [mount point, ...],           # every other writable mount: read-only
     "full_map": bool}                          # map every uid (root outside) or only ours

Unprivileged: a user namespace (unshare -U) owning a mount namespace (-m); the mounts live as
long as the job's processes and are seen by no one else. Overlays are mounted in place (a
directory over itself), so every path means what it meant; the upper and work folders are
reached through descriptors opened before any mount covers them. `--probe [DIR]` exits 0 when
the whole mechanism works here (an overlay of a temporary folder, its upper in DIR), else 1
with the reason.
"""

import ctypes
import json
import os
import sys
import tempfile
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_CAPBSET_DROP, CAP_SYS_ADMIN = 24, 21
EXIT_SETUP = 126  # the confinement could not be set up: the job did not start

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_namespace(full_map: bool) -> None:
    """A user namespace (our uid mapped to itself, or every uid for root) owning a new mount
    namespace whose mounts propagate nowhere."""
    uid, gid = os.getuid(), os.getgid()
    if full_map:
        _unshare_mapped_by_helper()
    else:
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(user, mount namespaces)")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)


def _unshare_mapped_by_helper() -> None:
    """Every uid mapped to itself: only a process left in the parent namespace, with its
    CAP_SETUID there, may write such a map, so a forked helper writes it for us."""
    me = os.getpid()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_w)
        code = 1
        try:
            if os.read(ready_r, 1) == b"1":
                for kind, own in (("uid", os.getuid()), ("gid", os.getgid())):
                    try:
                        _write(f"/proc/{me}/{kind}_map", "0 0 4294967295\n")
                    except OSError:  # inside a namespace that maps fewer ids: our own
                        _write(f"/proc/{me}/{kind}_map", f"{own} {own} 1\n")
                code = 0
        except OSError as exc:
            sys.stderr.write(f"traindx: confinement: uid map: {exc}\n")
        os._exit(code)
    os.close(ready_r)
    failed = _libc.unshare(CLONE_NEWUSER | CLONE_NEWNS)
    err = ctypes.get_errno()
    os.write(ready_w, b"0" if failed else b"1")
    os.close(ready_w)
    _, status = os.waitpid(pid, 0)
    if failed:
        raise SetupError(f"unshare(user, mount namespaces): {os.strerror(err)}")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SetupError("could not map the user ids")


def _overlay(lower: int, upper: int, work: int, target: str) -> None:
    opts = f"lowerdir=/proc/self/fd/{lower},upperdir=/proc/self/fd/{upper},workdir=/proc/self/fd/{work}"
    try:
        _mount("overlay", target, "overlay", 0, opts + ",userxattr")
    except SetupError:  # a kernel before userxattr (5.11) or an upper fs without user xattrs
        _mount("overlay", target, "overlay", 0, opts)


def _flags_of(where: str | int) -> int:
    """The per-mount flags a remount inside a user namespace must keep (they are locked)."""
    f = os.statvfs(where).f_flag
    pairs = (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (getattr(os, "ST_RELATIME", 4096), MS_RELATIME),
    )
    return sum(ms for st, ms in pairs if f & st)


def set_up(spec: dict[str, Any]) -> list[str]:
    """Every mount of the spec; returns one line per part that could not be made (a folder
    then stays read-only, never written through)."""
    problems: list[str] = []
    flags = os.O_PATH | os.O_DIRECTORY
    # every folder a mount comes from is held first: a top bound over its parent hides it
    fds: list[tuple[str, int, int, int]] = []
    for lower, upper, work in spec.get("overlays", []):
        up_fd, work_fd = os.open(upper, flags), os.open(work, flags)  # ours: missing is an error
        try:
            low_fd = os.open(lower, flags)
        except FileNotFoundError:  # another process's temporary folder, gone since the plan
            os.close(up_fd)
            os.close(work_fd)
            continue
        fds.append((lower, low_fd, up_fd, work_fd))
    tops = [(folder, os.open(private, flags)) for folder, private in spec.get("tops", [])]
    binds = []
    for path in spec.get("binds", []):
        try:
            binds.append((path, os.open(path, flags)))
        except FileNotFoundError:  # gone since the plan
            continue
    # the mounts made read-only, held as they are now (a top may come to cover one's path)
    readonly = []
    for point in spec.get("readonly", []):
        try:
            readonly.append((point, os.open(point, flags)))
        except OSError as exc:
            problems.append(f"{point}: stays writable ({exc.strerror})")
    # the run folder, held before an overlay covers it
    real = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in spec.get("real", [])]
    # a socket seen through an overlay is another inode: connect() would be refused
    sockets = []
    for path in spec.get("sockets", []):
        try:
            sockets.append((path, os.open(path, os.O_PATH)))
        except OSError:
            continue
    for folder, fd in tops:  # parents first: a nested top lands on its parent's copy
        _mount(f"/proc/self/fd/{fd}", folder, None, MS_BIND, None)
        os.close(fd)
    for lower, low_fd, up_fd, work_fd in fds:
        try:
            _overlay(low_fd, up_fd, work_fd, lower)
        except SetupError as exc:
            problems.append(f"{lower}: {exc} (read-only instead)")
            _read_only_bind(low_fd, lower, problems)
    for path, fd in binds:
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
        os.close(fd)
    for path in spec.get("tmpfs", []):
        try:
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        except SetupError as exc:
            problems.append(f"{path}: {exc}")
    # overlays cover the run folder where it lies inside one: bound back, real again
    for path, fd in real:
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
        os.close(fd)
    for path, fd in sockets:
        try:
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND, None)
        except SetupError:
            pass  # it went away meanwhile
        os.close(fd)
    for point, fd in readonly:
        try:
            _mount(None, f"/proc/self/fd/{fd}", None, MS_REMOUNT | MS_BIND | MS_RDONLY | _flags_of(fd), None)
        except (SetupError, OSError) as exc:
            problems.append(f"{point}: stays writable ({exc})")
        os.close(fd)
    for _, *opened in fds:
        for fd in opened:
            os.close(fd)
    return problems


def _read_only_bind(fd: int, target: str, problems: list[str]) -> None:
    """The folder bound over itself read-only (inside a top, its place would be empty)."""
    try:
        _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _flags_of(fd), None)
    except (SetupError, OSError) as exc:
        problems.append(f"{target}: {exc}")


def probe(where: str | None = None) -> int:
    """Exit 0 when a user namespace can mount an overlay here (its upper folder in `where`, the
    --fix folder: overlayfs refuses some file systems as upper, NFS among them), else 1 and
    the reason."""
    with tempfile.TemporaryDirectory(prefix=".traindx-probe-", dir=where) as tmp:
        lower, upper, work = (os.path.join(tmp, p) for p in ("lower", "upper", "work"))
        for p in (lower, upper, work):
            os.mkdir(p)
        pid = os.fork()
        if pid == 0:
            try:
                enter_namespace(False)
                flags = os.O_PATH | os.O_DIRECTORY
                _overlay(os.open(lower, flags), os.open(upper, flags), os.open(work, flags), lower)
                with open(os.path.join(lower, "w"), "w") as f:
                    f.write("x")
                os._exit(0 if os.path.exists(os.path.join(upper, "w")) else 3)
            except BaseException as exc:  # the reason goes to our parent
                sys.stderr.write(f"{exc}\n")
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code == 0 and os.path.exists(os.path.join(lower, "w")):
            sys.stderr.write("the overlay wrote through to the real folder\n")
            return 1
        for name in os.listdir(work):  # overlayfs leaves a mode-0 folder there
            os.chmod(os.path.join(work, name), 0o700)
        return 0 if code == 0 else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:
        return probe(argv[1] if len(argv) > 1 else None)
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: confine_exec.py SPEC_JSON|@SPEC_FILE -- command...\n")
        return 2
    if argv[0].startswith("@"):  # the spec's file (fix_confine writes it beside the arm)
        with open(argv[0][1:], encoding="utf-8") as f:
            spec = json.load(f)
    else:
        spec = json.loads(argv[0])
    command = argv[2:]
    cwd = os.getcwd()
    try:
        enter_namespace(bool(spec.get("full_map")))
        problems = set_up(spec)
        # a job that runs as root inside must not undo the view (umount): no CAP_SYS_ADMIN
        _libc.prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0)
        os.chdir(cwd)  # the working folder again, now through the view
    except (SetupError, OSError) as exc:
        sys.stderr.write(f"traindx: could not confine the job's writes: {exc}; the job was not started\n")
        return EXIT_SETUP
    for line in problems:
        sys.stderr.write(f"traindx: confinement: {line}\n")
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"traindx: cannot start {command[0]}: {exc.strerror}\n")
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
