"""The run's manifest: what ran, where, with which packages, and what evidence is missing; and
the run folder's lock (one recording per folder) and the end of a run whose recorder died."""

from __future__ import annotations

import fcntl
import getpass
import importlib.metadata
import os
import platform
import re
import socket
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from traindx.common import atomic, redact, untrusted
from traindx.profiler.eventparse import CorruptEvidenceWarning
from traindx.profiler.shim._traindx_shim.roles import announced_ranks
from traindx.profiler.shim._traindx_shim.writer import utf8_paths

TRACKED_PACKAGES = (
    "torch",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "triton",
    "flash-linear-attention",
    "megatron-core",
    "transformer-engine",
    "traindx",
)
REDACTED = redact.REDACTED


def write_json_atomic(path: str, data: Any) -> None:
    """Written beside and renamed into place (traindx.common.atomic): a failure (a full disk)
    leaves the previous file whole and no stray temporary; the OSError is the caller's to report."""
    # a C locale's undecoded paths (cwd, argv) written as the UTF-8 text the shim's events use
    atomic.write_json(path, utf8_paths(data), indent=2, default=str)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """The job's environment as the manifest keeps it: secrets hidden by name and by value."""
    return redact.redact_env(env)


def redact_command(command: Sequence[str]) -> list[str]:
    """The command as the manifest keeps it (the job itself runs with the real one)."""
    return redact.redact_argv(command)


def redact_options(options: Any) -> Any:
    return redact.redact_value(options)


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def host_info() -> dict[str, Any]:
    try:
        user = getpass.getuser()
    except Exception:
        user = None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "user": user,
    }


# -- reading a manifest (a received folder's too: untrusted input) ----------------------------
MAX_NS = 2**63 - 1  # a time every reader can hold as int64 ns
MAX_MANIFEST_BYTES = 64 * untrusted.MiB  # the env, packages and a merged run's ranks: ~10 KB
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+=-]{0,127}")  # a node's name: a folder under nodes/


def _time_ns(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_NS  # NaN fails too


def _whole(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _texts(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# the manifest's fields and what every reader relies on them to be (launcher, attach, merge
# write them): a field that is not is dropped with one warning, the rest of the run analysed
MANIFEST_FIELDS: dict[str, Callable[[Any], bool]] = {
    "command": _texts,
    "gpus": lambda v: isinstance(v, list),
    "signals_forwarded": lambda v: isinstance(v, list),
    "host": lambda v: isinstance(v, dict),
    "packages": lambda v: isinstance(v, dict),
    "env": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    "options": lambda v: isinstance(v, dict),
    "ranks": lambda v: isinstance(v, dict),
    "missing": lambda v: isinstance(v, dict),
    "nvml": lambda v: isinstance(v, dict),
    "budget": lambda v: isinstance(v, dict),
    "start_ns": _time_ns,
    "end_ns": _time_ns,
    "exit_code": _whole(-(2**31), 2**31 - 1),
    "pid": _whole(1, 2**31 - 1),
    "cwd": lambda v: isinstance(v, str),
    "status": lambda v: isinstance(v, str),
    # a merged run's nodes name folders under nodes/: a name that is a path ("../x") never is one
    "nodes": lambda v: _texts(v) and all(_NAME.fullmatch(x) and x not in (".", "..") for x in v),
}
_SCALARS = ("start_ns", "end_ns", "exit_code", "pid", "cwd", "status")  # dropped: None
_LISTS = ("command", "gpus", "signals_forwarded", "nodes")  # dropped: [] (the rest: {})


def read_manifest(path: str, stacklevel: int = 2) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None), or (None, why it is not one: missing, unreadable, not JSON, not a
    traindx manifest). Read as untrusted input (traindx.common.untrusted: no link, FIFO or
    device; nesting bounded); a field of the wrong type or out of range (a start time NaN,
    Infinity or 1e308, a node named "../x") is dropped with one warning."""
    try:
        raw = untrusted.read_bytes(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None, "no manifest.json"
    except OSError as exc:
        return None, f"manifest.json unreadable ({exc.strerror})"
    try:
        manifest = untrusted.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError too
        return None, "manifest.json is corrupt (not JSON)"
    if not isinstance(manifest, dict) or "command" not in manifest:
        return None, "manifest.json is not a traindx manifest"
    if isinstance(manifest["command"], str):
        manifest["command"] = [manifest["command"]]
    wrong = []
    for key, ok in MANIFEST_FIELDS.items():  # the shapes every reader relies on
        if key not in manifest:
            continue
        value = manifest[key]
        empty = None if key in _SCALARS else [] if key in _LISTS else {}
        if value is None:
            manifest[key] = empty  # readers take a missing one as empty; null is the same
        elif not ok(value):
            wrong.append(key)
            manifest[key] = empty
    if wrong:
        warnings.warn(
            f"{path}: field{'s' if len(wrong) > 1 else ''} of the wrong type or out of range "
            f"ignored: {', '.join(wrong)}",
            CorruptEvidenceWarning,
            stacklevel=stacklevel + 1,
        )
    return manifest, None


# -- one run per folder ----------------------------------------------------------------------
CAPTURED = "captured"  # --fix: what an arm wrote in its view, and its private copies of the job's folders
LOCK_NAME = ".traindx.lock"
# what a run folder holds once a run was recorded into it (any one: the folder is taken)
RUN_EVIDENCE = ("manifest.json", "events", "log.txt", "pyspy", "nvml.csv", "trace", "findings.json")


class RunDirRefused(Exception):
    """The run folder cannot take this run (in use, already holds one, not writable): one line."""


class RunLock:
    """An exclusive flock on RUN/.traindx.lock, held while diagnose records into RUN. The kernel
    drops it when diagnose ends, however it ends (SIGKILL too): a run that says `running` with
    no holder was interrupted. The descriptor is not inherited (the job and the collectors
    never hold it)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock
            self.fd = None


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def _lock_path(run_dir: str) -> str:
    return os.path.join(run_dir, LOCK_NAME)


def claim_run_dir(run_dir: str) -> RunLock:
    """Take RUN for one new recording; returns its RunLock. Refused (RunDirRefused) when another
    diagnose records into it, when it already holds a run (never merged into), or when it
    cannot be written."""
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise RunDirRefused(f"{run_dir} is a file, not a folder: give a folder for the run")
    _refuse_links(run_dir)
    _refuse_a_used_folder(run_dir)  # before the lock file: a used folder gets nothing new
    try:
        os.makedirs(run_dir, exist_ok=True)
        # never through a link planted meanwhile (O_NOFOLLOW: ELOOP)
        fd = os.open(_lock_path(run_dir), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RunDirRefused(f"cannot write the run folder {run_dir}: {_reason(exc)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirRefused(
            f"{run_dir} is in use: another diagnose{holder} is recording into "
            "it; give this run its own --run-dir"
        ) from None
    try:
        _refuse_a_used_folder(run_dir)  # again under the lock: a run that started meanwhile
    except RunDirRefused:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    except OSError as exc:
        os.close(fd)
        raise RunDirRefused(f"cannot write the run folder {run_dir}: {_reason(exc)}") from None
    return RunLock(fd)


def refuse_a_foreign_folder(run_dir: str) -> None:
    """A --run-dir the user names must be new, empty or traindx's (a run, a --fix root of arms,
    a multi-node run's nodes/): an existing folder of theirs (a project, $HOME, ".") would get a
    run's files among its own, and its report.html or log.txt overwritten."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RunDirRefused(f"cannot read the run folder {run_dir}: {_reason(exc)}") from None
    for name in names:  # a planted link is named as such (as claim_run_dir's walk would)
        path = os.path.join(run_dir, name)
        if os.path.islink(path):
            raise RunDirRefused(
                f"{run_dir} holds a symbolic link ({name} -> {os.readlink(path)}): a run folder "
                "is traindx's alone; give a new --run-dir"
            )
    ours = {LOCK_NAME, CAPTURED, "nodes", *RUN_EVIDENCE}
    if not names or any(n in ours or _is_a_run(os.path.join(run_dir, n)) for n in names):
        return
    raise RunDirRefused(
        f"{run_dir} is not empty and holds no run (it holds {sorted(names)[0]!r}"
        f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}): a run folder is traindx's "
        "alone; give a new or empty --run-dir"
    )


def _is_a_run(path: str) -> bool:
    return not os.path.islink(path) and any(
        os.path.lexists(os.path.join(path, n)) for n in (LOCK_NAME, "manifest.json")
    )


def _refuse_links(run_dir: str) -> None:
    """A run folder is traindx's alone: one that holds a symbolic link (to a file or a folder
    elsewhere, which a write of ours would go through) is refused. --fix's own CAPTURED folder is
    not walked: an arm's private copies of the job's folders keep their links as they are (a
    copy of /usr/local holds cuda -> /etc/alternatives/cuda), and no write of ours goes there."""
    for folder, dirs, files in os.walk(run_dir):  # os.walk does not descend into linked folders
        for name in dirs + files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                raise RunDirRefused(
                    f"{run_dir} holds a symbolic link ({os.path.relpath(path, run_dir)} -> "
                    f"{os.readlink(path)}): a run folder is traindx's alone; give a new --run-dir"
                )
        if folder == run_dir and CAPTURED in dirs:
            dirs.remove(CAPTURED)  # a real folder (a planted link was refused above)


def _refuse_a_used_folder(run_dir: str) -> None:
    if any(os.path.lexists(os.path.join(run_dir, name)) for name in RUN_EVIDENCE):
        holder = recorder_alive(run_dir)
        if holder is not None:
            raise RunDirRefused(
                f"{run_dir} is in use: another diagnose{holder.rstrip()} is "
                "recording into it; give this run its own --run-dir"
            )
        raise RunDirRefused(
            f"{run_dir} already holds a run ({describe_run(run_dir)}); a run "
            "is never recorded into another: give a new --run-dir, or leave it "
            "out for a fresh folder under --out"
        )


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").split()
    except OSError:
        return ""
    return f" (pid {text[0]} on {text[1]})" if len(text) >= 2 else ""


def recorder_alive(run_dir: str) -> str | None:
    """' (pid N on HOST)' when a diagnose holds RUN's lock now, else None."""
    try:  # a received folder's lock may be a FIFO or a link: never waited on, never followed
        fd = os.open(_lock_path(run_dir), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _read_holder(fd) or " "
    finally:
        os.close(fd)
    return None


STALE_S = 120.0  # a recorder on another host: gone once the folder has not changed this long


def recorder_gone(run_dir: str, stale_s: float = STALE_S) -> str | None:
    """Why RUN, whose manifest says `running`, has no recorder any more (SIGKILL, OOM, a lost
    machine: the kernel dropped its lock), or None while one records into it (or may: a lock
    taken on another host, which a shared filesystem may not show here, counts until the folder
    has not changed for stale_s)."""
    try:
        manifest = untrusted.load_json(os.path.join(run_dir, "manifest.json"), MAX_MANIFEST_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("status") != "running":
        return None
    if recorder_alive(run_dir) is not None:
        return None
    try:
        fd = os.open(_lock_path(run_dir), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        host = ""
    else:
        host = _read_holder(fd).rstrip(")").rpartition(" on ")[2]
        os.close(fd)
    if host and host != socket.gethostname():
        newest = _newest_evidence_ns(run_dir) or 0
        if time.time_ns() - newest < stale_s * 1e9:
            return None
        return f"{run_dir} says `running`, but its recorder on {host} has written nothing for {stale_s:.0f} s"
    return f"{run_dir} says `running`, but no diagnose records into it any more (killed?)"


def describe_run(run_dir: str) -> str:
    """'finished, exit code 0, 2026-12-01 10:33' or 'running' ... for a one-line message."""
    try:
        m = untrusted.load_json(os.path.join(run_dir, "manifest.json"), MAX_MANIFEST_BYTES)
        status: str = m.get("status") or "unknown status"
        if status == "running" and recorder_alive(run_dir) is None:
            status = "interrupted: its diagnose is gone"
        when = m.get("start_ns")
        parts = [status]
        if m.get("exit_code") is not None:
            parts.append(f"exit code {m['exit_code']}")
        if isinstance(when, int) and 0 <= when <= MAX_NS:
            parts.append("started " + time.strftime("%Y-%m-%d %H:%M", time.localtime(when / 1e9)))
        return ", ".join(parts)
    except (OSError, ValueError, AttributeError, TypeError):
        return "evidence without a readable manifest"


def finish_interrupted(run_dir: str) -> str | None:
    """A run whose recorder died (SIGKILL, OOM, a lost machine) says `running` for ever: once no
    diagnose holds its lock, mark it `interrupted` with what the folder itself tells (its end:
    the newest evidence; its ranks: the shim's announcements). Returns one line for the user,
    or None when there was nothing to finish. The evidence itself is not touched."""
    path = os.path.join(run_dir, "manifest.json")
    try:
        manifest = untrusted.load_json(path, MAX_MANIFEST_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("status") != "running":
        return None
    holder = recorder_alive(run_dir)
    if holder is not None:
        return (
            f"{run_dir} is still being recorded (diagnose{holder.rstrip()}): analysing what it holds so far"
        )
    missing = manifest.setdefault("missing", {})
    note = (
        "diagnose ended before the job did (killed?): the job's exit code and the "
        "collectors' last seconds are not known"
    )
    pid = manifest.get("pid")
    if isinstance(pid, int) and _is_our_job(pid, run_dir):
        note += f"; the job (pid {pid}) was still running when this was written"
    missing["recorder"] = note
    if (manifest.get("options") or {}).get("shim", True) and not manifest.get("ranks"):
        try:
            manifest["ranks"] = announced_ranks(run_dir)
        except Exception:
            pass
    manifest["end_ns"] = manifest.get("end_ns") or _newest_evidence_ns(run_dir)
    manifest["status"] = "interrupted"
    try:
        write_json_atomic(path, manifest)
    except OSError as exc:
        return f"{run_dir}: its recorder was interrupted; manifest.json was not updated ({_reason(exc)})"
    return f"{run_dir}: its recorder was interrupted; the run is marked `interrupted`"


def _is_our_job(pid: int, run_dir: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"TRAINDX_RUN_DIR={os.path.abspath(run_dir)}".encode() in env.split(b"\0")


def _newest_evidence_ns(run_dir: str) -> int | None:
    newest = 0
    for root, _, files in os.walk(run_dir):
        for name in files:
            try:
                newest = max(newest, os.stat(os.path.join(root, name)).st_mtime_ns)
            except OSError:
                continue
    return newest or None
