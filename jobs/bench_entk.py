"""Benchmark: batched eNTK features (``vmap(grad)`` in chunks) against a per-sample ``autograd.grad`` loop.

    python -m jobs.bench_entk [--samples 256] [--p 100000] [--model cnn] [--chunk-size 64]

Builds a seeded model (weights random: timing only) with its last linear layer
replaced by TCT's one-output head, draws ``--samples`` seeded inputs, and in
this same process computes their features with ``entk_features`` and with
``entk_features_loop``.
The two are timed alternately ``--repeats`` times and the fastest run of each is
kept, so that load from other processes on the machine biases neither. Prints
one JSON line: samples/s of both, their ratio and the largest difference
between the two feature sets. It also times, on the same chunks, one plain
batched forward and backward of the summed logit (no per-sample gradients):
no batched per-sample method can beat that, so ``ratio_bound_vs_loop`` is the
most any could gain over the loop on this device. On a small CPU that bound is
a few times (the loop already runs the convolutions near the rate batches
reach); on a GPU a batch-1 loop is bound by kernel launches and the bound is
far higher. FLOPs of one sample's forward and backward (torch's counter) turn
the rates into GFLOP/s.

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
from torch.utils.flop_counter import FlopCounterMode

from fedray.methods.entk import (
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
    """Seconds taken by ``run()`` (its device work finished) and its result."""
    start = time.perf_counter()
    result = run()
    result.sum().item()
    return time.perf_counter() - start, result


def sample_flops(model: nn.Module, sample: torch.Tensor) -> float:
    """FLOPs of one sample's forward and the backward of logit 0 w.r.t. every parameter (torch's counter)."""
    counter = FlopCounterMode(display=False)
    with counter, torch.enable_grad():
        logit = model.eval()(sample.unsqueeze(0))[0, 0]
        torch.autograd.grad(logit, list(model.parameters()))
    return float(counter.get_total_flops())


def batched_backward(model: nn.Module, inputs: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """One forward and backward of each chunk's summed logit 0: the batched work without per-sample gradients."""
    parameters = list(model.parameters())
    with torch.enable_grad():
        grads = [torch.autograd.grad(model.eval()(inputs[first : first + chunk_size])[:, 0].sum(), parameters)[0]
                 for first in range(0, len(inputs), chunk_size)]
    return torch.stack(grads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--p", type=int, default=100_000)
    parser.add_argument("--model", choices=sorted(MODELS), default="cnn")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = torch.device(args.device)
    build, shape = MODELS[args.model]
    model = reinitialize_last_layer(build(), seed=1).to(device)
    params = num_parameters(model)
    index = coordinate_index(params, args.p, seed=2).to(device)
    inputs = torch.randn(args.samples, *shape, generator=torch.Generator().manual_seed(3)).to(device)
    flops = sample_flops(model, inputs[0])
    entk_features(model, inputs[: min(8, args.samples)], index, chunk_size=args.chunk_size)  # warm-up

    batched_s = loop_s = bound_s = float("inf")
    for _ in range(args.repeats):
        seconds, batched = timed(lambda: entk_features(model, inputs, index, chunk_size=args.chunk_size))
        batched_s = min(batched_s, seconds)
        seconds, loop = timed(lambda: entk_features_loop(model, inputs, index))
        loop_s = min(loop_s, seconds)
        bound_s = min(bound_s, timed(lambda: batched_backward(model, inputs, args.chunk_size))[0])

    batched_sps, loop_sps, bound_sps = args.samples / batched_s, args.samples / loop_s, args.samples / bound_s
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
        "bound_samples_per_s": round(bound_sps, 1),
        "ratio_bound_vs_loop": round(bound_sps / loop_sps, 3),
        "flops_per_sample": flops,
        "batched_gflop_per_s": round(flops * batched_sps / 1e9, 2),
        "loop_gflop_per_s": round(flops * loop_sps / 1e9, 2),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "weights": "random (seeded; timing only)",
    }))


if __name__ == "__main__":
    main()
