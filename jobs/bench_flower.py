"""Benchmark: Fed3R over the same clients through Flower's simulation and through fedray, each a whole process.

    python -m jobs.bench_flower [--clients 1000] [--dim 1280] [--per-round 10]

The federation is the iNat-User-120K stand-in at ``--clients`` clients
(``synthetic:inat-user-120k?clients=K&dim=d``: C = 1,203). fedray runs it as a
user does, ``python -m fedray run --method fed3r`` (κ = ``--per-round`` clients
a round until every client was seen, one evaluation at the end). Flower runs
the same work in the shape of its tutorials, in a process of its own
(:func:`flower_run`): ``run_simulation`` on its Ray backend (one CPU per
client), one ``NumPyClient`` per client whose ``fit`` returns its ZᵀZ and ZᵀY
(float64), and a strategy (FedAvg's, three methods replaced) that gives each
round the next κ clients, so that every client uploads once as in fedray's run,
sums their statistics as they arrive, solves W = (Σ ZᵀZ + λI)⁻¹ Σ ZᵀY after the
last round, divides each class column by its norm (Fed3R's, as fedray does)
and evaluates it on the test rows (a centralized ``evaluate_fn``). Each
process loads the federation itself (each of Flower's workers too, once).

Prints one JSON line: each process's wall time as this process sees it
(interpreter start-up included), Flower's over fedray's, both test
accuracies, and the largest difference between the two classifiers relative
to fedray's largest weight (the same classifier to round-off). Where Flower
is not installed (``import flwr``), its figures are null and ``flower`` says so.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LAM = 0.01
"""Fed3R's λ: fedray's default (``--lam``)."""


def dataset_spec(clients: int, dim: int) -> str:
    return f"synthetic:inat-user-120k?clients={clients}&dim={dim}"


@functools.cache
def train_rows(spec: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The training features (float32), labels, client offsets and class count of ``spec``, read once a process."""
    from fedray.data.registry import load_federation

    federation = load_federation(spec)
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    features = federation.require_features().features("train", sample_ids).numpy()
    return features, labels.astype(np.int64), offsets, federation.num_classes


def accuracy_on_test_rows(spec: str, weight: np.ndarray) -> float:
    """Top-1 accuracy of the scores zᵀW on ``spec``'s test rows."""
    from fedray.data.registry import load_federation

    federation = load_federation(spec)
    sample_ids, labels = federation.test_arrays()
    features = federation.require_features().features("test", sample_ids).numpy()
    return float(np.mean(np.argmax(features @ weight.astype(np.float32), axis=1) == labels))


def flower_run(spec: str, per_round: int, out: Path) -> None:
    """Fed3R through Flower's simulation; writes W (d × C) and the test accuracy to ``out`` (``.npz``)."""
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, FitIns, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    num_clients = int(dict(part.split("=") for part in spec.partition("?")[2].split("&"))["clients"])
    rounds = -(-num_clients // per_round)
    empty = Parameters(tensors=[], tensor_type="numpy.ndarray")

    class RidgeClient(NumPyClient):
        """One client: its ZᵀZ and ZᵀY, the sums Fed3R's server needs."""

        def __init__(self, features: np.ndarray, labels: np.ndarray, num_classes: int) -> None:
            self.features, self.labels, self.num_classes = features, labels, num_classes

        def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int, dict]:
            z = self.features.astype(np.float64)
            onehot = np.zeros((len(z), self.num_classes))
            onehot[np.arange(len(z)), self.labels] = 1.0
            return [z.T @ z, z.T @ onehot], len(z), {}

    def client_fn(context: Context) -> object:
        features, labels, offsets, num_classes = train_rows(spec)
        client = int(context.node_config["partition-id"])
        rows = slice(int(offsets[client]), int(offsets[client + 1]))
        return RidgeClient(features[rows], labels[rows], num_classes).to_client()

    class Fed3RStrategy(FedAvg):
        """Each round the next κ clients; their statistics summed as they come; the ridge solve after the last."""

        def __init__(self) -> None:
            super().__init__(fraction_evaluate=0.0, min_available_clients=num_clients, initial_parameters=empty,
                             evaluate_fn=self.evaluate_last)
            self.gram: np.ndarray | None = None
            self.targets: np.ndarray | None = None
            self.accuracy = float("nan")

        def configure_fit(self, server_round: int, parameters: Parameters, client_manager: object) -> list:
            client_manager.wait_for(num_clients)
            clients = sorted(client_manager.all().values(), key=lambda proxy: proxy.cid)
            chosen = clients[(server_round - 1) * per_round:server_round * per_round]
            return [(proxy, FitIns(empty, {})) for proxy in chosen]

        def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[Parameters, dict]:
            if failures:
                raise RuntimeError(f"round {server_round}: {len(failures)} clients failed: {failures[0]!r}")
            for _, fit in results:
                gram, targets = parameters_to_ndarrays(fit.parameters)
                self.gram = gram if self.gram is None else self.gram + gram
                self.targets = targets if self.targets is None else self.targets + targets
            if server_round < rounds:
                return empty, {}
            weight = np.linalg.solve(self.gram + LAM * np.eye(len(self.gram)), self.targets)
            norms = np.linalg.norm(weight, axis=0)
            return ndarrays_to_parameters([weight / np.where(norms > 0, norms, 1.0)]), {}

        def evaluate_last(self, server_round: int, parameters: list[np.ndarray], config: dict) -> tuple | None:
            if server_round < rounds:
                return None
            self.accuracy = accuracy_on_test_rows(spec, parameters[0])
            np.savez(out, W=parameters[0], accuracy=self.accuracy)
            return 0.0, {"accuracy": self.accuracy}

    def server_fn(context: Context) -> ServerAppComponents:
        return ServerAppComponents(strategy=Fed3RStrategy(), config=ServerConfig(num_rounds=rounds))

    run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn),
                   num_supernodes=num_clients, backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    if not out.exists():
        raise SystemExit("Flower's simulation ended without the last round's classifier")


def timed_process(command: list[str]) -> float:
    """Seconds ``command`` takes as a whole process, which must succeed."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr[-4000:]}")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--per-round", type=int, default=10, help="clients a round, κ (default %(default)s)")
    parser.add_argument("--flower-out", help=argparse.SUPPRESS)  # the Flower process's own run
    args = parser.parse_args(argv)
    spec = dataset_spec(args.clients, args.dim)
    if args.flower_out:
        from jobs import bench_flower  # as an importable module, not __main__: Flower's workers load its functions

        bench_flower.flower_run(spec, args.per_round, Path(args.flower_out))
        return
    folder = Path(tempfile.mkdtemp(prefix="fedray-bench-flower-"))
    fedray_s = timed_process([sys.executable, "-m", "fedray", "run", "--method", "fed3r", "--dataset", spec,
                              "--clients-per-round", str(args.per_round), "--eval-every", str(args.clients),
                              "--lam", str(LAM), "--quiet", "--out", str(folder / "fedray")])
    fedray = np.load(folder / "fedray" / "classifier.npz")["W"]
    import polars as pl

    fedray_accuracy = float(pl.read_parquet(folder / "fedray" / "metrics.parquet")["accuracy"][-1])
    flower_s = flower_accuracy = difference = None
    installed = importlib.util.find_spec("flwr") is not None
    if installed:
        flower_s = timed_process([sys.executable, "-m", "jobs.bench_flower", "--clients", str(args.clients), "--dim",
                                  str(args.dim), "--per-round", str(args.per_round),
                                  "--flower-out", str(folder / "flower.npz")])
        flower = np.load(folder / "flower.npz")
        flower_accuracy = float(flower["accuracy"])
        difference = float(np.abs(flower["W"] - fedray).max() / np.abs(fedray).max())
    print(json.dumps({
        "benchmark": "fed3r_flower",
        "dataset": spec, "clients": args.clients, "dim": args.dim, "classes": fedray.shape[1],
        "clients_per_round": args.per_round, "lam": LAM,
        "flower": importlib.metadata.version("flwr") if installed else "not installed",
        "fedray_process_s": round(fedray_s, 2), "flower_process_s": None if flower_s is None else round(flower_s, 2),
        "ratio_flower_vs_fedray": None if flower_s is None else round(flower_s / fedray_s, 2),
        "fedray_accuracy": round(fedray_accuracy, 4),
        "flower_accuracy": None if flower_accuracy is None else round(flower_accuracy, 4),
        "max_rel_diff_flower_vs_fedray": difference,
    }))


if __name__ == "__main__":
    main()
