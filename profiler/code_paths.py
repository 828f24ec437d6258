"""Which code a recorded frame's file is: the job's own, an installed library's, the standard
library's. The in-job shim decides it when it records (it cannot import traindx, so the one
definition lives in its frames.py); this module is the public reader of it for the layers above,
which never read the shim's modules themselves."""

from __future__ import annotations

from traindx.profiler.shim._traindx_shim.frames import (
    KNOWN_LIBRARIES,
    LOW_LEVEL_PACKAGES,
    code_kind,
    installed_package,
    is_library_path,
    is_library_trace_file,
)

__all__ = [
    "KNOWN_LIBRARIES",
    "LOW_LEVEL_PACKAGES",
    "code_kind",
    "installed_package",
    "is_library_path",
    "is_library_trace_file",
]
