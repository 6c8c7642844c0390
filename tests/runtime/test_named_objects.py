"""Objects kept under a name: small ones in the GCS's key-value store, large ones in the object store behind a keeper
actor, read from any process of the cluster."""

import numpy as np
import pytest
import ray

from fedray.runtime.named_objects import NamedObjects, fetch, read


@ray.remote(num_cpus=0)
def read_elsewhere(name, key):
    return read(name, key)


@ray.remote(num_cpus=0)
def fetch_elsewhere(name, key):
    return fetch(name, key)


def test_small_objects_are_read_in_another_process_and_start_no_keeper(ray_session):
    kept = NamedObjects.put({("shard", 0): {"first": 3}, ("shard", 1): "text"}, {})
    try:
        assert kept.keeper is None
        assert ray.get(read_elsewhere.remote(kept.name, ("shard", 0))) == {"first": 3}
        assert ray.get(read_elsewhere.remote(kept.name, ("shard", 1))) == "text"
    finally:
        kept.release()


def test_large_objects_are_fetched_through_the_keeper_in_another_process(ray_session):
    rows = np.arange(12.0).reshape(3, 4)
    kept = NamedObjects.put({("shard", 0): 1}, {7: rows})
    try:
        assert kept.keeper is not None
        assert np.array_equal(ray.get(fetch_elsewhere.remote(kept.name, 7)), rows)
        assert ray.get(read_elsewhere.remote(kept.name, ("shard", 0))) == 1
    finally:
        kept.release()


def test_replace_shows_the_new_objects_and_forgets_the_old(ray_session):
    kept = NamedObjects.put({("shard", 0): "a", ("shard", 1): "b"}, {0: np.zeros(2)})
    try:
        kept = kept.replace({("shard", 0): "c"}, {0: np.ones(2)})
        assert ray.get(read_elsewhere.remote(kept.name, ("shard", 0))) == "c"
        assert np.array_equal(ray.get(fetch_elsewhere.remote(kept.name, 0)), np.ones(2))
        with pytest.raises(KeyError, match=r"keeps no \('shard', 1\)"):
            read(kept.name, ("shard", 1))
    finally:
        kept.release()


def test_release_leaves_nothing_under_the_name(ray_session):
    kept = NamedObjects.put({("shard", 0): "a"}, {0: np.zeros(2)})
    kept.release()
    with pytest.raises(KeyError):
        read(kept.name, ("shard", 0))
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(kept.keeper.reference.remote(0))
