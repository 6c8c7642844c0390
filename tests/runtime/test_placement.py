"""Placement: how many actors a run starts when not told."""

import ray

from fedray.runtime.shards import ShardPool
from tests.runtime.test_runtime import stand_in


def test_the_default_number_of_shards_does_not_depend_on_the_cpus_free_at_start(ray_session, monkeypatch):
    """Half the session's 2 CPUs free at the start: still 4 shards of 0.5 CPU (the cluster's total over 0.5), not 2."""
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 1.0})
    pool = ShardPool.start(stand_in("inat-geo-100"), cpus_per_shard=0.5)
    try:
        assert pool.num_shards == 4
    finally:
        pool.shutdown()
