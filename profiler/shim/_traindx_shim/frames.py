"""Locating the job's own code in a stack: the first frame outside Python itself and the
low-level libraries (torch, FlashAttention, CuTe DSL, Triton, traindx).

Frameworks such as Megatron or ms-swift count as the job's code on purpose: in the seed case the
line to fix (`max_seqlen` passed as a tensor) is in the framework, installed in site-packages.
Library folders are recognised by name, not by site-packages, because clusters install packages
in many places (the H200 test machine keeps them in /opt/gpu-site/site).
"""
import os
import sys
import sysconfig

LOW_LEVEL_PACKAGES = frozenset({
    "torch", "torchgen", "functorch", "flash_attn", "cutlass", "nvidia_cutlass_dsl", "tvm_ffi",
    "triton", "numpy", "einops", "_traindx_shim", "traindx", "importlib", "concurrent",
})
_STDLIB = tuple(os.path.realpath(p) + os.sep
                for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")} if p)
_cache = {}


def is_library_file(filename):
    verdict = _cache.get(filename)
    if verdict is None:
        if filename.startswith("<"):
            verdict = True
        else:
            real = os.path.realpath(filename)
            parts = real.split(os.sep)
            in_site = "site-packages" in parts or "dist-packages" in parts
            verdict = (any(p in LOW_LEVEL_PACKAGES for p in parts[:-1])
                       or (real.startswith(_STDLIB) and not in_site))
        _cache[filename] = verdict
    return verdict


def describe(frame):
    code = frame.f_code
    return {"file": code.co_filename, "line": frame.f_lineno, "function": code.co_name}


def first_user_frame(depth=1):
    """The innermost frame of the calling thread that belongs to the job, or None."""
    frame = sys._getframe(depth + 1)
    while frame is not None:
        if not is_library_file(frame.f_code.co_filename):
            return describe(frame)
        frame = frame.f_back
    return None
