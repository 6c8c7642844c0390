"""Run outputs, written atomically: metrics.parquet, classifier.npz, config.yaml, run.json (and model.pt after
fine-tuning).

A run's folder holds a complete run exactly when it holds ``metrics.parquet``:
:func:`write_run` writes every new file beside the previous run's before it
touches them, then swaps them in (metrics.parquet out first and in last), so
the files beside a ``metrics.parquet`` are always its run's, and a run that
cannot finish writing (a full disk) leaves the previous run as it was.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

import numpy as np

from fedray.core.full_disk import full_disk_code, full_disk_error
from fedray.core.lazy_modules import lazy_module

pa = lazy_module("pyarrow", globals())
pq = lazy_module("pyarrow.parquet", globals())
yaml = lazy_module("yaml", globals())

METRICS, CLASSIFIER, CONFIG, MODEL, ROUNDS = "metrics.parquet", "classifier.npz", "config.yaml", "model.pt", \
    "rounds.parquet"
RUN_JSON = "run.json"
RUN_FILES = (CLASSIFIER, MODEL, CONFIG, ROUNDS, RUN_JSON, METRICS)
ENVIRONMENT_PREFIX = "env_"
"""A sweep's results.parquet carries each field of a trial's run.json as a column ``env_NAME``."""
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
    objective); ``diverged`` marks the row a run stopped at. The next four
    are the papers' accounting conventions (:mod:`fedray.core.accounting`), None
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
    reported: dict[str, float | str] = field(default_factory=dict)
    """What the run's plugins reported (:func:`fedray.report`) up to this row: a column each."""
    callback_columns: dict[str, float | str] = field(default_factory=dict)
    """What a researcher's callbacks returned from ``on_evaluation`` at this row: a column each."""
    clock_columns: dict[str, float | int] = field(default_factory=dict)
    """A run on the clock's: virtual seconds at the row's round's end, their split, stragglers and dropouts so far
    (none without a clock)."""

    def columns(self) -> dict[str, object]:
        """The row's columns: its fields, then the clock's, each reported number and each callback's column."""
        return {**{name: getattr(self, name) for name in POINT_COLUMNS}, **self.clock_columns, **self.reported,
                **self.callback_columns}

    def added_names(self) -> tuple[str, ...]:
        """The names of the columns the clock, plugins and callbacks added to this row."""
        return (*self.clock_columns, *self.reported, *self.callback_columns)


POINT_COLUMNS = tuple(f.name for f in fields(EvalPoint)
                      if f.name not in ("reported", "callback_columns", "clock_columns"))
"""The columns every evaluation row has (besides the configuration's and what plugins report)."""


STALENESS_COUNTS = "staleness_counts"
"""rounds.parquet's column of an asynchronous server step's updates by staleness: element s counts those s versions
old (null on a synchronous round's row; absent from a run without asynchronous steps)."""


def rounds_schema(asynchronous: bool = False) -> pa.Schema:
    """rounds.parquet: one row a round of a run on the clock (virtual seconds since the run's start; the bytes of the
    kept uploads and of every selected client's download); ``asynchronous``: with :data:`STALENESS_COUNTS`."""
    columns = [("round", pa.int64()), ("stage", pa.string()), ("start_s", pa.float64()), ("end_s", pa.float64()),
               ("selected", pa.int64()), ("finished", pa.int64()), ("stragglers", pa.int64()), ("dropped", pa.int64()),
               ("bytes_up", pa.float64()), ("bytes_down", pa.float64())]
    if asynchronous:
        columns.append((STALENESS_COUNTS, pa.list_(pa.int64())))
    return pa.schema(columns)


Size = int | Callable[[], int] | None
"""The bytes a writer writes: a number, a function that counts them (called only when the disk is full, to say how
much space the write needed), or None (not known)."""


def write_atomically(path: Path, write: Callable[[Path], None], size: Size = None) -> None:
    """Write through a temporary file ``.NAME.TAG.tmp`` in the same folder, then rename over ``path``.

    ``path`` is the old file or the new one, never part of one: on any failure
    the temporary goes, and a full disk is a one-line error saying ``size``
    (the bytes ``write`` writes, or an estimate) and the space free.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with _Temporaries(path, path.parent) as temporaries:
        os.replace(temporaries.write(path, write, size), path)


class _Temporaries:
    """Temporaries beside the files they become: all removed when the block fails, a full disk told in one line."""

    def __init__(self, written: Path, folder: Path) -> None:
        self.written = written
        """What the disk-full error names: the file, or the folder of a run's files."""
        self.folder = folder
        self.sizes: dict[Path, Size] = {}
        """Each written temporary and the bytes its writer was to write (None: not known)."""
        self.reserved: list[Path] = []

    def write(self, path: Path, write: Callable[[Path], None], size: Size) -> Path:
        """A new temporary for ``path``, filled by ``write``."""
        temporary = self.reserve(path)
        self.sizes[temporary] = size
        write(temporary)
        return temporary

    def reserve(self, path: Path) -> Path:
        """A new empty temporary for ``path``, removed with the others if the block fails."""
        temporary = _new_temporary(path)
        self.reserved.append(temporary)
        return temporary

    def __enter__(self) -> _Temporaries:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: object) -> None:
        if error is None:
            return
        written = {temporary: _size_of(temporary) for temporary in self.sizes}
        for temporary in self.reserved:
            temporary.unlink(missing_ok=True)
        code = full_disk_code(error)
        if code is not None:
            sizes = [max(_bytes(size), written[temporary]) for temporary, size in self.sizes.items()]
            raise full_disk_error(code, self.written, self.folder, sizes, None in self.sizes.values()) from None


def _bytes(size: Size) -> int:
    """The bytes ``size`` says; 0 where counting them fails too (then what the writer wrote counts)."""
    if not callable(size):
        return size or 0
    try:
        return size()
    except Exception:
        return 0


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


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
    """Remove the temporaries that interrupted writes (:func:`write_atomically`, :func:`write_run`) of ``names`` left in
    ``folder``, nothing else."""
    if not folder.is_dir():
        return
    temporary = re.compile(rf"\.(?:{'|'.join(map(re.escape, names))})\.{TEMPORARY_TAG}\.tmp")
    for entry in folder.iterdir():
        if temporary.fullmatch(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)


class _Counter(io.RawIOBase):
    """A file that keeps nothing and counts the bytes written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:
        size = memoryview(data).nbytes
        self.count += size
        return size


def serialized_size(save: Callable[[BinaryIO], None]) -> int:
    """The bytes ``save`` writes to a file (it is run, into a file that keeps nothing): what the file takes, exactly
    for torch.save, within a few bytes per array for a zip of them (np.savez) that cannot seek back."""
    counter = _Counter()
    save(counter)
    return counter.count


def torch_size(value: object) -> int:
    """The bytes of ``torch.save(value)``."""
    import torch  # here, not at the top: analysis imports this module for EvalPoint without needing torch

    return serialized_size(lambda handle: torch.save(value, handle))


def _parquet_size(table: pa.Table) -> int:
    sink = pa.MockOutputStream()
    pq.write_table(table, sink)
    return sink.size()


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)


def _save_model(path: Path, model: dict) -> None:
    import torch  # here, not at the top: analysis imports this module for EvalPoint without needing torch

    with open(path, "wb") as handle:  # through a Python file, so a full disk raises its OSError (a path: a bare RuntimeError)
        torch.save(model, handle)


def _save_text(path: Path, text: str) -> None:
    path.write_text(text)


def _save_table(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path)


def write_run(out: Path, rows: list[dict], config: dict, arrays: dict[str, np.ndarray], model: dict | None = None,
              rounds: pa.Table | None = None, record: dict | None = None) -> None:
    """The run's files; ``model`` (a fine-tuned state dict) goes to model.pt, ``rounds`` (a run on the clock's, one
    row a round, :func:`rounds_schema`) to rounds.parquet, ``record`` (what made the run,
    :mod:`fedray.runtime.provenance`) to run.json. The metrics come last: they mark a complete run.

    Every file is written as a temporary beside the previous run's files first;
    only then are they swapped in (:func:`_swap`). A write that fails (a full
    disk: one line saying how much was needed) removes the temporaries and
    leaves the previous run untouched.
    """
    table = pa.Table.from_pylist(rows)
    text = yaml.safe_dump(config, sort_keys=False)
    files: list[tuple[str, Callable[[Path], None], Size]] = [
        (CLASSIFIER, lambda p: _save_npz(p, arrays), lambda: serialized_size(lambda handle: np.savez(handle, **arrays)))]
    if model is not None:
        files.append((MODEL, lambda p: _save_model(p, model), lambda: torch_size(model)))
    files.append((CONFIG, lambda p: _save_text(p, text), len(text.encode())))
    if rounds is not None:
        files.append((ROUNDS, lambda p: _save_table(p, rounds), lambda: _parquet_size(rounds)))
    if record is not None:
        made = json.dumps(record, indent=2) + "\n"
        files.append((RUN_JSON, lambda p: _save_text(p, made), len(made.encode())))
    files.append((METRICS, lambda p: _save_table(p, table), lambda: _parquet_size(table)))
    out.mkdir(parents=True, exist_ok=True)
    with _Temporaries(out, out) as temporaries:
        _swap(out, {name: temporaries.write(out / name, write, size) for name, write, size in files}, temporaries)


def _swap(out: Path, new: dict[str, Path], temporaries: _Temporaries) -> None:
    """The written files ``new`` (name: temporary, metrics.parquet last) in place of the previous run's, by renames.

    The previous run's files move aside first, metrics.parquet first, so the
    folder holds the previous complete run, then no complete run, then the new
    one. A failure puts the previous run back (metrics.parquet last); its files
    go only once the new run is in place.
    """
    aside: dict[str, Path] = {}
    placed: list[str] = []
    try:
        for name in (METRICS, *(name for name in RUN_FILES if name != METRICS)):
            if os.path.lexists(out / name):
                temporary = temporaries.reserve(out / name)
                os.replace(out / name, temporary)
                aside[name] = temporary
        for name, temporary in new.items():
            os.replace(temporary, out / name)
            placed.append(name)
    except BaseException:
        for name in placed:
            (out / name).unlink()
        for name, temporary in reversed(aside.items()):
            os.replace(temporary, out / name)
        raise
    for temporary in aside.values():
        temporary.unlink()
