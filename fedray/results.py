"""Run outputs, written atomically: metrics.parquet, classifier.npz, config.yaml (and model.pt after fine-tuning).

A run's folder holds a complete run exactly when it holds ``metrics.parquet``:
:func:`write_run` removes the previous run's metrics first and writes them
last, so the files beside a ``metrics.parquet`` are always its run's.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

METRICS, CLASSIFIER, CONFIG, MODEL = "metrics.parquet", "classifier.npz", "config.yaml", "model.pt"
RUN_FILES = (CLASSIFIER, MODEL, CONFIG, METRICS)
TEMPORARY_TAG = "[a-z0-9_]{8}"
"""The random part of a temporary's name ``.NAME.TAG.tmp``: hex digits, or mkstemp's alphabet (older fedray used it)."""


@dataclass
class EvalPoint:
    """One row of metrics.parquet (besides the run's configuration columns).

    ``stage`` is ``closed_form`` or ``train`` (a two-stage run has both),
    ``calibrated`` (SphereFed's FFC), ``tct_scaffold`` or ``tct_closed_form``
    (TCT's stage 2); ``train_loss`` is the mean loss of the global model on the
    samples of the clients sampled since the previous row, before their local
    training (None where no client trained; TCT's stage 2: its squared-loss
    objective); ``diverged`` marks the row a run stopped at. The last four
    are the papers' accounting conventions (:mod:`fedray.accounting`), None
    where a paper defines no count for the run's method.
    """

    round: int
    clients_seen: int
    samples_seen: int
    accuracy: float
    bytes_up: float
    bytes_down: float
    flops_client_avg: float
    wall_s: float
    stage: str = "closed_form"
    train_loss: float | None = None
    diverged: bool = False
    comm_floats_fedcof: float | None = None
    comm_floats_fed3r: float | None = None
    macs_client_avg_fed3r: float | None = None
    forward_passes: float | None = None


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file ``.NAME.TAG.tmp`` in the same folder, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _new_temporary(path)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _new_temporary(path: Path) -> Path:
    """A new empty file beside ``path``, created with mode 0666 less the umask like any tool's output (mkstemp's are 0600)."""
    while True:
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return temporary
        except FileExistsError:
            continue


def remove_stale_temporaries(folder: Path, names: Iterable[str]) -> None:
    """Remove the temporaries that interrupted :func:`write_atomically` calls for ``names`` left in ``folder``, nothing else."""
    if not folder.is_dir():
        return
    temporary = re.compile(rf"\.(?:{'|'.join(map(re.escape, names))})\.{TEMPORARY_TAG}\.tmp")
    for entry in folder.iterdir():
        if temporary.fullmatch(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)


def _save_model(path: Path, model: dict) -> None:
    import torch  # here, not at the top: analysis imports this module for EvalPoint without needing torch

    torch.save(model, path)


def write_run(out: Path, rows: list[dict], config: dict, arrays: dict[str, np.ndarray], model: dict | None = None) -> None:
    """The run's files; ``model`` (a fine-tuned state dict) goes to model.pt. The metrics come last: they mark a complete run.

    A previous run's metrics.parquet goes first (and its model.pt, when this run
    has none), so an interruption between the files never leaves a folder that
    looks complete with files of two runs.
    """
    table = pa.Table.from_pylist(rows)
    (out / METRICS).unlink(missing_ok=True)
    if model is None:
        (out / MODEL).unlink(missing_ok=True)
    write_atomically(out / CLASSIFIER, lambda p: _save_npz(p, arrays))
    if model is not None:
        write_atomically(out / MODEL, lambda p: _save_model(p, model))
    write_atomically(out / CONFIG, lambda p: p.write_text(yaml.safe_dump(config, sort_keys=False)))
    write_atomically(out / METRICS, lambda p: pq.write_table(table, p))
