"""Which folders of spilled clients' states have a living owner: the ones that must stay.

An actor that spills (:mod:`fedray.runtime.client_states`) owns its folder for
as long as its process lives: it holds an exclusive ``flock`` on the folder's
``.owner`` file, which the kernel releases when the process ends, however it
ends (a SIGKILL of the driver takes the actors with it, and no shutdown runs).
A folder whose ``.owner`` can be locked has no owner any more, and the next
actor to start on the node removes it (tens of GB at iNat scale); a folder
without one (written by an earlier fedray, or still being created) stays. The
lock needs no process ids (which the system reuses) nor Ray's state API (which
knows only its own cluster's actors: a second run on the machine has another).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from pathlib import Path
from typing import IO

OWNER = ".owner"
"""The file of a spill folder whose lock its owner holds."""


def claim(folder: Path) -> IO[bytes]:
    """``folder``, new and empty, owned by this process until the returned file is closed (or the process ends).

    The folder is made under a temporary name with its ``.owner`` locked before
    it has that name, and only then renamed: no other actor ever sees it with an
    unlocked ``.owner``. What was at ``folder`` (an owner's that is gone) is removed.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    making = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.claiming")
    making.mkdir()
    lock = open(making / f"{OWNER}.new", "wb")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else can hold it
        os.rename(making / f"{OWNER}.new", making / OWNER)
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(making, folder)
    except BaseException:
        lock.close()
        shutil.rmtree(making, ignore_errors=True)
        raise
    return lock


def remove_orphans(root: Path, keep: Path | None = None) -> None:
    """Remove every folder of ``root`` whose owner is gone, but ``keep`` (the caller's, which it may not own yet)."""
    try:
        entries = list(root.iterdir())
    except OSError:  # no folder yet: nothing spilled on this node
        return
    for folder in entries:
        if folder != keep:
            _remove_if_orphaned(folder)


def _remove_if_orphaned(folder: Path) -> None:
    try:
        lock = open(folder / OWNER, "rb")
    except OSError:  # not a folder, no owner's file (an earlier fedray's, or being made): not ours to judge
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its owner lives
            return
        try:
            if os.stat(folder / OWNER).st_ino != os.fstat(lock.fileno()).st_ino:
                return  # claimed anew since it was opened
        except OSError:
            return
        for entry in folder.iterdir():  # the owner's file last: a removal cut short is still found orphaned
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name != OWNER:
                entry.unlink(missing_ok=True)
        (folder / OWNER).unlink(missing_ok=True)
        try:
            folder.rmdir()
        except OSError:
            pass
