"""Benchmark: FedAvg linear probing on the iNat-User-120K stand-in, runtime against a plain torch loop.

    python -m jobs.bench_lp [--rounds 100] [--reference-rounds 20] [--dim 1280]

The runtime (shard actors, batched dual-form local training, tree reduction)
runs ``--rounds`` rounds of FedAvg-LP: 10 clients per round drawn with
replacement, 5 local epochs of SGD (lr 0.001: the stand-in's features are
larger than MobileNetV2's and Fed3R's lr 0.1 overshoots on them; weight decay 4e-5, batch 50),
server learning rate 1, on all 9,275 clients (d = 1,280, C = 1,203). Then, in
this process, a plain implementation (``nn.Linear`` + ``torch.optim.SGD``, one
client and one mini-batch at a time, the same mini-batches) runs the first
``--reference-rounds`` rounds. Prints one JSON line: rounds/s of both (the runtime's without its two evaluations), their
ratio, and the largest relative difference between the two heads after the
reference's rounds (the runtime repeated for exactly those rounds).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fedray.core.federation import Federation
from fedray.data.registry import load_federation
from fedray.runtime.evaluator import Evaluator
from fedray.methods.training.local import LocalSGD, client_rng, minibatches
from fedray.runtime.probing import ProbeBackend
from fedray.methods.training.server import FedAvg
from fedray.engine.training import Accounting, TrainingState, train
from fedray.methods.base import Classifier
from fedray.methods.training_algorithms import FedAvg as FedAvgAlgorithm
from fedray.runtime import sampling
from fedray.runtime.session import init_ray
from fedray.runtime.shards import ShardPool, peak_memory_bytes

MB = 2**20


def train_client_plainly(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, sgd: LocalSGD, batches: list[np.ndarray],
    correction: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One client, written plainly: nn.Linear, cross-entropy, torch.optim.SGD, one mini-batch at a time.

    ``correction`` (SCAFFOLD's c − c_i for weight and bias) is added to every gradient.
    """
    head = torch.nn.Linear(weight.shape[0], weight.shape[1], dtype=weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight.T)
        head.bias.copy_(bias)
    optimizer = torch.optim.SGD(head.parameters(), lr=sgd.lr, weight_decay=sgd.weight_decay, momentum=sgd.momentum)
    for batch in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(x[batch]) / sgd.temperature, y[batch])
        if sgd.prox_mu:
            loss = loss + sgd.prox_mu / 2 * (((head.weight - weight.T) ** 2).sum() + ((head.bias - bias) ** 2).sum())
        if correction is not None:
            loss = loss + (head.weight * correction[0].T).sum() + (head.bias * correction[1]).sum()
        loss.backward()
        optimizer.step()
    return head.weight.detach().T, head.bias.detach()


def client_gradient(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of a client's mean cross-entropy at (weight, bias), by autograd: SCAFFOLD's c_i (option I)."""
    weight, bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    torch.nn.functional.cross_entropy((x @ weight + bias) / temperature, y).backward()
    return weight.grad, bias.grad


def plain_fedavg(
    federation: Federation, rounds: list[np.ndarray], sgd: LocalSGD, seed: int, head: Classifier, server_lr: float,
    scaffold: bool = False,
) -> Classifier:
    """FedAvg (or SCAFFOLD with a dense c_i per client) written plainly over all clients' features in one process."""
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    features = federation.require_features().features("train", sample_ids)
    labels = torch.from_numpy(labels.astype(np.int64))
    weight, bias = head.weight.clone(), head.bias.clone()
    control = (torch.zeros_like(weight), torch.zeros_like(bias))
    client_controls: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for number, clients in enumerate(rounds, start=1):
        total_w, total_b, total_n = torch.zeros_like(weight), torch.zeros_like(bias), 0
        control_w, control_b = torch.zeros_like(weight), torch.zeros_like(bias)
        for client in clients:
            rows = slice(offsets[client], offsets[client + 1])
            size = int(offsets[client + 1] - offsets[client])
            batches = minibatches(size, sgd.batch_size, sgd.epochs, client_rng(seed, number, int(client)))
            correction = None
            if scaffold:
                own = client_controls.get(int(client), (torch.zeros_like(weight), torch.zeros_like(bias)))
                correction = (control[0] - own[0], control[1] - own[1])
                new = client_gradient(features[rows], labels[rows], weight, bias, sgd.temperature)
                control_w += size * (new[0] - own[0])
                control_b += size * (new[1] - own[1])
                client_controls[int(client)] = new
            trained_w, trained_b = train_client_plainly(features[rows], labels[rows], weight, bias, sgd, batches, correction)
            total_w += size * (trained_w - weight)
            total_b += size * (trained_b - bias)
            total_n += size
        weight += server_lr * total_w / total_n
        bias += server_lr * total_b / total_n
        control = (control[0] + control_w / len(labels), control[1] + control_b / len(labels))
    return Classifier(weight, bias)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--reference-rounds", type=int, default=20)
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--lr", type=float, default=0.001, help="client learning rate (default %(default)s, for the stand-in's feature scale)")
    args = parser.parse_args(argv)
    seed, sgd = 0, LocalSGD(lr=args.lr)
    started = time.perf_counter()
    init_ray()
    ray_start_s = time.perf_counter() - started
    federation = load_federation(f"synthetic:inat-user-120k?dim={args.dim}")
    load_s = time.perf_counter()
    pool = ShardPool.start(federation)
    pool.wait()  # the shards load their rows in the background; time the rounds, not the start
    load_s = time.perf_counter() - load_s
    rounds = sampling.schedule(federation.num_clients, 10, True, seed, max_rounds=args.rounds)
    zero = Classifier(torch.zeros(args.dim, federation.num_classes), torch.zeros(federation.num_classes))
    evaluator = Evaluator(pool)
    backend = ProbeBackend(pool, sgd, seed, evaluator, FedAvgAlgorithm())

    def train_rounds(schedule: list[np.ndarray]) -> tuple[TrainingState, float]:
        state = TrainingState({"weight": zero.weight.clone(), "bias": zero.bias.clone()}, {}, {},
                              Accounting(np.zeros(federation.num_clients, dtype=bool)))
        started = time.perf_counter()
        train(backend, backend.algorithm, FedAvg(), state, schedule, federation.client_sizes, len(schedule), quiet=True)
        return state, time.perf_counter() - started

    try:
        trained, runtime_s = train_rounds(rounds)
        reference_rounds = rounds[: args.reference_rounds]
        runtime_head = Classifier(**train_rounds(reference_rounds)[0].params)
        shard_rss = pool.peak_memory_bytes()
    finally:
        pool.shutdown()
    plain_s = time.perf_counter()
    plain_head = plain_fedavg(federation, reference_rounds, sgd, seed, zero, 1.0)
    plain_s = time.perf_counter() - plain_s
    runtime_rate = args.rounds / (runtime_s - trained.eval_s)
    plain_rate = len(reference_rounds) / plain_s
    difference = float((runtime_head.weight - plain_head.weight).abs().max() / plain_head.weight.abs().max())
    print(json.dumps({
        "benchmark": "fedavg_lp",
        "dataset": federation.name, "clients": federation.num_clients, "dim": args.dim, "classes": federation.num_classes,
        "clients_per_round": 10, "client_lr": sgd.lr, "local_epochs": sgd.epochs, "batch_size": sgd.batch_size, "shards": pool.num_shards,
        "ray_start_s": round(ray_start_s, 2), "load_s": round(load_s, 2),
        "rounds": args.rounds, "runtime_s": round(runtime_s, 2), "eval_s": round(trained.eval_s, 2),
        "runtime_rounds_per_s": round(runtime_rate, 2), "accuracy_after_rounds": round(trained.points[-1].accuracy, 4),
        "reference_rounds": len(reference_rounds), "plain_s": round(plain_s, 2), "plain_rounds_per_s": round(plain_rate, 2),
        "ratio_runtime_vs_plain": round(runtime_rate / plain_rate, 2),
        "max_rel_diff_vs_plain": difference,
        "peak_rss_driver_mb": peak_memory_bytes() // MB, "peak_rss_shards_mb": [m // MB for m in shard_rss],
        "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
