"""The run's manifest: what ran, where, with which packages, and what evidence is missing."""
import getpass
import importlib.metadata
import os
import platform
import socket
import sys

from traindx import redact

TRACKED_PACKAGES = ("torch", "flash-attn-4", "nvidia-cutlass-dsl", "triton",
                    "flash-linear-attention", "megatron-core", "transformer-engine", "traindx")
REDACTED = redact.REDACTED


def redact_env(env):
    """The job's environment as the manifest keeps it: secrets hidden by name and by value."""
    return redact.redact_env(env)


def redact_command(command):
    """The command as the manifest keeps it (the job itself runs with the real one)."""
    return redact.redact_argv(command)


def redact_options(options):
    return redact.redact_value(options)


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
