"""``fedray data export --partition-size N`` writes a Parquet directory, streamed a few clients at a time; ``parquet:DIR``
reads it back, each reader opening only the parts that hold its rows."""

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fedray.data.export as export
from fedray.app.cli import main
from fedray.core.errors import FedrayError
from fedray.core.federation import TEST, TRAIN
from fedray.data import synthetic
from fedray.data.export import export_parquet, export_parquet_directory
from fedray.data.parquet import load_parquet
from fedray.data.registry import load_federation
from tests.full_disk import fill, hashes, small_disk  # noqa: F401 (a fixture)

SPEC = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
"""186 clients, 1,619 training and 480 test samples."""
PARTITION = 300


@pytest.fixture(scope="module")
def source():
    return load_federation(SPEC)


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """SPEC as a directory of parts of about 300 samples, row groups of at most 100 rows, and as one file."""
    folder = tmp_path_factory.mktemp("directory")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "ROWS_PER_BATCH", 100)
        export_parquet_directory(source, folder / "parts", PARTITION)
    export_parquet(source, folder / "one.parquet")
    return folder / "parts", folder / "one.parquet"


def parts(folder):
    return sorted(folder.iterdir())


def test_parts_are_cut_at_client_boundaries_test_rows_apart(source, exported):
    folder, _ = exported
    assert [p.name for p in parts(folder)] == [f"part-{n:05d}.parquet" for n in range(len(parts(folder)))]
    train_parts, clients_seen = [], []
    for path in parts(folder):
        table = pq.read_table(path, columns=["client_id", "split"])
        splits = set(table.column("split").to_pylist())
        assert splits in ({TRAIN}, {TEST}), "a part holds training rows or test rows, not both"
        if splits == {TRAIN}:
            assert not train_parts or train_parts[-1], "the training parts come first"
            clients = table.column("client_id").to_pylist()
            ordered = list(dict.fromkeys(clients))
            sizes = [clients.count(client) for client in ordered]
            assert table.num_rows <= PARTITION or len(ordered) == 1
            clients_seen += ordered
            metadata = pq.read_metadata(path)
            first = 0
            for group in range(metadata.num_row_groups):  # row groups: whole clients, at most 100 rows unless one has more
                count = metadata.row_group(group).num_rows
                assert first + count in np.cumsum(sizes) and (count <= 100 or len(set(clients[first:first + count])) == 1)
                statistics = metadata.row_group(group).column(0).statistics
                assert (statistics.min, statistics.max) == (min(clients[first:first + count]), max(clients[first:first + count]))
                first += count
        train_parts.append(splits == {TRAIN})
    assert clients_seen == source.client_ids, "every client in one part, in the federation's order"
    test_rows = [pq.read_metadata(path).num_rows for path, train in zip(parts(folder), train_parts) if not train]
    assert test_rows == [300, 180]  # 480 test rows
    assert sum(pq.read_metadata(path).num_rows for path in parts(folder)) == 1619 + 480


def test_the_directory_reads_back_as_the_federation_and_the_one_file(source, exported):
    folder, one = exported
    for federation in (load_federation(f"parquet:{folder}"), load_parquet(one)):
        assert federation.client_ids == source.client_ids and federation.num_classes == source.num_classes
        assert np.array_equal(federation.client_offsets, source.client_offsets)
        ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
        source_ids, source_labels, _ = source.train_arrays(0, source.num_clients)
        assert np.array_equal(labels, source_labels)
        assert torch.equal(federation.source.features(TRAIN, ids), source.source.features(TRAIN, source_ids))
        test_ids, test_labels = federation.test_arrays()
        assert np.array_equal(test_labels, source.test_arrays()[1])
        assert torch.equal(federation.source.features(TEST, test_ids), source.source.features(TEST, source.test_arrays()[0]))
    assert load_federation(f"parquet:{folder}").spec == f"parquet:{folder.resolve()}"


def test_the_export_streams_a_few_clients_at_a_time(source, tmp_path, monkeypatch):
    """No call for features asks for more rows than a row group holds (100 here), never the whole federation's."""
    asked = []
    features = type(source.source).features

    def counting(self, split, sample_ids):
        asked.append(len(sample_ids))
        return features(self, split, sample_ids)

    monkeypatch.setattr(type(source.source), "features", counting)
    monkeypatch.setattr(export, "ROWS_PER_BATCH", 100)
    export_parquet_directory(source, tmp_path / "parts", PARTITION)
    assert sum(asked) == 1619 + 480 and max(asked) <= max(100, int(np.diff(source.client_offsets).max()))


def test_a_reader_opens_only_the_parts_of_its_rows(exported, monkeypatch):
    folder, _ = exported
    federation = load_parquet(folder)
    opened = []
    parquet_file = pq.ParquetFile

    def recording(path, *args, **kwargs):
        opened.append(path)
        return parquet_file(path, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", recording)
    second = pq.read_table(parts(folder)[1], columns=["client_id"]).column("client_id").to_pylist()
    clients = [federation.client_ids.index(client) for client in dict.fromkeys(second)]  # the clients of part 1
    ids, _, _ = federation.train_arrays(clients[0], clients[-1] + 1)
    federation.source.features(TRAIN, ids)
    assert opened == [str(parts(folder)[1])]
    opened.clear()
    federation.source.features(TEST, federation.test_arrays()[0][-3:])
    assert opened == [str(parts(folder)[-1])]


def test_a_run_on_the_directory_gives_bitwise_the_classifier_of_the_source_and_of_one_file(ray_session, exported,
                                                                                          tmp_path):
    import fedray

    folder, one = exported
    weights = {}
    for name, dataset in (("source", SPEC), ("directory", f"parquet:{folder}"), ("file", f"parquet:{one}")):
        result = fedray.run(method="fed3r", dataset=dataset, out=tmp_path / name, clients_per_round=20, num_shards=2,
                            cpus_per_shard=0.5, quiet=True)
        weights[name] = result.classifier.weight
    assert torch.equal(weights["directory"], weights["source"]) and torch.equal(weights["file"], weights["source"])


def test_the_command_writes_a_directory_and_without_partition_size_one_file(tmp_path, exported):
    folder, one = exported
    assert main(["data", "export", SPEC, "--out", str(tmp_path / "parts"), "--partition-size", str(PARTITION)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["parts"], "no temporary left"
    assert len(parts(tmp_path / "parts")) == 9
    assert pq.read_table(tmp_path / "parts" / "part-00008.parquet").equals(pq.read_table(parts(folder)[-1]))
    assert main(["data", "export", SPEC, "--out", str(tmp_path / "one.parquet")]) == 0
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(one))


def test_bad_directories_and_outputs_get_one_line(exported, tmp_path, source):
    folder, one = exported
    (tmp_path / "empty").mkdir()
    with pytest.raises(FedrayError, match=rf"^{re.escape(str(tmp_path / 'empty'))}: a directory without parts "):
        load_federation(f"parquet:{tmp_path / 'empty'}")
    other = tmp_path / "other"
    other.mkdir()
    for path in parts(folder)[:2]:
        (other / path.name).write_bytes(path.read_bytes())
    pq.write_table(pq.read_table(parts(folder)[1]).drop_columns(["label"]), other / "part-00001.parquet")
    with pytest.raises(FedrayError, match=r"part-00001\.parquet: another schema than part-00000\.parquet's"):
        load_federation(f"parquet:{other}")
    split = tmp_path / "split"
    split.mkdir()
    table = pq.read_table(parts(folder)[1])
    pq.write_table(table.slice(0, 1), split / "part-00000.parquet")
    pq.write_table(table.slice(1), split / "part-00001.parquet")
    client = table.column("client_id")[0].as_py()
    with pytest.raises(FedrayError, match=rf"^client '{client}' is split across .*part-00000\.parquet and part-00001\.parquet"):
        load_federation(f"parquet:{split}")
    with pytest.raises(FedrayError, match="^--partition-size must be ≥ 1 sample, got 0$"):
        export_parquet_directory(source, tmp_path / "new", 0)
    with pytest.raises(FedrayError, match=rf"^--out {re.escape(str(one))}: is a file; --partition-size writes a directory"):
        export_parquet_directory(source, one, PARTITION)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FedrayError, match=r"holds notes\.txt, not a Parquet export's part"):
        export_parquet_directory(source, tmp_path / "mine", PARTITION)
    assert not (tmp_path / "new").exists() and (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def copied(folder, to):
    to.mkdir()
    for path in parts(folder):
        (to / path.name).write_bytes(path.read_bytes())
    return to


def truncated(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flipped(path):
    """200 bytes of a data page inverted: the footer reads, a column chunk does not."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 3
    data[middle:middle + 200] = bytes(b ^ 0xFF for b in data[middle:middle + 200])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncated, flipped])
def test_a_damaged_part_is_named_with_arrows_message_on_one_line(exported, tmp_path, damage):
    folder = copied(exported[0], tmp_path / "damaged")
    damage(folder / "part-00001.parquet")
    with pytest.raises(FedrayError) as error:
        load_federation(f"parquet:{folder}").source.check()
    message = str(error.value)
    assert message.startswith(f"{folder / 'part-00001.parquet'}: not a readable Parquet file (") and "\n" not in message


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-size-lists", "lists"])
def test_parts_of_another_feature_length_are_refused_before_any_row_is_read(exported, tmp_path, fixed):
    folder = copied(exported[0], tmp_path / "lengths")
    for path, length in [(folder / "part-00000.parquet", 8), (folder / "part-00001.parquet", 4)]:
        table = pq.read_table(path)
        features = pa.array([row[:length] for row in table.column("features").to_pylist()],
                            pa.list_(pa.float32(), length if fixed else -1))
        pq.write_table(table.set_column(table.schema.get_field_index("features"), "features", features), path)
    with pytest.raises(FedrayError) as error:
        load_federation(f"parquet:{folder}")  # reads the parts' schemas and first rows, no features beyond
    assert str(error.value) == (f"{folder / 'part-00001.parquet'}: features of 4 floats, where part-00000.parquet's "
                                "have 8: every part of a Parquet directory holds features of one length")


def test_a_new_export_replaces_the_previous_directory(source, tmp_path):
    out = tmp_path / "parts"
    export_parquet_directory(source, out, 100_000)  # every client in one part, the test rows in another
    assert [p.name for p in parts(out)] == ["part-00000.parquet", "part-00001.parquet"]
    export_parquet_directory(source, out, PARTITION)
    assert len(parts(out)) == 9 and [p.name for p in tmp_path.iterdir()] == ["parts"]


def test_an_export_onto_a_full_disk_leaves_the_previous_directory(small_disk):
    small = synthetic.build("inat-geo-100", dim=4, scale=0.05, classes=5)
    out = small_disk / "parts"
    export_parquet_directory(small, out, 50)
    fill(small_disk)
    previous = hashes(small_disk)
    # 8,197 training and 2,428 test rows of 4 features and a label, 4 bytes each: 212,500 bytes, in 4 kB blocks 0.21 MB.
    with pytest.raises(FedrayError, match=rf"^disk full: writing {re.escape(str(out))} needed 0\.2 MB, 0 kB free$"):
        export_parquet_directory(small, out, 50)
    assert hashes(small_disk) == previous
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "parts"], "no temporary directory left"


def test_a_population_without_a_per_sample_table_exports_and_reads_back(tmp_path):
    """A population's driver never builds its per-sample table (``train`` raises): the export streams it anyway."""
    population = load_federation("synthetic:inat-user-120k?clients=300&dim=4&classes=20&seed=4")
    with pytest.raises(FedrayError, match="no per-sample table"):
        population.train
    export_parquet_directory(population, tmp_path / "parts", 500)
    back = load_federation(f"parquet:{tmp_path / 'parts'}")
    assert back.client_ids == population.client_ids and np.array_equal(back.client_offsets, population.client_offsets)
    ids, labels, _ = back.train_arrays(0, back.num_clients)
    source_ids, source_labels, _ = population.train_arrays(0, population.num_clients)
    assert np.array_equal(labels, source_labels)
    assert torch.equal(back.source.features(TRAIN, ids), population.source.features(TRAIN, source_ids))
    assert torch.equal(back.source.features(TEST, back.test_arrays()[0]),
                       population.source.features(TEST, population.test_arrays()[0]))
