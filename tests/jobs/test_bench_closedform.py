"""The closed-form benchmark runs end to end on a small stand-in and reports the same classifier from both sources."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_benchmark_prints_one_line_with_both_sources_accuracies_equal(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jobs.bench_closedform", "--dim", "16", "--scale", "0.02",
                           "--parquet", str(tmp_path / "small.parquet")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    synthetic, parquet = result["synthetic"], result["parquet"]
    assert synthetic["accuracy"] == parquet["accuracy"] and 0 < synthetic["accuracy"] <= 1
    assert synthetic["max_rel_diff_vs_bare_gemm"] < 1e-9 and synthetic["stderr_lines"] == 0
    cpu = synthetic["cpu_s"]  # the machine's busy time holds every process's: the driver's and each shard's among them
    assert len(cpu["shards"]) == synthetic["shards"] and cpu["driver"] > 0 and min(cpu["shards"]) > 0
    assert cpu["machine"] + 0.05 >= cpu["driver"] + sum(cpu["shards"])  # /proc/stat counts in 10 ms ticks
