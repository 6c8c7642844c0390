"""Which Ray a command uses: with no address (nor ``local``) a new embedded one, never a cluster that ``ray start`` left
on the machine; with one, that cluster. ``ray.init`` is replaced by a recorder: no Ray starts and none is joined.
Signals during ``ray.init`` are tested on a real start-up in tests/e2e/test_interrupts.py."""

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from ray._common.utils import get_ray_address_file
from ray._private import services

from fedray.runtime import session, tensor_transfer, watchdog
from tests.runtime.test_address import answering_head


@pytest.fixture
def ray_init_calls(monkeypatch):
    """Each ``ray.init`` call's keyword arguments, and whether the embedded Ray's watchdog was started after it."""
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **options: calls.append(options))
    monkeypatch.setattr(session.watchdog, "start", lambda: calls.append("watchdog"))
    monkeypatch.setattr(tensor_transfer, "register", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


EMBEDDED = [{"address": "local", "include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING,
             "_system_config": {"raylet_client_connect_timeout_milliseconds": 50,
                                "raylet_client_num_connect_attempts": 200}}, "watchdog"]


@pytest.mark.parametrize("address, environment", [(None, None), (None, ""), ("local", None), (None, "local"),
                                                  ("local", "10.0.0.5:6379")],
                         ids=["neither", "empty-RAY_ADDRESS", "--address-local", "RAY_ADDRESS-local", "--address-wins"])
def test_no_address_starts_a_new_embedded_ray(ray_init_calls, monkeypatch, address, environment):
    if environment is not None:
        monkeypatch.setenv("RAY_ADDRESS", environment)
    session.init_ray(address)
    assert ray_init_calls == EMBEDDED
    assert ray_init_calls[0]["_system_config"] is not session.QUICK_STORE_CONNECT, "ray.init adds its session's entries"


@pytest.mark.parametrize("how", ["--address", "RAY_ADDRESS"])
def test_an_address_joins_that_cluster(ray_init_calls, monkeypatch, how):
    with answering_head() as address:
        if how == "RAY_ADDRESS":
            monkeypatch.setenv("RAY_ADDRESS", address)
        session.init_ray(address if how == "--address" else None)
    assert ray_init_calls == [{"address": address, "log_to_driver": False, "logging_level": logging.WARNING}]


def test_the_driver_prints_rays_pushed_raylet_messages_only_when_verbose(ray_init_calls, monkeypatch):
    """Unless --verbose, no ``(raylet) A worker died ...`` lines (a killed shard's): the driver does not listen."""
    listening = ray._private.worker.listen_error_messages
    heard = []
    monkeypatch.setattr(ray, "init",
                        lambda **options: heard.append(ray._private.worker.listen_error_messages is listening))
    session.init_ray()
    session.init_ray(verbose=True)
    assert heard == [False, True]
    assert ray._private.worker.listen_error_messages is listening, "Ray's own again after ray.init"


def test_an_embedded_ray_starts_without_importing_the_dashboard_s_packages(ray_init_calls, monkeypatch):
    """``ray.init`` imported aiohttp, grpc, opentelemetry, ... (2 s) only to ask whether they are installed: an
    embedded Ray (its dashboard left out) is told they are not, as a minimal install of Ray is; a cluster's is not."""
    check = ray._private.utils.get_dashboard_dependency_error
    told = []
    monkeypatch.setattr(ray, "init", lambda **options: told.append(ray._private.utils.get_dashboard_dependency_error()))
    session.init_ray()
    with answering_head() as address:
        session.init_ray(address)
    assert [type(error) for error in told] == [ImportError, check().__class__]
    assert ray._private.utils.get_dashboard_dependency_error is check, "Ray's own check again after ray.init"


HEAD_STEPS = ("start_api_server", "start_monitor", "start_log_monitor")


def test_an_embedded_ray_skips_the_head_processes_it_does_not_use(ray_init_calls, monkeypatch):
    """The API server (its usage-stats module only, yet waited for), the autoscaler's monitor and, unless verbose, the
    log monitor are not started by an embedded Ray's ``ray.init``; a cluster's join, and Ray after the start, keep
    Ray's own steps."""
    node = ray._private.node.Node
    own = {step: getattr(node, step) for step in HEAD_STEPS}
    seen = []
    monkeypatch.setattr(ray, "init", lambda **options: seen.append(
        tuple(step for step in HEAD_STEPS if getattr(node, step) is own[step])))
    session.init_ray()
    session.init_ray(verbose=True)
    with answering_head() as address:
        session.init_ray(address)
    assert seen == [(), ("start_log_monitor",), HEAD_STEPS]
    assert {step: getattr(node, step) for step in HEAD_STEPS} == own, "Ray's own steps again after ray.init"


START_AND_LIST = """
import sys
from fedray.runtime import session, watchdog
import ray
session.init_ray(verbose=sys.argv[1] == "verbose")
print(ray.get(ray.remote(lambda: 7).remote()))
print(ray.get(ray.remote(lambda: [ray._raylet.Config.raylet_client_connect_timeout_milliseconds(),
                                  ray._raylet.Config.raylet_client_num_connect_attempts()]).remote()))
for pid in watchdog.descendants(__import__("os").getpid()):
    try:
        print(open(f"/proc/{pid}/cmdline").read().replace("\\0", " "))
    except OSError:
        pass
"""


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_a_real_embedded_start_runs_tasks_without_those_processes(verbose):
    """A real start: a task runs, its worker retrying the raylet's connections every 50 ms; no ``dashboard.py`` or
    autoscaler ``monitor.py`` among Ray's processes, and ``log_monitor.py`` only for a verbose run (whose driver
    prints the workers' output)."""
    done = subprocess.run([sys.executable, "-c", START_AND_LIST, "verbose" if verbose else "quiet"],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.splitlines()
    assert lines[:2] == ["7", "[50, 200]"]
    scripts = {Path(word).name for line in lines[2:] for word in line.split() if word.endswith(".py")}
    assert "dashboard.py" not in scripts and "monitor.py" not in scripts
    assert ("log_monitor.py" in scripts) == verbose
    assert any("raylet" in line for line in lines[2:]), "the listing sees Ray's processes"


def test_auto_is_left_to_ray(ray_init_calls):
    session.init_ray("auto")
    assert ray_init_calls == [{"address": "auto", "log_to_driver": False, "logging_level": logging.WARNING}]


def test_ray_joins_the_cluster_ray_start_left_unless_told_local(tmp_path, monkeypatch):
    """Why ``address="local"``: Ray resolves no address to the cluster recorded by the last ``ray start``
    (TEMP_DIR/ray_current_cluster), and ``local`` to none (a new one)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with open(get_ray_address_file(str(tmp_path)), "w") as recorded:
        recorded.write("10.0.0.5:6379")
    assert services.canonicalize_bootstrap_address(None, str(tmp_path)) == "10.0.0.5:6379"
    assert services.canonicalize_bootstrap_address("local", str(tmp_path)) is None


def test_ray_init_keeps_the_caller_s_sigterm_handler(monkeypatch):
    """Ray's init replaced it with ``sys.exit(15)``: a SIGTERM during start-up ended fedray with exit 15 and no word."""
    def init(**options):
        ray._private.utils.set_sigterm_handler(lambda number, frame: sys.exit(number))  # what ray.init does first
        assert ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER  # read by the core worker ray.init builds

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(session.watchdog, "start", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    caller_s = signal.getsignal(signal.SIGTERM)
    session.init_ray()
    assert signal.getsignal(signal.SIGTERM) is caller_s
    assert not ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER  # Ray's own workers keep it


def interrupted_start(monkeypatch, init) -> None:
    """``init_ray`` of an embedded Ray whose ``ray.init`` is ``init`` (which raises KeyboardInterrupt, as Ctrl-C would)."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(KeyboardInterrupt):
        session.init_ray()


def test_an_interrupted_start_kills_what_it_had_started_orphans_included(monkeypatch):
    """A process whose parent died first (the raylet's agents, when Ctrl-C reaches the raylet too) is killed as well."""
    started = {}

    def init(**options):
        shell = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
        started["orphan"] = int(shell.stdout)  # its parent, the shell, has ended
        started["child"] = subprocess.Popen(["sleep", "60"])
        raise KeyboardInterrupt

    interrupted_start(monkeypatch, init)
    assert started["child"].wait(timeout=10) == -signal.SIGKILL
    assert os.waitpid(started["orphan"], 0)[1] == signal.SIGKILL  # this process's child now, so it can wait for it


def test_an_interrupted_start_kills_what_was_forked_while_it_killed(monkeypatch):
    """A parent that forks as the kill comes (the raylet starting its agents as Ctrl-C arrives): its new children are
    killed too, however many passes it takes. Here a shell forks 300 sleeps as fast as it can."""
    before = set(watchdog.descendants(os.getpid()))

    def init(**options):
        subprocess.Popen(["sh", "-c", "for i in $(seq 300); do sleep 60 & done; wait"])
        while len(set(watchdog.descendants(os.getpid())) - before) < 20:  # the shell is forking
            pass
        raise KeyboardInterrupt

    interrupted_start(monkeypatch, init)
    assert [pid for pid in set(watchdog.descendants(os.getpid())) - before if alive(pid)] == []


def alive(pid: int) -> bool:
    """Running: neither ended nor a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_where_written_is_absolute_and_says_when_it_is_in_rays_copy_of_a_jobs_working_dir(tmp_path, monkeypatch):
    """``ray job submit --working-dir .`` runs its command in Ray's unpacked copy: a relative --out lands there."""
    monkeypatch.chdir(tmp_path)
    assert session.where_written("results/quickstart") == (f"{tmp_path}/results/quickstart", None)
    copy = tmp_path / "session_latest" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    assert session.where_written("results/quickstart") == (
        f"{copy}/results/quickstart", f"{copy}/results/quickstart is inside Ray's copy of the job's --working-dir on "
        "the node that ran it (not where the job was sent from), removed with Ray's session files: give an absolute "
        "--out on storage you can read to keep the results")
