"""The Flower benchmark runs end to end on a few clients and gets fedray's classifier through Flower's simulation."""

import importlib.util
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="Flower (flwr) is not installed")
def test_flower_and_fedray_solve_the_same_classifier():
    done = subprocess.run([sys.executable, "-m", "jobs.bench_flower", "--clients", "30", "--dim", "16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["flower_accuracy"] == result["fedray_accuracy"]
    assert result["max_rel_diff_flower_vs_fedray"] < 1e-9
