"""Locating the job's own code in a stack: the first frame outside Python, site-packages and traindx."""
import os
import sys
import sysconfig

_LIBRARY_ROOTS = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)
_SHIM_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
_LIBRARY_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_cache = {}


def is_library_file(filename):
    verdict = _cache.get(filename)
    if verdict is None:
        if filename.startswith("<"):
            verdict = True
        else:
            real = os.path.realpath(filename)
            verdict = (real.startswith(_LIBRARY_ROOTS) or real.startswith(_SHIM_DIR)
                       or any(m in real for m in _LIBRARY_MARKERS))
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
