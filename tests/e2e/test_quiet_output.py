"""Fine-tuning and extraction print no ERROR or WARNING line (their actors take no object-store constructor
arguments), on generated images with seeded random weights saved as a file (``--weights random`` warns, rightly,
that its features are not pre-trained)."""

import re

import pytest

from tests.app.test_cli import fedray_subprocess
from tests.images import write_inat_split, write_squeezenet_weights

LOG_LINE = re.compile(r"ERROR|WARNING|\] E |\] W |constructor arguments")
"""Python logging's levels, and Ray's C++ log lines (``[time E pid tid] file:line: ...``)."""


@pytest.fixture
def split(tmp_path):
    train_csv, images = write_inat_split(tmp_path / "data", users=4, images_per_user=3, classes=3, test_images=4)
    return f"hsu:{train_csv}?images={images}"


@pytest.fixture
def weights_file(tmp_path):
    return write_squeezenet_weights(tmp_path / "squeezenet.pt")


def loud_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if LOG_LINE.search(line)]


def test_a_fine_tuning_run_prints_no_error_or_warning_line(tmp_path, split, weights_file):
    out = tmp_path / "run"
    rc, stdout, stderr, _ = fedray_subprocess(
        ["run", "--method", "fedavg", "--finetune", "ft", "--dataset", split, "--backbone", "squeezenet1_1",
         "--weights", weights_file, "--image-size", "64", "--clients-per-round", "2", "--rounds", "1", "--eval-every", "1",
         "--batch-size", "4", "--local-epochs", "1", "--num-trainers", "2", "--cpus-per-trainer", "0.5", "--quiet",
         "--out", out], env={"FEDRAY_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert rc == 0, stderr
    assert (out / "metrics.parquet").is_file()
    assert loud_lines(stderr) == [], stderr


def test_an_extraction_prints_no_error_or_warning_line(tmp_path, split, weights_file):
    rc, stdout, stderr, _ = fedray_subprocess(
        ["extract", "--dataset", split, "--out", tmp_path / "features", "--backbone", "squeezenet1_1", "--weights", weights_file,
         "--image-size", "64", "--pool-size", "2", "--cpus-per-worker", "0.5", "--quiet"],
        env={"FEDRAY_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert rc == 0, stderr
    assert "features:" in stdout
    assert loud_lines(stderr) == [], stderr


def test_a_quiet_dp_fedavg_run_prints_its_result_line_and_nothing_else(tmp_path):
    """q = 60/1082, σ = 0.5 and the RDP accountant: dp-accounting's series does not converge at orders 1.1 to 1.5
    there, and it logged a warning for each, every round; a run prints its result line only."""
    out = tmp_path / "run"
    rc, stdout, stderr, _ = fedray_subprocess(
        ["run", "--method", "fedavg", "--dataset", "synthetic:inat-geo-100?dim=8&scale=0.3&classes=10",
         "--clients-per-round", "60", "--rounds", "2", "--eval-every", "2", "--num-shards", "1", "--clip-norm", "0.5",
         "--dp-noise", "0.5", "--dp-delta", "1e-5", "--option", "dp_accountant=rdp", "--quiet", "--out", out],
        timeout=300)
    assert rc == 0, stderr
    assert stderr == "" and len(stdout.splitlines()) == 1 and stdout.startswith("fedavg on "), (stdout, stderr)
