"""The baselines sweep: every configuration resolves before any work, and a quick run tables one row per configuration
with the upload each method's formula gives."""

import numpy as np
import polars as pl
import pytest

from fedray.core.errors import FedrayError
from fedray.data.registry import load_federation
from jobs import sweep_baselines
from jobs.sweep_baselines import CONFIGURATIONS, QUICK, Configuration, check, datasets, run_keywords

TINY = "synthetic:inat-user-120k?dim=8&scale=0.01&classes=20"


def test_the_tables_sections_hold_the_papers_methods_and_ablations():
    labels = [c.label for c in CONFIGURATIONS]
    assert len(set(labels)) == len(labels), "a label names one configuration"
    methods = {c.method for c in CONFIGURATIONS if c.section == "closed-form"}
    assert methods == {"fedncm", "fed3r", "fed3r-rf", "fedcof", "fedcof-oracle", "ccvr"}
    gradient = [c for c in CONFIGURATIONS if c.section == "gradient"]
    names = ["fedavg", "fedavgm", "fedadam", "fedadagrad", "fedyogi", "fedprox", "scaffold", "feddyn", "fednova"]
    assert sorted(c.method for c in gradient if "init" not in c.run_options) == sorted(names)
    assert sorted(c.method for c in gradient if c.run_options.get("init") == "fed3r") == sorted(names)
    noise = [(c.method, c.postprocessor, c.options["count_noise"], c.options["count_noise_epsilon"])
             for c in CONFIGURATIONS if c.section == "noise"]
    assert sorted(noise) == sorted(("fedcof", "count-noise", kind, epsilon) for kind in ("uniform", "gaussian", "laplace")
                                   for epsilon in (0.1, 0.3, 0.5, 0.7, 0.9)), "FedCOF App. I, Fig. 6"


@pytest.mark.parametrize("quick", [False, True])
def test_every_configuration_resolves_on_both_datasets_without_running(quick):
    for dataset in QUICK if quick else datasets(128):
        for configuration in CONFIGURATIONS:
            check(run_keywords(configuration, dataset, quick))


@pytest.mark.parametrize("configuration, message", [
    (Configuration("x", "fedncm", "closed-form", {"distanse": "euclidean"}), "unknown option"),
    (Configuration("x", "fedcof", "closed-form", {"covariance": "diagonal"}), "--covariance applies to fedcof-oracle"),
    (Configuration("x", "fedavgx", "gradient"), "unknown method 'fedavgx'"),
])
def test_a_misspelt_or_misplaced_option_or_method_is_refused(configuration, message):
    with pytest.raises(FedrayError, match=message):
        check(run_keywords(configuration, QUICK[0], True))


def pairs(spec: str) -> tuple[int, int]:
    """K and M, the (client, class) pairs, counted from the federation's labels."""
    federation = load_federation(spec)
    _, labels, offsets = federation.train_arrays(0, federation.num_clients)
    return federation.num_clients, sum(len(np.unique(labels[offsets[k]:offsets[k + 1]])) for k in range(federation.num_clients))


@pytest.mark.slow
def test_a_quick_run_tables_one_row_per_configuration_with_its_upload(ray_session, tmp_path, capsys):
    sweep_baselines.main(["--quick", "--sections", "closed-form,gradient", "--dataset", TINY, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    table = pl.read_csv(tmp_path / "analysis" / "summary.csv")
    ran = [c.label for c in CONFIGURATIONS if c.section in ("closed-form", "gradient")]
    assert table["label"].to_list() == ran, "one row per configuration of the sections run, in order"
    assert "| fedcof-oracle (diagonal) |" in printed and "failed" not in printed
    rows = {row["label"]: row for row in table.iter_rows(named=True)}
    clients, m = pairs(TINY)
    d = 8
    # every client uploads once: FedNCM M·d floats, FedCOF-oracle (full) M·(d + d²), 4 bytes each
    assert rows["fedncm"]["upload_bytes"] == m * d * 4
    assert rows["fedncm"]["upload_bytes_per_client"] == pytest.approx(m * d * 4 / clients, rel=1e-12)
    assert rows["fedcof-oracle (full)"]["upload_bytes"] == m * (d + d * d) * 4
    assert rows["fedcof-oracle (full)"]["upload_bytes_per_client"] == pytest.approx(m * (d + d * d) * 4 / clients, rel=1e-12)
    assert (tmp_path / "results.parquet").exists()
