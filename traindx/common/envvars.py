"""Which environment variables matter to a training run, defined once: the ones that change how
it performs (a recipe card exports them to reproduce the run; the report shows them) and the
ones that describe the launch (the report shows them too). Values come from the manifest,
already redacted."""

from __future__ import annotations

import re
from collections.abc import Mapping

# prefixes (or whole names) of the variables that change how training performs
PERFORMANCE_ENV_PREFIXES = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "NCCL_",
    "TORCH_NCCL_",
    "TORCHINDUCTOR_",
    "FLASH_ATTENTION_",
    "CUTE_DSL_",
    "NVTE_",
    "TRITON_",
    "FLA_",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)
# the launch: which process is which, where the job looks for code; and traindx's own switches
LAUNCH_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTHONPATH",
)
# shown in the report beside those: the device and framework settings around them
CONTEXT_ENV_PREFIXES = (
    "CUDA_",
    "TORCH",
    "PYTORCH_",
    "MEGATRON",
    "HF_HUB_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "TRAINDX_",
)


def is_performance_var(name: str) -> bool:
    return str(name).startswith(PERFORMANCE_ENV_PREFIXES)


def is_relevant_var(name: str) -> bool:
    """Worth showing with a run: performance, launch or context (anything else stays out)."""
    name = str(name)
    return is_performance_var(name) or name in LAUNCH_ENV or name.startswith(CONTEXT_ENV_PREFIXES)


# -- which installed release reads which switch ----------------------------------------------------
# (package, switch) -> the lowest release whose source was read for it (docs/autotune.md)
VERIFIED = {
    ("triton", "TRITON_CACHE_DIR"): "2.0.0",  # runtime/cache.py os.getenv in 2.x; knobs.py in 3.6
    ("triton", "TRITON_CACHE_AUTOTUNING"): "3.6.0",
    ("fla", "FLA_CACHE_RESULTS"): "0.6.0",
    ("fla", "FLA_CACHE_MODE"): "0.6.0",
    ("fla", "FLA_CONFIG_DIR"): "0.6.0",
}
FLA_PACKAGES = ("fla-core", "flash-linear-attention")


def release(text: str | None) -> tuple[int, ...] | None:
    """'3.6.0+git1a2b' -> (3, 6, 0); '0.6.0rc1' -> (0, 6, 0); None when there is no number."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text or ""))
    return tuple(int(p) for p in match[1].split(".")) if match else None


def reads(packages: Mapping[str, str] | None, package: str, switch: str) -> bool:
    """Does the installed `package` read `switch`, as far as the source we read says?"""
    have = release(package_version(packages, package))
    need = release(VERIFIED.get((package, switch)))
    return have is not None and need is not None and have >= need


def package_version(packages: Mapping[str, str] | None, package: str) -> str | None:
    """The installed release of `package` ('fla': either of its distributions) in the manifest's
    package versions, or None."""
    packages = packages or {}
    if package == "fla":
        return next((packages.get(p) for p in FLA_PACKAGES if packages.get(p)), None)
    return packages.get(package)
