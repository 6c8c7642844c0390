"""Federated linear probing through the shard runtime equals FedAvg / SCAFFOLD written plainly in one process."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedray.runtime.evaluator import Evaluator
from fedray.core.errors import FedrayError
from fedray.methods.training.local import LocalSGD, client_rng, minibatches
from fedray.runtime.probing import ProbeBackend
from fedray.methods.training.server import ServerSGD
from fedray.methods.training_algorithms import FedAvg, FedProx, Scaffold
from fedray.engine.training import Accounting, TrainingState, train
from fedray.methods.base import Classifier
from fedray.runtime import sampling
from fedray.runtime.shards import ShardPool
from tests.reference import fedavg_by_autograd, train_client_plainly


@pytest.mark.parametrize("sgd, shards, scaffold", [
    pytest.param(LocalSGD(batch_size=8, epochs=2), 2, False, marks=pytest.mark.slow),
    pytest.param(LocalSGD(prox_mu=0.1, temperature=0.5), 3, False, marks=pytest.mark.slow),
    (LocalSGD(lr=0.05, batch_size=8, epochs=2, temperature=0.5), 2, True),
])
def test_the_runtime_equals_plain_fedavg(ray_session, small_inat, sgd, shards, scaffold):
    rounds = [clients.copy() for clients in sampling.schedule(small_inat.num_clients, 7, True, seed=3, max_rounds=6)]
    # Clients drawn twice make SCAFFOLD use a stored c_i, not only the zero it starts from.
    rounds[4][:2] = rounds[1][:2]
    generator = torch.Generator().manual_seed(1)
    head = Classifier(0.01 * torch.randn(small_inat.dim, small_inat.num_classes, generator=generator),
                      torch.zeros(small_inat.num_classes))
    pool = ShardPool.start(small_inat, num_shards=shards, cpus_per_shard=2 / shards, reusable=True)
    try:
        algorithm = Scaffold() if scaffold else FedProx(prox_mu=sgd.prox_mu) if sgd.prox_mu else FedAvg()
        backend = ProbeBackend(pool, replace(sgd, prox_mu=0.0), 3, Evaluator(pool), algorithm)
        params = {"weight": head.weight.clone(), "bias": head.bias.clone()}
        state = TrainingState(params, {}, algorithm.init_server_state(params), Accounting(np.zeros(small_inat.num_clients, dtype=bool)))
        train(backend, algorithm, ServerSGD(), state, rounds, small_inat.client_sizes, 3)
    finally:
        pool.shutdown()
    expected = fedavg_by_autograd(small_inat, rounds, sgd, 3, head, server_lr=1.0, scaffold=scaffold)
    torch.testing.assert_close(state.params["weight"], expected.weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.params["bias"], expected.bias, rtol=1e-4, atol=1e-5)
    points = state.points
    assert [p.round for p in points] == [0, 3, 6]
    model_bytes = 4 * (small_inat.dim * small_inat.num_classes + small_inat.num_classes) * (2 if scaffold else 1)
    assert points[-1].bytes_up == points[-1].bytes_down == 6 * 7 * model_bytes
    assert points[-1].clients_seen == len(np.unique(np.concatenate(rounds)))
    assert all(np.isfinite(p.train_loss) for p in points[1:]) and points[0].train_loss is None


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_shard_layouts_give_the_same_heads_bit_for_bit(ray_session, small_inat):
    """The clients' float32 updates are summed per leaf of the fixed tree, whatever shard trains them: the heads of
    1 shard (2 threads), 2 and 3 shards are the same bits."""
    rounds = sampling.schedule(small_inat.num_clients, 7, True, seed=3, max_rounds=6)
    heads = {}
    for shards in (1, 3, 2):  # 2 last: the next test takes its parked shards
        pool = ShardPool.start(small_inat, num_shards=shards, cpus_per_shard=2 / shards, reusable=True)
        try:
            algorithm = FedAvg()
            backend = ProbeBackend(pool, LocalSGD(lr=0.05, batch_size=8, epochs=2), 3, Evaluator(pool), algorithm)
            params = {"weight": torch.zeros(small_inat.dim, small_inat.num_classes), "bias": torch.zeros(small_inat.num_classes)}
            state = TrainingState(params, {}, algorithm.init_server_state(params),
                                  Accounting(np.zeros(small_inat.num_clients, dtype=bool)))
            train(backend, algorithm, ServerSGD(), state, rounds, small_inat.client_sizes, 3)
        finally:
            pool.shutdown()
        heads[shards] = state.params["weight"]
    for shards in (2, 3):
        assert torch.equal(heads[shards], heads[1]), shards


def test_step_budgets_reach_each_shards_clients(ray_session, small_inat):
    sgd = LocalSGD(lr=0.05, batch_size=8, epochs=2)
    clients = np.array([313, 4, 238, 41, 62])
    sizes = small_inat.client_sizes[clients]
    full = np.array([2 * math.ceil(n / 8) for n in sizes])
    budgets = np.maximum(full // 3, 1)
    assert (budgets < full).sum() >= 3
    generator = torch.Generator().manual_seed(1)
    params = {"weight": 0.01 * torch.randn(small_inat.dim, small_inat.num_classes, generator=generator),
              "bias": torch.zeros(small_inat.num_classes)}
    pool = ShardPool.start(small_inat, num_shards=2, cpus_per_shard=0.5, reusable=True)
    try:
        assert len(set(pool.owners(clients).tolist())) == 2
        backend = ProbeBackend(pool, sgd, 3, Evaluator(pool), FedAvg())
        assert backend.local_steps(clients).tolist() == full.tolist()
        whole, same, partial = (backend.train_round(params, {}, clients, 2, steps) for steps in (None, full, budgets))
        with pytest.raises(FedrayError, match="one count per client: 5 clients, got 4 budgets"):
            backend.train_round(params, {}, clients, 2, budgets[:4])
    finally:
        pool.shutdown()
    assert all(torch.equal(same.sums[name], whole.sums[name]) for name in whole.sums)
    sample_ids, labels, offsets = small_inat.train_arrays(0, small_inat.num_clients)
    features = small_inat.require_features().features("train", sample_ids)
    labels = torch.from_numpy(labels.astype(np.int64))
    expected = torch.zeros_like(params["weight"])
    for client, n, budget in zip(clients.tolist(), sizes, budgets):
        rows = slice(offsets[client], offsets[client + 1])
        batches = minibatches(int(n), 8, 2, client_rng(3, 2, client))[:budget]
        trained, _ = train_client_plainly(features[rows], labels[rows], params["weight"], params["bias"], sgd, batches)
        expected += int(n) * (trained - params["weight"])
    assert partial.weight == sizes.sum()
    torch.testing.assert_close(partial.sums["weight"] / partial.weight, expected / sizes.sum(), rtol=1e-4, atol=1e-5)
    assert (partial.sums["weight"] - whole.sums["weight"]).abs().max() > 1e-3
