"""Federated linear probing through the shard runtime equals FedAvg written plainly in one process."""

import numpy as np
import pytest
import torch

from fedray.evaluation import Evaluator
from fedray.gradient.local import LocalSGD
from fedray.gradient.probing import LocalTrainer, run_linear_probe
from fedray.gradient.server import ServerOptimizer
from fedray.methods.base import Classifier
from fedray.runtime import sampling
from fedray.runtime.shards import ShardPool
from jobs.bench_lp import plain_fedavg


@pytest.mark.parametrize("sgd, shards", [(LocalSGD(batch_size=8, epochs=2), 2), (LocalSGD(prox_mu=0.1, temperature=0.5), 3)])
def test_the_runtime_equals_plain_fedavg(ray_session, small_inat, sgd, shards):
    rounds = sampling.schedule(small_inat.num_clients, 7, True, seed=3, max_rounds=6)
    generator = torch.Generator().manual_seed(1)
    head = Classifier(0.01 * torch.randn(small_inat.dim, small_inat.num_classes, generator=generator),
                      torch.zeros(small_inat.num_classes))
    pool = ShardPool.start(small_inat, num_shards=shards, cpus_per_shard=2 / shards)
    try:
        points, trained = run_linear_probe(pool, LocalTrainer(sgd, seed=3), ServerOptimizer("fedavg"), head, rounds, 3,
                                           Evaluator(small_inat), quiet=True)
    finally:
        pool.shutdown()
    expected = plain_fedavg(small_inat, rounds, sgd, 3, head, server_lr=1.0)
    torch.testing.assert_close(trained.weight, expected.weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(trained.bias, expected.bias, rtol=1e-4, atol=1e-5)
    assert [p.round for p in points] == [3, 6]
    model_bytes = 4 * (small_inat.dim * small_inat.num_classes + small_inat.num_classes)
    assert points[-1].bytes_up == points[-1].bytes_down == 6 * 7 * model_bytes
    assert points[-1].clients_seen == len(np.unique(np.concatenate(rounds)))

