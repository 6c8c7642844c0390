"""Shards load their own clients' rows from the federation's spec: no object-store constructor arguments, no table in the driver."""

import pickle
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import ray
import torch

from fedray.data import synthetic
from fedray.data.export import export_parquet
from fedray.data.parquet import load_parquet
from fedray.core.errors import FedrayError
from fedray.methods.base import ClientBatch, Classifier, ClosedFormMethod
from fedray.runtime.shards import ShardPool
from tests.app.test_cli import SMALL_RUN, SPEC, fedray_subprocess
from tests.started_pools import keeping_started_pools


class Rows(ClosedFormMethod):
    """The clients' features themselves, in upload order (what a shard holds, made visible): a list, since they grow
    with the clients."""

    def client_statistics(self, batch: ClientBatch) -> list[torch.Tensor]:
        return [batch.features.clone()]

    def combine(self, a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
        return a + b

    def solve(self, stats: torch.Tensor) -> Classifier:
        raise NotImplementedError


@pytest.fixture(scope="module")
def parquet_path(tmp_path_factory):
    """SPEC exported to Parquet in row groups of 100 rows, clients' rows in client order (as ``data export`` writes them)."""
    path = tmp_path_factory.mktemp("shards") / "small.parquet"
    export_parquet(synthetic.build("inat-user-120k", dim=8, scale=0.02, classes=20), path)
    pq.write_table(pq.read_table(path), path, row_group_size=100)
    return path


def file_rows(path, client_ids):
    """The features of the train rows of ``client_ids`` read straight from the file, client after client in file order."""
    table = pq.read_table(path)
    train = table.filter(pc.equal(table.column("split"), "train"))
    rows = [row for client in client_ids for row in train.filter(pc.equal(train.column("client_id"), client)).column("features").to_pylist()]
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.slow  # a CLI run in a subprocess
@pytest.mark.parametrize("kind", ["synthetic", "parquet"])
def test_a_run_prints_no_error_line(tmp_path, parquet_path, kind):
    dataset = SPEC if kind == "synthetic" else f"parquet:{parquet_path}"
    rc, out, err, _ = fedray_subprocess(["run", "--method", "fed3r", "--dataset", dataset, "--out", tmp_path / "out", *SMALL_RUN])
    assert rc == 0, err
    assert "fed3r on" in out
    assert "constructor arguments" not in err and "ERROR" not in err and " E " not in err, err


def test_the_driver_holds_no_features(parquet_path):
    federation = load_parquet(parquet_path)
    assert federation.table.column_names == ["client_id", "sample_id", "label", "split"]
    assert federation.spec == f"parquet:{parquet_path.resolve()}"
    assert len(pickle.dumps(federation.source)) < 1000  # a path and d, no rows


def test_each_shard_holds_exactly_its_clients_rows_from_the_file(ray_session, parquet_path):
    federation = load_parquet(parquet_path)
    pool = ShardPool.start(federation, num_shards=2, cpus_per_shard=0.5, reusable=True)
    try:
        method = Rows(federation.dim, federation.num_classes)
        for first, end in zip(pool.bounds[:-1], pool.bounds[1:]):
            clients = np.arange(first, end)
            held = torch.cat(pool.statistics(method, clients).result())
            assert torch.equal(held, file_rows(parquet_path, [federation.client_ids[c] for c in clients]))
    finally:
        pool.shutdown()


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_restarted_parquet_shard_reloads_the_same_rows(ray_session, parquet_path):
    federation = load_parquet(parquet_path)
    pool = ShardPool.start(federation, num_shards=2, cpus_per_shard=0.5, reusable=True)
    try:
        method = Rows(federation.dim, federation.num_classes)
        clients = np.arange(pool.bounds[1])
        before = torch.cat(pool.statistics(method, clients).result())
        ray.kill(pool.actors[0], no_restart=False)
        assert torch.equal(torch.cat(pool.statistics(method, clients).result()), before)
    finally:
        pool.shutdown()


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_federation_held_in_memory_gives_the_same_rows(ray_session):
    """Without a spec (features computed in memory), the shards get their rows by reference, and hold the same ones;
    only those rows need a keeper actor (a process): a spec's shards read their assignments from Ray's GCS."""
    federation = synthetic.build("inat-user-120k", dim=8, scale=0.02, classes=20)
    clients = np.arange(federation.num_clients)
    held = {}
    for name, which in (("spec", federation), ("memory", replace(federation, spec=None))):
        pool = ShardPool.start(which, num_shards=2, cpus_per_shard=0.5, reusable=True)
        try:
            assert (pool.stored.keeper is None) == (name == "spec")
            held[name] = torch.cat(pool.statistics(Rows(federation.dim, federation.num_classes), clients).result())
        finally:
            pool.shutdown()
    assert torch.equal(held["spec"], held["memory"])
    assert torch.equal(held["spec"], federation.source.features("train", federation.train_arrays(0, federation.num_clients)[0]))


def test_rows_are_read_and_checked_one_row_group_at_a_time(tmp_path, parquet_path):
    """A NaN in row 5 (row group 0) stops only a reader of row group 0."""
    table = pq.read_table(parquet_path)
    rows = table.column("features").to_pylist()
    rows[5] = [float("nan")] * len(rows[5])
    bad = tmp_path / "nan.parquet"
    pq.write_table(table.set_column(3, "features", pa.array(rows, table.schema.field("features").type)), bad,
                   row_group_size=100)
    source = load_parquet(bad).source
    assert torch.equal(source.features("train", np.array([250, 101, 199])),
                       torch.tensor([rows[250], rows[101], rows[199]], dtype=torch.float32))
    with pytest.raises(FedrayError, match="NaN or inf in the features of row 5"):
        source.features("train", np.array([150, 5]))
    with pytest.raises(FedrayError, match="row 5"):
        source.check()


class Rows64(Rows):
    """The same, asking for float64 features as Fed3R, FedNCM and FedCOF do."""

    features_dtype = torch.float64


def test_a_method_asking_for_float64_gets_its_clients_rows_exactly_in_id_order(ray_session, parquet_path):
    federation = load_parquet(parquet_path)
    pool = ShardPool.start(federation, num_shards=2, cpus_per_shard=0.5, reusable=True)
    try:
        clients = np.random.default_rng(0).permutation(np.arange(pool.bounds[1]))  # shard 0's clients, shuffled
        method = Rows64(federation.dim, federation.num_classes)
        # All of them, then fewer, then more: the shard converts into the buffer it keeps, and each call gets its rows.
        for block in (clients, clients[:3], clients[5:], clients[1:2]):
            held = torch.cat(pool.statistics(method, block).result())
            expected = file_rows(parquet_path, [federation.client_ids[c] for c in np.sort(block)])  # the fixed tree's
            assert held.dtype == torch.float64
            assert torch.equal(held, expected.to(torch.float64))
    finally:
        pool.shutdown()


def kill_one_shard_mid_run(monkeypatch, at_round: int):
    """``on_evaluation`` for a run that kills (restartably) shard 1 of the run's pool at evaluation row ``at_round``;
    its ``killed`` lists the rows it killed at."""
    pools = keeping_started_pools(monkeypatch)

    def kill(row, classifier):
        if row["round"] == at_round and not kill.killed:
            ray.kill(pools[0].actors[1], no_restart=False)
            kill.killed.append(row["round"])

    kill.killed = []
    return kill


RUNS = {  # a closed form, and a training algorithm that keeps a state per client in the shards
    "fed3r": dict(method="fed3r", clients_per_round=5, eval_every=2),
    "scaffold": dict(method="scaffold", client_lr=0.05, rounds=6, clients_per_round=6, eval_every=2, checkpoint_every=3),
}


@pytest.mark.slow  # four runs twice, a shard restarting in each
@pytest.mark.parametrize("method", RUNS)
@pytest.mark.parametrize("kind", ["spec", "memory"])
def test_a_shard_killed_mid_run_gives_bitwise_the_unkilled_run(ray_session, tmp_path, monkeypatch, capfd, method, kind):
    """A federation built in memory has no spec to rebuild its shards from: a restarted shard gets its rows again from
    Ray's object store, where the pool keeps them (before: the run ended, its actor's worker process dead), and no
    shard takes a reference in its constructor (Ray's error line about restarting such an actor)."""
    import fedray

    federation = synthetic.build("inat-user-120k", dim=8, scale=0.02, classes=20)
    dataset = federation if kind == "spec" else replace(federation, spec=None)
    options = dict(dataset=dataset, num_shards=2, cpus_per_shard=0.5, quiet=True, **RUNS[method])
    plain = fedray.run(out=tmp_path / "plain", **options)
    kill = kill_one_shard_mid_run(monkeypatch, at_round=4)
    killed = fedray.run(out=tmp_path / "killed", on_evaluation=kill, **options)
    assert kill.killed == [4]
    assert "constructor arguments" not in capfd.readouterr().err
    assert killed.metrics.drop("wall_s", "out", strict=False).rows() == plain.metrics.drop("wall_s", "out", strict=False).rows()
    assert torch.equal(killed.classifier.weight, plain.classifier.weight)
    assert (killed.classifier.bias is None and plain.classifier.bias is None) or torch.equal(killed.classifier.bias,
                                                                                            plain.classifier.bias)
