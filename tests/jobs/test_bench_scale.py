"""The scale benchmark runs end to end on small populations and prints its one JSON line."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_benchmark_prints_one_line_with_every_point():
    done = subprocess.run([sys.executable, "-m", "jobs.bench_scale", "--clients", "300,600", "--methods", "fedncm,fedcof",
                           "--dim", "8"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["benchmark"] == "scale"
    assert [(p["method"], p["clients"]) for p in result["points"]] == [
        ("fedncm", 300), ("fedcof", 300), ("fedncm", 600), ("fedcof", 600)]
    for point in result["points"]:
        assert point["rounds"] == point["clients"] // 100 and 0 < point["accuracy"] <= 1
        assert point["driver_peak_rss_mb"] > 0 and point["shard_peak_rss_mb"] > 0
        # FedNCM and FedCOF upload one d-float mean per class a client holds: 4 · 8 bytes times M/K
        assert 32 <= point["bytes_up_per_client"] <= 32 * 20
    assert set(result["bare_gemm_s"]) == {"300", "600"}


@pytest.mark.slow
def test_a_training_point_reports_its_clients_states_in_memory_and_spilled():
    done = subprocess.run([sys.executable, "-m", "jobs.bench_scale", "--clients", "100", "--methods", "feddyn",
                           "--dim", "8", "--client-state-memory", "0", "--training-rounds", "2"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    point, = json.loads(done.stdout.strip().splitlines()[-1])["points"]
    assert point["rounds"] == 2 and point["samples"] is None
    # FedDyn keeps ∇L_k (9 × 1,203 float32, 43 kB) for each client sampled: in rounds of 100 among 100, every client
    # in each; with a budget of 0, every one on disk (written in round 1, read back and written again in round 2)
    assert point["states_memory_mb"] == 0
    assert point["states_spilled_mb"] == round(100 * 9 * 1203 * 4 / 2**20)
    refused = subprocess.run([sys.executable, "-m", "jobs.bench_scale", "--training-rounds", "0"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "--training-rounds must be at least 1, got 0" in refused.stderr


@pytest.mark.slow
def test_clock_runs_each_point_again_on_phones_with_diurnal_availability_and_reports_the_ratios():
    done = subprocess.run([sys.executable, "-m", "jobs.bench_scale", "--clients", "1000", "--methods", "fed3r",
                           "--dim", "8", "--clock"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["clock"] == {"devices": "phones", "availability": "diurnal:86400,0.3"}
    point, = result["points"]
    assert point["clock_wall_s"] > 0 and point["clock_driver_peak_rss_mb"] > 0
    assert point["clock_wall_ratio"] == round(point["clock_wall_s"] / point["wall_s"], 3)
    memory_ratio = point["clock_driver_peak_rss_mb"] / point["driver_peak_rss_mb"]
    assert point["clock_driver_memory_ratio"] == round(memory_ratio, 3)
    assert 0 < point["driver_peak_private_mb"] < point["driver_peak_rss_mb"]
    assert 0 < point["clock_driver_peak_private_mb"] < point["clock_driver_peak_rss_mb"]
    assert point["clock_driver_private_memory_ratio"] == \
        round(point["clock_driver_peak_private_mb"] / point["driver_peak_private_mb"], 3)
    assert point["driver_peak_heap_mb"] > 0 and point["clock_driver_peak_heap_mb"] > 0
    assert point["clock_driver_heap_ratio"] == \
        round(point["clock_driver_peak_heap_mb"] / point["driver_peak_heap_mb"], 3)
    # the plain run sees every client once; the clocked one those online (30 % of a day) while it runs
    assert point["clients_seen"] == 1000 and 0 < point["clock_clients_seen"] <= 1000
    # as often evaluated, evenly over its span: the last client comes online within the 70 % of a day it is offline
    assert point["clock_rows"] == point["rows"] == 10
    assert 0.5 * 24 < point["clock_span_h"] <= 24
