"""Shared fixtures. FA4: the newest flash-attn-4 comes with the `fa4` extra; the buggy 4.0.0b17
(the seed case) is installed on demand into a cache folder that a job puts first on PYTHONPATH,
so CI exercises both releases."""
import importlib.util
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

FA4_B17 = "4.0.0b17"
FA4_B17_DIR = os.environ.get("TRAINDX_TEST_FA4_B17_DIR") or os.path.join(TESTS, ".cache", "fa4-b17")


def fa4_available():
    """flash-attn-4 and the CuTe DSL are importable (the `fa4` extra is installed)."""
    return all(importlib.util.find_spec(m) is not None for m in ("flash_attn", "cutlass", "torch"))


def _b17_installed(folder):
    return os.path.isfile(os.path.join(folder, "flash_attn", "cute", "interface.py")) and any(
        n.startswith(f"flash_attn_4-{FA4_B17}") for n in os.listdir(folder))


@pytest.fixture(scope="session")
def fa4_b17_path():
    """A folder holding flash-attn-4 4.0.0b17 alone (no dependencies: the venv's serve it), to
    put first on a job's PYTHONPATH. Installed with pip --target once, then reused."""
    if not fa4_available():
        pytest.skip("flash-attn-4 is not installed (pip install '.[fa4]')")
    if os.path.isdir(FA4_B17_DIR) and _b17_installed(FA4_B17_DIR):
        return FA4_B17_DIR
    os.makedirs(os.path.dirname(FA4_B17_DIR), exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                           FA4_B17_DIR, f"flash-attn-4=={FA4_B17}"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not _b17_installed(FA4_B17_DIR):
        pytest.skip(f"could not install flash-attn-4=={FA4_B17}: {proc.stderr.strip()[-300:]}")
    return FA4_B17_DIR
