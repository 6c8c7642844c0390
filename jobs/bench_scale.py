"""Benchmark: FedNCM, Fed3R and FedCOF over populations of 10⁴, 10⁵ and 10⁶ clients.

    python -m jobs.bench_scale [--clients 10000,100000,1000000] [--methods fedncm,fed3r,fedcof] [--dim 1280] [--clock]
                               [--training-rounds 100]

Each point runs one method on ``synthetic:inat-user-120k?clients=K`` (d = 1,280,
C = 1,203; about 13 samples a client, so 13 million samples at 10⁶), every client
once, 100 clients per round, evaluation every 10% of the run (``--evaluations``
sets how many), in a fresh process
as ``fedray run`` would (2 shards on a 2-core machine: Ray's default), and
reports its wall time (the whole process, from the interpreter's start), the
driver's and the largest shard's peak resident memory (the driver's split into its private memory and the object
store's pages it has mapped: :mod:`jobs.private_memory`), the bytes each client
uploads and the final accuracy. The shards generate their own clients' rows; the
driver holds per-client numbers only, so its peak should not grow with K.

With ``--methods fedavg,scaffold,feddyn`` (any training method) each point runs
100 rounds of 100 clients instead (``--training-rounds``), the clients' states in the shards (at most
``--client-state-memory`` GB a shard in memory, the rest spilled to disk), and
reports the same figures (``samples`` none: a training run visits some clients
many times) and, at the end, the states' megabytes in the shards' memory and on
their disk (``states_memory_mb``, ``states_spilled_mb``).

``bare_gemm_s`` is the lower bound, for each K, measured in a process of its own
with every core: generating the same features (the population's own generator)
and the bare float64 Gram ZᵀZ over them, run by run of rows as the shards do
(``generate_s``, ``gram_s`` and their sum); ``ratio_vs_bare`` is a point's
wall time over that sum.

``--clock`` runs each point a second time on the virtual clock, with
``--devices phones --availability diurnal:86400,0.3`` (:data:`CLOCK`), in a
fresh process of its own, and adds its wall time and driver peak memory
beside the plain run's (``clock_wall_s``, ``clock_driver_peak_rss_mb``),
their ratios to the plain run's (``clock_wall_ratio``, target at most 1.10;
``clock_driver_memory_ratio``, target 1: the clock keeps per-client numbers
in the driver only for the clients a round asks), the same for the driver's private memory
(``clock_driver_peak_private_mb``, ``clock_driver_private_memory_ratio``) and for the bytes its code holds, without
the allocator's slack (``driver_peak_heap_mb``, ``clock_driver_peak_heap_mb``, ``clock_driver_heap_ratio``; with
glibc), the clients the clocked
run saw (``clock_clients_seen``) and its rounds and rows (``clock_rounds``,
``clock_rows``; the plain run's ``rounds``, ``rows``). A closed form on the
clock is evaluated as often as the plain run, evenly in virtual time:
``--eval-every-s`` is its span (``clock_span_h``, virtual hours) over
``--evaluations``, the span found beforehand in a process of its own that
plans the run's rounds on the clock and does nothing else (by rounds, its rows
would follow its many more rounds, each a solve and an evaluation; the span
depends on the uploads' size as well as on availability). It asks
only clients it has not heard yet, online as it goes, and goes on after its
⌈K / 100⌉ scheduled rounds until it has heard every client, so it sees what
the plain run sees (fewer only where a client's uploads were lost too often:
:data:`fedray.clock.hearing.MAX_LOST`). Prints one JSON line.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from jobs.fresh_process import json_line_of  # noqa: E402
from jobs.private_memory import PeakPrivateMemory  # noqa: E402

if TYPE_CHECKING:
    from fedray.engine.config import RunConfig

MB = 2**20
PER_ROUND = 100
CLOSED_FORM = ("fedncm", "fed3r", "fedcof")
TRAINING_ROUNDS = 100
CLOCK = {"devices": "phones", "availability": "diurnal:86400,0.3"}
"""``--clock``'s options: measured phones, each client online 30 % of a 24 h day."""


def dataset(clients: int, dim: int) -> str:
    return f"synthetic:inat-user-120k?clients={clients}&dim={dim}"


def point_config(method: str, clients: int, dim: int, state_memory: float | None, evaluations: int,
                 clock: bool, clock_span_s: float | None, training_rounds: int) -> RunConfig:
    """The run of a point (see :func:`one_point`)."""
    from fedray.engine.config import RunConfig

    training = method not in CLOSED_FORM
    rounds = training_rounds if training else math.ceil(clients / PER_ROUND)
    options = dict(CLOCK) if clock else {}
    if clock_span_s is not None:  # evenly in virtual time, the last row at the end (a hair past the span: no extra)
        options["eval_every_s"] = clock_span_s / evaluations * (1 + 1e-9)
    return RunConfig(method=method, dataset=dataset(clients, dim), clients_per_round=PER_ROUND,
                     rounds=rounds if training else None, eval_every=max(1, rounds // evaluations), quiet=True,
                     out=tempfile.mkdtemp(prefix="fedray-scale-"), client_state_memory=state_memory,
                     component_options=options)


def clock_span(method: str, clients: int, dim: int) -> float:
    """The virtual seconds a closed form's point lasts on :data:`CLOCK`: its rounds planned on the clock, as the run
    plans them before any work (no Ray, no statistics)."""
    from fedray.data.registry import load_federation
    from fedray.engine.plan import plan, postprocessing, stages

    config = point_config(method, clients, dim, None, 1, True, None, TRAINING_ROUNDS).resolved()
    federation = load_federation(config.dataset)
    run = plan(config, federation, stages(config), postprocessing(config))
    for stage in run.stages:
        stage.check(run, federation)
    return run.clock.now


def one_point(method: str, clients: int, dim: int, state_memory: float | None, evaluations: int,
              clock: bool = False, clock_span_s: float | None = None, training_rounds: int = TRAINING_ROUNDS) -> dict:
    """One run as ``fedray run`` does it, in this process; its figures. A closed-form method sees every client once; a
    training method runs ``training_rounds`` rounds; ``evaluations`` rows, evenly spaced, the last at the end;
    ``clock``: on the virtual clock, with :data:`CLOCK` (a closed form's rows spread over ``clock_span_s``)."""
    import ray

    from fedray.engine.run_config import run
    from fedray.runtime.shards import ShardPool, peak_memory_bytes

    peaks: list[int] = []
    states: list[tuple[int, int]] = []
    shutdown = ShardPool.shutdown

    def measured_shutdown(pool: ShardPool) -> None:  # the shards' figures, read before the run lets them go
        peaks.extend(pool.peak_memory_bytes())
        states.extend(pool.client_state_sizes())
        shutdown(pool)

    ShardPool.shutdown = measured_shutdown
    memory = PeakPrivateMemory().start()
    training = method not in CLOSED_FORM
    config = point_config(method, clients, dim, state_memory, evaluations, clock, clock_span_s, training_rounds)
    rows = run(config).rows
    ray.shutdown()
    seconds = time.perf_counter() - STARTED
    return {
        "method": method,
        "clients": clients,
        "samples": rows[-1]["samples_seen"] if not training else None,
        "rounds": rows[-1]["round"],
        "rows": len(rows),
        "wall_s": round(seconds, 1),
        "clients_seen": rows[-1]["clients_seen"],
        "clients_per_s": round(rows[-1]["clients_seen"] / seconds),
        "driver_peak_rss_mb": round(peak_memory_bytes() / MB),
        **memory.figures(),
        "shard_peak_rss_mb": round(max(peaks) / MB),
        "bytes_up_per_client": round(rows[-1]["bytes_up"] / rows[-1]["clients_seen"]),
        "accuracy": round(rows[-1]["accuracy"], 4),
        **({"states_memory_mb": round(sum(held for held, _ in states) / MB),
            "states_spilled_mb": round(sum(spilled for _, spilled in states) / MB)} if training else {}),
    }


def bare(clients: int, dim: int) -> dict:
    """Generating every training feature of the population and the bare float64 ZᵀZ, run by run, in this process."""
    import numpy as np

    from fedray.core.federation import STREAMED_ROWS, TRAIN
    from fedray.data.registry import load_federation
    from fedray.methods.base import gram

    federation = load_federation(dataset(clients, dim))
    samples = int(federation.client_offsets[-1])
    total = None
    generate_s = gram_s = 0.0
    for start in range(0, samples, STREAMED_ROWS):
        begun = time.perf_counter()
        z = federation.source.features(TRAIN, np.arange(start, min(start + STREAMED_ROWS, samples)))
        generated = time.perf_counter()
        part = gram(z)
        total = part if total is None else total.add_(part)
        gram_s += time.perf_counter() - generated
        generate_s += generated - begun
    return {"generate_s": round(generate_s, 3), "gram_s": round(gram_s, 3), "total_s": round(generate_s + gram_s, 3)}


def child(*arguments: str) -> dict:
    """This job's point of ``arguments`` in a fresh process."""
    return json_line_of("jobs.bench_scale", *arguments)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10000,100000,1000000", help="comma-separated population sizes")
    parser.add_argument("--methods", default="fedncm,fed3r,fedcof", help="comma-separated methods")
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--evaluations", type=int, default=10, help="evaluation rows of each run (default 10: every "
                        "10%% of its rounds)")
    parser.add_argument("--client-state-memory", type=float, help="GB of clients' states a shard keeps in memory "
                        "(default: a run's, 1/8 of the machine's memory shared by its shards)")
    parser.add_argument("--training-rounds", type=int, default=TRAINING_ROUNDS, help="rounds of a training method's "
                        "point (default %(default)s)")
    parser.add_argument("--clock", action="store_true", help="also run each point on the virtual clock (phones, "
                        "diurnal availability) and report its wall time and driver memory beside the plain run's")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--clock-span-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--span", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--bare", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.training_rounds < 1:
        parser.error(f"--training-rounds must be at least 1, got {args.training_rounds}")
    if args.one:
        print(json.dumps(one_point(args.one[0], int(args.one[1]), args.dim, args.client_state_memory, args.evaluations,
                                   args.clock, args.clock_span_s, args.training_rounds)))
        return
    if args.span:
        print(json.dumps({"span_s": clock_span(args.span[0], int(args.span[1]), args.dim)}))
        return
    if args.bare:
        print(json.dumps(bare(args.bare, args.dim)))
        return
    sizes, methods = [int(k) for k in args.clients.split(",")], args.methods.split(",")
    closed_form = any(method in CLOSED_FORM for method in methods)
    bare_s = {str(k): child("--bare", str(k), "--dim", str(args.dim)) for k in sizes} if closed_form else {}
    points = []
    for k in sizes:
        for method in methods:
            point_options = ["--training-rounds", str(args.training_rounds)]
            if args.client_state_memory is not None:
                point_options += ["--client-state-memory", str(args.client_state_memory)]
            point = child("--one", method, str(k), "--dim", str(args.dim), "--evaluations", str(args.evaluations),
                          *point_options)
            if method in CLOSED_FORM:
                bare_total = bare_s[str(k)]["total_s"]  # 0 only for a population too small to time
                point["ratio_vs_bare"] = round(point["wall_s"] / bare_total, 2) if bare_total else None
            if args.clock:
                span_s = child("--span", method, str(k), "--dim", str(args.dim))["span_s"] \
                    if method in CLOSED_FORM else None
                clocked = child("--one", method, str(k), "--dim", str(args.dim), "--evaluations", str(args.evaluations),
                                *point_options, "--clock", *(["--clock-span-s", repr(span_s)] if span_s else []))
                point |= {"clock_wall_s": clocked["wall_s"],
                          "clock_driver_peak_rss_mb": clocked["driver_peak_rss_mb"],
                          "clock_wall_ratio": round(clocked["wall_s"] / point["wall_s"], 3),
                          "clock_driver_memory_ratio": round(clocked["driver_peak_rss_mb"]
                                                             / point["driver_peak_rss_mb"], 3),
                          "clock_driver_peak_private_mb": clocked["driver_peak_private_mb"],
                          "clock_driver_private_memory_ratio": round(clocked["driver_peak_private_mb"]
                                                                     / point["driver_peak_private_mb"], 3),
                          **({"clock_driver_peak_heap_mb": clocked["driver_peak_heap_mb"],
                              "clock_driver_heap_ratio": round(clocked["driver_peak_heap_mb"]
                                                               / point["driver_peak_heap_mb"], 3)}
                             if "driver_peak_heap_mb" in point else {}),
                          "clock_clients_seen": clocked["clients_seen"], "clock_rounds": clocked["rounds"],
                          "clock_rows": clocked["rows"],
                          **({"clock_span_h": round(span_s / 3600, 2)} if span_s else {})}
            points.append(point)
            print(json.dumps(points[-1]), file=sys.stderr)
    print(json.dumps({"benchmark": "scale", "dim": args.dim, "clients_per_round": PER_ROUND,
                      "evaluations": args.evaluations, "client_state_memory_gb": args.client_state_memory,
                      **({"clock": CLOCK} if args.clock else {}), "points": points,
                      "bare_gemm_s": bare_s}))


if __name__ == "__main__":
    main()
