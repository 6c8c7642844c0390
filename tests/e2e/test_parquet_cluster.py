"""The must-show of a Parquet directory on a cluster: the same closed-form run on two nodes, each shard reading its own
parts, gives bitwise the classifier of one node."""

import json
import subprocess
import sys

import numpy as np

import fedray
from fedray.data.export import export_parquet_directory
from fedray.data.registry import load_federation
from tests.local_cluster import ENV, local_cluster

SPEC = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
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


def test_a_closed_form_run_on_two_nodes_reading_a_parquet_directory_is_bitwise_one_nodes(ray_session, tmp_path):
    folder = tmp_path / "parts"
    export_parquet_directory(load_federation(SPEC), folder, 300)
    dataset = f"parquet:{folder}"
    one_node = fedray.run(dataset=dataset, out=tmp_path / "one-node", **RUN)
    source = fedray.run(dataset=SPEC, out=tmp_path / "source", **RUN)
    with local_cluster(nodes=2, cpus=1, gpus=0) as address:  # one CPU a node: one shard on each
        done = subprocess.run([sys.executable, "-c", DRIVER, address, dataset, str(tmp_path / "two-nodes"), json.dumps(RUN)],
                              env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["127.0.0.2", "127.0.0.3"], "a shard on each node"
    with np.load(tmp_path / "two-nodes" / "classifier.npz") as two_nodes:
        assert np.array_equal(two_nodes["W"], one_node.classifier.weight.numpy())
        assert np.array_equal(two_nodes["W"], source.classifier.weight.numpy())
