"""Autoscaling on one machine: Ray's fake multi-node provider grows a 1-CPU head to run a sweep that needs more."""

import subprocess
import sys
import tempfile
from pathlib import Path

import polars as pl
import yaml

from tests.local_cluster import ENV, free_port, start_node, stop_node, wait_started

CONFIG = Path(__file__).resolve().parents[2] / "cluster" / "local-fake-autoscaling.yaml"
# Every node on 127.0.0.1: the fake provider starts worker nodes at the address Ray finds for this machine.
FAKE_ENV = {**ENV, "RAY_FAKE_CLUSTER": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def test_a_sweep_larger_than_the_head_grows_the_cluster_and_finishes(tmp_path):
    port = free_port()
    config = yaml.safe_load(CONFIG.read_text())
    config["provider"]["gcs_address"] = f"127.0.0.1:{port}"
    config_path = tmp_path / "autoscaling.yaml"
    config_path.write_text(yaml.safe_dump(config))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("""
name: grows
base: {dataset: "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20", clients_per_round: 10, eval_every: 5}
grid: {method: [fedncm, fed3r]}
shards_per_trial: 1
cpus_per_shard: 1
driver_cpus: 1
""")
    script = (
        "import ray, sys\n"
        f"ray.init(address='127.0.0.1:{port}', logging_level='ERROR')\n"
        "from fedray.app.cli import main\n"
        "from fedray.runtime.cluster import may_add_nodes\n"
        "print('GROWS', may_add_nodes())\n"
        f"code = main(['sweep', '--config', '{sweep}', '--out', '{tmp_path / 'out'}', '--quiet'])\n"
        "print('NODES', len([n for n in ray.nodes() if n['Alive']]))\n"
        "sys.exit(code)\n"
    )
    temp_dir = tempfile.mkdtemp(prefix="fra", dir="/tmp")
    head = start_node(["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                       f"--ray-client-server-port={free_port()}", f"--autoscaling-config={config_path}"], temp_dir, env=FAKE_ENV)
    try:
        wait_started(head)
        done = subprocess.run([sys.executable, "-c", script], env=FAKE_ENV, capture_output=True, text=True, timeout=400)
    finally:
        stop_node(head, temp_dir)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "GROWS True" in done.stdout, "an autoscaler with room for workers: requests wait for nodes instead of failing"
    nodes = int(done.stdout.split("NODES")[-1].split()[0])
    assert nodes >= 2, "each trial needs 2 CPUs and the head has 1: workers were added"
    results = pl.read_parquet(tmp_path / "out" / "grows" / "results.parquet")
    assert sorted(results["method"].unique()) == ["fed3r", "fedncm"]
