"""Overlay upgrade for a `--fix` candidate: the fixed release of a package installed into a folder
inside the fix folder, put on the candidate's PYTHONPATH (after the shim's folder, before the
user's own entries), so the candidate imports it and the user's environment stays as it was.

Source: a local wheel directory (`diagnose --fix --wheels DIR`: pip --no-index --find-links DIR)
or the package index (pip's own configuration). --no-deps: the user's environment serves the
dependencies, as it does for the release the job runs today.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


class OverlayError(Exception):
    """One line saying why, and the installer's last lines."""

    def __init__(self, line: str, tail: str = "") -> None:
        super().__init__(line)
        self.line, self.tail = line, tail


def requirement(package: str, min_version: str | None) -> str:
    return f"{package}>={min_version}" if min_version else package


def pip_command(target: str, requirements: Iterable[str], wheels: str | None = None) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-input",
        "--upgrade",
        "--target",
        target,
    ]
    if wheels:
        cmd += ["--no-index", "--find-links", wheels]
    return cmd + list(requirements)


def install(
    target: str,
    requirements: list[str],
    wheels: str | None = None,
    timeout: float = 900,
    runner: Callable[..., Any] = subprocess.run,
) -> dict[str, Any]:
    """pip install the requirements into `target`; returns {"command", "installed": {dist: version}}.
    Raises OverlayError with one line and the output's last lines."""
    if wheels and not os.path.isdir(wheels):
        raise OverlayError(f"--wheels {wheels}: no such folder")
    os.makedirs(target, exist_ok=True)
    cmd = pip_command(target, requirements, wheels)
    try:
        proc = runner(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OverlayError(f"installing {', '.join(requirements)} took over {timeout} s") from None
    except OSError as exc:
        raise OverlayError(f"could not run pip: {exc}") from None
    tail = "\n".join((proc.stdout or "").strip().splitlines()[-12:])
    if proc.returncode != 0:
        where = f"the wheels in {wheels}" if wheels else "the package index"
        raise OverlayError(
            f"could not install {', '.join(requirements)} from {where} "
            f"(pip exit {proc.returncode}); give a folder of wheels with "
            "--wheels DIR",
            tail,
        )
    return {"command": cmd, "installed": installed_versions(target), "output_tail": tail}


def installed_versions(target: str) -> dict[str, str]:
    """{distribution name: version} of the .dist-info folders in `target`."""
    out = {}
    for name in sorted(os.listdir(target)) if os.path.isdir(target) else ():
        if name.endswith(".dist-info"):
            dist, _, version = name[: -len(".dist-info")].rpartition("-")
            out[dist.replace("_", "-").lower()] = version
    return out


def candidate_pythonpath(target: str, environ: Mapping[str, str] | None = None) -> str:
    """PYTHONPATH of the candidate: the overlay first (the shim's folder goes before it when the
    job starts), then the user's own entries."""
    environ = os.environ if environ is None else environ
    current = environ.get("PYTHONPATH")
    return target + (os.pathsep + current if current else "")
