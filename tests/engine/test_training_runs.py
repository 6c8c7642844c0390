"""Whole gradient-method runs: IID FedAvg vs centralized logistic regression, FedAdagrad and FedYogi vs a plain loop,
two-stage runs, resume, divergence."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fedray.app.cli import main
from fedray.engine.config import RunConfig
from fedray.data.registry import load_federation
from fedray.core.errors import FedrayError
from fedray.engine.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from fedray.engine.training import Accounting, TrainingState
from fedray.engine.run_config import run
from fedray.methods.base import Classifier
from fedray.methods.training.local import LocalSGD, random_head
from tests.reference import fedavg_by_autograd

SMALL = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60"
IID = SMALL + "&seed=3&split=dirichlet_per_class&alpha=1000&clients=100"  # each class spread evenly: near IID
COMMON = {"num_shards": 2, "cpus_per_shard": 0.5, "quiet": True}


def rows_of(out: Path) -> list[dict]:
    return pq.read_table(out / "metrics.parquet").to_pylist()


def centralized_logistic_regression(spec: str, weight_decay: float) -> float:
    """Test accuracy of multinomial logistic regression on all training features, solved by L-BFGS in float64."""
    federation = load_federation(spec)
    sample_ids, labels, _ = federation.train_arrays(0, federation.num_clients)
    x = federation.source.features("train", sample_ids).double()
    y = torch.from_numpy(labels.astype(np.int64))
    weight = torch.zeros(federation.dim, federation.num_classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(federation.num_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=100, line_search_fn="strong_wolfe", history_size=50)

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = torch.nn.functional.cross_entropy(x @ weight + bias, y)
        value = value + weight_decay / 2 * ((weight**2).sum() + (bias**2).sum())
        value.backward()
        return value

    optimizer.step(loss)
    test_ids, test_labels = federation.test_arrays()
    scores = federation.source.features("test", test_ids).double() @ weight + bias
    return float((scores.argmax(1).numpy() == test_labels).mean())


@pytest.mark.slow
def test_fedavg_on_an_iid_split_approaches_centralized_logistic_regression(ray_session, tmp_path):
    config = RunConfig(method="fedavg", dataset=IID, out=str(tmp_path / "iid"), rounds=300, eval_every=150, **COMMON)
    rows = run(config).rows
    centralized = centralized_logistic_regression(IID, config.weight_decay)
    accuracies = [row["accuracy"] for row in rows]
    assert [row["round"] for row in rows] == [0, 150, 300]
    assert accuracies[0] < 0.05 < accuracies[1] < accuracies[2]
    assert accuracies[2] == pytest.approx(centralized, abs=0.015), (accuracies, centralized)


SECOND_MOMENTS = {  # Reddi et al., Algorithm 2, at β₂ = 0.95
    "fedadagrad": lambda v, delta: v + delta**2,
    "fedyogi": lambda v, delta: v - 0.05 * delta**2 * torch.sign(v - delta**2),
}


@pytest.mark.parametrize("method", ["fedyogi", pytest.param("fedadagrad", marks=pytest.mark.slow)])
def test_an_adaptive_server_run_equals_fedavgs_clients_and_the_optimizer_written_plainly(ray_session, tmp_path, method):
    """--method fedyogi / fedadagrad: FedAvg's clients, then m ← β₁m + (1 − β₁)Δ, v from Δ², θ ← θ + ηm/(√v + τ), m and
    v from 0 (examples/fedyogi.py starts v at τ²: not this reference), at options other than the defaults."""
    config = RunConfig(method=method, dataset=SMALL, out=str(tmp_path / method), rounds=3, eval_every=3, client_lr=0.05,
                       batch_size=8, local_epochs=2, server_lr=0.05, adam_beta1=0.8, adam_tau=1e-2, seed=4, **COMMON,
                       **({"adam_beta2": 0.95} if method == "fedyogi" else {}))
    completed = run(config)
    moments: dict[str, tuple] = {}

    def server(name: str, delta: torch.Tensor) -> torch.Tensor:
        m, v = moments.get(name, (0.0, 0.0))
        m, v = 0.8 * m + 0.2 * delta, SECOND_MOMENTS[method](v, delta)
        moments[name] = m, v
        return m / (torch.sqrt(v) + 1e-2)

    federation = load_federation(SMALL)
    head = Classifier(**random_head(federation.dim, federation.num_classes, seed=4))
    expected = fedavg_by_autograd(federation, list(completed.rounds), LocalSGD(lr=0.05, batch_size=8, epochs=2), 4,
                                  head, server_lr=0.05, server=server)
    assert len(completed.rounds) == 3
    torch.testing.assert_close(torch.from_numpy(completed.arrays["W"]), expected.weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(completed.arrays["bias"]), expected.bias, rtol=1e-4, atol=1e-5)
    assert (expected.weight - head.weight).abs().max() > 1e-2, "the head moved"
    last = completed.rows[-1]  # counted as FedAvg, the head (d·C = 24·60) down and up per participation
    assert last["comm_floats_fedcof"] == last["comm_floats_fed3r"] == 3 * 10 * 2 * 24 * 60


@pytest.mark.slow
def test_fed3r_initialized_training_starts_at_fed3r_and_does_not_drop_below_it(ray_session, tmp_path):
    # The stand-in's features are larger than MobileNetV2's, so lr 0.1 at temperature 0.1 overshoots here.
    config = RunConfig(method="fedavg", dataset=SMALL, out=str(tmp_path / "two-stage"), init="fed3r", temperature=0.1,
                       client_lr=0.001, rounds=50, eval_every=10, **COMMON)
    completed = run(config)
    rows = completed.rows
    closed_form = [row for row in rows if row["stage"] == "closed_form"]
    training = [row for row in rows if row["stage"] == "train"]
    # the rounds' clients, numbered as the rows: the closed form's rounds (with replacement, as training samples) until
    # every client was seen, then 50 rounds; 10 distinct clients each
    stage_rounds = closed_form[-1]["round"]
    assert len(completed.rounds) == training[-1]["round"] == stage_rounds + 50
    assert np.array_equal(np.unique(np.concatenate(completed.rounds[:stage_rounds])), np.arange(371))
    assert len(np.unique(np.concatenate(completed.rounds[:stage_rounds - 1]))) < 371
    assert [len(np.unique(clients)) for clients in completed.rounds] == [10] * (stage_rounds + 50)
    start = training[0]
    assert start["round"] == closed_form[-1]["round"] and start["accuracy"] == closed_form[-1]["accuracy"]
    assert start["clients_seen"] == closed_form[-1]["clients_seen"] == 371
    assert start["bytes_up"] == closed_form[-1]["bytes_up"] and start["bytes_down"] == 0
    assert [row["round"] - start["round"] for row in training] == [0, 10, 20, 30, 40, 50]
    assert min(row["accuracy"] for row in training[1:]) >= start["accuracy"], [row["accuracy"] for row in training]
    head_bytes = 4 * (24 * 60 + 60)
    assert training[-1]["bytes_up"] == closed_form[-1]["bytes_up"] + 50 * 10 * head_bytes
    assert training[-1]["bytes_down"] == 50 * 10 * head_bytes
    assert training[-1]["flops_client_avg"] > closed_form[-1]["flops_client_avg"]


class Interrupted(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("method, init, clock", [("scaffold", "fed3r", {}), ("fedadam", "random", {}),
                                                 ("scaffold", "fed3r", {"devices": "phones"})])
def test_a_resumed_run_equals_an_uninterrupted_one(ray_session, tmp_path, method, init, clock):
    """On the clock too: the resumed run clocks its closed form's rounds again (they ran before the checkpoint) and
    writes the same rounds.parquet."""
    config = RunConfig(method=method, dataset=SMALL, init=init, init_rounds=15, rounds=12, eval_every=4,
                       checkpoint_every=4, temperature=0.5, client_lr=0.01, **clock, **COMMON)
    whole = tmp_path / "whole"
    whole_run = run(replace(config, out=str(whole)))
    assert not (whole / CHECKPOINT).exists(), "a finished run leaves no checkpoint"

    parts = tmp_path / "parts"

    def stop_at_round_eight(point, classifier):
        if point.stage == "train" and point.round - (15 if init != "random" else 0) == 8:
            raise Interrupted

    with pytest.raises(Interrupted):
        run(replace(config, out=str(parts)), on_point=stop_at_round_eight)
    assert (parts / CHECKPOINT).is_file() and not (parts / "metrics.parquet").exists()
    resumed = run(replace(config, out=str(parts), quiet=True), resume=True)
    assert len(resumed.rounds) == (15 if init != "random" else 0) + 12  # the closed form's too, though not rerun
    assert all(np.array_equal(a, b) for a, b in zip(resumed.rounds, whole_run.rounds, strict=True))

    def without_wall(rows):
        return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]

    assert without_wall(rows_of(parts)) == without_wall(rows_of(whole))
    with np.load(whole / "classifier.npz") as a, np.load(parts / "classifier.npz") as b:
        assert a.files == b.files and all(np.array_equal(a[name], b[name]) for name in a.files)
    if clock:
        assert (parts / "rounds.parquet").read_bytes() == (whole / "rounds.parquet").read_bytes()


def test_resume_refuses_a_checkpoint_of_other_options(tmp_path):
    config = RunConfig(method="fedavg", dataset=SMALL).to_dict()
    state = TrainingState({"weight": torch.ones(2, 3)}, {}, {}, Accounting(np.zeros(4, dtype=bool)))
    save_checkpoint(tmp_path, config, state)
    assert load_checkpoint(tmp_path, {**config, "quiet": True, "checkpoint_every": 7}).params["weight"].equal(torch.ones(2, 3))
    with pytest.raises(FedrayError, match=r"saved by a run with other options \(client_lr, seed\)"):
        load_checkpoint(tmp_path, {**config, "client_lr": 0.05, "seed": 1})


def test_divergence_stops_the_run_with_a_marked_row(ray_session, tmp_path, capsys):
    out = tmp_path / "diverged"
    rc = main(["run", "--method", "fedavg", "--dataset", SMALL, "--out", str(out), "--rounds", "20", "--eval-every", "5",
               "--client-lr", "1e30", "--num-shards", "2", "--cpus-per-shard", "0.5", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "fedavg diverged in round 1" in err and str(out) in err
    rows = rows_of(out)
    assert [(row["round"], row["diverged"]) for row in rows] == [(0, False), (1, True)]
    assert np.isnan(rows[-1]["accuracy"])
    with np.load(out / "classifier.npz") as arrays:
        assert np.isfinite(arrays["W"]).all(), "the last finite head is kept"


LAYOUTS = ((1, 1.0), (2, 0.5), (3, 0.5))
"""(--num-shards, --cpus-per-shard): one, two and three shards, each computing on one thread (a shard of 2 CPUs computes
on 2 threads, which split some products and reductions between them: another order, so other last bits)."""


@pytest.mark.slow
@pytest.mark.parametrize("method, extra", [
    ("fedavg", {}), ("scaffold", {}), ("feddyn", {}), ("fednova", {}),
    ("fedavg", {"init": "fed3r", "temperature": 0.1, "client_lr": 0.001}),
])
def test_shard_layouts_give_the_same_bits(ray_session, tmp_path, method, extra):
    """A client trains in bits of its own whichever clients share its shard, and a round's sums are added per leaf of
    the fixed tree: the same head and the same rows, bit for bit, on every layout (SCAFFOLD's and FedDyn's client
    states held by other shards; a two-stage run's closed form and training)."""
    results = []
    for shards, cpus in LAYOUTS:
        config = RunConfig(method=method, dataset=SMALL, out=str(tmp_path / str(shards)), rounds=6, eval_every=3,
                           clients_per_round=40, seed=2, num_shards=shards, cpus_per_shard=cpus, quiet=True, **extra)
        results.append(run(config))
    one = results[0]
    assert len(one.rows) >= 3 and one.rows[-1]["accuracy"] > one.rows[0]["accuracy"]
    for (shards, _), result in zip(LAYOUTS[1:], results[1:]):
        assert result.arrays.keys() == one.arrays.keys()
        assert all(np.array_equal(result.arrays[name], one.arrays[name]) for name in one.arrays), shards
        assert [without_layout(row) for row in result.rows] == [without_layout(row) for row in one.rows], shards


def without_layout(row: dict) -> dict:
    """A row without what differs between layouts by design: this machine's time and the layout itself."""
    return {name: value for name, value in row.items() if name not in ("wall_s", "num_shards", "cpus_per_shard")}
