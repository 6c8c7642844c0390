"""run.json's record of what made a run: the imported versions, the machine, the layout, the checkout's commit."""

import importlib.metadata
import platform
import subprocess
from datetime import datetime
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
import ray
import torch

from fedray.runtime import provenance
from fedray.runtime.provenance import FIELDS, differing, record, utc_now

REPO = Path(__file__).resolve().parents[2]


def git(folder: Path, *arguments: str) -> str:
    return subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *arguments],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_record_holds_the_imported_versions_the_machine_and_the_layout(ray_session):
    started = utc_now()
    made = record(3, 2.5, "fedray run --method fed3r", started)
    assert list(made) == list(FIELDS)
    assert all(value is None or isinstance(value, FIELDS[name]) for name, value in made.items())
    assert made["fedray"] == importlib.metadata.version("fedray")
    assert (made["python"], made["torch"], made["numpy"], made["ray"], made["pyarrow"], made["polars"]) == \
        (platform.python_version(), torch.__version__, np.__version__, ray.__version__, pa.__version__, pl.__version__)
    assert (made["shards"], made["cpus_per_shard"], made["threads"]) == (3, 2.5, 2), "a shard's whole CPUs are threads"
    assert made["nodes"] == 1 and made["command"] == "fedray run --method fed3r" and made["started"] == started
    assert made["cpu"] in Path("/proc/cpuinfo").read_text()
    assert made["isa"] == torch.backends.cpu.get_cpu_capability()  # AVX2, AVX512, ...: what torch's kernels use
    assert made["gpus"] == int(ray.cluster_resources().get("GPU", 0)) and (made["gpu"] is None) == (made["gpus"] == 0)
    assert datetime.fromisoformat(started) <= datetime.fromisoformat(made["ended"])


def test_a_record_names_the_checkout_it_runs_from(ray_session):
    try:
        head = git(REPO, "rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the tests do not run from a git checkout")
    made = record(1, 1, None, utc_now())
    assert made["commit"] == head and made["dirty"] == bool(git(REPO, "status", "--porcelain", "--untracked-files=no"))


def test_the_commit_is_fedrays_own_and_a_changed_tracked_file_makes_it_dirty(tmp_path):
    (tmp_path / "fedray").mkdir()
    (tmp_path / "fedray" / "__init__.py").write_text("")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    head = git(tmp_path, "rev-parse", "HEAD")
    assert provenance._git_state(tmp_path / "fedray") == (head, False)
    (tmp_path / "results.txt").write_text("an untracked file\n")
    assert provenance._git_state(tmp_path / "fedray") == (head, False)
    (tmp_path / "fedray" / "__init__.py").write_text("x = 1\n")
    assert provenance._git_state(tmp_path / "fedray") == (head, True)
    (tmp_path / "venv" / "fedray").mkdir(parents=True)  # installed inside another project's repository
    assert provenance._git_state(tmp_path / "venv" / "fedray") == (None, None)
    assert provenance._git_state(Path("/") / "nowhere" / "fedray") == (None, None)  # no repository at all


def test_without_git_the_commit_is_unknown(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert provenance._git_state(REPO / "fedray") == (None, None)


def test_the_fields_that_differ_leave_out_the_command_and_the_times():
    recorded = {"torch": "2.4.0", "threads": 1, "gpu": None, "command": "fedray run", "started": "a", "ended": "b"}
    rerun = {"torch": "2.5.1", "threads": 1, "command": "fedray reproduce", "started": "c", "ended": "d"}
    assert differing(recorded, rerun) == ["torch", "gpu"], "a field one record lacks differs"
