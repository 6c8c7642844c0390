"""Benchmark: FedBuff against synchronous rounds on the clock, at 10⁶ clients.

    python -m jobs.bench_async [--clients 1000000] [--concurrency 1000] [--steps 100] [--dim 1280]
                               [--availability always --availability diurnal:86400,0.3]

For each availability, two runs of FedAvg linear probing on ``synthetic:inat-user-120k?clients=K`` with
``--devices phones``, each in a fresh process as ``fedray run`` would: the synchronous run (``--steps`` rounds of
``--concurrency`` clients) and FedBuff (``--scheduler fedbuff``, ``--steps`` server steps with ``--concurrency``
clients training at once, the buffer its default ⌈M / 2⌉). Each reports its wall time (the whole process, from the
interpreter's start, as :mod:`jobs.bench_scale` does), the part of it inside the run (``run_s``: after Ray and the
federation are up), the driver's peak resident memory and the two parts of it (:mod:`jobs.private_memory`): its
private memory and the object store's pages it has mapped; the point adds their ratios, FedBuff's over the
synchronous run's (``wall_ratio``, target at most 1.2; ``driver_private_memory_ratio``, target about 1: the driver
keeps per-client numbers only for the clients training now, and the updates waiting for their steps are held beside
the shards; ``driver_memory_ratio``, the resident memory's, store pages included). Prints one JSON line.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from jobs.fresh_process import json_line_of  # noqa: E402
from jobs.private_memory import PeakPrivateMemory  # noqa: E402

MB = 2**20
DEVICES = "phones"
AVAILABILITIES = ("always", "diurnal:86400,0.3")
"""The default availabilities: everyone online, and each client online 30 % of a 24 h day (``jobs.bench_scale``'s)."""


def one_run(scheduler: str, clients: int, concurrency: int, steps: int, dim: int, availability: str) -> dict:
    """One FedAvg run on the clock as ``fedray run`` does it, in this process; its figures."""
    import ray

    from fedray.engine.config import RunConfig
    from fedray.engine.run_config import run
    from fedray.runtime.shards import peak_memory_bytes

    options = {"devices": DEVICES, "availability": availability, "scheduler": scheduler}
    if scheduler != "sync":
        options["concurrency"] = concurrency
    config = RunConfig(method="fedavg", dataset=f"synthetic:inat-user-120k?clients={clients}&dim={dim}",
                       clients_per_round=concurrency, rounds=steps, eval_every=steps, quiet=True,
                       out=tempfile.mkdtemp(prefix="fedray-async-"), component_options=options)
    memory = PeakPrivateMemory().start()
    begun = time.perf_counter()
    rows = run(config).rows
    run_s = time.perf_counter() - begun
    ray.shutdown()
    return {"scheduler": scheduler, "wall_s": round(time.perf_counter() - STARTED, 1), "run_s": round(run_s, 1),
            "driver_peak_rss_mb": round(peak_memory_bytes() / MB), **memory.figures(), "steps": rows[-1]["round"],
            "clock_s": round(rows[-1]["clock_s"], 1), "accuracy": round(rows[-1]["accuracy"], 4)}


def child(*arguments: str) -> dict:
    """This job's point of ``arguments`` in a fresh process."""
    return json_line_of("jobs.bench_async", *arguments)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1_000_000, help="population size (default 10⁶)")
    parser.add_argument("--concurrency", type=int, default=1000, help="FedBuff's clients training at once, and the "
                        "synchronous rounds' clients (default 1,000)")
    parser.add_argument("--steps", type=int, default=100, help="server steps, and synchronous rounds (default 100)")
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--availability", action="append", help=f"an availability model to run both under, "
                        f"repeatable (default: {' and '.join(AVAILABILITIES)})")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    availabilities = args.availability or list(AVAILABILITIES)
    sizes = ["--clients", str(args.clients), "--concurrency", str(args.concurrency), "--steps", str(args.steps),
             "--dim", str(args.dim)]
    if args.one:
        print(json.dumps(one_run(args.one, args.clients, args.concurrency, args.steps, args.dim, availabilities[0])))
        return
    points = []
    for availability in availabilities:
        sync, fedbuff = (child("--one", scheduler, *sizes, "--availability", availability)
                         for scheduler in ("sync", "fedbuff"))
        points.append({"availability": availability, "sync": sync, "fedbuff": fedbuff,
                       "wall_ratio": round(fedbuff["wall_s"] / sync["wall_s"], 3),
                       "run_ratio": round(fedbuff["run_s"] / sync["run_s"], 3),
                       "driver_memory_ratio": round(fedbuff["driver_peak_rss_mb"] / sync["driver_peak_rss_mb"], 3),
                       "driver_private_memory_ratio": round(fedbuff["driver_peak_private_mb"]
                                                            / sync["driver_peak_private_mb"], 3)})
        print(json.dumps(points[-1]), file=sys.stderr)
    print(json.dumps({"benchmark": "async", "clients": args.clients, "concurrency": args.concurrency,
                      "steps": args.steps, "dim": args.dim, "devices": DEVICES, "points": points}))


if __name__ == "__main__":
    main()
