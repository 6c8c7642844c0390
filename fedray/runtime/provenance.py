"""What made a run: the software, the machine and the cluster layout it ran on, recorded in its run.json.

Every field is a plain JSON value (a string, a number, a bool or null), so the
same record is a row's worth of columns in a sweep's results.parquet
(:data:`~fedray.core.results.ENVIRONMENT_PREFIX` + name). A field that cannot be found out (no git, no
``/proc/cpuinfo``) is null; finding out never fails a run.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray
import torch

import fedray
from fedray.runtime.shards import shard_threads

FIELDS: dict[str, type] = {
    "fedray": str, "commit": str, "dirty": bool, "python": str, "torch": str, "numpy": str, "ray": str, "pyarrow": str,
    "polars": str, "cpu": str, "isa": str, "nodes": int, "shards": int, "cpus_per_shard": float, "threads": int,
    "gpu": str, "gpus": int, "command": str, "started": str, "ended": str,
}
"""run.json's fields, in its order, and the type of each (any may be null)."""
UNCOMPARED = ("command", "started", "ended")
"""The fields that say how and when a run was made, not what made it: never the same twice, so not compared."""
GIT_TIMEOUT_S = 10
ACCELERATOR = "accelerator_type:"
"""The prefix of the resources by which Ray names a node's GPU model (``accelerator_type:H100``)."""


def utc_now() -> str:
    """The time now in UTC, ISO 8601 to the second (``2026-11-28T20:32:10Z``)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def record(num_shards: int | None, cpus_per_shard: float, command: str | None, started: str) -> dict[str, object]:
    """run.json's fields (:data:`FIELDS`) for a run on ``num_shards`` shards of ``cpus_per_shard`` CPUs, made by
    ``command`` (a command line, or the API call's name) from ``started`` until now. Call it with Ray up."""
    commit, dirty = _git_state(Path(fedray.__file__).resolve().parent)
    cluster = ray.cluster_resources()
    return {
        "fedray": _installed_version("fedray"), "commit": commit, "dirty": dirty,
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
        "ray": ray.__version__, "pyarrow": pa.__version__, "polars": _installed_version("polars"),
        "cpu": _cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(),
        "nodes": sum(1 for node in ray.nodes() if node.get("Alive")), "shards": num_shards,
        "cpus_per_shard": float(cpus_per_shard), "threads": shard_threads(cpus_per_shard),
        "gpu": _gpu_models(cluster), "gpus": int(cluster.get("GPU", 0)),
        "command": command, "started": started, "ended": utc_now(),
    }


def _gpu_models(cluster: dict[str, float]) -> str | None:
    """The cluster's GPU models as Ray names them (``H100``, ``A100, T4``); None without any."""
    return ", ".join(sorted(key.removeprefix(ACCELERATOR) for key in cluster if key.startswith(ACCELERATOR))) or None


def _installed_version(package: str) -> str | None:
    """``package``'s installed version, read without importing it (polars takes a second)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_state(package: Path) -> tuple[str | None, bool | None]:
    """The commit of the checkout ``package`` (fedray's folder) sits at the top of, and whether a tracked file differs
    from it (untracked files do not count); (None, None) outside a checkout, or without git."""
    try:
        top = _git(package, "rev-parse", "--show-toplevel")
        if Path(top).resolve() != package.parent:  # installed inside some other repository: not fedray's commit
            return None, None
        return _git(package, "rev-parse", "HEAD"), bool(_git(package, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None


def _git(folder: Path, *arguments: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *arguments], capture_output=True, text=True, check=True,
                          timeout=GIT_TIMEOUT_S).stdout.strip()


def _cpu_model() -> str | None:
    """The driver's CPU model as /proc/cpuinfo names it (``model name``; elsewhere the platform's own name)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, colon, value = line.partition(":")
                if colon and key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def differing(recorded: dict, rerun: dict) -> list[str]:
    """The fields (but :data:`UNCOMPARED`) whose values differ between two records, in :data:`FIELDS`' order; a field
    one record lacks (an earlier fedray's) differs."""
    missing = object()
    return [name for name in FIELDS
            if name not in UNCOMPARED and recorded.get(name, missing) != rerun.get(name, missing)]

