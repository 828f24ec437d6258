"""The evidence yields the disk to the job: the free-space figures the launcher and the roller
read (statvfs of the run folder's disk)."""

from __future__ import annotations

import os

# the evidence yields the disk to the job: its budget is at most this share of the space free
# when the run starts, and under the floor (FLOOR_SHARE of the disk, at most FLOOR_MAX_BYTES)
# the roller sheds what it can (every rolled segment) and the run says so
EVIDENCE_FREE_SHARE = 0.1
FLOOR_SHARE, FLOOR_MAX_BYTES = 0.1, 1 << 30
FLOOR_CHECK_S = 0.25


def free_bytes(path: str) -> int | None:
    """Bytes free to an unprivileged writer on path's disk (None: unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def under_floor(path: str) -> bool:
    """The disk holding path has less free than its floor: the job may need the rest."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    floor = min(FLOOR_MAX_BYTES, int(st.f_blocks * st.f_frsize * FLOOR_SHARE))
    return st.f_bavail * st.f_frsize < floor


def folder_bytes(path: str) -> int:
    """The bytes of every file under path."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
