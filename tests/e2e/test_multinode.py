"""Placement groups on a real multi-node cluster: the extraction pool with (logical) GPUs, shards beyond the cluster."""

import json
import subprocess
import time
from pathlib import Path


from fedray.data.registry import load_federation
from tests.images import write_image_folder, write_squeezenet_weights
from tests.local_cluster import ENV, driver_command, local_cluster
from tests.app.test_cli import SPEC
from tests.app.test_extract import SIZE, check_against_direct


def test_gpu_bundles_are_spread_over_the_nodes_and_fall_back_to_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDRAY_CACHE_DIR", str(tmp_path / "fedray-cache"))
    folder = write_image_folder(tmp_path / "folder", classes=2, train_per_class=6, test_per_class=2)
    weights = write_squeezenet_weights(tmp_path / "squeezenet.pt", seed=5)
    argv = ["extract", "--dataset", f"imagefolder:{folder}", "--backbone", "squeezenet1_1", "--weights", str(weights),
            "--image-size", str(SIZE), "--batch-size", "4", "--out", str(tmp_path / "cache"), "--quiet"]
    with local_cluster(nodes=2, cpus=1, gpus=1) as address:
        done = subprocess.run(driver_command(address, argv), env={**ENV, "FEDRAY_CACHE_DIR": str(tmp_path / "fedray-cache")},
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    entry = done.stdout.split("features:")[-1].strip()
    workers = json.loads((Path(entry) / "manifest.json").read_text())["workers"]
    assert len(workers) == 2, "one replica per GPU of the cluster"
    assert len({w["node_id"] for w in workers}) == 2, "the two GPU bundles are on the two nodes"
    assert all(w["gpu_ids"] == ["0"] for w in workers), "each replica was given its node's GPU"
    assert all(w["device"] == "cpu" for w in workers), "no CUDA here: the replicas ran on the CPU"
    cached = load_federation(f"features:{entry}")
    assert cached.train.num_rows == 12 and cached.test.num_rows == 4
    check_against_direct(load_federation(f"imagefolder:{folder}"), entry, weights)


def test_shards_beyond_a_hand_started_cluster_fail_at_once(tmp_path):
    """A cluster started with ``ray start`` runs Ray's read-only autoscaler: no node will come, so no 60 s wait."""
    out = tmp_path / "out"
    argv = ["run", "--dataset", SPEC, "--out", str(out), "--num-shards", "3", "--cpus-per-shard", "1", "--quiet"]
    with local_cluster(nodes=2, cpus=1, gpus=0) as address:
        start = time.monotonic()
        done = subprocess.run(driver_command(address, argv), env=ENV, capture_output=True, text=True, timeout=300)
        seconds = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-2000:]
    assert "fedray: error: cannot reserve 3 shards × 1 CPU: the cluster has 2 CPU, 0 GPU" in done.stderr, done.stderr[-2000:]
    assert "on 2 nodes and no autoscaler to add more; lower --num-shards or --cpus-per-shard" in done.stderr
    assert seconds < 50, "failed at once, not after the 60 s wait"
    assert not out.exists()
