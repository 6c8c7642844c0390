"""Real signals to real ``fedray run`` processes: Ctrl-C and SIGTERM stop cleanly, and SIGKILL leaves no Ray behind
(``fedray sweep`` stopped by Ctrl-C: tests/e2e/test_sweep_trials.py).

Each test starts the command line as a process of its own session (as a shell
starts a job), waits until the work is under way (a checkpoint file, the
progress bar when no checkpoint is due) or until a moment of its start-up,
signals it, and checks its exit code, its last line, the files it leaves and
that every process it had started is gone. SIGINT goes to the whole process
group, as Ctrl-C in a terminal sends it.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedray.engine.config import resolve
from fedray.engine.checkpoint import CHECKPOINT, load_checkpoint
from fedray.core.folder_lock import LOCK
from fedray.runtime.client_states import SPILL_FOLDERS

REPO = Path(__file__).resolve().parents[2]
SPEC = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60"
FOREVER = {"method": "fedavg", "dataset": SPEC, "rounds": 100000, "eval_every": 1000, "num_shards": 2, "cpus_per_shard": 0.5}
STARTUP_S = 300
"""Bound on the wait for Ray, the shards and the first rounds (minutes on a loaded 2-core machine)."""
CLEANUP_S = 30
"""Bound on the wait for a signalled run and every process it started to end (Ray's agents outlived a killed driver by 60 s)."""


def starting_stop_s() -> float:
    """Bound, from now, on the end of a run signalled while Ray starts: ``CLEANUP_S`` on a machine no busier than its
    cores, more in proportion to its load. Such a run first lets ``ray.init`` end on its thread (a core worker cut short
    would crash the process: :mod:`fedray.runtime.ray_start`), then shuts that Ray down: seconds of CPU (Ray's wait for
    its raylet to register, the driver's connection, the imports ``ray.shutdown`` makes), 9 s at a load of 4 on 2
    cores, and more than 30 s beside the other pytest-xdist worker's tests."""
    return CLEANUP_S * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def command_line(out: Path, **options) -> list[str]:
    arguments = [sys.executable, "-m", "fedray", "run", "--out", str(out)]
    for key, value in {**FOREVER, **options}.items():
        flag = "--" + key.replace("_", "-")
        arguments += [flag] if value is True else [flag, str(value)]
    return arguments


@pytest.fixture
def start():
    """Starts ``fedray run`` (stderr to a file) in a session of its own; kills what is left of it after the test."""
    drivers = []

    def started(out: Path, log: Path, arguments: list[str] | None = None, env: dict[str, str] | None = None,
                **options) -> subprocess.Popen:
        """``fedray run`` with FOREVER and ``options``, or the command line ``arguments`` (``env``: its environment)."""
        with open(log, "w") as stderr:
            drivers.append(subprocess.Popen(arguments or command_line(out, **options), cwd=REPO, env=env,
                                            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True))
        return drivers[-1]

    yield started
    for driver in drivers:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()


def wait_until(ready, driver: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not ready():
        assert driver.poll() is None, f"the run ended before it was signalled:\n{log.read_text()[-2000:]}"
        if time.monotonic() > deadline:
            pytest.fail(f"the run did not get going in {STARTUP_S} s:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)


def children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def process_tree(pid: int) -> dict[int, str]:
    """Every process below ``pid`` now, by pid, with its start time (a reused pid has another)."""
    tree, found, todo = children(), {}, [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if (started := start_time(child)) is not None:
                found[child] = started
            todo.append(child)
    return found


def start_time(pid: int) -> str | None:
    """None once ``pid`` has ended (or is a zombie waiting for its parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def survivors(processes: dict[int, str]) -> dict[int, str]:
    """Those of ``processes`` still running ``CLEANUP_S`` after the driver ended (returns as soon as none is)."""
    deadline = time.monotonic() + CLEANUP_S
    while True:
        alive = {pid: started for pid, started in processes.items() if start_time(pid) == started}
        if not alive or time.monotonic() > deadline:
            return {pid: command_of(pid) for pid in alive}
        time.sleep(0.2)


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace")
    except OSError:
        return "(ended just now)"


def signal_run(driver: subprocess.Popen, number: int) -> tuple[dict[int, str], int]:
    """Send ``number`` (SIGINT to the process group, as Ctrl-C does); the run's processes then, and its exit code."""
    processes = process_tree(driver.pid)
    assert processes, "Ray's processes are children of the driver"
    if number == signal.SIGINT:
        os.killpg(driver.pid, number)
    else:
        os.kill(driver.pid, number)
    try:
        return processes, driver.wait(timeout=CLEANUP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"signal {number}: the run did not stop within {CLEANUP_S} s")


def last_line(log: Path) -> str:
    return log.read_text().strip().splitlines()[-1]


@pytest.mark.parametrize("number, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_a_run_at_its_last_checkpoint(start, tmp_path, number, code):
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    driver = start(out, log, checkpoint_every=2, quiet=True)
    wait_until(lambda: (out / CHECKPOINT).is_file(), driver, log)
    processes, exit_code = signal_run(driver, number)

    assert exit_code == code, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and "SIGTERM received" not in text, text[-3000:]
    name = signal.Signals(number).name
    prefix = f"fedray: stopped by {name}: the last checkpoint is {out / CHECKPOINT}, after training round "
    line = last_line(log)
    assert line.startswith(prefix) and line.endswith("; continue with --resume"), line
    saved_round = int(line[len(prefix):].split(";")[0])
    assert sorted(path.name for path in out.iterdir()) == [CHECKPOINT], "nothing but the checkpoint, no temporary file"
    config = resolve({}, {**FOREVER, "out": str(out), "checkpoint_every": 2, "quiet": True})
    assert load_checkpoint(out, config.to_dict()).done == saved_round and saved_round % 2 == 0
    assert survivors(processes) == {}, "Ray is shut down with the run"


@pytest.mark.parametrize("number, code", [(signal.SIGINT, 130)])
def test_a_signal_before_the_first_checkpoint_says_nothing_was_written(start, tmp_path, number, code):
    """Ctrl-C, as a user watching the progress bar presses it. SIGTERM in training is the last test's; its line when
    nothing is written, the start-up moments' (test_a_signal_at_any_moment_of_start_up_stops_the_run_in_one_line)."""
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    driver = start(out, log, checkpoint_every=100000)
    wait_until(lambda: "fedavg:" in log.read_text(), driver, log)  # the progress bar of fedavg: training has started
    processes, exit_code = signal_run(driver, number)

    assert exit_code == code, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
    assert last_line(log) == f"fedray: stopped by {signal.Signals(number).name}: nothing written to {out} (no checkpoint yet)"
    assert not out.exists() or not any(out.iterdir())
    assert survivors(processes) == {}


def test_no_ray_process_outlives_a_killed_run(start, tmp_path):
    """SIGKILL runs no cleanup: the processes Ray ties to the driver die with it, and fedray's watchdog takes the rest."""
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    driver = start(out, log, checkpoint_every=2, quiet=True)
    wait_until(lambda: (out / CHECKPOINT).is_file(), driver, log)
    processes, exit_code = signal_run(driver, signal.SIGKILL)

    assert exit_code == -signal.SIGKILL
    left = sorted(path.name for path in out.iterdir())
    assert LOCK in left, "SIGKILL runs no cleanup: the run's lock file stays (the kernel released its lock)"
    left.remove(LOCK)
    # A kill during a later checkpoint's write leaves that write's temporary beside the whole checkpoint; the next
    # run on the folder removes it (tests/app/test_outputs.py::test_a_later_run_removes_only_its_own_stale_temporaries).
    assert left[-1] == CHECKPOINT and len(left) <= 2, left
    assert all(re.fullmatch(rf"\.{re.escape(CHECKPOINT)}\.[0-9a-f]{{8}}\.tmp", name) for name in left[:-1]), left
    config = resolve({}, {**FOREVER, "out": str(out), "checkpoint_every": 2, "quiet": True})
    assert load_checkpoint(out, config.to_dict()).done >= 2, "the checkpoint, written atomically, is whole"
    assert survivors(processes) == {}


def spill_folders_holding(out: Path, temporary: Path) -> set[Path]:
    """The spill folders (in the temporary folder ``temporary``) holding files a checkpoint in ``out`` links to."""
    linked = {file.stat().st_ino for file in out.glob("checkpoint-clients-r*-spilled/client-*.safetensors")}
    assert linked, "the run spilled every state and its checkpoint links them"
    return {file.parent for file in (temporary / SPILL_FOLDERS).glob("*/client-*.safetensors")
            if file.stat().st_ino in linked}


def test_the_next_run_removes_the_states_a_killed_run_spilled(start, tmp_path):
    """SIGKILL runs no cleanup: the killed run's shards' spill folders stayed (29 and 31 files after a later run, tens of
    GB at iNat scale); the next run's shards remove them as they start. Both runs spill into a temporary folder of
    their own (``TMPDIR``; Ray's stays where it was): any shard that starts on the machine removes a dead run's spill
    folders, another test's beside this one (pytest-xdist) included."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "RAY_TMPDIR": tempfile.gettempdir()}
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    driver = start(out, log, env=env, method="feddyn", checkpoint_every=2, client_state_memory=0, quiet=True)
    wait_until(lambda: (out / CHECKPOINT).is_file(), driver, log)
    processes, exit_code = signal_run(driver, signal.SIGKILL)
    assert exit_code == -signal.SIGKILL and survivors(processes) == {}
    leaked = spill_folders_holding(out, temporary)
    assert len(leaked) == 2, "both shards' spill folders are left behind"

    later_log = tmp_path / "later.txt"
    later = start(tmp_path / "later", later_log, env=env, rounds=1, eval_every=1, quiet=True)
    assert later.wait(timeout=STARTUP_S) == 0, later_log.read_text()[-3000:]
    assert not any(folder.exists() for folder in leaked)


def handles_signals(pid: int) -> bool:
    """Whether ``pid`` catches SIGINT and SIGTERM (its SigCgt mask): fedray's ``main`` has begun. Before it, the
    interpreter is still starting and a signal can only do what it does by default (end the process)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return all(caught >> (number - 1) & 1 for number in (signal.SIGINT, signal.SIGTERM))


def session_processes(driver_pid: int, started_after: str) -> dict[int, str]:
    """Processes of the embedded Ray that ``driver_pid`` started, by their session (``session_<date>_<driver pid>``)
    on their command line, whoever their parent is now (a process whose parent died is the init process's)."""
    session = re.compile(rf"session_[0-9_-]+_{driver_pid}\b")
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and session.search(command_of(int(entry.name))):
            started = start_time(int(entry.name))
            if started is not None and int(started) >= int(started_after):
                found[int(entry.name)] = started
    return found


class RunProcesses:
    """Every process of a run seen so far: its process tree, polled while the driver runs, and its Ray session."""

    def __init__(self, driver: subprocess.Popen) -> None:
        self.driver = driver
        self.created = time.monotonic()
        self.driver_started = start_time(driver.pid)
        self.seen: dict[int, str] = {}

    def poll(self) -> None:
        self.seen.update(process_tree(self.driver.pid))

    def wait_for(self, ready, log: Path) -> None:
        """Poll until ``ready()`` (the driver still running)."""
        deadline = time.monotonic() + STARTUP_S
        while not ready():
            self.poll()
            assert self.driver.poll() is None, f"the run ended before it was signalled:\n{log.read_text()[-2000:]}"
            if time.monotonic() > deadline:
                pytest.fail(f"the run did not get there in {STARTUP_S} s:\n{log.read_text()[-2000:]}")
            time.sleep(0.02)
        self.poll()

    def signal_and_wait(self, number: int) -> int:
        """Send ``number`` (SIGINT to the process group, as Ctrl-C does); the exit code, the processes polled until then."""
        if number == signal.SIGINT:
            os.killpg(self.driver.pid, number)
        else:
            os.kill(self.driver.pid, number)
        bound = starting_stop_s()
        deadline = time.monotonic() + bound
        while self.driver.poll() is None:
            self.poll()
            if time.monotonic() > deadline:
                pytest.fail(f"signal {number}: the run did not stop within {bound:.0f} s")
            time.sleep(0.02)
        self.seen.update(session_processes(self.driver.pid, self.driver_started))
        return self.driver.returncode

    def survivors(self) -> dict[int, str]:
        """Those still running ``CLEANUP_S`` after the driver ended, by pid with their command; they are killed (they
        are this run's, no one else's)."""
        left = survivors(self.seen)
        for pid in left:
            if start_time(pid) == self.seen[pid]:
                os.kill(pid, signal.SIGKILL)
        return left


def seconds_after_start(seconds: float):
    """``seconds`` after the run started, or once fedray's main catches signals if that is later."""
    return lambda run: lambda: time.monotonic() - run.created >= seconds and handles_signals(run.driver.pid)


def once_running(*names: str):
    """Once a process whose command line contains one of ``names`` is below the driver."""
    return lambda run: lambda: any(name in command_of(pid) for pid in process_tree(run.driver.pid) for name in names)


TIMES = {f"{seconds}s": seconds_after_start(seconds) for seconds in (0.3, 1, 2, 4, 8)}
"""The interpreter and the imports, the federation, ray.init: where these times fall on a quiet 2-core machine."""
STEPS = {
    "gcs_server": once_running("gcs_server"),
    "raylet": once_running("raylet/raylet"),
    "agents": once_running("runtime_env/agent", "ray::RuntimeEnvAgent"),
    "shard_actors": once_running("ray::ShardActor"),
}
"""ray.init's steps and what follows it, whatever the machine's speed."""
SIGINT, SIGTERM = (signal.SIGINT, 130), (signal.SIGTERM, 143)
MOMENTS = [(moment, *signalled) for moment, signalled in zip(TIMES, [SIGINT, SIGTERM] * len(TIMES))] + \
          [(moment, *signalled) for moment in STEPS for signalled in (SIGINT, SIGTERM)]
"""Each of ``STEPS`` with both signals, each of ``TIMES`` with one, in turn. In the driver the two take one path (the
handler raises the signal's interrupt in the main thread, the same blocks unwind, the same line is printed with the
signal's name); they differ in who else gets them: Ctrl-C goes to the whole process group, Ray's processes included
(a raylet or an agent ended by it while ``ray.init`` waits on them), SIGTERM to the driver alone. That matters once
Ray's processes run, at each of ``STEPS``; ``TIMES`` fall in the imports and the reading of the data, with Ray's
processes, if any are up yet, already taken at each step by both signals."""


@pytest.mark.parametrize("moment, number, code", [
    pytest.param(moment, number, code, id=f"{number}-{code}-{moment}") for moment, number, code in MOMENTS])
def test_a_signal_at_any_moment_of_start_up_stops_the_run_in_one_line(start, tmp_path, moment, number, code):
    """Once fedray's main runs, Ctrl-C and SIGTERM end a starting run with 130 / 143 and one line, whatever it was
    doing (importing torch, building the federation, starting Ray's processes, connecting, starting the shards),
    and no process of its Ray outlives it. They used to be ignored (exit 0), end it with exit 15 and no word (Ray's
    own SIGTERM handler during ray.init), or with a pandas traceback (an import stopped halfway), and to leave Ray's
    dashboard and runtime-env agents running for a minute."""
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    driver = start(out, log, checkpoint_every=100000, quiet=True)
    run = RunProcesses(driver)
    run.wait_for({**TIMES, **STEPS}[moment](run), log)
    exit_code = run.signal_and_wait(number)
    left = run.survivors()

    text = log.read_text()
    assert exit_code == code, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    name = signal.Signals(number).name
    nothing_written = f"fedray: stopped by {name}: nothing written to {out} (no checkpoint yet)"
    # Before the run's options are read, --out is not known yet: the line says only what stopped the run.
    expected = {nothing_written} if moment in STEPS else {f"fedray: stopped by {name}", nothing_written}
    assert last_line(log) in expected, text[-3000:]
    assert not out.exists() or not any(out.iterdir())
    assert left == {}, f"still running {CLEANUP_S} s after the run ended"


CONNECTING_INTERRUPTED = """
import os, signal, sys
import ray
import ray._private.worker as worker
from fedray.core import interrupts
from fedray.runtime import session

connect = worker.connect

def connect_after_ctrl_c(*args, **kwargs):
    os.killpg(0, signal.SIGINT)  # Ctrl-C as the driver connects, to Ray's processes too; the driver's is held
    return connect(*args, **kwargs)

worker.connect = connect_after_ctrl_c
with interrupts.handling_interrupts():
    try:
        session.init_ray()
    except KeyboardInterrupt:
        print("interrupted, connected:", ray.is_initialized(), flush=True)
        ray.shutdown()
        sys.exit(130)
"""


def test_ctrl_c_as_the_driver_connects_leaves_no_ray_process(tmp_path):
    """Ctrl-C (to the process group) exactly while the driver connects, the one step where the driver's interrupt
    waits: it comes once Ray is up, the caller shuts Ray down, and no process of that Ray outlives the driver."""
    driver = subprocess.Popen([sys.executable, "-c", CONNECTING_INTERRUPTED], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started, seen = start_time(driver.pid), {}
    while driver.poll() is None:
        seen.update(process_tree(driver.pid))
        time.sleep(0.02)
    output = driver.stdout.read()
    assert driver.returncode == 130 and "interrupted, connected: True" in output, output[-3000:]
    seen.update(session_processes(driver.pid, started))
    assert seen, "the embedded Ray's processes were seen"
    assert survivors(seen) == {}
