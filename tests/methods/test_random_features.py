"""On the iNat stand-in, Fed3R-RF accuracy grows with the number of random features D."""

import pytest

from fedray.engine.config import RunConfig
from fedray.data import synthetic
from fedray.runtime.evaluator import Evaluator
from fedray.engine.plan import build_method
from fedray.engine.run_config import simulate
from fedray.runtime.shards import ShardPool


@pytest.fixture(scope="module")
def pool(ray_session):
    started = ShardPool.start(synthetic.build("inat-user-120k", dim=256, scale=0.5), num_shards=2, reusable=True)
    yield started
    started.shutdown()


@pytest.mark.slow
def test_fed3r_rf_accuracy_grows_with_d(pool):
    evaluator = Evaluator(pool)
    accuracy = {}
    for rf_dim in (64, 256, 1024):
        config = RunConfig(method="fed3r-rf", rf_dim=rf_dim, clients_per_round=100, eval_every=10_000, quiet=True)
        _, rows, _ = simulate(config, build_method(config, pool.federation), pool, evaluator)
        accuracy[rf_dim] = rows[-1]["accuracy"]
    assert accuracy[64] < accuracy[256] < accuracy[1024], accuracy
