"""Benchmark: batched eNTK features (``vmap(grad)`` in chunks) against a per-sample ``autograd.grad`` loop.

    python -m jobs.bench_entk [--samples 256] [--p 100000] [--model cnn] [--chunk-size 64]

Builds a seeded model (weights random: timing only) with its last linear layer
re-initialized, draws ``--samples`` seeded inputs, and in this same process
computes their features with ``entk_features`` and with ``entk_features_loop``.
The two are timed alternately ``--repeats`` times and the fastest run of each is
kept, so that load from other processes on the machine biases neither. Prints
one JSON line: samples/s of both, their ratio and the largest difference
between the two feature sets.

Models: ``cnn`` (3 conv + BatchNorm blocks and a linear head on 32 px, the
size of TCT's small CIFAR/FMNIST networks), ``mlp`` (784-200-200-10 on 28 px)
and ``resnet18`` (torchvision, 32 px, the TCT CIFAR-10 backbone).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torchvision
from torch import nn

from fedray.tct.entk import (
    coordinate_index,
    entk_features,
    entk_features_loop,
    num_parameters,
    reinitialize_last_layer,
)


def small_cnn(classes: int = 10) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32), nn.MaxPool2d(2), *block(32, 64), nn.MaxPool2d(2), *block(64, 64),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "cnn": (small_cnn, (3, 32, 32)),
    "mlp": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                                  nn.Linear(200, 10)), (1, 28, 28)),
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (3, 32, 32)),
}


def timed(run: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    """Seconds taken by ``run()`` and its result."""
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--p", type=int, default=100_000)
    parser.add_argument("--model", choices=sorted(MODELS), default="cnn")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    build, shape = MODELS[args.model]
    model = reinitialize_last_layer(build(), seed=1)
    params = num_parameters(model)
    index = coordinate_index(params, args.p, seed=2)
    inputs = torch.randn(args.samples, *shape, generator=torch.Generator().manual_seed(3))
    entk_features(model, inputs[: min(8, args.samples)], index, chunk_size=args.chunk_size)  # warm-up

    batched_s = loop_s = float("inf")
    for _ in range(args.repeats):
        seconds, batched = timed(lambda: entk_features(model, inputs, index, chunk_size=args.chunk_size))
        batched_s = min(batched_s, seconds)
        seconds, loop = timed(lambda: entk_features_loop(model, inputs, index))
        loop_s = min(loop_s, seconds)

    batched_sps, loop_sps = args.samples / batched_s, args.samples / loop_s
    print(json.dumps({
        "benchmark": "entk",
        "model": f"{args.model}@{shape[-1]}px",
        "params": params,
        "p": index.numel(),
        "samples": args.samples,
        "chunk_size": args.chunk_size,
        "batched_samples_per_s": round(batched_sps, 1),
        "loop_samples_per_s": round(loop_sps, 1),
        "ratio_batched_vs_loop": round(batched_sps / loop_sps, 3),
        "max_abs_diff": float((batched - loop).abs().max()),
        "torch_threads": torch.get_num_threads(),
        "weights": "random (seeded; timing only)",
    }))


if __name__ == "__main__":
    main()
