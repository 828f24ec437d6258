"""Library code or the job's own: every rule traindx uses to tell them apart, defined here once
(standard library only: the shim reads it inside the job; the analyzers and the report read the
same rules outside it).

Two questions, on purpose:
- `is_library_file` (the shim, at run time): is this frame below the job, in Python itself or a
  low-level package (torch, FlashAttention, CuTe DSL, Triton, traindx)? Frameworks such as
  Megatron or ms-swift count as the job's code: in the seed case the line to fix (`max_seqlen`
  passed as a tensor) is in the framework, installed in site-packages.
- `is_library_path` (py-spy's and the shim's recorded paths) and `is_library_trace_file`
  (torch.profiler's, relative to sys.path): is this any installed code (site-packages, the
  interpreter's lib, a low-level package) rather than the job's own files?
Library folders are also recognised by name, not only by site-packages, because clusters install
packages in many places (the H200 test machine keeps them in /opt/gpu-site/site).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import sysconfig

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from types import FrameType
    from typing import Any

LIBRARY_DIRS = ("site-packages", "dist-packages")
LOW_LEVEL_PACKAGES = frozenset(
    {
        "torch",
        "torchgen",
        "functorch",
        "flash_attn",
        "cutlass",
        "nvidia_cutlass_dsl",
        "tvm_ffi",
        "triton",
        "numpy",
        "einops",
        "quack",
        "_traindx_shim",
        "traindx",
        "importlib",
        "concurrent",
    }
)
# top-level names of libraries as torch.profiler shows their files (relative to sys.path)
KNOWN_LIBRARIES = frozenset(
    {
        "torch",
        "torchvision",
        "torchaudio",
        "triton",
        "numpy",
        "transformers",
        "megatron",
        "flash_attn",
        "cutlass",
        "apex",
        "transformer_engine",
        "deepspeed",
        "accelerate",
        "swift",
        "datasets",
        "einops",
        "fla",
        "torchtitan",
        "tensordict",
        "pandas",
        "traindx",
        "_traindx_shim",
        "functorch",
        "sympy",
        "safetensors",
        "tokenizers",
        "peft",
        "trl",
        "lightning",
        "pytorch_lightning",
        "jinja2",
        "google",
        "tqdm",
        "wandb",
        "tensorboard",
        "nvtx",
        "pynvml",
        "scipy",
        "sklearn",
        "filelock",
        "fsspec",
        "requests",
        "urllib3",
        "typing_extensions",
    }
)
_INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]")
_INTERPRETER_LIB = re.compile(r"[/\\]lib[/\\]python\d\.\d+[/\\]")
_STDLIB = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")}
    if p
)
_cache: dict[Any, Any] = {}


def is_library_file(filename: str) -> bool:
    """The shim's question, on a real file of this interpreter: Python itself or a low-level
    package (frameworks in site-packages are the job's code)."""
    verdict = _cache.get(filename)
    if verdict is None:
        if filename.startswith("<"):
            verdict = True
        else:
            real = os.path.realpath(filename)
            parts = real.split(os.sep)
            in_site = any(d in parts for d in LIBRARY_DIRS)
            verdict = any(p in LOW_LEVEL_PACKAGES for p in parts[:-1]) or (
                real.startswith(_STDLIB) and not in_site
            )
        _cache[filename] = verdict
    return verdict


def is_library_path(path: str) -> bool:
    """Installed code, not the job's own file: site-packages, the interpreter's lib, `<frozen …>`
    and the low-level packages wherever a cluster installs them. For absolute paths (py-spy's,
    the shim's callers)."""
    if not path or path.startswith("<") or _INSTALLED.search(path) or _INTERPRETER_LIB.search(path):
        return True
    parts = re.split(r"[/\\]", path)[:-1]
    return any(p in LOW_LEVEL_PACKAGES for p in parts)


def is_library_trace_file(path: str) -> bool:
    """torch.profiler strips the sys.path prefix, so tell libraries by their top-level name."""
    if is_library_path(path) and path.startswith(("/", "<")):
        return True
    top = re.split(r"[/\\]", path, maxsplit=1)[0]
    top = top[:-3] if top.endswith(".py") else top
    return top in KNOWN_LIBRARIES or top in sys.stdlib_module_names


def installed_package(path: str) -> str | None:
    """The top-level package of a file under site-packages ('…/site-packages/torch/x.py' ->
    'torch'), or None."""
    parts = re.split(r"[/\\]", path or "")
    for marker in LIBRARY_DIRS:
        if marker in parts:
            i = parts.index(marker)
            if i + 1 < len(parts):
                name = parts[i + 1]
                return name[:-3] if name.endswith(".py") else name
    return None


@functools.lru_cache(maxsize=65536)
def code_kind(path: str, cwd: str = "") -> str:
    """How the report colours a frame's file: user (the job's own files), library, python (the
    stdlib), traindx (our hooks) or native (no file)."""
    f = path or ""
    if not f:
        return "native"
    if "_traindx_shim" in f or "/traindx/" in f:
        return "traindx"  # the profiler's own hooks: not the user's code
    if f.startswith("<"):
        return "python"
    if _INSTALLED.search(f):
        return "library"
    parts = f.split("/")
    if not f.startswith("/") or (cwd and f.startswith(cwd.rstrip("/") + "/")):
        # under the job's folder, except packages unpacked into hidden folders (.venv, .fa4-b17)
        inside = parts[len(cwd.rstrip("/").split("/")) :] if f.startswith("/") else parts
        return "library" if any(p.startswith(".") and p not in (".", "..") for p in inside[:-1]) else "user"
    if _INTERPRETER_LIB.search(f):
        return "python"
    return "library"  # elsewhere on the machine: an installed package (e.g. /opt/…/site)


def describe(frame: FrameType) -> dict[str, Any]:
    code = frame.f_code
    # f_lineno is None at an instruction of no line (Python 3.11): the function's first line
    return {"file": code.co_filename, "line": frame.f_lineno or code.co_firstlineno, "function": code.co_name}


def first_user_frame(depth: int = 1) -> dict[str, Any] | None:
    """The innermost frame of the calling thread that belongs to the job, or None."""
    frame: FrameType | None = sys._getframe(depth + 1)
    while frame is not None:
        if not is_library_file(frame.f_code.co_filename):
            return describe(frame)
        frame = frame.f_back
    return None


def framework_chain(depth: int = 1, limit: int = 64) -> dict[str, Any] | None:
    """Where installed code (a framework's callback, handler or loop) made a call the job never
    wrote: the job's own innermost frame (its file outside installed packages) and the classes
    of the objects whose methods ran between it and the call, innermost first ([module, name];
    the job built some of them: its callback, its trainer) and `called`: the outermost of them,
    whose method the job called itself. None when the caller is the job's."""
    frame: FrameType | None = sys._getframe(depth + 1)
    objects: list[list[str]] = []
    called: list[str] | None = None
    while frame is not None and limit > 0:
        name = frame.f_code.co_filename
        if not is_library_path(name):
            return {"job": describe(frame), "objects": objects, "called": called} if objects else None
        owner = frame.f_locals.get("self") if frame.f_code.co_varnames[:1] == ("self",) else None
        if owner is not None:
            cls = type(owner)
            item = [str(getattr(cls, "__module__", "")), str(getattr(cls, "__qualname__", cls.__name__))]
            called = item
            if item not in objects:
                objects.append(item)
        frame = frame.f_back
        limit -= 1
    return None
