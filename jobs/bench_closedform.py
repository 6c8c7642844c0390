"""Benchmark: Fed3R over the whole iNat-User-120K stand-in against one bare torch GEMM.

    python -m jobs.bench_closedform [--dim 1280]

Runs Fed3R on all 9,275 clients (d = 1,280, C = 1,203), 10 clients per round
until every client was seen, evaluation every 100 rounds, on an embedded local
Ray (or $RAY_ADDRESS). Then, in the same process, computes the same statistic
ZᵀZ as one float64 torch GEMM over all training features. Prints one JSON line:
wall times (Ray start-up and shard loading reported apart); the ratio of the
run's statistics path (sampling, shard GEMMs, reduction, solves: the run minus
the server's evaluations) to the bare GEMM, and of the whole run including the
ten evaluations on 35,637 test samples (1.1 TFLOP of float32 GEMMs, more than
the statistics' 0.39 TFLOP); peak memory; and the largest relative difference
between the run's classifier and the one solved from the bare GEMM.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fedray.config import RunConfig
from fedray.data.registry import load_federation
from fedray.evaluation import Evaluator
from fedray.methods.base import ClientBatch
from fedray.methods.from_config import build_method
from fedray.engine import simulate
from fedray.runtime.session import init_ray
from fedray.runtime.shards import ShardPool, peak_memory_bytes

MB = 2**20


def timed(compute):
    start = time.perf_counter()
    result = compute()
    return time.perf_counter() - start, result


def bare_gemms(federation, method) -> tuple[float, float, torch.Tensor]:
    """Seconds for one float64 ZᵀZ over all training features with torch and with numpy's
    BLAS (another library's view of the machine's limit), and the classifier torch's gives."""
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    z = federation.require_features().features("train", sample_ids).to(torch.float64)
    torch_s, gram = timed(lambda: z.T @ z)
    numpy_s, _ = timed(lambda: z.numpy().T @ z.numpy())
    batch = ClientBatch(z, torch.from_numpy(labels.astype(np.int64)), offsets, np.arange(federation.num_clients))
    stats = method.client_statistics(batch)
    stats.gram = gram
    return torch_s, numpy_s, method.solve(stats).weight


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1280)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    init_ray()
    ray_start_s = time.perf_counter() - started

    dataset = f"synthetic:inat-user-120k?dim={args.dim}"
    loading = time.perf_counter()
    federation = load_federation(dataset)
    pool = ShardPool.start(federation)
    evaluator = Evaluator(federation)
    load_s = time.perf_counter() - loading

    config = RunConfig(method="fed3r", dataset=dataset, clients_per_round=10, eval_every=100, quiet=True)
    method = build_method(config, federation)
    running = time.perf_counter()
    _, rows, outcome = simulate(config, method, pool, evaluator)
    fed3r_s = time.perf_counter() - running
    shard_peaks = pool.peak_memory_bytes()
    driver_peak = peak_memory_bytes()
    pool.shutdown()

    gemm_s, numpy_gemm_s, bare_weight = bare_gemms(federation, method)
    difference = float((outcome.classifier.weight - bare_weight).abs().max() / bare_weight.abs().max())
    print(json.dumps({
        "benchmark": "closedform_fed3r",
        "dataset": dataset,
        "clients": federation.num_clients,
        "rounds": rows[-1]["round"],
        "eval_points": len(rows),
        "shards": pool.num_shards,
        "accuracy": round(rows[-1]["accuracy"], 4),
        "ray_start_s": round(ray_start_s, 2),
        "load_s": round(load_s, 2),
        "fed3r_s": round(fed3r_s, 2),
        "fed3r_eval_s": round(outcome.eval_s, 2),
        "fed3r_solve_s": round(outcome.solve_s, 2),
        "bare_gemm_s": round(gemm_s, 2),
        "bare_gemm_numpy_s": round(numpy_gemm_s, 2),
        "ratio_statistics_path": round((fed3r_s - outcome.eval_s) / gemm_s, 2),
        "ratio_whole_run": round(fed3r_s / gemm_s, 2),
        "ratio_statistics_path_vs_numpy": round((fed3r_s - outcome.eval_s) / numpy_gemm_s, 2),
        "total_s": round(time.perf_counter() - started, 2),
        "peak_rss_driver_mb": round(driver_peak / MB),
        "peak_rss_shards_mb": [round(p / MB) for p in shard_peaks],
        "max_rel_diff_vs_bare_gemm": difference,
        "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
