"""The sharded runtime gives the centralized solutions, on any split, rate, sampling and shard count."""

import math

import numpy as np
import pytest
import ray
import torch

from fedray.engine.config import RunConfig
from fedray.data import synthetic
from fedray.runtime.evaluator import Evaluator
from fedray.engine.plan import build_method
from fedray.engine.run_config import simulate
from fedray.runtime import sampling
from fedray.runtime.actor_group import balanced_bounds
from fedray.runtime.shards import ShardPool
from tests.reference import class_means, fedcof_algorithm1, features_and_labels, max_relative_difference, normalized, ridge

SPLITS = ["inat-user-120k", "inat-geo-100", "inat-geo-3k"]


def stand_in(split):
    return synthetic.build(split, dim=24, scale=0.04, classes=60, seed=3)


@pytest.fixture(scope="module")
def pools(ray_session):
    """The shard pool of (split, shards), keeping only the latest one alive (2 CPUs in all)."""
    latest = {}

    def get(split, shards):
        if (split, shards) not in latest:
            for pool in latest.values():
                pool.shutdown()
            latest.clear()
            latest[split, shards] = ShardPool.start(stand_in(split), num_shards=shards, cpus_per_shard=2 / shards,
                                                    reusable=True)
        return latest[split, shards]

    yield get
    for pool in latest.values():
        pool.shutdown()


def run_on(pool, **options):
    config = RunConfig(**{"quiet": True, "eval_every": 10_000, **options})
    method = build_method(config, pool.federation)
    return simulate(config, method, pool, Evaluator(pool))


@pytest.fixture(scope="module")
def centralized_ridge():
    z, labels, _ = features_and_labels(stand_in(SPLITS[0]))
    return ridge(z, labels, 60, 0.01)


@pytest.mark.parametrize(
    "split, shards, participation, replacement",
    [pytest.param(s, n, p, r, marks=[pytest.mark.slow] if s == "inat-geo-3k" or (p, r) == (0.02, "without") or (n, p) == (3, 0.02) else [])
     # by number of shards first: each split's pool takes the shards the split before parked
     for n in (1, 3) for s in SPLITS for p in (0.02, 0.3) for r in ("without", "with")],
)
def test_fed3r_is_the_centralized_ridge_solution(pools, centralized_ridge, split, shards, participation, replacement):
    _, rows, outcome = run_on(pools(split, shards), method="fed3r", participation=participation, sampling=replacement)
    assert max_relative_difference(outcome.classifier.weight, centralized_ridge) <= 1e-8
    assert rows[-1]["clients_seen"] == pools(split, shards).federation.num_clients


def test_fedncm_is_the_centralized_class_means(pools):
    pool = pools("inat-geo-100", 3)
    _, _, outcome = run_on(pool, method="fedncm", clients_per_round=13)
    z, labels, _ = features_and_labels(pool.federation)
    assert max_relative_difference(outcome.classifier.weight, normalized(class_means(z, labels, 60).T)) <= 1e-12


@pytest.mark.parametrize("shards", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_fedcof_matches_its_algorithm_1(pools, shards):
    pool = pools("inat-user-120k", shards)
    _, _, outcome = run_on(pool, method="fedcof", clients_per_round=11, sampling="with")
    z, labels, offsets = features_and_labels(pool.federation)
    assert max_relative_difference(outcome.classifier.weight, fedcof_algorithm1(z, labels, offsets, 60, 0.1)) <= 1e-8


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_same_configuration_gives_bitwise_the_same_results(pools):
    first = run_on(pools("inat-user-120k", 3), method="fedcof", clients_per_round=9, sampling="with", seed=4)
    second = run_on(pools("inat-user-120k", 3), method="fedcof", clients_per_round=9, sampling="with", seed=4)
    assert torch.equal(first[2].classifier.weight, second[2].classifier.weight)
    assert [{k: v for k, v in r.items() if k != "wall_s"} for r in first[1]] == [
        {k: v for k, v in r.items() if k != "wall_s"} for r in second[1]
    ]


def test_eval_points_and_accounting(pools):
    pool = pools("inat-geo-100", 3)
    federation = pool.federation
    K, d, M = federation.num_clients, federation.dim, int(federation.client_num_classes.sum())
    _, rows, _ = run_on(pool, method="fed3r", clients_per_round=10, eval_every=5)
    assert [r["round"] for r in rows] == list(range(5, math.ceil(K / 10), 5)) + [math.ceil(K / 10)]
    assert rows[-1]["bytes_up"] == 4 * (M * d + K * d * d)
    assert rows[-1]["samples_seen"] == federation.client_sizes.sum()
    sizes = federation.client_sizes
    assert rows[-1]["flops_client_avg"] == pytest.approx(np.mean(2.0 * sizes * d * d + sizes * d), rel=1e-12)
    assert all(r["bytes_down"] == 0 for r in rows)
    assert np.all(np.diff([r["clients_seen"] for r in rows]) > 0)
    _, ncm_rows, _ = run_on(pool, method="fedncm", participation=0.5)
    assert ncm_rows[-1]["bytes_up"] == 4 * M * d and ncm_rows[-1]["round"] == 2
    _, oracle_rows, _ = run_on(pool, method="fedcof-oracle", clients_per_round=K)
    assert oracle_rows[-1]["bytes_up"] == 4 * M * (d + d * d)
    _, rf_rows, _ = run_on(pool, method="fed3r-rf", clients_per_round=K, rf_dim=50)
    assert rf_rows[-1]["bytes_up"] == 4 * (M * 50 + K * 50 * 50)


def test_a_restarted_shard_gives_bitwise_the_same_statistics(pools):
    pool = pools("inat-user-120k", 3)
    method = build_method(RunConfig(method="fed3r"), pool.federation)
    blocks = np.array_split(np.random.default_rng(0).permutation(pool.federation.num_clients), 4)
    clean = [pool.statistics(method, block).result() for block in blocks]
    pending = [pool.statistics(method, block) for block in blocks]
    ray.kill(pool.actors[0], no_restart=False)
    for before, after in zip(clean, [reduction.result() for reduction in pending]):
        assert torch.equal(before.gram, after.gram) and torch.equal(before.targets, after.targets)


def test_a_round_budget_stops_early(pools):
    _, rows, _ = run_on(pools("inat-geo-100", 1), method="fed3r", clients_per_round=5, rounds=3)
    assert rows[-1]["round"] == 3 and rows[-1]["clients_seen"] == 15


def test_shards_are_balanced_by_samples():
    offsets = np.concatenate([[0], np.cumsum(np.random.default_rng(0).integers(1, 50, size=1000))])
    bounds = balanced_bounds(offsets, 4)
    per_shard = np.diff(offsets[bounds])
    assert len(per_shard) == 4 and per_shard.max() - per_shard.min() <= 2 * 50


def test_sampling_schedules():
    without = sampling.schedule(95, 10, replacement=False, seed=0)
    assert len(without) == 10 and sorted(np.concatenate(without)) == list(range(95))
    with_replacement = sampling.schedule(95, 10, replacement=True, seed=0)
    assert all(len(set(r)) == 10 for r in with_replacement)
    assert len(np.unique(np.concatenate(with_replacement))) == 95
    assert len(np.unique(np.concatenate(with_replacement[:-1]))) == 94
    assert all(np.array_equal(a, b) for a, b in zip(with_replacement, sampling.schedule(95, 10, True, seed=0)))


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_shard_layouts_give_the_same_bits(pools):
    """1, 2 and 3 shards (2, 1 and 1 threads) add the clients' statistics in the one fixed tree over leaves of clients
    (fedray.runtime.fixed_tree): every method's classifier and every evaluation row are bitwise the same."""
    options = {"fedncm": {}, "fed3r": {}, "fed3r-rf": {"rf_dim": 40, "clients_per_round": 9},
               "fedcof": {"sampling": "with", "clients_per_round": 11}}
    layouts = {shards: {method: run_on(pools("inat-user-120k", shards), method=method, seed=5, eval_every=3, **extra)
                        for method, extra in options.items()} for shards in (1, 2, 3)}
    for shards in (2, 3):
        for method in options:
            (_, rows, outcome), (_, one_rows, one) = layouts[shards][method], layouts[1][method]
            assert torch.equal(outcome.classifier.weight, one.classifier.weight), (shards, method)
            assert len(rows) > 2 and [without_wall(row) for row in rows] == [without_wall(row) for row in one_rows]


def without_wall(row: dict) -> dict:
    """A row without what differs between layouts by design: this machine's time and the layout itself."""
    return {name: value for name, value in row.items() if name not in ("wall_s", "num_shards")}
