"""The run's manifest: what ran, where, with which packages, and what evidence is missing."""
import getpass
import importlib.metadata
import os
import platform
import re
import socket
import sys

TRACKED_PACKAGES = ("torch", "flash-attn-4", "nvidia-cutlass-dsl", "triton",
                    "flash-linear-attention", "megatron-core", "transformer-engine", "traindx")
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
REDACTED = "<redacted>"


def redact_env(env):
    return {k: (REDACTED if SECRET_NAME.search(k) else v) for k, v in sorted(env.items())}


def package_versions():
    versions = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def host_info():
    try:
        user = getpass.getuser()
    except Exception:
        user = None
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": sys.version.split()[0], "cpus": os.cpu_count(), "user": user}
