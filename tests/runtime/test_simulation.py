"""The closed-form rounds solve one block ahead: the shards evaluate the next classifier while the driver waits for
this one's accuracy, and every row still reports the classifier of its own round."""

import pytest

from fedray.engine.config import RunConfig
from fedray.engine.run_config import simulate
from fedray.engine.plan import build_method
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.shards import ShardPool


class RecordingEvaluator(Evaluator):
    """An evaluator that logs when each evaluation is queued and when its accuracy is taken."""

    def __init__(self, pool, log):
        super().__init__(pool)
        self.log = log

    def submit(self, feature_map, classifier):
        pending, number, log = super().submit(feature_map, classifier), sum(e[0] == "submit" for e in self.log) + 1, self.log
        log.append(("submit", number))

        class Logged:
            def result(self):
                log.append(("result", number))
                return pending.result()

        return Logged()


@pytest.fixture(scope="module")
def pool(ray_session, small_inat):
    pool = ShardPool.start(small_inat, num_shards=2, cpus_per_shard=0.5, reusable=True)
    yield pool
    pool.shutdown()


def run(pool, evaluator, **options):
    config = RunConfig(**{"method": "fed3r", "quiet": True, "clients_per_round": 10, **options})
    return simulate(config, build_method(config, pool.federation), pool, evaluator)[1]


def test_the_next_evaluation_is_queued_before_this_one_is_waited_for(pool):
    log = []
    rows = run(pool, RecordingEvaluator(pool, log), rounds=30, eval_every=10)
    assert [row["round"] for row in rows] == [10, 20, 30]
    assert log == [("submit", 1), ("submit", 2), ("result", 1), ("submit", 3), ("result", 2), ("result", 3)]


def test_each_row_is_the_accuracy_of_its_own_rounds_classifier(pool):
    rows = run(pool, Evaluator(pool), rounds=30, eval_every=10)
    # reference: runs that stop at each evaluation round, whose only row is that round's classifier
    alone = [run(pool, Evaluator(pool), rounds=budget, eval_every=1000)[-1] for budget in (10, 20, 30)]
    assert [row["accuracy"] for row in rows] == [row["accuracy"] for row in alone]
    assert len({row["accuracy"] for row in rows}) == 3, "the three classifiers differ, so a row one block off would show"
