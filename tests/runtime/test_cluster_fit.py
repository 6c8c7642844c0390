"""Requests a cluster can never hold fail at once, naming its resources, unless an autoscaler may add nodes."""

import numpy as np
import pytest

from fedray.engine.config import RunConfig
from fedray.data import synthetic
from fedray.core.errors import FedrayError
from fedray.runtime import cluster
from fedray.runtime.cluster import bundles_that_fit, check_bundles_fit, check_memory, may_add_nodes
from fedray.engine.plan import footprints, plan

NODES = [{"CPU": 2.0, "memory": 4e9}, {"CPU": 1.0, "GPU": 1.0, "memory": 2e9}]


@pytest.mark.parametrize("bundle, fits", [
    ({"CPU": 1}, 3), ({"CPU": 0.5}, 6), ({"CPU": 1 / 3}, 9), ({"CPU": 2}, 1), ({"CPU": 4}, 0),
    ({"CPU": 1, "GPU": 1}, 1), ({"GPU": 1, "CPU": 0}, 1),
])
def test_bundles_that_fit(bundle, fits):
    assert bundles_that_fit(bundle, NODES) == fits


def test_the_embedded_ray_cannot_grow(ray_session):
    assert may_add_nodes() is False


def test_bundles_beyond_the_cluster_fail_at_once_without_autoscaler(ray_session, monkeypatch):
    check_bundles_fit([{"CPU": 1}] * 2, "2 things", "lower them")
    with pytest.raises(FedrayError, match=r"cannot reserve 3 things: the cluster has 2 CPU, 0 GPU, [\d.]+ GB memory on 1 node "
                                          r"and no autoscaler to add more; lower them"):
        check_bundles_fit([{"CPU": 1}] * 3, "3 things", "lower them")
    monkeypatch.setattr(cluster, "may_add_nodes", lambda: True)
    check_bundles_fit([{"CPU": 1}] * 3, "3 things", "lower them")  # left to the placement group's wait


def test_memory_beyond_the_cluster_fails_with_the_estimate(monkeypatch):
    federation = synthetic.build("inat-user-120k", dim=64, scale=0.05, classes=50, seed=1)
    config = RunConfig(method="fed3r-rf", rf_dim=20_000).validate().resolved()
    footprint, = footprints(plan(config, federation), federation)
    samples = np.array([federation.train.num_rows // 2, federation.train.num_rows - federation.train.num_rows // 2])
    tests = np.array([federation.test.num_rows, 0])  # under 8,192 test rows: one chunk, held by the first shard
    monkeypatch.setattr(cluster, "may_add_nodes", lambda: False)
    monkeypatch.setattr(cluster, "alive_nodes", lambda: NODES)
    with pytest.raises(FedrayError) as error:
        check_memory(footprint, samples, tests)
    message = str(error.value)
    total = (footprint.shard(int(samples[0]), int(tests[0])) + footprint.shard(int(samples[1]), 0) + footprint.driver) / 1e9
    for needle in (f"fed3r-rf needs about {total:.1f} GB of memory", "2 shards of up to", "GB on the driver",
                   "p = 20000", "more than the cluster's 6.0 GB (largest node 4.0 GB): lower --rf-dim"):
        assert needle in message, (needle, message)
    monkeypatch.setattr(cluster, "alive_nodes", lambda: [{"CPU": 2.0, "memory": 1e12}])
    check_memory(footprint, samples, tests)
    monkeypatch.setattr(cluster, "alive_nodes", lambda: NODES)
    monkeypatch.setattr(cluster, "may_add_nodes", lambda: True)
    check_memory(footprint, samples, tests)  # nodes may come: not refused on the present ones
