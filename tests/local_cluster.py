"""A multi-node Ray cluster on this machine, on loopback, for tests that need real placement across nodes.

Each node is a ``ray start`` process with its own loopback address (127.0.0.2,
127.0.0.3, ...: Ray rewrites 127.0.0.1 to the machine's network address) and
logical GPUs, and the cluster lives in its own temp folder so that it never
becomes the "current cluster" that a later ``ray.init()`` would join.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_node(arguments: list[str], temp_dir: str, env: dict | None = None) -> subprocess.Popen:
    """``ray start --block`` in a process group of its own (so that :func:`stop_node` takes all it started)."""
    ports = [f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
    return subprocess.Popen(
        [RAY, "start", "--block", f"--temp-dir={temp_dir}", *ports, *arguments],
        env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )


def wait_started(head: subprocess.Popen) -> None:
    for line in head.stdout:
        if b"Ray runtime started" in line:
            return
    raise RuntimeError("the head node did not start")


def stop_node(process: subprocess.Popen, temp_dir: str) -> None:
    """Kill the node's whole process group, then anything still running from its temp folder (nodes the autoscaler made)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    subprocess.run(["pkill", "-KILL", "-f", temp_dir], check=False)


@contextmanager
def local_cluster(nodes: int, cpus: int, gpus: int, dashboard_port: int | None = None, timeout_s: float = 120):
    """Yield the address (``127.0.0.2:PORT``) of a cluster of ``nodes`` nodes, each with ``cpus`` CPUs and ``gpus`` logical GPUs.

    With ``dashboard_port``, the head serves the dashboard (and the job API) on 127.0.0.1:``dashboard_port``.
    """
    temp_dir = tempfile.mkdtemp(prefix="frc", dir="/tmp")
    port = free_port()
    address = f"127.0.0.2:{port}"
    resources = [f"--num-cpus={cpus}", f"--num-gpus={gpus}"]
    dashboard = (["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
                 if dashboard_port else ["--include-dashboard=false"])
    processes = [start_node(["--head", "--node-ip-address=127.0.0.2", f"--port={port}", *dashboard,
                         f"--ray-client-server-port={free_port()}", *resources], temp_dir)]
    try:
        wait_started(processes[0])
        processes += [start_node([f"--address={address}", f"--node-ip-address=127.0.0.{3 + n}", *resources], temp_dir)
                      for n in range(nodes - 1)]
        _wait_for_nodes(address, nodes, timeout_s)
        yield address
    finally:
        for process in reversed(processes):
            stop_node(process, temp_dir)


def _wait_for_nodes(address: str, nodes: int, timeout_s: float) -> None:
    """Poll the cluster from a short-lived driver process (this process may already hold another Ray)."""
    script = (
        "import ray, sys, time\n"
        f"ray.init(address='{address}', _node_ip_address='127.0.0.2', logging_level='ERROR')\n"
        f"deadline = time.time() + {timeout_s}\n"
        f"while len([n for n in ray.nodes() if n['Alive']]) < {nodes}:\n"
        "    if time.time() > deadline: sys.exit('nodes did not join')\n"
        "    time.sleep(0.5)\n"
    )
    subprocess.run([sys.executable, "-c", script], env=ENV, check=True, timeout=timeout_s + 30)


def driver_command(address: str, argv: list[str]) -> list[str]:
    """A ``fedray`` command line run as a driver of the cluster at ``address``."""
    script = (
        "import ray, sys\n"
        f"ray.init(address='{address}', _node_ip_address='127.0.0.2', logging_level='ERROR')\n"
        "from fedray.app.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return [sys.executable, "-c", script, *argv]
