"""The asynchronous benchmark runs both schedulers end to end on a small population and prints its one JSON line."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_benchmark_runs_fedbuff_beside_synchronous_rounds_and_reports_the_ratios():
    done = subprocess.run([sys.executable, "-m", "jobs.bench_async", "--clients", "300", "--concurrency", "20",
                           "--steps", "4", "--dim", "8", "--availability", "diurnal:86400,0.5"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert (result["benchmark"], result["clients"], result["concurrency"], result["steps"]) == ("async", 300, 20, 4)
    point, = result["points"]
    assert point["availability"] == "diurnal:86400,0.5"
    sync, fedbuff = point["sync"], point["fedbuff"]
    assert (sync["scheduler"], fedbuff["scheduler"]) == ("sync", "fedbuff")
    for run in (sync, fedbuff):
        assert run["steps"] == 4 and run["clock_s"] > 0 and 0 < run["run_s"] < run["wall_s"]
        assert 0 < run["driver_peak_private_mb"] < run["driver_peak_rss_mb"]
        assert 0 <= run["driver_peak_store_pages_mb"] < run["driver_peak_rss_mb"]
    assert point["wall_ratio"] == round(fedbuff["wall_s"] / sync["wall_s"], 3)
    assert point["run_ratio"] == round(fedbuff["run_s"] / sync["run_s"], 3)
    assert point["driver_memory_ratio"] == round(fedbuff["driver_peak_rss_mb"] / sync["driver_peak_rss_mb"], 3)
    assert point["driver_private_memory_ratio"] == \
        round(fedbuff["driver_peak_private_mb"] / sync["driver_peak_private_mb"], 3)
    # a buffer of ⌈20 / 2⌉ steps the server twice as often as a round of 20 ends: less virtual time for 4 steps
    assert fedbuff["clock_s"] < sync["clock_s"]
