"""Benchmark: the whole process of a Fed3R run over the iNat-User-120K stand-in, beside Ray's floor and bare GEMMs.

    python -m jobs.bench_closedform [--dim 1280] [--scale 1.0 | --clients K] [--parquet /tmp/fedray-bench/inat.parquet]

Runs Fed3R on all clients (9,275 at scale 1; d = 1,280, C = 1,203), 10 clients
per round until every client was seen, evaluation every 100 rounds, twice, each
in a fresh process as ``fedray run`` would: on the synthetic stand-in, and on
the same federation exported to a Parquet file (written once with
``fedray data export``: 0.8 GB at scale 1, kept for later runs; ``--scale``
makes a smaller one for a quick run; ``--clients K`` runs only the synthetic population of K clients shaped like the
split's, as ``jobs.bench_flower`` does, which has no Parquet copy). Each process times its stages from its
own start (imports, driver load, the wait for Ray, shard start (the shards load their
training and test rows), the rounds (and within them the driver's solves and
its waits for evaluations), writing) and, in the same process, Ray's floor
(``ray.init`` plus one round trip to a new actor), one read of the whole file,
the bare float64 GEMM ZᵀZ over all training features (torch and numpy; the
statistics path is compared with the faster) and the bare float32 evaluation
GEMMs (all test rows times the classifier, once per evaluation point, into one
output; in the driver, one thread pool). The shards queue each evaluation
behind the statistics already submitted, so a run's rounds interleave the two:
the statistics path is timed once more on its own after the run (every client
once, in the run's upload order and number of blocks, through the shards and
the tree reduction) and compared with the faster bare GEMM, and the rounds as
a whole (statistics, solves overlapped with evaluations, evaluations) with the
bare GEMMs together. Ray starts in the background from the process's start, as
``fedray run`` starts it (:mod:`fedray.runtime.ray_start`): ``ray_start_s`` is
its start on its thread (part of the floor), ``ray_wait_s`` what the driver
waited for it after its imports and load. ``goal_s`` is the issue's target: floor + one read +
statistics and evaluation GEMMs + 2 s. ``cpu_s`` is the CPU time spent until the results are written: by the whole
machine (every process: the driver, the shards, Ray's own; from /proc/stat, so on a quiet machine), the driver's
process and each shard's (start-up and imports included); ``cpu_bound_s`` is the machine's over its cores, the
least wall time that work can take. Driver peak memory is taken before the
statistics path is timed again and the bare GEMMs load the features into the
driver, and broken down by kind at the same moment (its own memory, mapped
libraries, the object store's pages it touched: on Linux), beside the same
breakdown once the driver has imported its modules, read the federation's
client and label columns and started Ray, before any shard starts. Prints one
JSON line.
"""

from __future__ import annotations

import os
import time


def machine_busy_s() -> float:
    """CPU time every core of the machine has spent busy since boot, by every process (Linux's /proc/stat)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


STARTED = time.perf_counter()
BUSY_AT_START = machine_busy_s()

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from jobs.private_memory import resident_parts  # noqa: E402

MB = 2**20
DEFAULT_PARQUET = Path(tempfile.gettempdir()) / "fedray-bench" / "inat-{dim}-{scale:g}.parquet"


def timed(compute):
    start = time.perf_counter()
    result = compute()
    return time.perf_counter() - start, result


def ray_floor() -> float:
    """Seconds for one round trip to a freshly started actor (a worker process, no torch)."""
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self) -> int:
            return 1

    start = time.perf_counter()
    actor = Echo.remote()
    ray.get(actor.ping.remote())
    seconds = time.perf_counter() - start
    ray.kill(actor)
    return seconds


def bare_gemms(federation, method, eval_points: int) -> dict:
    """The bare float64 ZᵀZ over all training features (torch and numpy's BLAS), the bare float32 evaluation GEMMs (all
    test rows times the classifier, into one output, once per evaluation point; in the driver), and the largest
    relative difference between the run's classifier and the one solved from torch's ZᵀZ."""
    import numpy as np
    import torch

    from fedray.methods.base import ClientBatch

    source = federation.require_features()
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    z = source.features("train", sample_ids).to(torch.float64)
    torch_s, gram = timed(lambda: z.T @ z)
    numpy_s, _ = timed(lambda: z.numpy().T @ z.numpy())
    batch = ClientBatch(z, torch.from_numpy(labels.astype(np.int64)), offsets, np.arange(federation.num_clients))
    stats = method.client_statistics(batch)
    stats.gram = gram
    classifier = method.solve(stats)
    del z, batch, stats
    test = source.features("test", federation.test_arrays()[0])
    weight = classifier.weight.to(torch.float32)
    scores = torch.empty(len(test), weight.shape[1])
    eval_s, _ = timed(lambda: [torch.matmul(test, weight, out=scores) for _ in range(eval_points)])
    return {"torch": torch_s, "numpy": numpy_s, "eval": eval_s, "weight": classifier.weight}


def resident_mb() -> dict[str, int]:
    """This process's resident memory now, by kind (:func:`jobs.private_memory.resident_parts`), in MB."""
    kinds = {"RssAnon": "own", "RssFile": "files", "RssShmem": "object_store"}
    return {kinds[name]: round(value / MB) for name, value in resident_parts().items()}


def statistics_path_s(pool, method, clients, blocks: int) -> float:
    """The run's statistics alone: ``clients`` (in the run's upload order) in ``blocks`` blocks (as many as the run's
    evaluation points), through the shards and the tree reduction as a run sends them, with no evaluation queued
    between them."""
    import numpy as np
    import ray

    method_ref = ray.put(method)
    start = time.perf_counter()
    for reduction in [pool.statistics(method, block, method_ref) for block in np.array_split(clients, blocks)]:
        reduction.result()
    return time.perf_counter() - start


def read_file_s(path: str) -> float:
    """One read of the whole file into memory (what any reader of every row pays at least)."""
    import pyarrow.parquet as pq

    seconds, table = timed(lambda: pq.read_table(path))
    del table
    return seconds


def one_run(dataset: str) -> dict:
    """One run as ``fedray run`` composes it (see :func:`fedray.engine.run_config.run`), timed stage by stage from process start."""
    times: dict[str, float] = {}
    mark = [STARTED]

    def lap(name: str) -> None:
        now = time.perf_counter()
        times[name] = now - mark[0]
        mark[0] = now

    from fedray.runtime.ray_start import RayStart

    ray_start = RayStart()  # as fedray run starts Ray: in the background, while the driver imports and loads
    ray_start.ray_imported()

    import numpy as np
    import torch

    from fedray.engine.config import RunConfig
    from fedray.data.registry import load_federation
    from fedray.engine.run_config import simulate
    from fedray.runtime.evaluator import Evaluator
    from fedray.core.results import write_run
    from fedray.engine.plan import plan
    from fedray.runtime import sampling
    from fedray.runtime.shards import ShardPool, cpu_seconds, peak_memory_bytes

    lap("imports_s")
    config = RunConfig(method="fed3r", dataset=dataset, clients_per_round=10, eval_every=100, quiet=True,
                       out=tempfile.mkdtemp(prefix="fedray-bench-")).validate().resolved()
    federation = load_federation(dataset)
    run = plan(config, federation)
    method = run.stages[0].method.build(federation)
    lap("driver_load_s")
    ray_start.join()
    lap("ray_wait_s")
    floor_actor_s = ray_floor()
    lap("floor_actor_s")
    driver_started = resident_mb()  # imports, the federation's index and Ray, before any shard
    pool = ShardPool.start(federation, config.num_shards, config.cpus_per_shard,
                           footprints=run.footprints)
    lap("shard_submit_s")
    evaluator = Evaluator(pool)
    pool.wait()
    lap("shard_wait_s")
    resolved, rows, outcome = simulate(config, method, pool, evaluator)
    lap("rounds_s")
    write_run(Path(config.out), rows, resolved.to_dict(), {**outcome.classifier.arrays(), **method.arrays()})
    lap("write_s")
    whole_s = time.perf_counter() - STARTED
    machine_cpu_s = machine_busy_s() - BUSY_AT_START
    driver_cpu_s = cpu_seconds()
    shard_peaks, shard_cpu_s = pool.peak_memory_bytes(), pool.cpu_seconds()
    driver_peak, driver_now = peak_memory_bytes(), resident_mb()
    uploads = np.concatenate(sampling.schedule(federation.num_clients, 10, False, config.seed, None))  # the run's order
    statistics_alone_s = statistics_path_s(pool, method, uploads, len(rows))
    pool.shutdown()

    file_s = read_file_s(federation.source.paths[0]) if dataset.startswith("parquet:") else 0.0
    bare = bare_gemms(federation, method, len(rows))
    faster = min(bare["torch"], bare["numpy"])
    floor_s = ray_start.up_s + floor_actor_s
    goal_s = floor_s + file_s + faster + bare["eval"] + 2.0
    cores = len(os.sched_getaffinity(0))
    return {
        "dataset": dataset,
        "clients": federation.num_clients,
        "rounds": rows[-1]["round"],
        "shards": pool.num_shards,
        "accuracy": round(rows[-1]["accuracy"], 4),
        **{key: round(value, 2) for key, value in times.items()},
        "ray_start_s": round(ray_start.up_s, 2),
        "solves_s": round(outcome.solve_s, 2),
        "evaluation_waits_s": round(outcome.eval_s, 2),
        "statistics_path_s": round(statistics_alone_s, 2),
        "whole_process_s": round(whole_s, 2),
        "floor_s": round(floor_s, 2),
        "read_file_s": round(file_s, 2),
        "bare_gemm_torch_s": round(bare["torch"], 2),
        "bare_gemm_numpy_s": round(bare["numpy"], 2),
        "bare_eval_gemms_s": round(bare["eval"], 2),
        "goal_s": round(goal_s, 2),
        "within_goal": whole_s <= goal_s,
        "cpu_s": {"machine": round(machine_cpu_s, 2), "driver": round(driver_cpu_s, 2),
                  "shards": [round(seconds, 2) for seconds in shard_cpu_s]},
        "cores": cores,
        "cpu_bound_s": round(machine_cpu_s / cores, 2),
        "ratio_statistics_path_vs_faster_gemm": round(statistics_alone_s / faster, 2),
        "ratio_rounds_vs_bare_gemms": round(times["rounds_s"] / (faster + bare["eval"]), 2),
        "peak_rss_driver_mb": round(driver_peak / MB),
        "rss_driver_started_mb": driver_started,
        "rss_driver_at_end_mb": driver_now,
        "file_mb": round(Path(federation.source.paths[0]).stat().st_size / MB) if dataset.startswith("parquet:") else None,
        "peak_rss_shards_mb": [round(p / MB) for p in shard_peaks],
        "max_rel_diff_vs_bare_gemm": float((outcome.classifier.weight - bare["weight"]).abs().max()
                                           / bare["weight"].abs().max()),
        "torch_threads": torch.get_num_threads(),
        # with no __pycache__ yet, each process then compiles fedray's sources
        "dont_write_bytecode": bool(sys.flags.dont_write_bytecode),
    }


def child(dataset: str) -> dict:
    """``one_run(dataset)`` in a fresh process; its wall time as the parent sees it (interpreter start-up included)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "jobs.bench_closedform", "--one", dataset], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{dataset}: exit {done.returncode}\n{done.stderr}")
    return {**json.loads(done.stdout.splitlines()[-1]), "process_wall_s": round(time.perf_counter() - started, 2),
            "stderr_lines": len(done.stderr.splitlines())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the clients (a smaller, quicker run)")
    parser.add_argument("--clients", type=int, help="a population of this many clients instead (synthetic's clients=K)")
    parser.add_argument("--parquet", help="the Parquet file to use, written once when absent")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.one)))
        return
    synthetic = f"synthetic:inat-user-120k?dim={args.dim}" + (f"&scale={args.scale:g}" if args.scale < 1 else "")
    if args.clients is not None:  # a population generates its rows in the shards: it has no Parquet copy to export
        synthetic = f"synthetic:inat-user-120k?clients={args.clients}&dim={args.dim}"
        print(json.dumps({"benchmark": "closedform_fed3r", "synthetic": child(synthetic)}))
        return
    parquet = Path(args.parquet or str(DEFAULT_PARQUET).format(dim=args.dim, scale=args.scale))
    if not parquet.exists():
        parquet.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "fedray", "data", "export", synthetic, "--out", str(parquet)], check=True,
                       stdout=subprocess.DEVNULL)
    print(json.dumps({"benchmark": "closedform_fed3r", "synthetic": child(synthetic), "parquet": child(f"parquet:{parquet}")}))


if __name__ == "__main__":
    main()
