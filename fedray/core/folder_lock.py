"""One run at a time in an output folder: an exclusive lock held for the whole run.

Two runs writing one ``--out`` at once could mix their files or remove each
other's (a closed-form run removed the checkpoint a training run was still
writing). :func:`holding` takes an ``flock`` on ``FOLDER/.fedray.lock`` and
refuses a second run in one line. The kernel drops the lock when its process
ends, however it ends (SIGKILL included), so a lock file a killed run left
blocks nothing; the next run takes it over and removes it when it is done.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedray.core.errors import FedrayError

LOCK = ".fedray.lock"


@contextmanager
def holding(folder: Path, option: str = "--out") -> Iterator[None]:
    """Hold ``folder`` (created if missing) for this block, or refuse: another run holds it.

    Folders the lock created are removed again when the block ends while they
    are empty (a refused run leaves nothing behind), and so is the lock file.
    """
    folder = Path(folder)
    missing = [parent for parent in (folder.absolute(), *folder.absolute().parents) if not parent.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = _locked(folder / LOCK, option, folder)
        try:
            yield
        finally:
            (folder / LOCK).unlink(missing_ok=True)  # while still held: a run that opens it now sees it gone (_locked)
            os.close(descriptor)
    finally:
        for created in missing:  # deepest first
            try:
                created.rmdir()
            except OSError:
                break


def _locked(path: Path, option: str, folder: Path) -> int:
    """A descriptor of the lock file ``path``, locked; a file that its holder removed while this run waited is
    created anew (two runs must never hold locks on two files of the one name)."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(descriptor)
            os.close(descriptor)
            by = f" (pid {holder})" if holder else ""
            raise FedrayError(f"{option} {folder}: in use by another fedray run{by}; wait for it to end, or write to "
                              f"another folder") from None
        except BaseException:
            os.close(descriptor)
            raise
        if _same_file(descriptor, path):
            _write_pid(descriptor)
            return descriptor
        os.close(descriptor)


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _write_pid(descriptor: int) -> None:
    """This process's id in the lock file, for the refusal of another run; not on a full disk (the lock holds
    without it, and the run's own writes say that the disk is full)."""
    try:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass


def _holder(descriptor: int) -> int | None:
    """The process id the holder wrote, None if it wrote none (yet)."""
    try:
        text = os.pread(descriptor, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None
