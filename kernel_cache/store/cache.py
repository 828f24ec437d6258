"""FA4's persistent compile cache on disk: where it is, which environment it serves, what is in it.

Layout (flash_attn/cute/cache_utils.py): `<cache dir>/<fingerprint>/<kernel family>/<sha256>.o`,
with a `.lock` file beside each entry. The fingerprint hashes the Python minor version, the
cutlass and tvm_ffi versions and every `flash_attn/cute/*.py` source, so a folder only serves the
exact FA4 + cutlass + Python that wrote it. Nothing here imports FA4 or cutlass (seconds each):
versions come from the package metadata, sources from the installed files.
"""

import functools
import getpass
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import stat
import struct
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from traindx.common.atomic import LinkRefused, replace_with, write_json
from traindx.common.errors import UserError

ENABLE_VAR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
DIR_VAR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
METADATA_FILE = "traindx-kernel-cache.json"  # ours, in the fingerprint folder; FA4 ignores it
FINGERPRINT_RE = re.compile(r"^[0-9a-f]{64}$")
ENTRY_SUFFIX = ".o"
# the files FA4 writes in a family folder (cache_utils: <sha256>.o, <sha256>.lock, and
# .<sha256>.<pid>.tmp.o while it exports); a family folder's name (get_jit_cache's)
FA4_FILE_RE = re.compile(r"^(?:[0-9a-f]{64}\.(?:o|lock)|\.[0-9a-f]{64}\.\d+\.tmp\.o)$")
FAMILY_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
ELF_HEADER = 64  # an ELF64 header's size


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """FA4's own rule: $FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, else <tmp>/<user>/flash_attention_cute_dsl_cache."""
    environ = os.environ if environ is None else environ
    if environ.get(DIR_VAR):
        return Path(environ[DIR_VAR])
    return Path(tempfile.gettempdir()) / getpass.getuser() / "flash_attention_cute_dsl_cache"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder to use, refused (UserError, one line) when someone else controls it."""
    path = Path(cache_dir).expanduser().absolute() if cache_dir else default_cache_dir().absolute()
    problem = cache_dir_problem(path)
    if problem:
        raise UserError(
            f"kernel cache {path} not used: {problem}; FA4 loads its .o files as native code "
            f"(give your own folder with --cache-dir or ${DIR_VAR})"
        )
    return path


def _overflow_uid() -> int:
    """The owner root's files show in a user namespace (a --fix arm's view): /tmp stays sticky."""
    try:
        with open("/proc/sys/kernel/overflowuid", encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 65534


def cache_dir_problem(path: str | os.PathLike[str]) -> str:
    """'' when only this user (or root) can change what the cache folder holds, else why not.

    The folder (when it exists) must be owned by this user and writable by no one else, and no
    folder above it may be writable by others either, except a root-owned sticky one such as
    /tmp (there no one can rename or remove another's entry; in a user namespace root shows as
    the overflow uid). FA4's default sits in /tmp/<user>/: anyone can make that
    folder first and plant kernels in it."""
    uid = os.geteuid()
    real = Path(os.path.realpath(path))
    for i, folder in enumerate([real, *real.parents]):
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            continue  # made by FA4 or kernel-cache, as this user
        except OSError as exc:
            return f"{folder} cannot be checked ({exc.strerror or exc})"
        sticky = bool(st.st_mode & stat.S_ISVTX) and st.st_uid in (0, _overflow_uid())
        if i == 0 and st.st_uid != uid:
            return f"{folder} is owned by another user (uid {st.st_uid})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (i > 0 and sticky):
            return f"{folder} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


# -- the current environment ---------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def fa4_source_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("flash_attn.cute")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).resolve()


@dataclass(frozen=True)
class Environment:
    """What a cache folder must match to be used: FA4 sources, cutlass, tvm_ffi, Python minor."""

    python: str
    fa4: str | None
    cutlass: str | None
    tvm_ffi: str | None
    fa4_dir: str | None
    fingerprint: str | None

    def describe(self) -> str:
        return (
            f"flash-attn-4 {self.fa4 or '?'}, nvidia-cutlass-dsl {self.cutlass or '?'}, "
            f"tvm_ffi {self.tvm_ffi or '?'}, Python {self.python}"
        )

    def versions(self) -> dict[str, str | None]:
        return {
            "python": self.python,
            "flash-attn-4": self.fa4,
            "nvidia-cutlass-dsl": self.cutlass,
            "apache-tvm-ffi": self.tvm_ffi,
        }


def compute_fingerprint(
    cute_root: str | os.PathLike[str], python_minor: str, cutlass_version: str, tvm_ffi_version: str
) -> str:
    """The same hash as FA4's cache_utils._compute_source_fingerprint (checked by `verify`)."""
    h = hashlib.sha256()
    h.update(f"py{python_minor}".encode())
    h.update(f"cutlass={cutlass_version}".encode())
    h.update(f"tvm_ffi={tvm_ffi_version}".encode())
    for src in sorted(Path(cute_root).rglob("*.py")):
        if not src.is_file():
            continue
        h.update(src.relative_to(cute_root).as_posix().encode())
        content = src.read_bytes()
        h.update(len(content).to_bytes(8, "little"))
        h.update(content)
    return h.hexdigest()


_current: dict[str, Environment] = {}


def current_environment() -> Environment:
    if "env" not in _current:
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        fa4_dir = fa4_source_dir()
        cutlass, tvm_ffi = _version("nvidia-cutlass-dsl"), _version("apache-tvm-ffi")
        fingerprint = None
        if fa4_dir is not None and cutlass and tvm_ffi:
            fingerprint = compute_fingerprint(fa4_dir, python, cutlass, tvm_ffi)
        _current["env"] = Environment(
            python=python,
            fa4=_version("flash-attn-4"),
            cutlass=cutlass,
            tvm_ffi=tvm_ffi,
            fa4_dir=str(fa4_dir) if fa4_dir else None,
            fingerprint=fingerprint,
        )
    return _current["env"]


def require_fa4() -> Environment:
    env = current_environment()
    if env.fa4_dir is None:
        raise UserError(
            "flash-attn-4 is not installed in this Python "
            "(pip install 'traindx[fa4]' or flash-attn-4 + nvidia-cutlass-dsl)"
        )
    if env.fingerprint is None:
        raise UserError("nvidia-cutlass-dsl / apache-tvm-ffi are not installed: FA4 cannot compile")
    return env


# -- folders and entries -------------------------------------------------------------------------
@dataclass
class Entry:
    path: Path
    family: str  # fwd, bwd, bwd_pre, bwd_post, ... (FA4's get_jit_cache name)
    size: int


@dataclass
class CacheFolder:
    """One fingerprint folder: the entries for one FA4 + cutlass + Python."""

    path: Path
    entries: list[Entry] = field(default_factory=list)
    metadata: dict[str, Any] | None = None
    usable: bool = False  # serves this environment and holds no damaged entry
    reason: str = ""  # why it is unusable here, or "" when usable
    stale_files: int = 0  # leftover .tmp.o of an interrupted export
    serves: bool = False  # its fingerprint is this environment's (whatever its entries)
    bad: list[tuple[Entry, str]] = field(default_factory=list)  # damaged entries, with why

    @property
    def fingerprint(self) -> str:
        return self.path.name

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    def families(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for e in self.entries:
            n, s = out.get(e.family, (0, 0))
            out[e.family] = (n + 1, s + e.size)
        return dict(sorted(out.items()))

    def served(self) -> str:
        """Which FA4/cutlass/Python this folder was written for, as far as it is known."""
        meta = self.metadata or {}
        versions = meta.get("versions") or {}
        if versions:
            archs = sorted({w.get("arch") for w in meta.get("warmed") or [] if w.get("arch")})
            return (
                f"flash-attn-4 {versions.get('flash-attn-4')}, nvidia-cutlass-dsl "
                f"{versions.get('nvidia-cutlass-dsl')}, tvm_ffi {versions.get('apache-tvm-ffi')}, "
                f"Python {versions.get('python')}" + (f"; warmed for {', '.join(archs)}" if archs else "")
            )
        if self.usable:
            return current_environment().describe() + " (this environment)"
        return "unknown (not written by kernel-cache; FA4 keeps no record)"


def read_metadata(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        with open(Path(folder) / METADATA_FILE, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def write_metadata(
    folder: str | os.PathLike[str],
    arch: str | None = None,
    num_sms: int | None = None,
    source: str | None = None,
) -> None:
    """Record which environment (and arch) a folder was warmed for: FA4's fingerprint is one-way."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    meta = read_metadata(path) or {}
    env = current_environment()
    meta["versions"] = env.versions()
    meta["fingerprint"] = env.fingerprint
    warmed = meta.setdefault("warmed", [])
    warmed.append(
        {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "arch": arch,
            "num_sms": num_sms,
            "source": source,
            "host": os.uname().nodename,
        }
    )
    meta["warmed"] = warmed[-20:]
    write_json(path / METADATA_FILE, meta, indent=1)


def why_unusable(folder_name: str, metadata: Mapping[str, Any] | None, env: Environment) -> str:
    """'' if a folder serves `env`, else the reason it does not."""
    if env.fingerprint is not None and folder_name == env.fingerprint:
        return ""
    if env.fingerprint is None:
        return "FA4 or cutlass is not installed here"
    versions = (metadata or {}).get("versions") or {}
    if not versions:
        return (
            "fingerprint differs from this environment's "
            f"({env.fingerprint[:12]}…): built for another FA4, cutlass, tvm_ffi or Python "
            "(which one is unknown: it was not written by kernel-cache)"
        )
    diffs = []
    for name, here in env.versions().items():
        there = versions.get(name)
        if there != here:
            label = "Python" if name == "python" else name
            diffs.append(f"{label} {there} (here {here})")
    if diffs:
        return "built for " + ", ".join(diffs)
    return (
        "same versions, but the flash_attn/cute sources differ (a patched or rebuilt FA4): "
        "FA4 will not read it"
    )


def scan(cache_dir: str | os.PathLike[str]) -> list[CacheFolder]:
    """Every fingerprint folder under cache_dir, with entries and whether it serves this env."""
    root = Path(cache_dir)
    env = current_environment()
    folders: list[CacheFolder] = []
    if not root.is_dir():
        return folders
    for child in sorted(root.iterdir()):
        if not child.is_dir() or not FINGERPRINT_RE.match(child.name):
            continue
        folder = CacheFolder(path=child, metadata=read_metadata(child))
        for family_dir in sorted(p for p in child.iterdir() if p.is_dir()):
            for f in sorted(family_dir.iterdir()):
                if f.name.endswith(".tmp.o"):
                    folder.stale_files += 1
                elif f.suffix == ENTRY_SUFFIX and f.is_file():
                    folder.entries.append(Entry(path=f, family=family_dir.name, size=f.stat().st_size))
        folder.bad = [(e, why) for e in folder.entries if (why := entry_problem(e.path, e.size))]
        folder.reason = why_unusable(child.name, folder.metadata, env)
        folder.serves = not folder.reason
        if folder.serves and folder.bad:
            entry, why = folder.bad[0]
            folder.reason = (
                f"{len(folder.bad)} of {len(folder.entries)} entries damaged (first: "
                f"{entry.family}/{entry.path.name}: {why}); kernel-cache verify --delete-bad removes them"
            )
        folder.usable = not folder.reason
        folders.append(folder)
    return folders


def entry_problem(path: str | os.PathLike[str], size: int) -> str | None:
    """Why an entry cannot be a whole object file, by its bytes alone (no FA4): empty, not
    ELF, or shorter than its ELF header says (cut by a full disk or a copy). None: whole."""
    if size == 0:
        return "empty file"
    try:
        with open(path, "rb") as f:
            head = f.read(ELF_HEADER)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not head.startswith(b"\x7fELF"):
        return (
            f"truncated: {size} bytes"
            if b"\x7fELF".startswith(head)
            else "not an object file (no ELF header)"
        )
    if len(head) < ELF_HEADER or head[4] != 2 or head[5] not in (1, 2):
        return f"truncated or not ELF64: {size} bytes"
    order = "<" if head[5] == 1 else ">"
    phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
    extent = max(ELF_HEADER, phoff + phentsize * phnum, shoff + shentsize * shnum)
    if extent > size:
        return f"truncated: {size} bytes of the {extent} its header declares"
    return None


def foreign_files(folder: str | os.PathLike[str]) -> list[str]:
    """What a fingerprint folder holds that neither FA4 nor kernel-cache writes (paths relative
    to it; a symbolic link is always foreign): such a folder is not the cache's to delete."""
    root = Path(folder)
    foreign = []
    for child in sorted(root.iterdir()):
        if child.is_symlink():
            foreign.append(child.name)
        elif child.is_dir() and FAMILY_RE.match(child.name):
            foreign.extend(
                f"{child.name}/{f.name}"
                for f in sorted(child.iterdir())
                if f.is_symlink() or not f.is_file() or not FA4_FILE_RE.match(f.name)
            )
        elif not (child.is_file() and child.name.lstrip(".").startswith(METADATA_FILE)):
            foreign.append(child.name)
    return foreign


def entry_paths(cache_dir: str | os.PathLike[str]) -> dict[tuple[str, str], int]:
    """{(family, hash): size} of the entries serving this environment (to diff before/after)."""
    folder = Path(cache_dir) / (current_environment().fingerprint or "-")
    out: dict[tuple[str, str], int] = {}
    if folder.is_dir():
        for f in folder.glob(f"*/*{ENTRY_SUFFIX}"):
            if not f.name.endswith(".tmp.o"):
                out[(f.parent.name, f.stem)] = f.stat().st_size
    return out


# -- verify --------------------------------------------------------------------------------------
def load_entry(path: str | os.PathLike[str]) -> Any:
    """Load one entry the way FA4 does (cache_utils preloads the CuTe runtime libraries with
    RTLD_GLOBAL first; then cute.runtime.load_module(..., enable_tvm_ffi=True).func)."""
    # lazy: FA4 and CuTe DSL are optional and slow to import; only verify loads entries
    import cutlass.cute as cute
    import flash_attn.cute.cache_utils as cache_utils  # noqa: F401  (the preload)

    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, cache_utils.JITPersistentCache.EXPORT_FUNCTION_PREFIX)


def fa4_fingerprint() -> str:
    """FA4's own fingerprint of this environment (imports FA4: used by verify to cross-check)."""
    from flash_attn.cute.cache_utils import _compute_source_fingerprint  # lazy: FA4 is optional

    fingerprint: str = _compute_source_fingerprint()
    return fingerprint


# -- pack / unpack / clear -----------------------------------------------------------------------
ENTRY_FILE_RE = re.compile(r"^[0-9a-f]{64}\.o$")


def is_kernel_member(name: str) -> bool:
    """What a pack holds and unpack takes: `<fingerprint>/<family>/<sha256>.o` (a kernel) or
    `<fingerprint>/traindx-kernel-cache.json` (which environment it serves). Nothing else: a
    cache folder is shared storage, and anything else in it (a `.env`, a planted file) is not
    the cache's to ship or to take."""
    parts = name.split("/")
    if not parts or not FINGERPRINT_RE.match(parts[0]):
        return False
    if len(parts) == 2:
        return parts[1] == METADATA_FILE
    return (
        len(parts) == 3
        and bool(FAMILY_RE.match(parts[1]))
        and parts[1] not in (".", "..")
        and bool(ENTRY_FILE_RE.match(parts[2]))
    )


def _regular_file(path: str) -> os.stat_result | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def pack(
    cache_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], folders: Iterable[CacheFolder]
) -> int:
    """A tar.gz of the given fingerprint folders: their kernels and our metadata only, each a
    plain file member (a hard-linked, deduplicated entry too: unpack takes no link member),
    with no owner names."""
    count = 0

    def add(tar: tarfile.TarFile, full: str, st: os.stat_result) -> None:
        info = tarfile.TarInfo(os.path.relpath(full, cache_dir))
        info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
        with open(full, "rb") as f:
            tar.addfile(info, f)

    def write(tmp: str) -> None:
        nonlocal count
        with tarfile.open(tmp, "w:gz") as tar:
            for folder in folders:
                for root, dirs, files in os.walk(folder.path):  # does not enter linked folders
                    dirs.sort()
                    for name in sorted(files):
                        full = os.path.join(root, name)
                        st = _regular_file(full)
                        if st is not None and is_kernel_member(
                            os.path.relpath(full, cache_dir).replace(os.sep, "/")
                        ):
                            add(tar, full, st)
                            count += name.endswith(ENTRY_SUFFIX)

    replace_with(out_path, write)
    return count


def _copy_into(source: IO[bytes], tmp: str) -> None:
    with open(tmp, "wb") as f:
        shutil.copyfileobj(source, f)


def _takes(m: tarfile.TarInfo, kernels: set[str]) -> bool:
    """A kernel or metadata member: a plain file, or a hard link to one of the pack's own (what
    packs of earlier versions held for deduplicated entries)."""
    if not is_kernel_member(m.name):
        return False
    return m.isfile() or (m.islnk() and m.linkname in kernels)


def unpack(tarball: str | os.PathLike[str], cache_dir: str | os.PathLike[str]) -> list[str]:
    """Extract a pack into cache_dir; refuses a pack with a member that is not a kernel or our
    metadata. Entries already present are kept (FA4 writes the same bytes for the same key);
    nothing is written through a link in cache_dir. Returns the folders touched."""
    tarball = Path(tarball)
    if not tarball.is_file():
        raise UserError(f"no such file: {tarball}")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    touched: set[str] = set()
    try:
        tar = tarfile.open(tarball, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise UserError(f"{tarball} is not a tarball: {exc}") from None
    with tar:
        members: list[tarfile.TarInfo] = []
        kernels: set[str] = set()
        for m in tar.getmembers():
            if m.isdir():
                continue
            if not _takes(m, kernels):
                raise UserError(
                    f"{tarball}: unexpected member {m.name!r} (not a kernel-cache pack: it holds "
                    "only <fingerprint>/<family>/<sha256>.o kernels)"
                )
            kernels.add(m.name)
            members.append(m)
            touched.add(m.name.split("/")[0])
        for m in members:
            _take(tar, m, cache_dir)
    return sorted(touched)


def _take(tar: tarfile.TarFile, m: tarfile.TarInfo, cache_dir: Path) -> None:
    target = cache_dir / m.name
    st = _regular_file(str(target))
    if st is not None and target.suffix == ENTRY_SUFFIX and st.st_size > 0:
        return
    for folder in reversed([p for p in target.parents if cache_dir in p.parents]):
        if folder.is_symlink():
            raise UserError(f"{folder} is a symbolic link: the kernel cache is not written through it")
        folder.mkdir(exist_ok=True)
    src = cast("IO[bytes]", tar.extractfile(m))  # a regular file or a link to one: its bytes
    try:
        replace_with(target, functools.partial(_copy_into, src), root=cache_dir)
    except LinkRefused as exc:
        raise UserError(f"{exc}: the kernel cache is not written through links") from None


def clear(folders: Iterable[CacheFolder]) -> tuple[int, list[str]]:
    """Delete the folders that hold only what FA4 and kernel-cache write; (entries removed, one
    line per folder kept because it holds something else: it is not the cache's)."""
    removed = 0
    kept = []
    for folder in folders:
        try:
            foreign = foreign_files(folder.path)
        except OSError as exc:
            kept.append(f"{folder.path}: not cleared ({exc.strerror or exc})")
            continue
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            kept.append(f"{folder.path}: kept, it holds files kernel-cache did not make ({foreign[0]}{more})")
            continue
        try:
            shutil.rmtree(folder.path)
        except OSError as exc:
            kept.append(f"{folder.path}: not cleared ({exc.strerror or exc})")
            continue
        removed += len(folder.entries)
    return removed, kept


def human_size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"
