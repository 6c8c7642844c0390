"""Benchmark: FedAvg linear probing on the iNat-User-120K stand-in, runtime against a plain torch loop.

    python -m jobs.bench_lp [--rounds 100] [--reference-rounds 20] [--dim 1280]

The runtime (shard actors, batched dual-form local training, tree reduction)
runs ``--rounds`` rounds of FedAvg-LP: 10 clients per round drawn with
replacement, 5 local epochs of SGD (lr 0.001: the stand-in's features are
larger than MobileNetV2's and Fed3R's lr 0.1 overshoots on them; weight decay 4e-5, batch 50),
server learning rate 1, on all 9,275 clients (d = 1,280, C = 1,203). Then, in
this process, a plain per-step loop (:func:`plain_fedavg`: one client and one
mini-batch at a time, gradients by hand, the same mini-batches) runs the first
``--reference-rounds`` rounds, on one torch thread and on all, and counts at
the faster; where pfl-research is installed (``import pfl``), pfl then
simulates all ``--rounds`` rounds of the same FedAvg at that thread count.
Prints one JSON line: rounds/s of each (the runtime's without its two
evaluations; pfl's null where it is not installed), the runtime's ratio to
each, and the largest relative difference between the runtime's and the plain
loop's heads after the reference's rounds (the runtime repeated for exactly those rounds).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from fedray.core.federation import Federation
from fedray.data.registry import load_federation
from fedray.runtime.evaluator import Evaluator
from fedray.methods.training.local import LocalSGD, client_rng, minibatches
from fedray.runtime.probing import ProbeBackend
from fedray.methods.training.server import ServerSGD
from fedray.engine.training import Accounting, TrainingState, train
from fedray.methods.base import Classifier
from fedray.methods.training_algorithms import FedAvg
from fedray.runtime import sampling
from fedray.runtime.session import init_ray
from fedray.runtime.shards import ShardPool, peak_memory_bytes

MB = 2**20
T = TypeVar("T")


def plain_fedavg(
    federation: Federation, rounds: Sequence[np.ndarray], sgd: LocalSGD, seed: int, head: Classifier, server_lr: float,
) -> Classifier:
    """FedAvg-LP as one would write it in plain torch: one client and one mini-batch at a time, in one process.

    Gradients by hand under ``no_grad`` instead of autograd and an optimizer
    object: at temperature T the mean cross-entropy's gradient with respect to
    a batch's b logits is G = (softmax(z / T) − onehot(y)) / (T b), and SGD with
    weight decay is W ← (1 − lr·wd) W − lr Xᵀ G, one in-place addmm. The
    client's head and the round's sum are allocated once: a fresh d × C tensor
    per client costs more in page faults than the client's steps. Plain SGD,
    as the benchmark runs it (``sgd.momentum`` and ``sgd.prox_mu`` are not
    used); the same clients and mini-batches as the runtime.
    """
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    features = federation.require_features().features("train", sample_ids)
    labels = torch.from_numpy(labels.astype(np.int64))
    weight, bias = head.weight.clone(), head.bias.clone()
    client_weight, client_bias = torch.empty_like(weight), torch.empty_like(bias)
    sum_weight, sum_bias = torch.empty_like(weight), torch.empty_like(bias)  # Σ n_k W_k, Σ n_k b_k
    decay = 1 - sgd.lr * sgd.weight_decay
    with torch.no_grad():
        for number, clients in enumerate(rounds, start=1):
            sum_weight.zero_()
            sum_bias.zero_()
            total = 0
            for client in clients:
                start, stop = int(offsets[client]), int(offsets[client + 1])
                x, y = features[start:stop], labels[start:stop]
                client_weight.copy_(weight)
                client_bias.copy_(bias)
                for batch in minibatches(stop - start, sgd.batch_size, sgd.epochs, client_rng(seed, number, int(client))):
                    batch = torch.from_numpy(batch)
                    batch_x, batch_y = x[batch], y[batch]
                    gradient = torch.softmax(torch.addmm(client_bias, batch_x, client_weight) / sgd.temperature, dim=1)
                    gradient[torch.arange(len(batch)), batch_y] -= 1
                    step = sgd.lr / (sgd.temperature * len(batch))
                    client_weight.addmm_(batch_x.T, gradient, beta=decay, alpha=-step)
                    client_bias.mul_(decay).sub_(gradient.sum(0), alpha=step)
                sum_weight.add_(client_weight, alpha=stop - start)
                sum_bias.add_(client_bias, alpha=stop - start)
                total += stop - start
            # W + lr_s · (Σ n_k W_k / N − W)
            weight.mul_(1 - server_lr).add_(sum_weight, alpha=server_lr / total)
            bias.mul_(1 - server_lr).add_(sum_bias, alpha=server_lr / total)
    return Classifier(weight, bias)


def pfl_seconds(
    federation: Federation, rounds: Sequence[np.ndarray], sgd: LocalSGD, head: Classifier, server_lr: float,
) -> float | None:
    """Seconds pfl-research takes to simulate ``rounds`` of the same FedAvg-LP on the CPU, or None where it is not installed.

    pfl's own loop as its PyTorch examples write it (``nn.Linear``,
    ``torch.optim.SGD`` per user, FedAvg weighted by data points, one
    process), on the same clients, sizes, epochs and batch size. Only timed:
    pfl goes through a user's samples in their stored order, so its
    mini-batches (and head) are not the runtime's.
    """
    if importlib.util.find_spec("pfl") is None:
        return None
    os.environ.setdefault("PFL_PYTORCH_DEVICE", "cpu")  # where the runtime and the plain loop run
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Weighted
    from pfl.model.pytorch import PyTorchModel

    class Head(torch.nn.Linear):
        def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self(x) / sgd.temperature, y)

        @torch.no_grad()
        def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> dict[str, Weighted]:
            summed = torch.nn.functional.cross_entropy(self(x) / sgd.temperature, y, reduction="sum")
            return {"loss": Weighted(float(summed), len(y))}

    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    features = federation.require_features().features("train", sample_ids)
    labels = torch.from_numpy(labels.astype(np.int64))
    model = Head(*head.weight.shape)
    with torch.no_grad():
        model.weight.copy_(head.weight.T)
        model.bias.copy_(head.bias)
    schedule = iter(np.concatenate(rounds).tolist())
    users = FederatedDataset(
        lambda client: Dataset((features[offsets[client] : offsets[client + 1]], labels[offsets[client] : offsets[client + 1]]),
                               user_id=str(client)),
        lambda: next(schedule))
    started = time.perf_counter()
    FederatedAveraging().run(
        NNAlgorithmParams(central_num_iterations=len(rounds), evaluation_frequency=len(rounds), train_cohort_size=len(rounds[0]),
                          val_cohort_size=0),
        SimulatedBackend(training_data=users, val_data=users, postprocessors=[WeightByDatapoints()]),
        PyTorchModel(model, partial(torch.optim.SGD, weight_decay=sgd.weight_decay), torch.optim.SGD(model.parameters(), lr=server_lr)),
        NNTrainHyperParams(local_learning_rate=sgd.lr, local_num_epochs=sgd.epochs, local_batch_size=sgd.batch_size),
        NNEvalHyperParams(local_batch_size=None),
        send_metrics_to_platform=False)
    return time.perf_counter() - started


def with_threads(threads: int, work: Callable[[], T]) -> tuple[T, float]:
    """``work()``'s result and seconds with torch on ``threads`` intra-op threads, the caller's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        return work(), time.perf_counter() - started
    finally:
        torch.set_num_threads(before)


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
    backend = ProbeBackend(pool, sgd, seed, evaluator, FedAvg())

    def train_rounds(schedule: Sequence[np.ndarray]) -> tuple[TrainingState, float]:
        state = TrainingState({"weight": zero.weight.clone(), "bias": zero.bias.clone()}, {}, {},
                              Accounting(np.zeros(federation.num_clients, dtype=bool)))
        started = time.perf_counter()
        train(backend, backend.algorithm, ServerSGD(), state, schedule, federation.client_sizes, len(schedule))
        return state, time.perf_counter() - started

    try:
        trained, runtime_s = train_rounds(rounds)
        reference_rounds = rounds[: args.reference_rounds]
        runtime_head = Classifier(**train_rounds(reference_rounds)[0].params)
        shard_rss = pool.peak_memory_bytes()
    finally:
        pool.shutdown()
    # The plain loop at one thread and at all of them, kept at the faster: its small steps on a 2-core machine
    # that other work shares can run several times slower on two threads than on one (intra-op threads waiting
    # for each other), which would credit the runtime with torch's threading rather than with its own work.
    plain_runs = {threads: with_threads(threads, lambda: plain_fedavg(federation, reference_rounds, sgd, seed, zero, 1.0))
                  for threads in sorted({1, torch.get_num_threads()})}
    plain_threads = min(plain_runs, key=lambda threads: plain_runs[threads][1])
    plain_s = plain_runs[plain_threads][1]
    pfl_s = with_threads(plain_threads, lambda: pfl_seconds(federation, rounds, sgd, zero, 1.0))[0]
    runtime_rate = args.rounds / (runtime_s - trained.eval_s)
    plain_rate = len(reference_rounds) / plain_s
    pfl_rate = None if pfl_s is None else args.rounds / pfl_s
    difference = max(float((runtime_head.weight - plain.weight).abs().max() / plain.weight.abs().max())
                     for plain, _ in plain_runs.values())
    print(json.dumps({
        "benchmark": "fedavg_lp",
        "dataset": federation.name, "clients": federation.num_clients, "dim": args.dim, "classes": federation.num_classes,
        "clients_per_round": 10, "client_lr": sgd.lr, "local_epochs": sgd.epochs, "batch_size": sgd.batch_size, "shards": pool.num_shards,
        "ray_start_s": round(ray_start_s, 2), "load_s": round(load_s, 2),
        "rounds": args.rounds, "runtime_s": round(runtime_s, 2), "eval_s": round(trained.eval_s, 2),
        "runtime_rounds_per_s": round(runtime_rate, 2), "accuracy_after_rounds": round(trained.points[-1].accuracy, 4),
        "reference_rounds": len(reference_rounds), "plain_s": round(plain_s, 2), "plain_rounds_per_s": round(plain_rate, 2),
        "plain_threads": plain_threads,
        "plain_rounds_per_s_by_threads": {threads: round(len(reference_rounds) / seconds, 2) for threads, (_, seconds) in plain_runs.items()},
        "ratio_runtime_vs_plain": round(runtime_rate / plain_rate, 2),
        "max_rel_diff_vs_plain": difference,
        "pfl_s": None if pfl_s is None else round(pfl_s, 2), "pfl_rounds_per_s": None if pfl_rate is None else round(pfl_rate, 2),
        "ratio_runtime_vs_pfl": None if pfl_rate is None else round(runtime_rate / pfl_rate, 2),
        "peak_rss_driver_mb": peak_memory_bytes() // MB, "peak_rss_shards_mb": [m // MB for m in shard_rss],
        "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
