"""A file copy that shares the data blocks where the file system can (a reflink: btrfs, XFS,
bcachefs, ZFS 2.2, APFS-like copy-on-write), else copies them: either way a file of its own,
never a link back to the original."""

from __future__ import annotations

import os
import shutil
import stat

FICLONE = 0x40049409  # ioctl: this file shares the other's extents (Linux, copy-on-write file systems)


def clone_or_copy(src: str, dst: str) -> str:
    """Copy src to dst (metadata too); returns "clone" or "copy" (what was done). A file that
    is not a regular one (a pipe would block the open) raises OSError."""
    if not stat.S_ISREG(os.stat(src).st_mode):
        raise OSError(f"{src} is not a regular file")
    try:
        import fcntl  # not on every platform; only Linux has FICLONE

        with open(src, "rb") as fin, open(dst, "wb") as fout:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        shutil.copystat(src, dst)
        return "clone"
    except (OSError, ImportError):
        if os.path.lexists(dst) and not os.path.islink(dst):
            os.unlink(dst)
    shutil.copy2(src, dst)
    return "copy"
