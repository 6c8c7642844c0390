"""``python -m fedray run --dataset file.py:function?key=value`` (and ``module:function``) in a fresh process: the
function's federation reaches the Ray shards and the run equals the same rows' run from a Parquet file, bit for bit."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fedray
from tests.app.test_cli import REPO, fedray_subprocess
from tests.app.test_dataset_from_python import DATASET_FUNCTION, RUNS, SMALL, assert_same_run

FLAGS = ["--num-shards", "2", "--cpus-per-shard", "0.5", "--quiet", "--clients-per-round", "5", "--eval-every", "2"]


@pytest.mark.parametrize("method, form", [("fed3r", "file"), ("fedavg", "module")])
def test_a_dataset_function_runs_in_a_fresh_process(ray_session, tmp_path, method, form):
    (tmp_path / "toy_data.py").write_text(DATASET_FUNCTION)
    namespace: dict = {}
    exec(DATASET_FUNCTION, namespace)
    features, labels, owners, split = namespace["toy_rows"](30, 1)
    path = tmp_path / "toy.parquet"
    pq.write_table(pa.table({
        "client_id": pa.array([int(o) if s == "train" else None for o, s in zip(owners, split)], pa.int64()),
        "split": split.tolist(), "label": labels,
        "features": pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(features).ravel()), 8),
    }), path)
    fedray.run(method=method, dataset=f"parquet:{path}", out=tmp_path / "parquet", **SMALL, **RUNS[method])

    dataset = f"{tmp_path / 'toy_data.py'}:toy?seed=1" if form == "file" else "toy_data:toy?seed=1&clients=30"
    options = [f"--{key.replace('_', '-')}={value}" for key, value in RUNS[method].items()]
    rc, out, err, _ = fedray_subprocess(["run", "--method", method, "--dataset", dataset, "--out", tmp_path / "plugin",
                                         *FLAGS, *options], env={"PYTHONPATH": f"{REPO}:{tmp_path}"})
    assert rc == 0, err
    assert_same_run(tmp_path / "plugin", tmp_path / "parquet")
