"""An availability trace file: a Parquet or CSV table of online intervals, one row each, columns ``trace_id``
(integers or strings), ``start_s`` and ``end_s`` (seconds since the trace's start, intervals [start_s, end_s)).

A trace's rows may be interleaved with other traces' rows but must come in the order of their start; intervals that
touch (one starts where the previous ends) are joined. The traces span [0, the file's last end_s) and repeat over it.
Errors name the file, the trace and the 1-based data row (the header is not counted), before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module

pa = lazy_module("pyarrow", globals())
pacsv = lazy_module("pyarrow.csv", globals())
pq = lazy_module("pyarrow.parquet", globals())

COLUMNS = ("trace_id", "start_s", "end_s")


@dataclass(frozen=True)
class TraceSet:
    """The traces of a file, in the order of their sorted ids, their intervals trace after trace."""

    ids: np.ndarray
    starts: np.ndarray
    """float64 start of each interval, each trace's in increasing order."""
    ends: np.ndarray
    offsets: np.ndarray
    """Trace j's intervals are ``starts[offsets[j]:offsets[j + 1]]``."""
    span_s: float
    """The traces repeat every ``span_s`` seconds: the file's last end."""

    @property
    def num_traces(self) -> int:
        return self.ids.size


def load_traces(path: str | Path) -> TraceSet:
    """The traces of the file at ``path`` (``.parquet`` or ``.csv``), checked, or a one-line error."""
    path = Path(path)
    table = _read(path)
    ids = table["trace_id"].to_numpy(zero_copy_only=False)
    starts, ends = (table[column].to_numpy(zero_copy_only=False).astype(np.float64) for column in COLUMNS[1:])
    for column, values in (("start_s", starts), ("end_s", ends)):
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise FedrayError(f"{path}: trace {ids[bad[0]]}, row {bad[0] + 1}: {column} is not a finite number "
                              f"({values[bad[0]]})")
    _refuse_first(path, ids, starts < 0, lambda row: f"start_s is negative ({starts[row]:g})")
    _refuse_first(path, ids, ends <= starts,
                  lambda row: f"the interval [{starts[row]:g}, {ends[row]:g}) is empty or ends before it starts")
    trace_ids, trace_of_row = np.unique(ids, return_inverse=True)
    rows = np.argsort(trace_of_row, kind="stable")
    same_trace = trace_of_row[rows[1:]] == trace_of_row[rows[:-1]]
    before, after = rows[:-1], rows[1:]
    _refuse_pairs(path, ids, before, after, same_trace & (starts[after] < starts[before]),
                  lambda row, previous: f"starts at {starts[row]:g}, before row {previous + 1} "
                                        f"(start {starts[previous]:g}): a trace's intervals must come in the order "
                                        "of start_s")
    _refuse_pairs(path, ids, before, after, same_trace & (starts[after] < ends[before]),
                  lambda row, previous: f"[{starts[row]:g}, {ends[row]:g}) overlaps row {previous + 1} "
                                        f"[{starts[previous]:g}, {ends[previous]:g})")
    joined = np.concatenate([[False], same_trace & (starts[after] == ends[before])])
    first = rows[~joined]
    last = rows[np.concatenate([np.flatnonzero(~joined)[1:] - 1, [rows.size - 1]])]
    counts = np.bincount(trace_of_row[first], minlength=trace_ids.size)
    return TraceSet(trace_ids, starts[first], ends[last], np.concatenate([[0], np.cumsum(counts)]), float(ends.max()))


def _read(path: Path) -> pa.Table:
    if not path.is_file():
        raise FedrayError(f"{path}: no such trace file")
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".csv"):
        raise FedrayError(f"{path}: a trace file is .parquet or .csv, got {suffix or 'no suffix'}")
    try:
        table = pq.read_table(path) if suffix == ".parquet" else pacsv.read_csv(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise FedrayError(f"{path}: cannot read as {suffix[1:]}: {str(error).splitlines()[0]}") from None
    missing = [column for column in COLUMNS if column not in table.column_names]
    if missing:
        raise FedrayError(f"{path}: missing column(s) {', '.join(missing)} (a trace file has trace_id, start_s, end_s)")
    if table.num_rows == 0:
        raise FedrayError(f"{path}: no intervals")
    for column in COLUMNS:
        nulls = np.flatnonzero(table[column].is_null().to_numpy(zero_copy_only=False))
        if nulls.size:
            raise FedrayError(f"{path}: row {nulls[0] + 1}: {column} is empty")
    for column in COLUMNS[1:]:
        kind = table.schema.field(column).type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            raise FedrayError(f"{path}: column {column} must hold numbers (seconds), got {kind}")
    kind = table.schema.field("trace_id").type
    if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise FedrayError(f"{path}: column trace_id must hold integers or strings, got {kind}")
    return table


def _refuse_first(path: Path, ids: np.ndarray, wrong: np.ndarray, says: Callable[[int], str]) -> None:
    """A one-line error on the first row where ``wrong`` holds, ``says(row)`` what is wrong with it."""
    rows = np.flatnonzero(wrong)
    if rows.size:
        raise FedrayError(f"{path}: trace {ids[rows[0]]}, row {rows[0] + 1}: {says(rows[0])}")


def _refuse_pairs(path: Path, ids: np.ndarray, before: np.ndarray, after: np.ndarray, wrong: np.ndarray,
                  says: Callable[[int, int], str]) -> None:
    """A one-line error on the first row ``after[i]`` (in file order) where ``wrong[i]`` holds against the same
    trace's previous row ``before[i]``."""
    pairs = np.flatnonzero(wrong)
    if pairs.size:
        pair = pairs[np.argmin(after[pairs])]
        raise FedrayError(f"{path}: trace {ids[after[pair]]}, row {after[pair] + 1}: {says(after[pair], before[pair])}")
