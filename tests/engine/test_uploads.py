"""Every upload of every stage goes through the run's one postprocessing.

A counting postprocessor sees each client upload the run's schedule makes
(closed form: a client's first sampling; training: every sampling; SphereFed's
calibration, the ridge probe, TCT's normalization round and closed form: every
client once), numbered with the run's rounds; one that changes nothing (σ = 0 noise on each client's upload, with
``per_client`` true) leaves every built-in path bit for bit as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import fedray
from fedray.engine.run_config import run
from fedray.engine.config import resolve
from fedray.runtime import sampling
from tests.images import write_image_folder

DATASET = "synthetic:inat-geo-100?dim=12&scale=0.2&classes=10"
SMALL = {"dataset": DATASET, "clients_per_round": 6, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
         "client_lr": 0.05, "local_epochs": 1, "batch_size": 8}
"""Every run's options here, closed-form or training: each run takes those that apply to it (``drop_unused``)."""


class Counting(fedray.Postprocessor):
    """Appends ``round client names weight`` to the file ``log`` for each client upload, ``round aggregate clients``
    for each sum; changes nothing."""

    def __init__(self, log: Annotated[str, "the file each upload is recorded in"] = "") -> None:
        super().__init__()
        self.log = log

    @property
    def per_client(self) -> bool:
        return True

    def client(self, upload, context):
        with open(self.log, "a") as log:
            log.write(f"{context.round} {context.client} {','.join(sorted(upload.tensors))} {upload.weight:g}\n")
        return upload

    def aggregate(self, total, context):
        with open(self.log, "a") as log:
            log.write(f"{context.round} aggregate {context.clients}\n")
        return total


class ZeroNoise(fedray.Postprocessor):
    """σ = 0 Gaussian noise on each client's tensors and on the sum: adds ±0.0 everywhere, which changes no value."""

    @property
    def per_client(self) -> bool:
        return True

    def client(self, upload, context):
        return fedray.Upload({name: tensor + 0.0 * torch.randn(tensor.shape, generator=context.generator).to(tensor.dtype)
                              if tensor.is_floating_point() else tensor.clone() for name, tensor in upload.tensors.items()},
                             upload.weight)

    def aggregate(self, total, context):
        return {name: tensor + 0.0 if tensor.is_floating_point() else tensor for name, tensor in total.items()}


COUNTING = f"{__name__}:Counting"
ZERO_NOISE = f"{__name__}:ZeroNoise"


def counted(tmp_path: Path, name: str, **values) -> tuple[list[np.ndarray], list[tuple], list[tuple]]:
    """(the run's rounds, its client uploads as (round, client, names, weight), its aggregates as (round, clients))."""
    log = tmp_path / f"{name}.log"
    config = resolve({}, {**SMALL, "out": str(tmp_path / name), "postprocessor": COUNTING, "options": {"log": str(log)},
                          **values}, drop_unused=True)
    completed = run(config)
    uploads, sums = [], []
    for line in log.read_text().splitlines():
        fields = line.split()
        if fields[1] == "aggregate":
            sums.append((int(fields[0]), int(fields[2])))
        else:
            uploads.append((int(fields[0]), int(fields[1]), fields[2], float(fields[3])))
    return completed.rounds, uploads, sums


def first_samplings(rounds: list[np.ndarray]) -> set[tuple[int, int]]:
    """(round, client) of each client's first sampling: when a closed-form client uploads."""
    seen: set[int] = set()
    out = set()
    for number, clients in enumerate(rounds, start=1):
        out |= {(number, int(c)) for c in clients if int(c) not in seen}
        seen |= {int(c) for c in clients}
    return out


def every_sampling(rounds: list[np.ndarray], first: int = 1) -> list[tuple[int, int]]:
    return sorted((number, int(c)) for number, clients in enumerate(rounds, start=first) for c in clients)


def test_a_closed_form_run_passes_each_clients_one_upload_through_it(ray_session, tmp_path):
    rounds, uploads, sums = counted(tmp_path, "fed3r", method="fed3r", rounds=5, eval_every=2)
    assert {(r, c) for r, c, _, _ in uploads} == first_samplings(rounds) and len(uploads) == len(first_samplings(rounds))
    assert {(names, weight) for _, _, names, weight in uploads} == {("gram,targets", 1.0)}
    # one aggregate per evaluation block (rounds 2, 4, 5), summing the block's uploads
    blocks = {2: (1, 2), 4: (3, 4), 5: (5, 5)}
    assert sorted(sums) == [(end, sum(1 for r, *_ in uploads if first <= r <= last)) for end, (first, last) in blocks.items()]


def test_a_training_run_passes_every_participation_through_it(ray_session, tmp_path):
    rounds, uploads, sums = counted(tmp_path, "fedavg", method="fedavg", rounds=4, eval_every=2)
    assert sorted((r, c) for r, c, _, _ in uploads) == every_sampling(rounds)
    assert {names for _, _, names, _ in uploads} == {"bias,weight"}
    assert all(weight >= 1 for *_, weight in uploads)   # the weight the server sums with: the client's samples
    assert sorted(sums) == [(r, 6) for r in range(1, 5)]


def test_both_stages_of_a_two_stage_run_pass_through_the_same_postprocessing(ray_session, tmp_path):
    rounds, uploads, sums = counted(tmp_path, "init", method="fedavg", init="fed3r", init_rounds=3, rounds=2, eval_every=3)
    closed_form, training = rounds[:3], rounds[3:]
    expected = first_samplings(closed_form) | set(every_sampling(training, first=4))
    assert sorted((r, c) for r, c, _, _ in uploads) == sorted(expected)
    assert {names for r, _, names, _ in uploads if r <= 3} == {"gram,targets"}
    assert {names for r, _, names, _ in uploads if r > 3} == {"bias,weight"}
    assert [r for r, _ in sorted(sums)] == [3, 4, 5]     # the closed form's one block, then each training round


def test_spherefed_passes_training_and_its_calibration_through_it(ray_session, tmp_path):
    rounds, uploads, _ = counted(tmp_path, "sphere", method="fedavg", head="sphere", rounds=2, eval_every=1,
                                 probe_ridge=True)
    clients = len(rounds[-1])
    training = every_sampling(rounds[:2])
    calibration = [(3, c) for c in range(clients)]
    probe = [(4, c) for c in range(clients)]
    assert sorted((r, c) for r, c, _, _ in uploads) == sorted(training + calibration + probe)
    assert {names for r, _, names, _ in uploads if r == 3} == {"gram,targets"}


def tct(tmp_path: Path) -> dict:
    """A small TCT run's options: 2 rounds of stage 1 on 4 clients' tiny images, 2 of them a round, then both solvers
    on 20 eNTK coordinates, SCAFFOLD for 3 rounds."""
    root = write_image_folder(tmp_path / "data", classes=3, train_per_class=4, test_per_class=2)
    return dict(method="tct", dataset=f"imagefolder:{root}?split=classes&classes_per_client=2&clients=4",
                backbone="squeezenet1_1", weights="random", image_size=32, clients_per_round=2, rounds=2, eval_every=2,
                batch_size=4, num_trainers=2, cpus_per_trainer=0.5, entk_dim=20, entk_chunk=8, tct_rounds=3,
                tct_local_steps=2, tct_lr=1e-3, tct_solver="both")


@pytest.mark.slow
def test_tct_passes_both_stages_uploads_through_it(ray_session, tmp_path):
    rounds, uploads, sums = counted(tmp_path, "tct", **tct(tmp_path))
    # the schedule: stage 1's rounds 1–2, the normalization round 3 and the closed form's round 4 (every client once),
    # SCAFFOLD's rounds 4–6 (its round r is 3 + r: both solvers branch from the normalization)
    stage1, everyone, scaffold = rounds[:2], list(range(4)), rounds[3:]
    assert len(rounds) == 2 + 1 + 3 and sorted(rounds[2].tolist()) == everyone
    assert [r.tolist() for r in scaffold] == [r.tolist() for r in sampling.schedule(4, 2, True, 0, 3, past_coverage=True)]
    by_names: dict[str, list[tuple[int, int]]] = {}
    for r, c, names, _ in uploads:
        by_names.setdefault("training" if r <= 2 else names, []).append((r, c))
    assert {name: sorted(seen) for name, seen in by_names.items()} == {
        "training": every_sampling(stage1),
        "count,squares,sums": [(3, c) for c in everyone],
        "matrix,rhs": [(4, c) for c in everyone],
        "control_change,delta": every_sampling(scaffold, first=4),
    }
    assert {weight for r, _, names, weight in uploads if r > 2 and names != "control_change,delta"} == {1.0}
    assert sorted(sums) == sorted([(1, 2), (2, 2), (3, 4), (4, 4), (4, 2), (5, 2), (6, 2)])


def finished(tmp_path: Path, name: str, **values) -> tuple[list[dict], dict[str, np.ndarray]]:
    """The rows (less wall-clock times) and classifier.npz of a run."""
    config = resolve({}, {**SMALL, "out": str(tmp_path / name), **values}, drop_unused=True)
    run(config)
    rows = pq.read_table(tmp_path / name / "metrics.parquet").drop(["wall_s"]).to_pylist()
    return rows, dict(np.load(tmp_path / name / "classifier.npz"))


def assert_bitwise_unchanged(tmp_path: Path, **values) -> None:
    plain_rows, plain = finished(tmp_path, "plain", **values)
    rows, arrays = finished(tmp_path, "noiseless", postprocessor=ZERO_NOISE, **values)
    drop = ("postprocessor", "secure_aggregation")  # the uploads group's columns, a run with a postprocessor's
    assert [{k: v for k, v in row.items() if k not in drop} for row in rows] == \
        [{k: v for k, v in row.items() if k not in drop} for row in plain_rows]
    assert arrays.keys() == plain.keys()
    for key in plain:
        assert arrays[key].tobytes() == plain[key].tobytes(), key


@pytest.mark.parametrize("method", ["fedncm", "fed3r", "fed3r-rf", "fedcof", "fedcof-oracle"])
def test_zero_noise_leaves_a_closed_form_method_bitwise_unchanged(ray_session, tmp_path, method):
    assert_bitwise_unchanged(tmp_path, method=method, rounds=4, eval_every=2, **({"rf_dim": 32} if method == "fed3r-rf" else {}))


@pytest.mark.parametrize("method", ["fedavg", "fedavgm", "fedadam", "fedprox", "scaffold"])
def test_zero_noise_leaves_the_dual_form_bitwise_unchanged(ray_session, tmp_path, method):
    assert_bitwise_unchanged(tmp_path, method=method, rounds=3, eval_every=1)


@pytest.mark.parametrize("method", ["feddyn", "fednova"])
def test_zero_noise_leaves_autograd_training_bitwise_unchanged(ray_session, tmp_path, method):
    assert_bitwise_unchanged(tmp_path, method=method, rounds=3, eval_every=1)


@pytest.mark.slow
def test_zero_noise_leaves_two_stages_and_spherefed_bitwise_unchanged(ray_session, tmp_path):
    assert_bitwise_unchanged(tmp_path / "init", method="scaffold", init="fed3r", init_rounds=3, rounds=2, eval_every=2)
    assert_bitwise_unchanged(tmp_path / "sphere", method="fedprox", head="sphere", rounds=2, eval_every=1, probe_ridge=True)


@pytest.mark.slow
def test_zero_noise_leaves_tct_bitwise_unchanged(ray_session, tmp_path):
    assert_bitwise_unchanged(tmp_path, **tct(tmp_path))


@pytest.mark.slow
def test_zero_noise_leaves_fine_tuning_on_images_bitwise_unchanged(ray_session, tmp_path):
    root = write_image_folder(tmp_path / "data", classes=3, train_per_class=4, test_per_class=2)
    assert_bitwise_unchanged(
        tmp_path, method="scaffold", init="fedncm", dataset=f"imagefolder:{root}?split=classes&classes_per_client=2&clients=4",
        finetune="ftfeat", backbone="squeezenet1_1", weights="random", image_size=32, clients_per_round=2, rounds=2,
        eval_every=1, batch_size=4, num_trainers=1, cpus_per_trainer=1, num_shards=1, cpus_per_shard=0.5)
