"""A training algorithm's per-client state lives in the shards: a killed shard costs nothing but time (the run replays
from its last checkpoint to bitwise the result of one that never failed), and the driver never receives it."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
import torch

import fedray.engine.run_config
from fedray.engine.config import resolve
from tests.started_pools import keeping_started_pools

REPO = Path(__file__).resolve().parents[2]
DATASET = "synthetic:inat-geo-100?dim=8&scale=0.3&classes=6"


def config(out: Path, **values):
    return resolve({}, {"method": f"{REPO / 'examples' / 'local_drift.py'}:LocalDrift", "dataset": DATASET,
                        "out": str(out), "client_lr": 0.05, "rounds": 8, "clients_per_round": 6, "eval_every": 2,
                        "num_shards": 2, "cpus_per_shard": 0.5, "checkpoint_every": 3, "quiet": True,
                        "options": {"drift_alpha": 0.3}, **values})


def outputs(out: Path) -> tuple[list[dict], dict[str, np.ndarray]]:
    rows = pq.read_table(out / "metrics.parquet").drop(["wall_s"]).to_pylist()
    return rows, dict(np.load(out / "classifier.npz"))


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_shard_killed_mid_run_gives_bitwise_the_uninterrupted_run(ray_session, tmp_path, monkeypatch, capsys):
    fedray.engine.run_config.run(config(tmp_path / "plain"))
    pools = keeping_started_pools(monkeypatch)
    killed, reported = [], []

    def kill_after_round_4(point, classifier):
        reported.append(point.round)
        if point.round == 4 and not killed:  # after the checkpoint of round 3: the states of rounds 4.. are lost with it
            ray.kill(pools[0].actors[1], no_restart=False)
            killed.append(point.round)

    fedray.engine.run_config.run(config(tmp_path / "killed"), on_point=kill_after_round_4)
    assert killed == [4]
    assert reported == [0, 2, 4, 6, 8], "a replayed row is not reported again (to a Tune trial, on_evaluation)"
    assert "an actor restarted and lost its clients' states: replaying from training round 3" in capsys.readouterr().err
    plain_rows, plain_arrays = outputs(tmp_path / "plain")
    rows, arrays = outputs(tmp_path / "killed")
    assert rows == [{**row, "out": str(tmp_path / "killed")} if "out" in row else row for row in plain_rows]
    assert arrays.keys() == plain_arrays.keys()
    for name in arrays:
        assert np.array_equal(arrays[name], plain_arrays[name]), name
    assert not list((tmp_path / "killed").glob("checkpoint*")), "a finished run leaves no checkpoint or client states"


def test_the_clients_states_never_reach_the_driver(ray_session, tmp_path, monkeypatch):
    """Every object the driver receives from the cluster is recorded: none holds more than a few models' worth of
    floats, although the shards hold one drift per client seen (tens of models)."""
    worker = ray._private.worker.global_worker
    received: list[int] = []
    get_objects = type(worker).get_objects

    def recording(self, *args, **kwargs):
        values, *rest = get_objects(self, *args, **kwargs)
        received.extend(floats(value) for value in values)
        return (values, *rest)

    monkeypatch.setattr(type(worker), "get_objects", recording)
    fedray.engine.run_config.run(config(tmp_path / "run", checkpoint_every=None))
    monkeypatch.undo()
    saved = np.load(tmp_path / "run" / "classifier.npz")
    model = saved["W"].size + saved["bias"].size
    clients_seen = pq.read_table(tmp_path / "run" / "metrics.parquet")["clients_seen"][-1].as_py()
    assert clients_seen >= 30, "the shards hold 30+ drifts of one model each"
    assert received and max(received) <= 2 * model


def floats(value: object) -> int:
    """Floats in the tensors and arrays of ``value`` (dataclasses, dicts, sequences)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, np.ndarray):
        return value.size
    if isinstance(value, dict):
        return sum(floats(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(floats(item) for item in value)
    if hasattr(value, "__dataclass_fields__"):
        return sum(floats(getattr(value, name)) for name in value.__dataclass_fields__)
    return 0
