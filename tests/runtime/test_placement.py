"""Placement: how many actors a run starts when not told."""

import ray

from fedray.runtime.shards import ShardPool
from tests.runtime.test_runtime import stand_in


def test_the_default_number_of_shards_does_not_depend_on_the_cpus_free_at_start(ray_session, monkeypatch):
    counts = []
    for free in ({"CPU": 2.0}, {"CPU": 1.0}, {}):
        monkeypatch.setattr(ray, "available_resources", lambda free=free: free)
        pool = ShardPool.start(stand_in("inat-geo-100"), cpus_per_shard=0.5)
        counts.append(pool.num_shards)
        pool.shutdown()
    assert counts == [4, 4, 4]  # the test session's Ray has 2 CPUs
