"""A real disk that fills up (a 1 MiB tmpfs, mounted by root; tests skip where it cannot be) and ways to fail a write."""

import errno
import gc
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

SMALL_DISK_SIZE = "1m"


@pytest.fixture
def small_disk(tmp_path):
    """An empty 1 MiB tmpfs mounted at a new folder, unmounted after the test."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_SIZE}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root only): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        gc.collect()  # what the test left open on the disk (a spill folder's lock, in a caught error's frames) closes
        subprocess.run(["umount", str(folder)], check=True)


def fill(folder: Path) -> None:
    """Take every free byte of ``folder``'s filesystem with a file ``filler`` in it."""
    block = bytes(65536)
    descriptor = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        while True:
            os.write(descriptor, block)
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
    finally:
        os.close(descriptor)
    space = os.statvfs(folder)
    assert space.f_bavail == 0, "the filler took every free block"


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def hashes(folder: Path) -> dict[str, str]:
    """Each file under ``folder`` (relative name) and the SHA-256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
