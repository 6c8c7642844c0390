"""The FedAvg-LP benchmark's plain per-step loop (gradients by hand) computes FedAvg as autograd and torch.optim.SGD do."""

import pytest
import torch

from fedray.methods.training.local import LocalSGD
from fedray.methods.base import Classifier
from fedray.runtime import sampling
from jobs.bench_lp import plain_fedavg
from tests.reference import fedavg_by_autograd


@pytest.mark.parametrize("sgd, server_lr", [
    (LocalSGD(lr=0.05, batch_size=8, epochs=2), 1.0),
    (LocalSGD(lr=0.05, weight_decay=1e-2, batch_size=5, epochs=3, temperature=0.5), 0.7),
])
def test_the_plain_loop_equals_fedavg_by_autograd(small_inat, sgd, server_lr):
    rounds = sampling.schedule(small_inat.num_clients, 7, True, seed=3, max_rounds=5)
    generator = torch.Generator().manual_seed(2)
    head = Classifier(0.01 * torch.randn(small_inat.dim, small_inat.num_classes, generator=generator),
                      0.01 * torch.randn(small_inat.num_classes, generator=generator))
    given = head.weight.clone()
    plain = plain_fedavg(small_inat, rounds, sgd, 3, head, server_lr)
    assert torch.equal(head.weight, given), "the head given is left as it was"
    expected = fedavg_by_autograd(small_inat, rounds, sgd, 3, head, server_lr)
    torch.testing.assert_close(plain.weight, expected.weight, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(plain.bias, expected.bias, rtol=1e-4, atol=1e-6)
    assert not torch.equal(plain.weight, head.weight), "the rounds trained"
