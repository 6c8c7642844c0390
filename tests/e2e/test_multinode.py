"""Placement groups on a real multi-node cluster: the extraction pool with (logical) GPUs, shards beyond the cluster,
and the must-show of a Parquet directory on a cluster (the same closed-form run on two nodes, each shard reading its
own parts, gives bitwise the classifier of one node).

The tests share one cluster of two one-CPU nodes with a logical GPU each (starting one takes three processes per node):
the extraction pool takes its GPUs, and the closed-form runs, which ask for none, its CPUs."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import fedray
from fedray.data.export import export_parquet_directory
from fedray.data.registry import load_federation
from tests.images import write_image_folder, write_squeezenet_weights
from tests.local_cluster import ENV, driver_command, local_cluster
from tests.app.test_cli import SPEC
from tests.app.test_extract import SIZE, check_against_direct
from tests.engine.test_training_runs import without_layout

TINY = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
RUN = dict(method="fed3r", clients_per_round=20, num_shards=2, cpus_per_shard=1, quiet=True)

DRIVER = """
import json, sys
import ray
import fedray

ray.init(address=sys.argv[1], _node_ip_address="127.0.0.2", logging_level="ERROR")
fedray.run(dataset=sys.argv[2], out=sys.argv[3], **json.loads(sys.argv[4]))
actors = ray._private.state.actors().values()  # the GCS's table, dead actors included (no dashboard here)
print(json.dumps(sorted({actor["Address"]["IPAddress"] for actor in actors if actor["ActorClassName"] == "ShardActor"})))
"""


@pytest.fixture(scope="module")
def two_nodes():
    """The address of a cluster of two nodes of one CPU (one shard on each) and one logical GPU each (no CUDA)."""
    with local_cluster(nodes=2, cpus=1, gpus=1) as address:
        yield address


def test_gpu_bundles_are_spread_over_the_nodes_and_fall_back_to_cpu(two_nodes, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDRAY_CACHE_DIR", str(tmp_path / "fedray-cache"))
    folder = write_image_folder(tmp_path / "folder", classes=2, train_per_class=6, test_per_class=2)
    weights = write_squeezenet_weights(tmp_path / "squeezenet.pt", seed=5)
    argv = ["extract", "--dataset", f"imagefolder:{folder}", "--backbone", "squeezenet1_1", "--weights", str(weights),
            "--image-size", str(SIZE), "--batch-size", "4", "--out", str(tmp_path / "cache"), "--quiet"]
    env = {**ENV, "FEDRAY_CACHE_DIR": str(tmp_path / "fedray-cache")}
    done = subprocess.run(driver_command(two_nodes, argv), env=env, capture_output=True, text=True, timeout=300)
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


def test_shards_beyond_a_hand_started_cluster_fail_at_once(two_nodes, tmp_path):
    """A cluster started with ``ray start`` runs Ray's read-only autoscaler: no node will come, so no 60 s wait."""
    out = tmp_path / "out"
    argv = ["run", "--dataset", SPEC, "--out", str(out), "--num-shards", "3", "--cpus-per-shard", "1", "--quiet"]
    start = time.monotonic()
    done = subprocess.run(driver_command(two_nodes, argv), env=ENV, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-2000:]
    assert "fedray: error: cannot reserve 3 shards × 1 CPU: the cluster has 2 CPU, 2 GPU" in done.stderr, done.stderr[-2000:]
    assert "on 2 nodes and no autoscaler to add more; lower --num-shards or --cpus-per-shard" in done.stderr
    assert seconds < 50, "failed at once, not after the 60 s wait"
    assert not out.exists()


def test_a_closed_form_run_on_two_nodes_reading_a_parquet_directory_is_bitwise_one_nodes(ray_session, two_nodes,
                                                                                        tmp_path):
    folder = tmp_path / "parts"
    export_parquet_directory(load_federation(TINY), folder, 300)
    dataset = f"parquet:{folder}"
    one_node = fedray.run(dataset=dataset, out=tmp_path / "one-node", **RUN)
    source = fedray.run(dataset=TINY, out=tmp_path / "source", **RUN)
    driver = [sys.executable, "-c", DRIVER, two_nodes, dataset, str(tmp_path / "two-nodes"), json.dumps(RUN)]
    done = subprocess.run(driver, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["127.0.0.2", "127.0.0.3"], "a shard on each node"
    with np.load(tmp_path / "two-nodes" / "classifier.npz") as on_two_nodes:
        assert np.array_equal(on_two_nodes["W"], one_node.classifier.weight.numpy())
        assert np.array_equal(on_two_nodes["W"], source.classifier.weight.numpy())


LAYOUT_RUNS = {"fed3r": {}, "fedcof": {}, "fedncm": {}, "fedavg": {"rounds": 4},
               "scaffold": {"rounds": 4}, "feddyn": {"rounds": 4}, "fednova": {"rounds": 4},
               "two-stage": {"method": "fedavg", "init": "fed3r", "rounds": 4, "temperature": 0.1, "client_lr": 0.001}}
"""Runs of every kind of sum (closed forms, training with and without clients' states, a two-stage run) by name."""

LAYOUT_DRIVER = """
import json, sys
import ray
import fedray

ray.init(address=sys.argv[1], _node_ip_address="127.0.0.2", logging_level="ERROR")
for name, options in json.loads(sys.argv[4]).items():
    fedray.run(dataset=sys.argv[2], out=f"{sys.argv[3]}/{name}", **{"method": name, **options})
"""


@pytest.mark.slow
def test_every_kind_of_run_on_two_nodes_is_bitwise_three_shards_on_one(ray_session, two_nodes, tmp_path):
    """Two shards on two nodes (one thread each) and three shards of half a CPU on one node: the same classifier and
    the same rows, bit for bit, for closed forms, training runs and a two-stage run."""
    common = dict(clients_per_round=20, eval_every=2, seed=3, quiet=True)
    runs = {name: {**common, **options} for name, options in LAYOUT_RUNS.items()}
    nodes = {name: {**options, "num_shards": 2, "cpus_per_shard": 1} for name, options in runs.items()}
    driver = [sys.executable, "-c", LAYOUT_DRIVER, two_nodes, TINY, str(tmp_path / "two-nodes"), json.dumps(nodes)]
    done = subprocess.run(driver, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for name, options in runs.items():
        one = fedray.run(dataset=TINY, out=tmp_path / "one-node" / name,
                         **{"method": name, **options, "num_shards": 3, "cpus_per_shard": 0.5})
        two = tmp_path / "two-nodes" / name
        with np.load(two / "classifier.npz") as arrays:
            assert np.array_equal(arrays["W"], one.classifier.weight.numpy()), name
        rows = pq.read_table(two / "metrics.parquet").to_pylist()
        assert rows and ([without_layout(row) for row in rows]
                         == [without_layout(row) for row in one.metrics.to_dicts()]), name
