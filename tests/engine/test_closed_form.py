"""A closed-form method's rounds: the shards are given the blocks a few ahead of the driver, not all at once."""

import numpy as np

from fedray.data.registry import load_federation
from fedray.engine import closed_form
from fedray.engine.closed_form import BLOCKS_AHEAD, ClosedFormRounds
from fedray.engine.config import RunConfig
from fedray.engine.plan import build_method
from fedray.engine.run_config import simulate
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.shards import ShardPool


def test_the_shards_get_the_blocks_a_few_ahead_of_the_solve(ray_session, monkeypatch):
    """Every block's sums in the object store at once grew the driver by two C × d sums an evaluation (it maps each it
    reads): at most BLOCKS_AHEAD blocks beyond the one solved are given out, and the run is the same."""
    federation = load_federation("synthetic:inat-user-120k?clients=48&dim=8&classes=12&seed=1")
    given, solving = [], []
    statistics, solved = ShardPool.statistics, ClosedFormRounds._solved
    monkeypatch.setattr(ShardPool, "statistics", lambda self, method, clients, *args: given.append(args[-2][1])
                        or statistics(self, method, clients, *args))
    monkeypatch.setattr(ClosedFormRounds, "_solved", lambda self, state, number: solving.append((number, len(given)))
                        or solved(self, state, number))
    pool = ShardPool.start(federation, num_shards=2, cpus_per_shard=0.25, reusable=True)
    try:
        config = RunConfig(quiet=True, method="fedcof", clients_per_round=4, eval_every=1)
        outcome = simulate(config, build_method(config, federation), pool, Evaluator(pool))[2]
        monkeypatch.setattr(closed_form, "BLOCKS_AHEAD", 12)
        everything = simulate(config, build_method(config, federation), pool, Evaluator(pool))[2]
    finally:
        pool.shutdown()
    evaluations = list(range(1, 13))
    assert given[:12] == evaluations and [number for number, _ in solving[:12]] == evaluations
    assert [out for _, out in solving[:12]] == [min(number + BLOCKS_AHEAD, 12) for number in evaluations]
    assert given[12:] == evaluations and solving[12][1] == 24, "all at once: as the driver did before"
    assert np.array_equal(outcome.classifier.weight.numpy(), everything.classifier.weight.numpy())
    assert [p.accuracy for p in outcome.points] == [p.accuracy for p in everything.points]
