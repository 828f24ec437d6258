"""Names of the segments of a rolling line file (standard library only: the shim writes them,
the launcher rolls them, the loader reads them; all three share this one definition).

A line file X (events/p<pid>.jsonl, log.txt, pyspy/p<pid>-dump.jsonl) of a long run is:
  X              the head: the first segment, kept whole (start-up, compiles, the first steps)
  X.s000001 ...  the later segments in order; the newest is the one being written
  X.s000001.gz   a closed segment the launcher rolled off the tail (gzip, possibly thinned)
  X.rolled.json  what rolling thinned or dropped (profiler/rolling.py)
A short run has X alone, exactly as before rolling existed.
"""

from __future__ import annotations  # annotations stay text: no typing at import in the job

import os
import re

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Mapping

_SEGMENT = re.compile(r"\.s(\d{6})(\.gz)?$")
SEGMENT_BYTES_ENV = "TRAINDX_EVENTS_SEGMENT_BYTES"


def segment_path(head: str, n: int) -> str:
    return f"{head}.s{n:06d}"


def summary_path(head: str) -> str:
    return head + ".rolled.json"


def segments(head: str) -> list[tuple[int, str, bool]]:
    """[(n, path, gzipped)] of the segments after the head, in order; a segment present both
    plain and gzipped (the launcher stopped between the two steps of rolling it) is the plain one."""
    folder, base = os.path.split(head)
    found = {}
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    for name in names:
        if not name.startswith(base + ".s"):
            continue
        m = _SEGMENT.fullmatch(name[len(base) :])
        if not m:
            continue
        n, gz = int(m[1]), bool(m[2])
        if n in found and not found[n][1]:
            continue  # the plain copy is complete; the .gz beside it may be too, or not yet
        found[n] = (os.path.join(folder, name), gz)
    return [(n, path, gz) for n, (path, gz) in sorted(found.items())]


def segment_bytes_from_env(environ: Mapping[str, str] = None) -> int:
    """The events segment size the launcher asked for (0: never rotate)."""
    value = (os.environ if environ is None else environ).get(SEGMENT_BYTES_ENV, "")
    return int(value) if value.isdigit() else 0
