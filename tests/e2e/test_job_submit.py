"""A real ``ray job submit`` of a small fedray job to a local cluster whose dashboard listens on loopback."""

import subprocess
import sys

import pyarrow.parquet as pq

from tests.local_cluster import ENV, RAY, free_port, local_cluster


def test_a_submitted_job_succeeds_and_leaves_its_results_table(tmp_path):
    dashboard = free_port()
    out = tmp_path / "run"
    entrypoint = [sys.executable, "-m", "fedray", "run", "--method", "fed3r", "--dataset",
                  "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20", "--clients-per-round", "10",
                  "--eval-every", "5", "--out", str(out), "--quiet"]
    with local_cluster(nodes=1, cpus=2, gpus=0, dashboard_port=dashboard):
        done = subprocess.run(
            [RAY, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--", *entrypoint],
            env=ENV, capture_output=True, text=True, timeout=300,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "succeeded" in done.stdout
    metrics = pq.read_table(out / "metrics.parquet")
    assert metrics.column("method").to_pylist()[0] == "fed3r" and metrics.num_rows >= 2
