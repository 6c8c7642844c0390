"""The quickstart: FedNCM, Fed3R and FedCOF on the iNat-User-120K stand-in, every client once.

    python -m jobs.quickstart [--out results/quickstart] [--dim 1280] [--quiet]

All 9,275 clients, 10 per round until every client was seen (928 rounds),
evaluation every 100 rounds. Runs on an embedded local Ray unless RAY_ADDRESS
is set; one shard pool serves the three methods. Prints a comparison table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.compare import comparison_table, print_table
from fedray.engine.config import RunConfig
from fedray.data.registry import load_federation
from fedray.runtime.evaluator import Evaluator
from fedray.core.results import write_run
from fedray.engine.plan import build_method
from fedray.engine.run_config import simulate
from fedray.runtime.session import init_ray, where_written
from fedray.runtime.shards import ShardPool

METHODS = ("fedncm", "fed3r", "fedcof")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/quickstart", help="results folder (default %(default)s)")
    parser.add_argument("--dim", type=int, default=1280, help="feature dimension d (default %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    dataset = "synthetic:inat-user-120k" + ("" if args.dim == 1280 else f"?dim={args.dim}")
    federation = load_federation(dataset)
    init_ray()
    pool = ShardPool.start(federation)
    evaluator = Evaluator(pool)
    paths = []
    try:
        for name in METHODS:
            out = Path(args.out) / name
            config = RunConfig(method=name, dataset=dataset, out=str(out), clients_per_round=10, eval_every=100, quiet=args.quiet)
            method = build_method(config, federation)
            resolved, rows, outcome = simulate(config, method, pool, evaluator)
            write_run(out, rows, resolved.to_dict(), {**outcome.classifier.arrays(), **method.arrays()})
            paths.append(str(out / "metrics.parquet"))
    finally:
        pool.shutdown()
    print_table(comparison_table(paths))
    folder, note = where_written(args.out)
    print(f"results: {folder}/<method>/metrics.parquet (features are synthetic: a stand-in shaped like iNat-User-120K)")
    if note:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
