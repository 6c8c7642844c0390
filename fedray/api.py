"""``fedray.run``: one run from Python, as ``fedray run`` does it from the command line."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from fedray.config import resolve
from fedray.data.federation import Federation
from fedray.data.memory import memory_label
from fedray.errors import FedrayError
from fedray.plugins import spec_of
from fedray.results import METRICS


def _spec(value: str | type, what: str) -> str:
    """A method, server optimizer or client algorithm given by name, ``module:Class``, ``file.py:Class`` or as the class itself."""
    if isinstance(value, str):
        return value
    if isinstance(value, type):
        if "<locals>" in value.__qualname__:
            raise FedrayError(f"{what} {value.__qualname__}: define the class at the top level of a module or notebook cell")
        return spec_of(value)
    raise FedrayError(f"{what} must be a name, 'module:Class', 'file.py:Class' or a class, got {value!r}")


def run(
    method: str | type = "fed3r",
    dataset: str | Federation = "synthetic:inat-user-120k",
    out: str | Path = "results/run",
    options: dict[str, object] | None = None,
    server_optimizer: str | type | None = None,
    client_algorithm: str | type | None = None,
    address: str | None = None,
    resume: bool = False,
    **run_options: object,
) -> pl.DataFrame:
    """Run ``method`` on ``dataset``; writes ``out`` as ``fedray run`` does and returns its metrics table.

    ``dataset`` is a dataset spec or a :class:`Federation` (e.g. from
    :meth:`Federation.from_arrays`); one without a spec is recorded as
    ``memory:NAME@HASH`` (:func:`fedray.data.memory.memory_label`) and its
    shards get their rows through Ray's object store.
    ``run_options`` are the command line's run options with underscores
    (``clients_per_round=10``, ``rounds=500``, ``lam=0.1``, ``quiet=True``);
    ``options`` sets a plugin's own options by name (``--option key=value``).
    """
    from fedray.engine import run as run_config  # the engine imports Ray and torch: only when a run starts

    federation = dataset if isinstance(dataset, Federation) else None
    if federation is not None:
        dataset = federation.spec or memory_label(federation)
    elif not isinstance(dataset, str):
        raise FedrayError(f"dataset must be a spec ('synthetic:…', 'parquet:PATH', 'file.py:function', ...) or a "
                          f"fedray.Federation, got {type(dataset).__name__}")
    values = {**run_options, "method": _spec(method, "method"), "dataset": dataset, "out": str(out),
              "options": dict(options or {})}
    if server_optimizer is not None:
        values["server_optimizer"] = _spec(server_optimizer, "server optimizer")
    if client_algorithm is not None:
        values["client_algorithm"] = _spec(client_algorithm, "client algorithm")
    config = resolve({}, values)
    run_config(config, address=address, resume=resume, federation=federation)
    return pl.read_parquet(Path(config.out) / METRICS)
