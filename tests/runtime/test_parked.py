"""Shards parked by one run and taken by the next give bitwise what new shards give, and never stand in anyone's way."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

import fedray.engine.run_config
from fedray.core.errors import FedrayError
from fedray.data import synthetic
from fedray.engine.config import resolve
from fedray.runtime import parked
from fedray.runtime.actor_group import ActorGroup
from tests.started_pools import keeping_started_pools

SPEC = "synthetic:inat-geo-100?dim=8&scale=0.3&classes=6"  # rebuilt from its spec in each shard
RUNS = {  # a training algorithm with clients' states, then a closed form on another federation, held in memory
    "scaffold": dict(method="scaffold", client_lr=0.05, rounds=4, clients_per_round=6, eval_every=2),
    "fed3r": dict(method="fed3r", rounds=4, clients_per_round=5, eval_every=2),
}


def run(out: Path, method: str, on_point=None) -> tuple[list[dict], dict[str, np.ndarray]]:
    config = resolve({}, {"dataset": SPEC, "out": str(out), "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
                          **RUNS[method]})
    federation = synthetic.build("inat-geo-100", dim=8, scale=0.2, classes=5, seed=1) if method == "fed3r" else None
    fedray.engine.run_config.run(config, on_point=on_point, federation=federation)
    rows = pq.read_table(out / "metrics.parquet").drop(["wall_s"]).to_pylist()
    return rows, dict(np.load(out / "classifier.npz"))


def assert_same(a: tuple[list[dict], dict[str, np.ndarray]], b: tuple[list[dict], dict[str, np.ndarray]]) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert np.array_equal(a[1][name], b[1][name]), name


@pytest.fixture(scope="module")
def fresh_runs(ray_session, tmp_path_factory):
    """Each method's run on new shards (none parked, none taken)."""
    parked.release()
    with pytest.MonkeyPatch.context() as fresh:
        fresh.setattr(parked, "allowed", lambda: False)
        return {method: run(tmp_path_factory.mktemp(method), method) for method in RUNS}


@ray.remote
class Holder:
    pass


@pytest.mark.slow  # six runs, three on new shards, one killed; the fast layer keeps the parked shards' giving way
def test_two_runs_through_parked_shards_give_bitwise_two_fresh_runs(fresh_runs, tmp_path, monkeypatch):
    pools = keeping_started_pools(monkeypatch)

    def kill_shard_1(point, classifier):  # restarted, it loads this run's rows, not those it was created with
        if point.round == 2:
            ray.kill(pools[-1].actors[1], no_restart=False)

    reused = {method: run(tmp_path / f"reused-{method}", method) for method in RUNS}
    again = run(tmp_path / "again-scaffold", "scaffold")  # no clients' states left from the first run
    killed = run(tmp_path / "killed-fed3r", "fed3r", kill_shard_1)
    assert [pool.actors for pool in pools[1:]] == [pools[0].actors] * 3, "the later runs took the first run's shards"
    for method in RUNS:
        assert_same(reused[method], fresh_runs[method])
    assert_same(again, fresh_runs["scaffold"])
    assert_same(killed, fresh_runs["fed3r"])


@pytest.mark.slow  # with the fresh runs on new shards, four runs; the fast layer keeps the parked shards' giving way
def test_a_failed_run_leaves_no_shards_that_change_the_next(fresh_runs, tmp_path):
    def fail(point, classifier):
        if point.round == 2:
            raise FedrayError("stop here")

    with pytest.raises(FedrayError, match="stop here"):
        run(tmp_path / "failed", "scaffold", on_point=fail)
    assert_same(run(tmp_path / "after", "scaffold"), fresh_runs["scaffold"])


def test_parked_shards_give_way_to_any_reservation(ray_session, tmp_path):
    run(tmp_path / "parks", "fed3r")
    group = ActorGroup.launch(Holder, {"CPU": 2}, [()], np.array([0, 1]), what="all the CPUs", hint="none")
    group.shutdown()


def test_parked_shards_stay_beside_a_reservation_that_fits_beside_them(ray_session, tmp_path, monkeypatch):
    pools = keeping_started_pools(monkeypatch)
    run(tmp_path / "parks", "fed3r")  # 2 shards × 0.5 CPU of the session's 2
    beside = ActorGroup.launch(Holder, {"CPU": 1}, [()], np.array([0, 1]), what="the other CPU", hint="none")
    beside.shutdown()
    run(tmp_path / "takes", "fed3r")
    assert pools[1].actors == pools[0].actors, "the second run took the shards the first parked"
    whole = ActorGroup.launch(Holder, {"CPU": 2}, [()], np.array([0, 1]), what="all the CPUs", hint="none")
    whole.shutdown()
    assert not parked.any_parked(), "a reservation that needs their CPUs shut them down"
