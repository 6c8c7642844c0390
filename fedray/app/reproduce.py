"""``fedray reproduce OUT``: rerun a finished run folder from its config.yaml and say whether the same bits came out.

The rerun writes a new folder (never OUT). Its classifier.npz and metrics.parquet
are compared with OUT's: bitwise, and where they differ by the largest relative
difference, max |a − b| / max(|a|, |b|) over an array or a column (0 where both
are all zeros; infinite where their shapes, or the places of their NaNs and
nulls, differ). The metrics' wall-clock columns (:data:`~fedray.app.api.MEASURED`)
are left out; text columns are compared as they are. The two runs' run.json
are compared field by field, but for the command and the times.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from fedray.app.api import MEASURED
from fedray.core.errors import FedrayError
from fedray.core.results import CLASSIFIER, CONFIG, METRICS, RUN_JSON
from fedray.engine.checkpoint import CHECKPOINT
from fedray.engine.config import resolve
from fedray.engine.config_files import load_config_file
from fedray.runtime.provenance import differing

SUFFIX = "-reproduced"
"""The default rerun folder is OUT's name with this suffix (then ``-2``, ``-3``, ... while one is taken), beside it."""
NAMES_SHOWN = 6
"""At most this many differing arrays or columns are named, the largest differences first."""


@dataclass(frozen=True)
class Difference:
    """How two runs' classifiers, or metrics, differ: the arrays or columns that are not bitwise equal, the largest
    relative difference first (text columns, and those only one run has, after the numbers)."""

    differing: tuple[str, ...]
    largest: float | None
    """The largest relative difference of the numeric arrays or columns that differ; None where none of them is
    numeric (or nothing differs)."""

    @property
    def equal(self) -> bool:
        return not self.differing

    def text(self) -> str:
        if self.equal:
            return "bitwise equal"
        shown = ", ".join(self.differing[:NAMES_SHOWN])
        more = f" and {len(self.differing) - NAMES_SHOWN} more" if len(self.differing) > NAMES_SHOWN else ""
        size = "differ" if self.largest is None else f"up to {self.largest:.3g} relative"
        return f"{size} ({shown}{more})"


@dataclass(frozen=True)
class Comparison:
    """A run folder against its rerun."""

    classifier: Difference
    metrics: Difference
    environment: list[tuple[str, object, object]] | None
    """The recorded fields that differ, with OUT's value and the rerun's; None where OUT has no run.json."""
    rerun: Path

    @property
    def equal(self) -> bool:
        return self.classifier.equal and self.metrics.equal

    def line(self) -> str:
        """The one line ``fedray reproduce`` prints."""
        excluded = f"wall-clock columns excluded: {', '.join(MEASURED)}"
        if self.equal:
            head = f"bitwise equal: classifier and metrics ({excluded})"
        else:
            head = f"different: classifier {self.classifier.text()}, metrics {self.metrics.text()} ({excluded})"
        if self.environment is None:
            environment = f"environment not compared (no {RUN_JSON} in the run folder)"
        else:
            changes = ", ".join(f"{name} ({recorded} → {rerun})" for name, recorded, rerun in self.environment)
            environment = f"environment fields that differ: {changes or 'none'}"
        return f"{head}; {environment}; rerun in {self.rerun}"


def check_finished(out: Path) -> None:
    """Refuse, in one line, a folder that does not hold a finished run."""
    if not out.is_dir():
        raise FedrayError(f"{out}: no such run folder")
    if not (out / CONFIG).is_file():
        if (out / CHECKPOINT).is_file():
            raise FedrayError(f"{out}: an unfinished run ({CHECKPOINT}, no {CONFIG}); finish it with --resume first")
        raise FedrayError(f"{out}: not a run folder (no {CONFIG})")
    for name in (METRICS, CLASSIFIER):
        if not (out / name).is_file():
            raise FedrayError(f"{out}: an unfinished run (no {name})")


def fresh_folder(out: Path) -> Path:
    """A folder beside ``out`` that does not exist yet: ``OUT-reproduced``, else ``OUT-reproduced-2``, ..."""
    candidate, number = out.with_name(out.name + SUFFIX), 1
    while candidate.exists():
        number += 1
        candidate = out.with_name(f"{out.name}{SUFFIX}-{number}")
    return candidate


def reproduce(out: str | Path, new: str | Path | None = None, address: str | None = None,
              command: str | None = None) -> Comparison:
    """Rerun the finished run in ``out`` from its config.yaml into ``new`` (default :func:`fresh_folder`) and compare
    them; ``command`` is what the rerun's run.json records. Everything is checked before any work."""
    from fedray.engine.run_config import run  # Ray: only once the input is checked

    out = Path(out)
    check_finished(out)
    new = fresh_folder(out.absolute()) if new is None else Path(new)
    if out.resolve() in (new.resolve(), *new.resolve().parents):
        raise FedrayError(f"--out {new}: is the run folder being reproduced, or inside it; name another folder")
    config = resolve(load_config_file(out / CONFIG), {"out": str(new), "quiet": True})
    run(config, address=address, command=command)
    return compare_runs(out, new)


def compare_runs(recorded: Path, rerun: Path) -> Comparison:
    """The finished run in ``recorded`` against the one in ``rerun``."""
    return Comparison(_classifier_difference(recorded / CLASSIFIER, rerun / CLASSIFIER),
                      _metrics_difference(recorded / METRICS, rerun / METRICS),
                      _environment_difference(recorded / RUN_JSON, rerun / RUN_JSON), rerun)


def _classifier_difference(recorded: Path, rerun: Path) -> Difference:
    with np.load(recorded) as first, np.load(rerun) as second:
        a, b = dict(first), dict(second)
    return _difference({name: (a[name], b[name]) for name in a.keys() & b.keys()}, a.keys() ^ b.keys())


def _metrics_difference(recorded: Path, rerun: Path) -> Difference:
    a, b = (pl.read_parquet(path).drop(MEASURED, strict=False) for path in (recorded, rerun))
    common = [name for name in a.columns if name in b.columns]
    numeric = {name: (_values(a[name]), _values(b[name])) for name in common
               if _is_number(a[name].dtype) and _is_number(b[name].dtype)}
    text = {name for name in common if name not in numeric and not a[name].equals(b[name], check_dtypes=True)}
    return _difference(numeric, set(a.columns) ^ set(b.columns) | text)


def _is_number(dtype: pl.DataType) -> bool:
    return dtype.is_numeric() or dtype == pl.Boolean


def _values(column: pl.Series) -> np.ndarray:
    """A numeric column's values in its own type, or in float64 with NaN for its nulls where it has any."""
    return column.to_numpy() if column.null_count() == 0 else column.cast(pl.Float64).to_numpy()


def _difference(pairs: dict[str, tuple[np.ndarray, np.ndarray]], others: set[str]) -> Difference:
    """The arrays of ``pairs`` that are not bitwise equal, largest relative difference first, then ``others``."""
    sizes = {name: relative_difference(a, b) for name, (a, b) in pairs.items() if not bitwise_equal(a, b)}
    ordered = sorted(sizes, key=lambda name: (-sizes[name], name))
    return Difference((*ordered, *sorted(others)), max(sizes.values()) if sizes else None)


def bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """max |a − b| / max(|a|, |b|) over two arrays (see the module's docstring)."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.astype(np.float64), b.astype(np.float64)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return math.inf
    infinite = np.isinf(a) | np.isinf(b)
    if not np.array_equal(a[infinite], b[infinite]):
        return math.inf
    finite = np.isfinite(a)  # and so b
    a, b = a[finite], b[finite]
    scale = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))
    return 0.0 if scale == 0 else float(np.abs(a - b).max() / scale)


def _environment_difference(recorded: Path, rerun: Path) -> list[tuple[str, object, object]] | None:
    if not recorded.is_file():
        return None
    first, second = json.loads(recorded.read_text()), json.loads(rerun.read_text())
    return [(name, first.get(name), second.get(name)) for name in differing(first, second)]
