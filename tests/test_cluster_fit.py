"""Requests a cluster can never hold fail at once, naming its resources, unless an autoscaler may add nodes."""

import pytest

from fedray.errors import FedrayError
from fedray.runtime import cluster
from fedray.runtime.cluster import bundles_that_fit, check_bundles_fit, may_add_nodes

NODES = [{"CPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}]


@pytest.mark.parametrize("bundle, fits", [
    ({"CPU": 1}, 3), ({"CPU": 0.5}, 6), ({"CPU": 1 / 3}, 9), ({"CPU": 2}, 1), ({"CPU": 4}, 0),
    ({"CPU": 1, "GPU": 1}, 1), ({"GPU": 1, "CPU": 0}, 1),
])
def test_bundles_that_fit(bundle, fits):
    assert bundles_that_fit(bundle, NODES) == fits


def test_the_embedded_ray_cannot_grow(ray_session):
    assert may_add_nodes() is False


def test_bundles_beyond_the_cluster_fail_at_once_without_autoscaler(ray_session, monkeypatch):
    check_bundles_fit({"CPU": 1}, 2, "2 things", "lower them")
    with pytest.raises(FedrayError, match=r"cannot reserve 3 things: the cluster has 2 CPU, 0 GPU, [\d.]+ GB memory on 1 node "
                                          r"and no autoscaler to add more; lower them"):
        check_bundles_fit({"CPU": 1}, 3, "3 things", "lower them")
    monkeypatch.setattr(cluster, "may_add_nodes", lambda: True)
    check_bundles_fit({"CPU": 1}, 3, "3 things", "lower them")  # left to the placement group's wait
