"""Loader for the federated split CSVs of Hsu et al., ECCV 2020 (iNaturalist, Landmarks).

The train file (``federated_train*.csv``) has columns ``user_id,image_id,class``
and the test file (``test.csv``) ``image_id,class``; either may also carry an
integer ``label`` column. Error messages name the file and the 1-based data row
(the header is not counted).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from fedray.core.federation import TEST, TRAIN, Federation, split_table
from fedray.core.errors import FedrayError

TRAIN_COLUMNS = ("user_id", "image_id", "class")
TEST_COLUMNS = ("image_id", "class")
LABEL = "label"
MAX_LABEL = np.iinfo(np.int32).max - 1
"""Labels are stored as int32 and ``num_classes = max label + 1`` must fit too."""

_INTEGER = r"^[+-]?[0-9]+$"
_READ_AS_STRING = {name: pa.string() for name in ("user_id", "image_id", "class", LABEL)}


def hsu_test_csv_beside(train_csv: str | Path) -> Path | None:
    """The ``test.csv`` in the folder of ``train_csv``, if there is one."""
    candidate = Path(train_csv).parent / "test.csv"
    return candidate if candidate.is_file() else None


def load_hsu_split(train_csv: str | Path, test_csv: str | Path | None = None, name: str | None = None) -> Federation:
    """A split table (no features) from a Hsu et al. train CSV and optional test CSV.

    Test rows follow the train rows; ``sample_id`` numbers all rows 0..n-1 in
    that order. Extra columns: ``image_id`` and ``class_name`` (the ``class``
    value). Without a ``label`` column, labels number the distinct ``class``
    values of both files in sorted order (numeric if they are all integers).
    The default name is ``hsu:<train file stem>``.
    """
    train_path = Path(train_csv)
    train = _read(train_path, TRAIN_COLUMNS)
    if train.num_rows == 0:
        raise FedrayError(f"{train_path}: no train rows (header only)")
    _check_unique_image_ids(train_path, train)
    if test_csv is None:
        test_path, test = None, _empty_like(train)
    else:
        test_path = Path(test_csv)
        test = _read(test_path, TEST_COLUMNS)
    train_labels, test_labels, num_classes = _labels(train_path, train, test_path, test)

    n_train, n_test = train.num_rows, test.num_rows
    table = split_table(
        client_id=pa.concat_arrays([_column(train, "user_id"), pa.nulls(n_test, pa.string())]),
        sample_id=np.arange(n_train + n_test, dtype=np.int64),
        label=np.concatenate([train_labels, test_labels]),
        split=np.repeat(np.array([TRAIN, TEST]), [n_train, n_test]),
        image_id=pa.concat_arrays([_column(train, "image_id"), _column(test, "image_id")]),
        class_name=pa.concat_arrays([_column(train, "class"), _column(test, "class")]),
    )
    return Federation(name or f"hsu:{train_path.stem}", num_classes, table, source=None)


def _read(path: Path, required: tuple[str, ...]) -> pa.Table:
    """Read ``path`` with every known column as a string, checking required columns are present and filled."""
    if not path.is_file():
        raise FedrayError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise FedrayError(f"{path}: empty file")
    try:
        table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(column_types=_READ_AS_STRING))
    except (pa.ArrowInvalid, OSError) as err:
        raise FedrayError(f"{path}: cannot read as CSV: {str(err).splitlines()[0]}") from err
    missing = [column for column in required if column not in table.column_names]
    if missing:
        raise FedrayError(f"{path}: missing column(s) {', '.join(missing)} (header: {','.join(table.column_names)})")
    for column in required:
        row = _first_row(pc.equal(pc.utf8_trim_whitespace(table.column(column)), ""))
        if row is not None:
            raise FedrayError(f"{path}: data row {row + 1}: empty {column}")
    return table


def _empty_like(train: pa.Table) -> pa.Table:
    """A test table with no rows and the train table's test-relevant columns."""
    columns = [column for column in (*TEST_COLUMNS, LABEL) if column in train.column_names]
    return pa.table({column: pa.array([], pa.string()) for column in columns})


def _column(table: pa.Table, name: str) -> pa.Array:
    return table.column(name).combine_chunks()


def _first_row(mask: pa.ChunkedArray | np.ndarray) -> int | None:
    """Index of the first true entry of a boolean array, or None."""
    rows = np.flatnonzero(np.asarray(mask, dtype=bool))
    return int(rows[0]) if rows.size else None


def _check_unique_image_ids(path: Path, table: pa.Table) -> None:
    # dictionary codes are numbered in order of first appearance
    codes = _column(table, "image_id").dictionary_encode().indices.to_numpy()
    first_at = np.unique(codes, return_index=True)[1]
    repeats = np.flatnonzero(first_at[codes] != np.arange(len(codes)))
    if repeats.size:
        row = int(repeats[0])
        image_id = table.column("image_id")[row].as_py()
        raise FedrayError(
            f"{path}: data row {row + 1}: duplicate image_id {image_id!r} (first at data row {first_at[codes[row]] + 1})"
        )


def _labels(
    train_path: Path, train: pa.Table, test_path: Path | None, test: pa.Table
) -> tuple[np.ndarray, np.ndarray, int]:
    """``(train_labels, test_labels, num_classes)`` from ``label`` columns, else from ``class`` values."""
    has_label = {train_path: LABEL in train.column_names}
    if test_path is not None:
        has_label[test_path] = LABEL in test.column_names
    if any(has_label.values()) and not all(has_label.values()):
        lacking = next(path for path, present in has_label.items() if not present)
        raise FedrayError(f"{lacking}: no {LABEL} column, but the other file of the split has one")
    if all(has_label.values()):
        train_labels = _parse_labels(train_path, train.column(LABEL))
        test_labels = _parse_labels(test_path, test.column(LABEL))
        return train_labels, test_labels, int(max(train_labels.max(), test_labels.max(initial=0))) + 1
    return _class_labels(_column(train, "class"), _column(test, "class"))


def _parse_labels(path: Path | None, column: pa.ChunkedArray) -> np.ndarray:
    text = pc.utf8_trim_whitespace(column)
    row = _first_row(pc.invert(pc.match_substring_regex(text, _INTEGER)))
    if row is not None:
        raise FedrayError(f"{path}: data row {row + 1}: label {column[row].as_py()!r} is not an integer")
    values = pc.cast(text, pa.float64()).to_numpy()
    for bad, what in ((values < 0, "negative"), (values > MAX_LABEL, "too large")):
        row = _first_row(bad)
        if row is not None:
            raise FedrayError(f"{path}: data row {row + 1}: {what} label {column[row].as_py()!r}")
    return values.astype(np.int64)


def _class_labels(train_classes: pa.Array, test_classes: pa.Array) -> tuple[np.ndarray, np.ndarray, int]:
    """Number the distinct class values 0..C-1 in sorted order."""
    names = pc.unique(pa.concat_arrays([train_classes, test_classes])).to_pylist()
    if all(re.match(_INTEGER, name.strip()) for name in names):
        names.sort(key=lambda name: (int(name), name))
    else:
        names.sort()
    value_set = pa.array(names, pa.string())
    train_labels = pc.index_in(train_classes, value_set=value_set).to_numpy(zero_copy_only=False)
    test_labels = pc.index_in(test_classes, value_set=value_set).to_numpy(zero_copy_only=False)
    return train_labels.astype(np.int64), test_labels.astype(np.int64), len(names)
