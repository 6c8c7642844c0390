"""A write that ran out of space, told in one line: what was being written, how much it needed, how much is free."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from fedray.core.errors import FedrayError

FULL = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}


def full_disk_code(error: BaseException | None) -> int | None:
    """ENOSPC or EDQUOT when ``error``, or an error it was raised from or while handling, is that failure; else None.

    Libraries wrap the OSError: ``torch.save`` raises a RuntimeError with it as
    the context, polars a ComputeError that names it only in its message.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FULL:
            return error.errno
        for code in FULL:
            if os.strerror(code) in str(error):
                return code
        error = error.__cause__ or error.__context__
    return None


def full_disk_error(code: int, written: Path, folder: Path, sizes: list[int], at_least: bool = False) -> FedrayError:
    """``disk full: writing WRITTEN needed N MB, M MB free`` (free in ``folder``; a quota's free space is not known).

    ``sizes`` are the bytes of the files the write was to make (estimates),
    or with ``at_least`` only what they held when the space ran out; each
    takes whole blocks of the filesystem, so the need is counted in blocks
    (four files of 900 bytes need 16 kB where blocks are 4 kB, not 3.6 kB).
    """
    space = os.statvfs(folder)
    block = space.f_frsize or 1
    needed = sum(-(-size // block) * block for size in sizes)
    message = f"{FULL[code]}: writing {written} needed {'more than ' if at_least else ''}{size_text(needed)}"
    if code == errno.ENOSPC:
        message += f", {size_text(space.f_bavail * block)} free"
    return FedrayError(message)


def size_text(size: int) -> str:
    """``size`` bytes in MB with one decimal from 0.1 MB on, in kB with three significant digits below."""
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.3g} kB"
