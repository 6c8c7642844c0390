"""Ray started in the background (:mod:`fedray.runtime.ray_start`) while the driver imports torch and reads the data:
a refusal that comes after the start, while Ray is still starting or once it is up, stops that Ray; no process of it
outlives the driver, and a refused run leaves no folder. Ctrl-C and SIGTERM during the start:
tests/e2e/test_interrupts.py."""

import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from tests.app.test_cli import SMALL_RUN, byo_table
from tests.e2e.test_interrupts import REPO, process_tree, session_processes, start_time, survivors

REFUSED_AFTER_THE_START = """
import sys, time
from fedray.core.errors import FedrayError
from fedray.runtime.ray_start import RayStart, ray_is_up

try:
    with RayStart() as ray_start:
        while sys.argv[1] == "up" and ray_start.up_s is None:
            time.sleep(0.02)
        raise FedrayError("refused")
except FedrayError:
    print("refused, connected:", ray_is_up(), flush=True)
"""

IMPORTED_BESIDE_THE_START = """
import sys
from fedray.runtime.ray_start import RayStart

with RayStart() as ray_start:
    ray_start.ray_imported()
    services = sys.modules.get("ray._private.services")
    print("whole:", services is not None and hasattr(services, "get_address"), flush=True)
    from ray.util.placement_group import PlacementGroup
    ray_start.stop()
print("stopped", flush=True)
"""


def run_watched(arguments: list[str]) -> tuple[int, str, dict[int, str]]:
    """``arguments`` as a process; its exit code, its output, and every process below it seen while it ran or named
    after its Ray session."""
    driver = subprocess.Popen(arguments, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    started, seen = start_time(driver.pid), {}
    while driver.poll() is None:
        seen.update(process_tree(driver.pid))
        time.sleep(0.02)
    seen.update(session_processes(driver.pid, started))
    return driver.returncode, driver.stdout.read(), seen


@pytest.mark.parametrize("moment", ["starting", "up"])
def test_a_refusal_after_the_start_shuts_that_ray_down(moment):
    """Refused while ``ray.init`` still runs on its thread (the block waits for it, then shuts that Ray down) or once
    Ray is up: the driver is no longer connected, and none of the processes the start began outlives the driver."""
    code, output, seen = run_watched([sys.executable, "-c", REFUSED_AFTER_THE_START, moment])

    assert code == 0 and output.strip().splitlines()[-1] == "refused, connected: False", output[-3000:]
    assert seen, "Ray was started"
    assert survivors(seen) == {}


def test_the_main_thread_imports_ray_only_once_the_start_s_thread_has():
    """The start's thread imports Ray; the main thread waits for that import (``ray_imported``) before it imports
    Ray's modules itself (``fedray run`` imports ``ray.util.placement_group`` after torch). Two threads importing
    Ray at once could see ``ray._private.services`` half-initialized (``cannot import name 'get_address' from
    partially initialized module``)."""
    code, output, seen = run_watched([sys.executable, "-c", IMPORTED_BESIDE_THE_START])

    assert code == 0 and output.strip().splitlines()[-2:] == ["whole: True", "stopped"], output[-3000:]
    assert survivors(seen) == {}


def test_a_run_refused_once_its_data_is_read_leaves_no_ray_and_no_folder(tmp_path):
    """A refusal that needs the data (a federation without test rows) comes after Ray began starting in the
    background: one line, exit 2, no --out folder, and no process of the Ray it started outlives it."""
    path, out = tmp_path / "train-only.parquet", tmp_path / "out"
    pq.write_table(byo_table(num_test=0), path)
    code, output, seen = run_watched([sys.executable, "-m", "fedray", "run", "--dataset", f"parquet:{path}",
                                      "--out", str(out), *SMALL_RUN, "--clients-per-round", "2"])

    assert code == 2, output[-3000:]
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedray: error: ") and "no test rows" in lines[0], output[-3000:]
    assert not out.exists()
    assert seen, "Ray was started while the data was read"
    assert survivors(seen) == {}


CONNECTED_AT_EXIT = """
import atexit, runpy, sys
atexit.register(lambda: print("connected at exit:", sys.modules["ray"].is_initialized(), flush=True))  # runs last
runpy.run_module("fedray", run_name="__main__", alter_sys=True)
"""


def test_a_finished_run_ends_without_rays_shutdown_and_leaves_no_ray(tmp_path):
    """``python -m fedray run`` that started an embedded Ray ends once its results are written: its exit handlers run
    but Ray's shutdown (which would have disconnected it before the handler registered first), and none of Ray's
    processes outlives it."""
    out = tmp_path / "out"
    code, output, seen = run_watched([sys.executable, "-c", CONNECTED_AT_EXIT, "run", "--method", "fedncm",
                                      "--dataset", "synthetic:inat-user-120k?dim=8&scale=0.01&classes=20",
                                      "--out", str(out), *SMALL_RUN])

    assert code == 0, output[-3000:]
    lines = output.strip().splitlines()
    assert lines[-2].startswith("fedncm on synthetic:") and lines[-1] == "connected at exit: True", output[-3000:]
    assert (out / "metrics.parquet").exists() and (out / "classifier.npz").exists()
    assert seen, "Ray was started"
    assert survivors(seen) == {}
