"""Rows given from Python (``Federation.from_arrays`` / ``from_table``) are checked as a Parquet file's are and give, bit
for bit, the federation the Parquet loader gives for the same rows."""

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fedray
from fedray.core.federation import TEST, TRAIN, Federation
from fedray.data.parquet import load_parquet
from fedray.core.errors import FedrayError

DIM, CLASSES, CLIENTS = 6, 5, 9


def rows(n=120, seed=0):
    """One row per sample: features, labels, client ids (a test row's is junk: it must be ignored), split."""
    rng = np.random.default_rng(seed)
    split = np.where(rng.random(n) < 0.25, "test", "train")
    labels = rng.integers(CLASSES, size=n)
    labels[np.flatnonzero(split == "train")[:CLASSES]] = np.arange(CLASSES)
    clients = np.where(split == "train", 100 - 7 * rng.integers(CLIENTS, size=n), -1)
    features = rng.standard_normal((n, DIM)).astype(np.float32)
    return features, labels, clients, split


def parquet_file(path, features, labels, clients, split, metadata=None):
    """The same rows in the Parquet schema (a test row's client null, as the README's schema has it)."""
    table = pa.table({
        "client_id": pa.array([int(c) if s == "train" else None for c, s in zip(clients, split)], pa.int64()),
        "split": pa.array(split, pa.string()),
        "label": pa.array(labels, pa.int64()),
        "features": pa.array(list(features), pa.list_(pa.float32())),
    })
    pq.write_table(table.replace_schema_metadata(metadata), path)
    return path


def bits(tensor):
    return tensor.numpy().view(np.int32)


def assert_same_federation(mine, loaded):
    """Everything a run reads of a federation, compared exactly: C, split table, clients and their order, features bitwise."""
    assert mine.num_classes == loaded.num_classes and mine.dim == loaded.dim
    assert mine.table.equals(loaded.table)
    assert mine.client_ids == loaded.client_ids
    assert np.array_equal(mine.client_offsets, loaded.client_offsets)
    for a, b in zip(mine.train_arrays(0, mine.num_clients), loaded.train_arrays(0, loaded.num_clients)):
        assert np.array_equal(a, b)
    for a, b in zip(mine.test_arrays(), loaded.test_arrays()):
        assert np.array_equal(a, b)
    train_ids, test_ids = mine.train_arrays(0, mine.num_clients)[0], mine.test_arrays()[0]
    assert np.array_equal(bits(mine.source.features(TRAIN, train_ids)), bits(loaded.source.features(TRAIN, train_ids)))
    assert np.array_equal(bits(mine.source.features(TEST, test_ids)), bits(loaded.source.features(TEST, test_ids)))


def test_a_small_federation_written_out():
    """Clients numbered by first appearance among train rows, each one's rows in row order; test rows' clients ignored."""
    features = np.arange(14, dtype=np.float32).reshape(7, 2)
    federation = Federation.from_arrays(features, [2, 0, 1, 1, 3, 2, 0], ["b", "a", "b", "x", "c", "a", None],
                                        ["train", "train", "train", "test", "train", "train", "test"])
    assert federation.name == "from_arrays" and federation.spec is None
    assert (federation.num_classes, federation.num_clients, federation.dim) == (4, 3, 2)
    assert federation.client_ids == ["b", "a", "c"]
    sample_ids, labels, offsets = federation.train_arrays(0, 3)
    assert sample_ids.tolist() == [0, 2, 1, 5, 4] and labels.tolist() == [2, 1, 0, 2, 3] and offsets.tolist() == [0, 2, 4, 5]
    assert [column.tolist() for column in federation.test_arrays()] == [[3, 6], [1, 0]]
    assert federation.source.features(TEST, np.array([6, 3])).tolist() == [[12.0, 13.0], [6.0, 7.0]]


@pytest.mark.parametrize("given", ["numpy", "float64", "torch", "lists", "string_clients"])
def test_from_arrays_is_the_parquet_loaders_federation(tmp_path, given):
    features, labels, clients, split = rows()
    loaded = load_parquet(parquet_file(tmp_path / "rows.parquet", features, labels, clients, split))
    if given == "float64":  # float32 values held as float64 come back as the same float32
        features = features.astype(np.float64)
    elif given == "torch":
        features, labels, clients = torch.from_numpy(features), torch.from_numpy(labels), torch.from_numpy(clients)
    elif given == "lists":
        features, labels, clients, split = features.tolist(), labels.tolist(), clients.tolist(), split.tolist()
    elif given == "string_clients":  # the Parquet loader reads int client ids as their decimal strings
        clients = np.array([str(c) for c in clients])
    assert_same_federation(Federation.from_arrays(features, labels, clients, split), loaded)


@pytest.mark.parametrize("kind", ["pyarrow", "pyarrow_fixed_size", "polars", "polars_array"])
def test_from_table_is_the_parquet_loaders_federation(tmp_path, kind):
    features, labels, clients, split = rows(seed=1)
    path = parquet_file(tmp_path / "rows.parquet", features, labels, clients, split, {b"fedray.num_classes": b"7"})
    loaded = load_parquet(path)
    assert loaded.num_classes == 7
    if kind.startswith("pyarrow"):
        table = pq.read_table(path)
        if kind == "pyarrow_fixed_size":
            table = table.set_column(3, "features", pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), DIM))
        mine = Federation.from_table(table)  # C from the schema metadata, as in the file
    else:
        frame = pl.DataFrame({"client_id": clients, "split": split, "label": labels,
                              "features": features if kind == "polars_array" else features.tolist()})
        mine = Federation.from_table(frame, num_classes=7)
    assert_same_federation(mine, loaded)


def test_the_features_are_copied():
    features, labels, clients, split = rows()
    federation = Federation.from_arrays(features, labels, clients, split)
    features[:] = 0
    assert federation.source.features(TRAIN, np.arange(3)).abs().sum() > 0


def first_row(clients, split):
    return int(np.flatnonzero(np.asarray(split) == "train")[1])


def _negative_label(f, y, c, s):
    y[7] = -3
    return f, y, c, s


def _label_float(f, y, c, s):
    return f, y.astype(np.float64), c, s


def _nan(f, y, c, s):
    f[13, 1] = np.nan
    return f, y, c, s


def _inf(f, y, c, s):
    f[17, 2] = -np.inf
    return f, y, c, s


def _mixed_lengths(f, y, c, s):
    rows = f.tolist()
    rows[5] = [1.0] * (DIM + 1)
    return rows, y, c, s


def _train_row_without_client(f, y, c, s):
    c = c.astype(object)
    c[first_row(c, s)] = None
    return f, y, c, s


def _bad_split(f, y, c, s):
    s = s.astype(object)
    s[3] = "validation"
    return f, y, c, s


def _no_train_rows(f, y, c, s):
    return f, y, c, np.full(len(s), "test")


def _stray_huge_label(f, y, c, s):
    y[9] = 50_000_000
    return f, y, c, s


def _integer_features(f, y, c, s):
    return f.astype(np.int64), y, c, s


def _float_clients(f, y, c, s):
    return f, y, c.astype(np.float64), s


BAD_ROWS = {f.__name__[1:]: f for f in (
    _negative_label, _label_float, _nan, _inf, _mixed_lengths, _train_row_without_client, _bad_split, _no_train_rows,
    _stray_huge_label, _integer_features, _float_clients,
)}


def parquet_error(path) -> str:
    """The loader's error for ``path``, features included (they are checked when read: ``data info`` reads them all)."""
    with pytest.raises(FedrayError) as error:
        load_parquet(path).source.check()
    return str(error.value)


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_rows_get_the_parquet_loaders_one_line_error(tmp_path, case):
    features, labels, clients, split = BAD_ROWS[case](*rows())
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"client_id": pa.array(list(clients)), "split": pa.array(list(split), pa.string()),
                             "label": pa.array(labels), "features": pa.array(list(features))}), path)
    expected = parquet_error(path)  # "PATH: ..." (or "parquet:PATH: ..." for the federation's own checks)
    assert f"{path}: " in expected and "\n" not in expected, expected
    with pytest.raises(FedrayError) as error:
        Federation.from_arrays(features, labels, clients, split, name="mine")
    assert str(error.value) == "mine: " + expected.split(f"{path}: ", 1)[1]


@pytest.mark.parametrize("arguments, message", [
    ((np.zeros((4, 2)), [0, 1, 2], ["a"] * 4, ["train"] * 4),
     "mine: one row per sample, but the lengths differ: features 4, labels 3, clients 4, split 4"),
    ((np.zeros(4), [0, 1, 2, 3], ["a"] * 4, ["train"] * 4), "mine: features must be a 2-D array (samples × d), got shape (4,)"),
    ((np.zeros((4, 0)), [0, 1, 2, 3], ["a"] * 4, ["train"] * 4), "mine: features are empty"),
    ((np.zeros((4, 2)), 3, ["a"] * 4, ["train"] * 4), "mine: labels must hold one value per sample, got int"),
    ((np.zeros((4, 2)), [0, 1, 2, 3], ["a", 1, "b", 2], ["train"] * 4), "mine: column 'client_id': "),
])
def test_what_only_arrays_can_get_wrong(arguments, message):
    with pytest.raises(FedrayError) as error:
        Federation.from_arrays(*arguments, name="mine")
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_from_table_errors(tmp_path):
    features, labels, clients, split = rows()
    frame = pl.DataFrame({"client_id": clients, "split": split, "label": labels, "features": features})
    with pytest.raises(FedrayError, match=r"^from_table: missing column\(s\) label; expected client_id, split, label, features$"):
        Federation.from_table(frame.drop("label"))
    with pytest.raises(FedrayError, match=r"^from_table: row \d+: label 4 out of range for 3 classes$"):
        Federation.from_table(frame, num_classes=3)
    with pytest.raises(FedrayError, match=r"^from_table: num_classes must be an integer ≥ 1, got 0$"):
        Federation.from_table(frame, num_classes=0)
    with pytest.raises(FedrayError, match=r"^from_table: expected a pyarrow Table or polars DataFrame, got int"):
        Federation.from_table(3)


def test_the_federation_is_public():
    assert fedray.Federation is Federation
