"""Every stage's rows count what reached the server: with a postprocessor whose uploads some clients never deliver
(secure aggregation's dropouts, :meth:`fedray.Postprocessor.dropped`), ``clients_seen``, ``samples_seen`` and
``bytes_up`` leave those clients' uploads out, in ``--init``'s closed form, SphereFed's FFC calibration,
``--calibrate`` and TCT's stage 2; the ridge probe measures and counts nothing, with or without them.

The dropping postprocessor here loses every upload of clients 0, 3, 6, … (a weight-0 upload of zeros, as SecAgg's
dropouts are), so what arrived is written out plainly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedray
from fedray.data.registry import load_federation
from fedray.engine.config import RunConfig, resolve
from fedray.engine.plan import Sampler, stages
from fedray.engine.run_config import CompletedRun, run
from fedray.engine.tct import Stage2Run
from fedray.engine.training import Accounting
from fedray.core.results import EvalPoint
from fedray.methods.postprocessor import Postprocessing
from tests.methods.tct_stage2_reference import ScaffoldStage2, closed_form_stage2, standardize_clients
from tests.methods.test_tct_stage2 import NUM_CLASSES, label_skewed
from tests.runtime import test_tct_shards as tct_shards


class DropsMultiplesOfThree(fedray.Postprocessor):
    """Clients 0, 3, 6, … drop out after computing their uploads: theirs reach the server as nothing (weight 0, zeros,
    summed exactly), and :meth:`dropped` names them."""

    @property
    def per_client(self) -> bool:
        return True

    @property
    def exact_sum(self) -> bool:
        return True

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        if context.client % 3:
            return upload
        return fedray.Upload({name: torch.zeros_like(tensor) for name, tensor in upload.tensors.items()}, 0.0)

    def dropped(self, context: fedray.UploadContext) -> list[int]:
        return [client for client in context.participants if client % 3 == 0]


DROPS = f"{__name__}:DropsMultiplesOfThree"
DATASET = "synthetic:inat-user-120k?dim=8&scale=0.01&classes=6&seed=1&split=dirichlet&alpha=0.3&clients=24"
"""24 clients of 41 samples, d = 8, C = 6."""
SMALL = {"dataset": DATASET, "clients_per_round": 6, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
         "client_lr": 0.05, "local_epochs": 1, "batch_size": 8}


def arrived(clients: np.ndarray) -> np.ndarray:
    """Those of ``clients`` whose uploads reach the server: all but 0, 3, 6, …"""
    return clients[clients % 3 != 0]


def completed(tmp_path, name: str, **values) -> CompletedRun:
    config = resolve({}, {**SMALL, "out": str(tmp_path / name), "postprocessor": DROPS, **values}, drop_unused=True)
    return run(config)


@pytest.mark.parametrize("calibration", [pytest.param({"head": "sphere"}, marks=pytest.mark.slow),
                                         {"calibrate": "fed3r"}])
def test_a_calibration_counts_the_uploads_that_arrived_and_the_ridge_probe_none(ray_session, tmp_path, calibration):
    """SphereFed's FFC on l = d = 8 and Fed3R both upload M_k·8 + 8·8 floats (float32), every client once; the ridge
    probe after them adds nothing to any count."""
    result = completed(tmp_path, "calibrated", method="fedavg", rounds=2, eval_every=2, probe_ridge=True,
                       **calibration)
    trained, calibrated = result.rows[-2], result.rows[-1]
    assert (trained["stage"], calibrated["stage"]) == ("train", "calibrated")
    federation = load_federation(DATASET)
    received = arrived(np.arange(24))
    assert calibrated["clients_seen"] == len(received) == 16
    assert calibrated["samples_seen"] == int(federation.client_sizes[received].sum()) == 16 * 41
    uploaded = 4 * float((federation.client_num_classes[received] * 8.0 + 8 * 8).sum())
    assert calibrated["bytes_up"] == trained["bytes_up"] + uploaded
    assert calibrated["ridge_probe_accuracy"] is not None


def test_init_counts_the_closed_form_uploads_that_arrived(ray_session, tmp_path):
    """fedncm's --init uploads M_k·d floats, a client's first time; training's rounds d·C + C floats a participant."""
    result = completed(tmp_path, "init", method="fedavg", init="fedncm", init_rounds=2, rounds=2, eval_every=2)
    federation = load_federation(DATASET)
    assert [(row["round"], row["stage"]) for row in result.rows] == [(2, "closed_form"), (2, "train"), (4, "train")]
    seen: set[int] = set()
    bytes_up = 0.0
    for clients in result.rounds[:2]:  # the closed form's rounds 1–2
        new = arrived(np.array(sorted(set(clients.tolist()) - seen), dtype=np.int64))
        seen |= set(clients.tolist())
        bytes_up += 4 * float(federation.client_num_classes[new].sum() * 8)
    received = {int(c) for c in arrived(np.concatenate(result.rounds[:2]))}
    expected = [(len(received), int(federation.client_sizes[sorted(received)].sum()), bytes_up)] * 2  # training's start
    for clients in result.rounds[2:]:  # training's rounds 3–4
        received |= set(arrived(clients).tolist())
        bytes_up += 4 * (8 * 6 + 6) * len(arrived(clients))
    expected.append((len(received), int(federation.client_sizes[sorted(received)].sum()), bytes_up))
    assert [(row["clients_seen"], row["samples_seen"], row["bytes_up"]) for row in result.rows] == expected


@pytest.fixture(scope="module")
def tct_clients():
    return label_skewed(seed=4)


@pytest.fixture(scope="module")
def tct_held_out():
    held = label_skewed(seed=5, num_clients=4)
    return tct_shards.ClientData(torch.cat([c.features for c in held]), torch.cat([c.labels for c in held]))


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_tct_stage2_counts_and_solves_what_arrived(ray_session, tct_clients, tct_held_out):
    """TCT's stage 2 on six clients (0 and 3 drop out of every aggregate), 20 eNTK coordinates: the normalization
    round's 2p + 1 floats and the closed form's (p + 1)² + (p + 1)·C from the four that arrive, and the closed form is
    the exact minimizer over their samples alone (λ N with their N); SCAFFOLD's rounds (p + 1)·C a participant that
    arrives."""
    sizes = np.array([len(c.labels) for c in tct_clients])
    config = RunConfig(method="tct", tct_solver="both", tct_rounds=2, tct_local_steps=2, tct_lr=0.05, tct_lam=0.1,
                       clients_per_round=3, eval_every=1, seed=3).resolved()
    sampler = Sampler(len(sizes), config.per_round(len(sizes)), config.sampling == "with", config.seed)
    start = EvalPoint(7, 0, 0, 0.5, 0.0, 0.0, 0.0, 0.0, "train")
    pool = tct_shards.start_pool(None, tct_clients, tct_held_out)
    try:
        stage2 = Stage2Run(stages(config)[-1], sampler, config.eval_every, pool, sizes, NUM_CLASSES, 20, [start],
                           Accounting(np.zeros(len(sizes), dtype=bool)),
                           postprocessing=Postprocessing((DropsMultiplesOfThree(),), 3))
        normalization = stage2.normalize()
        model = stage2.closed_form(normalization)
        stage2.scaffold(normalization)
    finally:
        pool.shutdown()
    received = [1, 2, 4, 5]
    standardized = standardize_clients([tct_clients[k] for k in received])[0]
    expected = closed_form_stage2(standardized, NUM_CLASSES, lam=0.1)
    assert torch.allclose(model, expected, rtol=0, atol=1e-10 * expected.abs().max().item())
    closed_form, *scaffold = stage2.points[1:]
    objective, _ = ScaffoldStage2(standardized, NUM_CLASSES).loss_and_accuracy(expected)
    assert closed_form.train_loss == pytest.approx(objective, rel=1e-9)
    assert (closed_form.stage, closed_form.clients_seen, closed_form.samples_seen) == \
        ("tct_closed_form", 4, int(sizes[received].sum()))
    normalization_bytes = 4 * (2 * 20 + 1) * 4
    assert closed_form.bytes_up == normalization_bytes + 4 * (21 * 21 + 21 * NUM_CLASSES) * 4
    bytes_up = float(normalization_bytes)
    assert len(scaffold) == len(stage2.scaffold_rounds) == 2
    for row, clients in zip(scaffold, stage2.scaffold_rounds):
        bytes_up += len(arrived(clients)) * 21 * NUM_CLASSES * 4
        assert (row.stage, row.clients_seen, row.bytes_up) == ("tct_scaffold", 4, bytes_up)
