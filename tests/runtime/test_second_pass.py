"""A closed-form method's second pass: what grows with the clients (FedCOF's received means) stays in the shards, the
server sends what the solve needs, the shards return their sums. Parts over a shard's budget, or lost with a restarted
shard, are computed again from the rows, to the same bits. Where the labels tell every evaluation's request before the
pass (FedCOF's weights), the shards sum each part into every later evaluation's second pass as they compute it."""

from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest
import ray
import torch

from fedray.data import synthetic
from fedray.data.registry import load_federation
from fedray.engine.closed_form import ClosedFormRounds
from fedray.engine.config import RunConfig
from fedray.engine.plan import build_method
from fedray.engine.run_config import simulate
from fedray.methods.base import Classifier, ClientBatch, ClosedFormMethod
from fedray.methods.fedcof import FedCOF
from fedray.runtime.actor_group import combine_partials
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.kept import KeptParts
from fedray.runtime.shard_rows import HeldRows, Rows
from fedray.methods.postprocessor import flatten
from fedray.runtime.shard_statistics import ShardStatistics, add_block
from fedray.runtime.shards import ShardPool
from tests.reference import fedcof_algorithm1, features_and_labels, max_relative_difference


def run_on(pool, method="fedcof", on_point=None, **options):
    config = RunConfig(**{"quiet": True, "method": method, "clients_per_round": 20, "eval_every": 4, **options})
    return simulate(config, build_method(config, pool.federation), pool, Evaluator(pool), on_point)[2]


@pytest.fixture
def passes_again(monkeypatch):
    """Every evaluation's second pass over the kept parts, as a run whose postprocessor changes uploads makes it."""
    monkeypatch.setattr(ClosedFormRounds, "_requests_ahead", lambda self, pool, method_ref: None)


@pytest.fixture(scope="module")
def federation():
    return synthetic.build("inat-user-120k", dim=16, scale=0.03, classes=30, seed=5)


@pytest.fixture(scope="module")
def kept(ray_session, federation):
    pool = ShardPool.start(federation, num_shards=2, cpus_per_shard=0.25, reusable=True)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def recomputed(ray_session, federation):
    pool = ShardPool.start(federation, num_shards=2, cpus_per_shard=0.25, kept_budget=0, reusable=True)
    yield pool
    pool.shutdown()


def test_fedcof_through_the_second_pass_is_its_algorithm_1(kept, federation):
    outcome = run_on(kept)
    z, labels, offsets = features_and_labels(federation)
    reference = fedcof_algorithm1(z, labels, offsets, federation.num_classes, 0.1)
    assert max_relative_difference(outcome.classifier.weight, reference) <= 1e-8


def test_the_driver_receives_no_means(kept, monkeypatch):
    """The server's state holds class totals and counts of means (C × d), never a received mean."""
    from fedray.methods.fedcof import FedCOF

    seen = []
    solve_second = FedCOF.solve_second
    monkeypatch.setattr(FedCOF, "solve_second", lambda self, total, second: seen.append(total) or solve_second(self, total, second))
    run_on(kept)
    assert seen and all(total.blocks == [] for total in seen)
    assert all(tuple(total.sums.shape) == (30, 16) for total in seen)


def test_parts_over_the_budget_are_computed_again_to_the_same_bits(kept, recomputed, passes_again):
    held, again = run_on(kept), run_on(recomputed)
    assert torch.equal(held.classifier.weight, again.classifier.weight)
    assert [p.accuracy for p in held.points] == [p.accuracy for p in again.points]


def test_a_budget_that_holds_some_blocks_gives_the_same_bits(ray_session, federation, kept, passes_again):
    """Runs of a block are dropped as soon as they pass the budget (a shard never holds a whole block over it: a
    single block of a million clients' means took 18 GB); the blocks that fit stay."""
    pool = ShardPool.start(federation, num_shards=2, cpus_per_shard=0.25, kept_budget=50_000, reusable=True)
    try:
        partly = run_on(pool)
    finally:
        pool.shutdown()
    held = run_on(kept)
    assert torch.equal(held.classifier.weight, partly.classifier.weight)
    assert [p.accuracy for p in held.points] == [p.accuracy for p in partly.points]


def test_a_restarted_shard_computes_its_lost_parts_again(kept, federation):
    clean = run_on(kept)
    killed = []

    class KillOnce(Evaluator):
        def submit(self, feature_map, classifier):
            if not killed:
                killed.append(True)
                ray.kill(kept.actors[0], no_restart=False)
            return super().submit(feature_map, classifier)

    config = RunConfig(quiet=True, method="fedcof", clients_per_round=20, eval_every=4)
    outcome = simulate(config, build_method(config, federation), kept, KillOnce(kept))[2]
    assert killed and torch.equal(clean.classifier.weight, outcome.classifier.weight)


def test_every_evaluation_summed_ahead_is_the_second_pass_to_the_bit(kept, monkeypatch):
    """FedCOF's one pass (the weights of every evaluation from the labels, each mean summed into every later
    evaluation as it is computed) gives every evaluation's classifier of the second passes, bit for bit."""
    counted = []
    label_statistics = ShardPool.label_statistics
    monkeypatch.setattr(ShardPool, "label_statistics", lambda *args: counted.append(1) or label_statistics(*args))
    ahead, again = [], []
    one_pass = run_on(kept, on_point=lambda point, classifier: ahead.append(classifier.weight))
    monkeypatch.setattr(ClosedFormRounds, "_requests_ahead", lambda self, pool, method_ref: None)
    second_passes = run_on(kept, on_point=lambda point, classifier: again.append(classifier.weight))
    assert counted == [1] and len(ahead) == len(again) == 4
    assert all(torch.equal(a, b) for a, b in zip(ahead, again))
    assert [p.accuracy for p in one_pass.points] == [p.accuracy for p in second_passes.points]


def one_shard(federation) -> ShardStatistics:
    """Every client of ``federation`` in one shard, in this process, with room to keep every part."""
    rows = Rows.of(federation, (0, federation.num_clients), (0, federation.num_test))
    return ShardStatistics(HeldRows(rows, 0), KeptParts(2**30))


def summed_ahead(federation, method):
    """Three blocks of clients (tags 3, 6, 9), each evaluation's request from the labels, a shard, and each block's
    statistics from it with their second pass for every evaluation from the block on (its root)."""
    clients = np.random.default_rng(0).permutation(federation.num_clients)
    blocks = list(zip((3, 6, 9), np.array_split(clients, 3)))
    shard = one_shard(federation)
    total, requests = None, []
    for (tag, _), counted in zip(blocks, shard.label_statistics(method, [clients for _, clients in blocks])):
        total = counted if total is None else method.combine(total, counted)
        requests.append((tag, method.second_pass_request(total)))
    sums = [shard.statistics(method, clients, keep=("run", tag), ahead=[(e, r) for e, r in requests if e >= tag])
            .root(1, partial(add_block, method)) for tag, clients in blocks]
    return blocks, requests, shard, sums


def same_bits(a, b) -> bool:
    left, right = flatten(a), flatten(b)
    return left.keys() == right.keys() and all(torch.equal(left[path], right[path]) for path in left)


def test_a_shard_reads_each_mean_once_for_every_later_evaluation(federation, monkeypatch):
    method = FedCOF(16, 30)
    passes = []
    second_pass = FedCOF.second_pass
    monkeypatch.setattr(FedCOF, "second_pass",
                        lambda self, request, part: passes.append(1) or second_pass(self, request, part))
    blocks, requests, shard, sums = summed_ahead(federation, method)
    assert len(passes) == 3 + 2 + 1, "each block's means, once per evaluation from its own on"
    assert shard.kept.used == 0 and shard.kept.runs == {}, "no mean kept"
    today, received = one_shard(federation), None
    for (tag, clients), summed in zip(blocks, sums):
        block = today.statistics(method, clients, keep=("run", tag)).root(1, method.combine)
        assert same_bits(summed.statistics, block), "the statistics themselves as without the second passes"
        received = combine_partials(received, block, method.combine)
        assert torch.equal(method.second_pass_request(received), dict(requests)[tag]), "the server's weights"
    for number, (evaluation, request) in enumerate(requests, start=1):
        by_block = [summed.second_passes[[e for e, _ in requests[index:]].index(evaluation)]
                    for index, summed in enumerate(sums[:number])]
        passes.clear()
        again = [today.second_pass(method, request, "run", tag, clients, False).root(1, torch.add)
                 for tag, clients in blocks[:number]]
        assert len(passes) == number, "the second pass reads the kept means of every block again"
        assert all(torch.equal(a, b) for a, b in zip(by_block, again)), "block by block, the same bits"


def test_a_blocks_second_passes_are_a_function_of_the_block_alone(federation):
    """Nothing stays in the shard between blocks: a block computed again (a restarted shard's retried call) gives the
    same bits."""
    method = FedCOF(16, 30)
    blocks, requests, shard, sums = summed_ahead(federation, method)
    (tag, clients), later = blocks[1], requests[1:]
    again = shard.statistics(method, clients, keep=("run", tag), ahead=later).root(1, partial(add_block, method))
    assert same_bits(again.statistics, sums[1].statistics)
    assert all(torch.equal(a, b) for a, b in zip(again.second_passes, sums[1].second_passes))


class SpreadOfClientMeans(ClosedFormMethod):
    """A plugin with a second pass: each client sends its count and mean feature; the server needs the global mean μ
    before it can sum Σ_k n_k (μ_k − μ)(μ_k − μ)ᵀ, the between-client scatter. Its 'classifier' is that matrix's
    diagonal in every class column (a probe of the API, not a classifier)."""

    def client_statistics(self, batch: ClientBatch) -> "Totals":
        counts = torch.from_numpy(np.diff(batch.offsets)).double()
        sums = torch.zeros(len(counts), self.dim, dtype=torch.float64).index_add_(0, batch.client_of_row,
                                                                                   batch.features.double())
        return Totals(counts.sum(), sums.sum(0), [(counts, sums / counts.unsqueeze(1))])

    def combine(self, a, b):
        return Totals(a.count + b.count, a.sum + b.sum, a.means + b.means)

    def kept_in_shards(self, stats):
        return Totals(stats.count, stats.sum, []), stats.means

    def second_pass_request(self, total):
        return total.sum / total.count

    def second_pass(self, mean, kept):
        out = torch.zeros(self.dim, self.dim, dtype=torch.float64)
        for counts, means in kept:
            out += (means - mean).T @ ((means - mean) * counts.unsqueeze(1))
        return out

    def solve(self, stats):
        raise AssertionError("the second pass solves")

    def solve_second(self, total, second):
        return Classifier(second.diagonal().unsqueeze(1).repeat(1, self.num_classes))


@dataclass
class Totals:
    count: torch.Tensor
    sum: torch.Tensor
    means: list


def test_a_plugin_keeps_its_uploads_in_the_shards(ray_session):
    population = load_federation("synthetic:inat-user-120k?clients=400&dim=6&classes=10&seed=2")
    pool = ShardPool.start(population, num_shards=2, cpus_per_shard=0.25, reusable=True)
    try:
        config = RunConfig(quiet=True, clients_per_round=100, eval_every=2)
        outcome = simulate(config, SpreadOfClientMeans(6, 10), pool, Evaluator(pool))[2]
    finally:
        pool.shutdown()
    # written out: every client's mean, the global mean, the weighted scatter's diagonal
    sample_ids, _, offsets = population.train_arrays(0, population.num_clients)
    z = population.source.features("train", sample_ids).double().numpy()
    means = np.stack([z[a:b].mean(0) for a, b in zip(offsets[:-1], offsets[1:])])
    sizes = np.diff(offsets)
    centred = means - z.mean(0)
    np.testing.assert_allclose(outcome.classifier.weight[:, 0].numpy(), (sizes[:, None] * centred ** 2).sum(0), rtol=1e-9)
