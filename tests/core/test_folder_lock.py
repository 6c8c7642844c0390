"""One run at a time in a folder: a second is refused in one line naming the holder; a lock its dead holder left
blocks nothing; the lock and the folders it created go when the run ends."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedray.core.errors import FedrayError
from fedray.core.folder_lock import LOCK, holding

REPO = Path(__file__).resolve().parents[2]
HOLDER = "import sys, time; from fedray.core.folder_lock import holding\nwith holding(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n"


@pytest.fixture
def held_by_another_process(tmp_path):
    """``tmp_path / 'out'`` held by another process (killed after the test); yields (folder, process)."""
    folder = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline() == "held\n"
        yield folder, holder
    finally:
        holder.kill()
        holder.wait()


def test_a_folder_another_process_holds_is_refused_naming_that_process(held_by_another_process):
    folder, holder = held_by_another_process
    with pytest.raises(FedrayError) as refused:
        with holding(folder):
            pytest.fail("the block ran though another process held the folder")
    assert str(refused.value) == (f"--out {folder}: in use by another fedray run (pid {holder.pid}); wait for it to "
                                  "end, or write to another folder")
    assert (folder / LOCK).read_text() == f"{holder.pid}\n", "the refused run leaves the holder's lock as it was"


def test_the_lock_of_a_killed_holder_blocks_nothing_and_goes_with_the_next_run(held_by_another_process):
    folder, holder = held_by_another_process
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (folder / LOCK).exists(), "a killed holder leaves its lock file"
    with holding(folder):
        assert (folder / LOCK).read_text() == f"{os.getpid()}\n"
    assert os.listdir(folder) == []


def test_the_same_process_cannot_hold_a_folder_twice(tmp_path):
    with holding(tmp_path):
        with pytest.raises(FedrayError, match=f"in use by another fedray run \\(pid {os.getpid()}\\)"):
            with holding(tmp_path):
                pass
    with holding(tmp_path):  # released: taken again
        pass


def test_folders_the_lock_created_are_removed_when_left_empty_and_kept_otherwise(tmp_path):
    with holding(tmp_path / "a" / "b"):
        assert sorted(os.listdir(tmp_path / "a" / "b")) == [LOCK]
    assert os.listdir(tmp_path) == []
    with holding(tmp_path / "a" / "b"):
        (tmp_path / "a" / "b" / "metrics.parquet").write_text("a run's\n")
    assert os.listdir(tmp_path / "a" / "b") == ["metrics.parquet"]


def test_the_lock_is_released_when_the_block_fails(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with holding(tmp_path):
            raise KeyboardInterrupt
    with holding(tmp_path):
        pass
    assert os.listdir(tmp_path) == []
