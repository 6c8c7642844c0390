"""Benchmark: what secure aggregation costs on the iNat stand-in, in accuracy (the value bits) and in wall time (the masks).

    python -m jobs.bench_secagg [--dim 32] [--bits 8 12 16 20 24] [--cost-dim 128] [--neighbours 4] [--scale 1]

**Accuracy.** Fed3R and FedCOF-oracle (full class covariances) on ``synthetic:inat-user-120k?dim=D`` (all 9,275
clients, C = 1,203), 100 clients a round until every client was seen, an evaluation every 10 rounds (aggregates of
1,000 uploads), plain and through ``secagg`` with v value bits for each v of ``--bits`` and the default (``full``: the
most an aggregate of 1,000 fits in the ring, 33 of 43 bits). The clip C is the largest entry any client's statistics
can reach (n_k, and each class's and coordinate's Σ z² and Σ |z| over a client's samples bound every entry of its
counts, ZᵀZ, ZᵀY, class sums and Σ zzᵀ): nothing is clipped, the loss is the quantization's, a step of C / (2^(v−1) − 1)
per entry. The masks do not change the sum (it is exact), so these runs take SecAgg+ with 2 neighbours, the cheapest
graph. FedCOF itself cannot be measured: its server estimates the class covariances from every client's own class
means, rows it keeps side by side, never adds, so no secure sum can carry them (secagg refuses their integer class
indices in one line); its oracle uploads only sums.

**Masking.** Fed3R over the stand-in at ``--cost-dim`` (all its clients, ``--scale`` of them: 9,275 at 1; 10 clients
a round, an evaluation every 100 rounds, as ``jobs.bench_closedform``), plain and through ``--secure-aggregation``
(SecAgg+ with ``--neighbours`` k, 20 value bits) twice: with its masks modelled (``secagg_masks=model``, the default:
the server gets the survivors' quantized sum, the masks' cost is reported) and generated (``secagg_masks=generate``:
each client expands k + 1 masks of m = d² + d·C + C values, its self-mask and one per neighbour, the server one per
survivor), each run timed whole in this process (the shards' start and data included, the same for all three; after an
untimed run on a hundredth of the clients at d = 8, which pays the process's first imports): the plain, floor and
modelled runs ``--repeats`` times each (5 by default), one of each in turn, their median seconds reported; the
generated masks once. The
ratios to the plain run are the cost of the per-client statistics secure aggregation needs (each client's ZᵀZ on its
own rather than one GEMM per shard) and quantization (modelled: at each client's classes only, its ZᵀZ and its
classes' columns of ZᵀY, :mod:`fedray.runtime.compact_sum`), and, for the generated masks, of each client's dense
upload and its masks; ``same_classifier`` says whether the modelled and generated runs' classifiers are the same bits.
``floor_s``: the run through a postprocessor that sees each client's upload and changes nothing (:class:`PerClient`:
each client's dense statistics computed on their own, then, unchanged, summed as in the plain run), what the modelled
run paid before it computed only each client's classes. The generated run
takes minutes at scale 1 (``--scale 0.1`` for a quick run, ``--skip-generated`` to leave it out).

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import fedray

SECAGG = "fedray.postprocessors.secagg:SecureAggregation"
PER_CLIENT = "jobs.bench_secagg:PerClient"
DATASET = "synthetic:inat-user-120k?dim={dim}"
WARM_UP = "synthetic:inat-user-120k?dim=8&scale=0.01"
"""A run before the timed ones, so that none pays the process's first imports and Ray's first workers."""


class PerClient(fedray.Postprocessor):
    """A postprocessor that sees each client's upload and returns it as it is: the per-client statistics' cost alone."""

    @property
    def per_client(self) -> bool:
        return True


def largest_entry(dataset: str) -> float:
    """The largest absolute entry any client's Fed3R or FedCOF-oracle statistics can have: max over clients of n_k, of
    Σ_i z_ia² and of Σ_i |z_ia| (|Σ_i z_ia z_ib| ≤ max(Σ z_a², Σ z_b²), |Σ_i z_ia y_ic| ≤ Σ_i |z_ia|)."""
    import torch

    from fedray.data.registry import load_federation

    federation = load_federation(dataset)
    sample_ids, _, offsets = federation.train_arrays(0, federation.num_clients)
    z = federation.require_features().features("train", sample_ids).to(torch.float64).numpy()
    starts = np.asarray(offsets[:-1])
    squares = np.add.reduceat(z * z, starts, axis=0).max()
    absolute = np.add.reduceat(np.abs(z), starts, axis=0).max()
    return float(max(np.diff(offsets).max(), squares, absolute))


def timed_run(out: Path, **values) -> tuple[float, float]:
    """Seconds of one run (the whole ``run`` call) and its final accuracy."""
    import pyarrow.parquet as pq

    from fedray.engine.config import resolve
    from fedray.engine.run_config import run

    config = resolve({}, {"out": str(out), "quiet": True, **values}, drop_unused=True)
    start = time.perf_counter()
    run(config)
    seconds = time.perf_counter() - start
    return seconds, float(pq.read_table(out / "metrics.parquet").column("accuracy").to_pylist()[-1])


def accuracy_cost(folder: Path, dim: int, bits: list[int]) -> dict:
    dataset = DATASET.format(dim=dim)
    clip = largest_entry(dataset)
    common = {"dataset": dataset, "clients_per_round": 100, "eval_every": 10}
    table: dict = {"dataset": dataset, "clip": clip, "aggregate": 1000, "neighbours": 2}
    for method in ("fed3r", "fedcof-oracle"):
        _, plain = timed_run(folder / f"{method}-plain", method=method, **common)
        row = {"plain": plain}
        for value_bits in (*bits, None):
            options = {"secagg_clip": repr(clip), "secagg_neighbours": "2"}
            if value_bits is not None:
                options["secagg_value_bits"] = str(value_bits)
            name = "full" if value_bits is None else str(value_bits)
            _, secure = timed_run(folder / f"{method}-{name}", method=method, postprocessor=SECAGG, options=options,
                                  **common)
            row[name] = secure
        table[method] = row
    return table


def masking_cost(folder: Path, dim: int, neighbours: int, scale: float, generated: bool, repeats: int) -> dict:
    dataset = DATASET.format(dim=dim) + (f"&scale={scale:g}" if scale < 1 else "")
    common = {"method": "fed3r", "dataset": dataset, "clients_per_round": 10, "eval_every": 100}
    timed_run(folder / "warm-up", **{**common, "dataset": WARM_UP})  # the process's one-time costs, paid untimed
    options = {"secagg_clip": repr(largest_entry(dataset)), "secagg_neighbours": str(neighbours),
               "secagg_value_bits": "20"}
    arms = {"plain": common, "floor": {**common, "postprocessor": PER_CLIENT},
            "model": {**common, "secure_aggregation": True, "options": {**options, "secagg_masks": "model"}}}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    accuracy = {}
    for repeat in range(repeats):  # alternated: a slower spell of the machine falls on every arm alike
        for arm, values in arms.items():
            run_s, accuracy[arm] = timed_run(folder / f"cost-{arm}-{repeat}", **values)
            seconds[arm].append(run_s)
    median = {arm: statistics.median(runs) for arm, runs in seconds.items()}
    result: dict = {"dataset": dataset, "neighbours": neighbours, "aggregate": 1000, "repeats": repeats,
                    "plain_s": round(median["plain"], 2), "plain_accuracy": accuracy["plain"]}
    for arm in ("floor", "model"):
        result |= {f"{arm}_s": round(median[arm], 2), f"{arm}_ratio": round(median[arm] / median["plain"], 2)}
    result["model_accuracy"] = accuracy["model"]
    if generated:
        generate_s, result["generate_accuracy"] = timed_run(
            folder / "cost-generate", secure_aggregation=True, options={**options, "secagg_masks": "generate"},
            **common)
        result |= {"generate_s": round(generate_s, 2), "generate_ratio": round(generate_s / median["plain"], 2)}
        modelled, drawn = (np.load(folder / name / "classifier.npz") for name in ("cost-model-0", "cost-generate"))
        result["same_classifier"] = modelled.keys() == drawn.keys() and all(
            np.array_equal(modelled[key], drawn[key]) for key in modelled)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=32, help="the features' dimension of the accuracy runs")
    parser.add_argument("--bits", type=int, nargs="*", default=[8, 12, 16, 20, 24], help="value bits v to measure")
    parser.add_argument("--cost-dim", type=int, default=128, help="the features' dimension of the masking cost runs")
    parser.add_argument("--neighbours", type=int, default=4, help="SecAgg+'s k in the masking cost runs")
    parser.add_argument("--scale", type=float, default=1.0, help="the fraction of the stand-in's clients the masking "
                        "cost runs keep (0 < s ≤ 1)")
    parser.add_argument("--skip-accuracy", action="store_true", help="only the masking cost")
    parser.add_argument("--skip-generated", action="store_true", help="the masking cost without the generated masks")
    parser.add_argument("--repeats", type=int, default=5, help="alternated runs of the plain, floor and modelled "
                        "masking cost arms; their medians are reported (default %(default)s; the generated masks run "
                        "once)")
    arguments = parser.parse_args()
    if arguments.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {arguments.repeats}")
    with tempfile.TemporaryDirectory(prefix="fedray-bench-secagg-") as folder:
        result = {}
        if not arguments.skip_accuracy:
            result["accuracy"] = accuracy_cost(Path(folder), arguments.dim, arguments.bits)
        result["masking"] = masking_cost(Path(folder), arguments.cost_dim, arguments.neighbours, arguments.scale,
                                         not arguments.skip_generated, arguments.repeats)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
