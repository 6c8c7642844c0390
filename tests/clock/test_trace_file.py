from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedray.clock.trace_file import load_traces
from fedray.core.errors import FedrayError


def write_csv(path, text: str):
    path.write_text(text)
    return path


def test_traces_are_sorted_by_id_and_touching_intervals_joined(tmp_path):
    path = write_csv(tmp_path / "t.csv", "trace_id,start_s,end_s\n"
                                         "b,0,10\n"
                                         "a,5,6\n"
                                         "b,10,20\n"
                                         "a,8,9.5\n"
                                         "b,30,40\n")
    traces = load_traces(path)
    assert traces.ids.tolist() == ["a", "b"]
    assert traces.starts.tolist() == [5.0, 8.0, 0.0, 30.0]
    assert traces.ends.tolist() == [6.0, 9.5, 20.0, 40.0]
    assert traces.offsets.tolist() == [0, 2, 4]
    assert traces.span_s == 40.0


def test_parquet_and_csv_give_the_same_traces(tmp_path):
    table = pa.table({"trace_id": [3, 1, 3], "start_s": [0.0, 2.0, 5.0], "end_s": [1.0, 4.0, 7.0]})
    pq.write_table(table, tmp_path / "t.parquet")
    from_csv = load_traces(write_csv(tmp_path / "t.csv", "trace_id,start_s,end_s\n3,0,1\n1,2,4\n3,5,7\n"))
    from_parquet = load_traces(tmp_path / "t.parquet")
    assert from_parquet.ids.tolist() == from_csv.ids.tolist() == [1, 3]
    for name in ("starts", "ends", "offsets"):
        assert getattr(from_parquet, name).tolist() == getattr(from_csv, name).tolist()


HEADER = "trace_id,start_s,end_s\n"


@pytest.mark.parametrize("text, message", [
    ("trace_id,start_s\n1,0\n", "missing column.s. end_s .a trace file has trace_id, start_s, end_s."),
    ("id,begin,end_s\n1,0,1\n", "missing column.s. trace_id, start_s"),
    (HEADER, "no intervals"),
    (HEADER + "1,0,5\n2,-3,4\n", "trace 2, row 2: start_s is negative .-3."),
    (HEADER + "1,0,5\n1,7,6\n", r"trace 1, row 2: the interval \[7, 6\) is empty or ends before it starts"),
    (HEADER + "1,0,5\n1,7,7\n", r"trace 1, row 2: the interval \[7, 7\) is empty"),
    (HEADER + "1,0,5\n2,0,1\n1,4,8\n", r"trace 1, row 3: \[4, 8\) overlaps row 1 \[0, 5\)"),
    (HEADER + "1,10,15\n2,0,1\n1,0,5\n", "trace 1, row 3: starts at 0, before row 1 .start 10.: a trace's intervals "
                                         "must come in the order of start_s"),
    (HEADER + "1,0,5\n2,,4\n", "row 2: start_s is empty"),
    (HEADER + "1,0,5\n,1,4\n", "row 2: trace_id is empty"),
    (HEADER + "1,0,5\n1,6,nan\n", "row 2: end_s is empty"),  # CSV reads nan as an empty cell
    (HEADER + "1,0,five\n", "column end_s must hold numbers .seconds., got string"),
    (HEADER + "1.5,0,5\n", "column trace_id must hold integers or strings, got double"),
])
def test_bad_traces_are_refused_naming_file_trace_and_row(tmp_path, text, message):
    path = write_csv(tmp_path / "bad.csv", text)
    with pytest.raises(FedrayError, match=f"^{path}: {message}"):
        load_traces(path)


@pytest.mark.parametrize("column, value", [("start_s", np.nan), ("end_s", np.inf)])
def test_times_that_are_not_finite_are_refused(tmp_path, column, value):
    table = {"trace_id": [1, 2], "start_s": [0.0, 1.0], "end_s": [2.0, 3.0]}
    table[column][1] = value
    pq.write_table(pa.table(table), tmp_path / "t.parquet")
    with pytest.raises(FedrayError, match=f"t.parquet: trace 2, row 2: {column} is not a finite number .{value}."):
        load_traces(tmp_path / "t.parquet")


def test_a_bad_parquet_trace_is_refused_too(tmp_path):
    table = pa.table({"trace_id": ["x", "x"], "start_s": [0.0, 1.0], "end_s": [2.0, 3.0]})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(FedrayError, match=r"t.parquet: trace x, row 2: \[1, 3\) overlaps row 1 \[0, 2\)"):
        load_traces(tmp_path / "t.parquet")


@pytest.mark.parametrize("name, content, message", [
    ("absent.csv", None, "no such trace file"),
    ("t.json", "{}", "a trace file is .parquet or .csv, got .json"),
    ("t.parquet", "not parquet", "cannot read as parquet"),
])
def test_unreadable_files_are_refused(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(FedrayError, match=f"{tmp_path / name}: {message}"):
        load_traces(tmp_path / name)



def test_the_example_file_loads():
    traces = load_traces(Path(__file__).resolve().parents[2] / "examples" / "availability_traces.csv")
    assert traces.ids.tolist() == ["commuter", "evening-user", "night-charger", "office-wifi"]
    assert traces.span_s == 86400.0
    assert traces.offsets.tolist() == [0, 2, 3, 5, 6]
