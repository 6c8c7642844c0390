"""Asynchronous training on the clock: FedBuff and FedAsync against a plain event loop and plain FedAvg written out
here (their results' staleness too), a scheduler that changes nothing changes no bit, the same events and bits on one
shard and two, and what asynchronous rounds do not take refused in one line."""

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fedray.core.errors import FedrayError
from fedray.data.registry import load_federation
from fedray.engine.asynchronous import AsyncUpdates
from fedray.engine.config import RunConfig
from fedray.engine.run_config import run
from fedray.methods.base import Classifier
from fedray.methods.training.local import LocalSGD, client_rng, minibatches, random_head
from fedray.runtime.probing import ProbeBackend
from tests.reference import train_client_plainly

TINY = "synthetic:inat-user-120k?dim=16&scale=0.005&classes=10&seed=3"  # 46 clients, d = 16, 10 classes
COMMON = {"dataset": TINY, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True, "method": "fedavg", "seed": 5,
          "client_lr": 0.1, "batch_size": 8, "local_epochs": 1}
CLOCK_COLUMNS = {"clock_s", "clock_compute_s", "clock_comm_s", "clients_straggled", "clients_dropped"}
MODEL_BYTES = (16 * 10 + 10) * 4
"""The head's float32 weights and biases: what a FedAvg client downloads and uploads."""


def seconds(client: int) -> float:
    """Client ``client``'s task: its download and upload, at its own speed (compute is instant)."""
    return 1.0 + (client * 7 % 46) / 46


def device_table(path, seconds_of) -> str:
    """A table of 46 devices, client k's task taking ``seconds_of(k)``."""
    path.write_text("client_id,macs_per_s,down_bps,up_bps\n" + "".join(
        f"{client},1e30,{2 * 8 * MODEL_BYTES / seconds_of(client)},{2 * 8 * MODEL_BYTES / seconds_of(client)}\n"
        for client in range(46)))
    return str(path)


@pytest.fixture
def devices(tmp_path):
    return device_table(tmp_path / "devices.csv", seconds)


def plain_events(steps, buffer, max_staleness=None):
    """Every client trains all the time (a concurrency of all 46): each re-dispatched the moment it arrives. Returns
    each step's (time, [(client, version it downloaded)]) in arrival order."""
    arrivals = {client: (seconds(client), 0) for client in range(46)}
    version, buffered, taken = 0, [], []
    while len(taken) < steps:
        now = min(end for end, _ in arrivals.values())
        for client in sorted(client for client, (end, _) in arrivals.items() if end == now):
            _, downloaded = arrivals[client]
            if max_staleness is None or version - downloaded <= max_staleness:
                buffered.append((client, downloaded))
                if len(buffered) == buffer:
                    version += 1
                    taken.append((now, buffered))
                    buffered = []
                    if len(taken) == steps:
                        break
            arrivals[client] = (now + seconds(client), version)
    return taken


def plain_update(federation, features, labels, offsets, model, client, version, sgd, seed):
    """Client ``client``'s FedAvg update (its samples, trained model − start) from ``model`` in round version + 1."""
    rows = slice(offsets[client], offsets[client + 1])
    size = int(offsets[client + 1] - offsets[client])
    batches = minibatches(size, sgd.batch_size, sgd.epochs, client_rng(seed, version + 1, client))
    weight, bias = train_client_plainly(features[rows], labels[rows], model[0], model[1], sgd, batches)
    return size, (weight - model[0], bias - model[1])


def plain_run(events, mixing=None, staleness=lambda s: 1 / math.sqrt(1 + s)):
    """FedBuff (θ += Σ n·w(s)·Δ / Σ n·w(s)) or, with ``mixing`` α, FedAsync (θ ← (1 − α·w)·θ + α·w·(θ_v + Δ))."""
    federation = load_federation(TINY)
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    features = federation.require_features().features("train", sample_ids).to(torch.float64)
    labels = torch.from_numpy(labels.astype(np.int64))
    head = Classifier(**random_head(federation.dim, federation.num_classes, seed=5))
    sgd = LocalSGD(lr=0.1, batch_size=8, epochs=1)
    versions = [(head.weight.to(torch.float64), head.bias.to(torch.float64))]  # in float64: fedray's float32 to 1e-6
    for number, (_, updates) in enumerate(events, start=1):
        weight, bias = versions[-1]
        if mixing is None:
            total_w, total_b, total = torch.zeros_like(weight), torch.zeros_like(bias), 0.0
            for client, version in updates:
                size, (dw, db) = plain_update(federation, features, labels, offsets, versions[version], client,
                                              version, sgd, 5)
                w = size * staleness(number - 1 - version)
                total_w, total_b, total = total_w + w * dw, total_b + w * db, total + w
            versions.append((weight + total_w / total, bias + total_b / total))
        else:
            (client, version), = updates
            _, (dw, db) = plain_update(federation, features, labels, offsets, versions[version], client, version, sgd, 5)
            rate = mixing * staleness(number - 1 - version)
            base = versions[version]
            versions.append((weight + rate * (base[0] + dw - weight), bias + rate * (base[1] + db - bias)))
    return versions[-1]


def assert_head(completed, expected):
    torch.testing.assert_close(torch.from_numpy(completed.arrays["W"]), expected[0].to(torch.float32), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(completed.arrays["bias"]), expected[1].to(torch.float32), rtol=0,
                               atol=1e-6)


def test_fedbuff_equals_the_plain_event_loop_and_fedavg_with_staleness_weights(ray_session, tmp_path, devices):
    steps, buffer = 4, 10
    events = plain_events(steps, buffer)
    assert max(number - 1 - version for number, (_, updates) in enumerate(events, 1) for _, version in updates) >= 1
    completed = run(RunConfig(out=str(tmp_path / "run"), rounds=steps, eval_every=4, devices=devices,
                              scheduler="fedbuff", concurrency=46, buffer=buffer, **COMMON))
    per_step = pq.read_table(tmp_path / "run" / "rounds.parquet").to_pylist()
    assert [row["end_s"] for row in per_step] == [end for end, _ in events]
    assert [client.tolist() for client in completed.rounds] == [[c for c, _ in updates] for _, updates in events]
    assert_head(completed, plain_run(events))
    ages = [[number - 1 - version for _, version in updates] for number, (_, updates) in enumerate(events, start=1)]
    assert [row["staleness_counts"] for row in per_step] == [[step.count(s) for s in range(max(step) + 1)]
                                                              for step in ages]
    every = [age for step in ages for age in step]
    staleness = [(row["round"], row["aggregations"], row["staleness_mean"], row["staleness_max"])
                 for row in completed.rows]
    assert staleness == [(0, 0, None, None), (4, 4, sum(every) / len(every), max(every))]


def test_fedasync_mixes_each_update_in_at_its_staleness_s_rate(ray_session, tmp_path, devices):
    steps = 12
    events = plain_events(steps, 1)
    completed = run(RunConfig(out=str(tmp_path / "run"), rounds=steps, eval_every=6, devices=devices,
                              scheduler="fedasync", concurrency=46, mixing=0.5, staleness="poly:0.5", **COMMON))
    assert [client.tolist() for client in completed.rounds] == [[c for c, _ in updates] for _, updates in events]
    assert_head(completed, plain_run(events, mixing=0.5, staleness=lambda s: (1 + s) ** -0.5))


def test_a_buffer_of_the_whole_concurrency_on_equal_devices_is_synchronous_fedavg_bit_for_bit(ray_session, tmp_path):
    table = tmp_path / "equal.csv"
    table.write_text("macs_per_s,down_bps,up_bps,share\n1e30,1e6,1e6,1\n")
    options = {**COMMON, "rounds": 4, "eval_every": 2, "clients_per_round": 6, "devices": str(table)}
    synchronous = run(RunConfig(out=str(tmp_path / "sync"), **options))
    buffered = run(RunConfig(out=str(tmp_path / "fedbuff"), scheduler="fedbuff", concurrency=6, buffer=6, **options))
    for name, array in synchronous.arrays.items():
        assert np.array_equal(array, buffered.arrays[name]), name
    kept = set(synchronous.rows[0]) - {"wall_s", "scheduler", "concurrency", "buffer"}
    assert [{k: row[k] for k in kept} for row in synchronous.rows] == [{k: row[k] for k in kept} for row in buffered.rows]
    assert not {"aggregations", "staleness_mean", "staleness_max"} & set(synchronous.rows[0])
    assert [(row["aggregations"], row["staleness_mean"], row["staleness_max"]) for row in buffered.rows] == \
        [(0, None, None), (2, 0.0, 0), (4, 0.0, 0)]
    assert "staleness_counts" not in pq.read_schema(tmp_path / "sync" / "rounds.parquet").names
    assert pq.read_table(tmp_path / "fedbuff" / "rounds.parquet")["staleness_counts"].to_pylist() == [[6]] * 4


@pytest.mark.parametrize("options", [{"scheduler": "fedbuff", "concurrency": 10, "buffer": 4},
                                     {"scheduler": "fedasync", "concurrency": 6, "mixing": 0.5}])
def test_one_shard_or_two_give_the_same_events_and_the_same_model(ray_session, tmp_path, options):
    """At d = 24 and 20 classes: at TINY's d = 16 and 10 classes MKL's kernels give a row of a product other last
    bits at another place in it (docs/how-it-runs.md, "Shards, exactness and layouts"), which no layout fixes."""
    config = {**COMMON, "rounds": 8, "eval_every": 4, "devices": "phones", "availability": "diurnal:0.005,0.7",
              "dataset": TINY.replace("dim=16", "dim=24").replace("classes=10", "classes=20"), **options}
    one = run(RunConfig(out=str(tmp_path / "one"), **{**config, "num_shards": 1}))
    two = run(RunConfig(out=str(tmp_path / "two"), **config))
    events = pq.read_table(tmp_path / "one" / "rounds.parquet")
    assert events.equals(pq.read_table(tmp_path / "two" / "rounds.parquet"))
    assert sum(events.column("dropped").to_pylist()) > 0
    assert max(len(counts) for counts in events.column("staleness_counts").to_pylist()) > 1  # some update was stale
    assert [client.tolist() for client in one.rounds] == [client.tolist() for client in two.rounds]
    on_the_clock = CLOCK_COLUMNS | {"round", "aggregations", "staleness_mean", "staleness_max"}
    assert [{name: row[name] for name in on_the_clock} for row in one.rows] == \
        [{name: row[name] for name in on_the_clock} for row in two.rows]
    for name, array in one.arrays.items():  # each client's sum in the same fixed tree on any layout
        assert np.array_equal(array, two.arrays[name]), name


def test_the_updates_held_beside_the_shards_are_those_the_driver_would_hold_bit_for_bit(ray_session, tmp_path,
                                                                                       monkeypatch):
    """Beside the shards every batch of a version is queued at once and its sum added where it waits; without
    ``hold_batches`` each batch goes through ``train_round``, awaited, and waits on the driver. Five clients ten
    times faster than the others arrive several times between two steps: one version's group has them several times
    (a batch each time)."""
    devices = device_table(tmp_path / "devices.csv", lambda client: 0.1 if client < 5 else seconds(client))
    batches, planned = [], AsyncUpdates._batches

    def recorded(self, version):
        made = planned(self, version)
        batches.extend(made)
        return made

    monkeypatch.setattr(AsyncUpdates, "_batches", recorded)
    options = {**COMMON, "rounds": 6, "eval_every": 6, "devices": devices, "scheduler": "fedbuff", "concurrency": 46,
               "buffer": 40}
    in_shard = run(RunConfig(out=str(tmp_path / "in_shard"), **options))
    assert any(not arrival.complete for _, arrival in batches)  # a group of several batches
    assert any(arrival.weight != 1 for _, arrival in batches)  # stale updates, scaled where they wait
    monkeypatch.delattr(ProbeBackend, "hold_batches")
    on_driver = run(RunConfig(out=str(tmp_path / "on_driver"), **options))
    for name, array in on_driver.arrays.items():
        assert np.array_equal(array, in_shard.arrays[name]), name


@pytest.mark.parametrize("options, message", [
    ({"method": "scaffold"}, "--scheduler fedbuff: scaffold keeps state for each client"),
    ({"method": "fed3r", "client_lr": None, "batch_size": None, "local_epochs": None},
     "--scheduler fedbuff schedules training's server steps: fed3r does not train"),
    ({"deadline": 2.0}, "--scheduler fedbuff: --deadline belong to synchronous rounds"),
    ({"concurrency": 50}, "--concurrency 50 is more than the federation's 46 clients"),
    ({"secure_aggregation": True, "options": {"secagg_clip": 10.0}}, "--scheduler fedbuff does not take postprocessors"),
])
def test_what_asynchronous_rounds_do_not_take_is_refused_in_one_line(ray_session, tmp_path, options, message):
    config = {**COMMON, "rounds": 2, "scheduler": "fedbuff", "devices": "uniform", **options}
    config = {name: value for name, value in config.items() if value is not None}
    with pytest.raises(FedrayError, match=message):
        run(RunConfig(out=str(tmp_path / "run"), **config))
    assert not (tmp_path / "run").exists()
