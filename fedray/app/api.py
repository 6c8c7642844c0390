"""``fedray.run`` and ``fedray.sweep``: a run and a sweep from Python, as ``fedray run`` and ``fedray sweep`` do them
from the command line."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch

from fedray.engine.config import resolve
from fedray.engine.config_files import Spelling, typed_options
from fedray.core.federation import Federation
from fedray.data.memory import memory_label
from fedray.core.errors import FedrayError, shown
from fedray.methods.base import Classifier
from fedray.core.options import Option
from fedray.core.plugins import spec_of
from fedray.core.results import METRICS


@dataclass(eq=False)
class RunResult:
    """What ``fedray.run`` returns: the run's files as Python objects, and the clients of its rounds.

    Two results are equal (``==``) when their runs' results are: the same metrics but for ``wall_s`` (time measured on
    this machine, never the same twice), bitwise the same classifier and arrays, the same rounds; wherever they were
    written (``out``). The same configuration gives equal results."""

    metrics: pl.DataFrame
    """metrics.parquet: one row per evaluation point."""
    classifier: Classifier
    """The final classifier (classifier.npz's ``W`` and ``bias``): scores = features @ W + bias, on the features the
    method classifies (Fed3R-RF's random features, SphereFed's normalized projection, TCT's eNTK features)."""
    arrays: dict[str, np.ndarray]
    """classifier.npz's other arrays: what that map needs (``rf_omega``, ``proj_weight``, ``entk_index``, ...)."""
    rounds: Sequence[np.ndarray]
    """The clients of each round, numbered as the metrics' ``round``: round r's are ``rounds[r - 1]``; drawn as they
    are read (a :class:`~fedray.runtime.schedules.Schedule`), not held whole."""
    out: Path
    """The run's folder."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RunResult):
            return NotImplemented
        return (_measured_aside(self.metrics).equals(_measured_aside(other.metrics))
                and _same_tensor(self.classifier.weight, other.classifier.weight)
                and _same_tensor(self.classifier.bias, other.classifier.bias)
                and self.arrays.keys() == other.arrays.keys()
                and all(np.array_equal(self.arrays[name], other.arrays[name]) for name in self.arrays)
                and self.rounds == other.rounds)

    __hash__ = None  # type: ignore[assignment]  # equal by value


MEASURED = ("wall_s",)
"""The metrics columns measured on the machine, not computed: set aside when results are compared."""


def _measured_aside(metrics: pl.DataFrame) -> pl.DataFrame:
    return metrics.drop(MEASURED, strict=False)


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None and b is None or a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b)


Evaluation = Callable[[dict, "Classifier | None"], None]
"""``on_evaluation(row, classifier)``: each evaluation point's columns and the classifier evaluated there."""

RUN, SWEEP = "fedray.run", "fedray.sweep"
"""How their one-line errors name them."""
KEYWORD_SPELLING = Spelling("in options={{'{key}': ...}}", "in dataset= as ?{key}=...")
"""How ``fedray.run`` takes a plugin's option and a dataset option, for the hint after an unknown keyword."""
RESUME, QUIET, VERBOSE = Option("resume", bool, False), Option("quiet", bool, False), Option("verbose", bool, False)
ADDRESS = Option("address", str, None, optional=True)
"""The arguments of ``fedray.run`` and ``fedray.sweep`` that are not run options, typed as run options are."""


def _folder(value: object, where: str) -> str:
    """``out``: a folder as a string or a path."""
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    raise FedrayError(f"{where}: out must be a folder, a str or pathlib.Path, got {shown(value)}")


def _spec(value: str | type, what: str) -> str:
    """A method, server optimizer or postprocessor given by name, ``module:Class``, ``file.py:Class`` or as the class itself."""
    if isinstance(value, str):
        return value
    if isinstance(value, type):
        if "<locals>" in value.__qualname__:
            raise FedrayError(f"{RUN}: {what} {value.__qualname__}: define the class at the top level of a module "
                              f"or notebook cell")
        return spec_of(value)
    raise FedrayError(f"{RUN}: {what} must be a name, 'module:Class', 'file.py:Class' or a class, got {shown(value)}")


def _postprocessors(value: str | type | list | tuple) -> str | None:
    """``postprocessor=``: one class or spec, or a list of them in order, as ``--postprocessor A,B`` takes them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, (str, type)):
            raise FedrayError(f"{RUN}: postprocessor must be a name, 'module:Class', 'file.py:Class', a class, or a list of "
                              f"them, got {shown(value)}")
    return ",".join(_spec(item, "postprocessor") for item in items) or None


def run(
    method: str | type = "fed3r",
    dataset: str | Federation = "synthetic:inat-user-120k",
    out: str | Path = "results/run",
    options: dict[str, object] | None = None,
    server_optimizer: str | type | None = None,
    postprocessor: str | type | list[str | type] | None = None,
    address: str | None = None,
    resume: bool = False,
    on_evaluation: Evaluation | None = None,
    verbose: bool = False,
    callbacks: list | None = None,
    **run_options: object,
) -> RunResult:
    """Run ``method`` on ``dataset``; writes ``out`` as ``fedray run`` does and returns a :class:`RunResult`
    (``.metrics``: its metrics table).

    ``dataset`` is a dataset spec or a :class:`Federation` (e.g. from
    :meth:`Federation.from_arrays`); one without a spec is recorded as
    ``memory:NAME@HASH`` (:func:`fedray.data.memory.memory_label`) and its
    shards get their rows through Ray's object store.
    ``run_options`` are the command line's run options with underscores
    (``clients_per_round=10``, ``rounds=500``, ``lam=0.1``, ``quiet=True``);
    ``options`` sets a plugin's own options by name (``--option key=value``; ``{"Owner.key": value}`` for one class,
    as ``--option Owner.key=value``).
    ``method``, ``server_optimizer`` and ``postprocessor`` take a spec or the class itself
    (``postprocessor`` also a list of them, applied in order).
    Every value is typed and checked as a config file's is, before any work
    (:meth:`fedray.core.options.Option.coerce`, then the command line's checks),
    with the same one-line :class:`FedrayError`: ``None`` only where the
    option has no value by default (``rounds=None``: until every client was
    seen; ``checkpoint_every=None``: never), a bool is not a number, nor a
    float an integer (``rounds=2.0`` is refused), a numpy number is a number,
    and a string is parsed as the command line parses it (``"1e-3"``).
    ``on_evaluation(row, classifier)`` is called at each evaluation point with
    its evaluation columns (``round``, ``accuracy``, ``bytes_up``, ...) and the
    classifier evaluated there: a closed form's solve, a training run's head
    (SphereFed: the fixed classifier; TCT's stage 2: its model), yours to keep.
    ``verbose`` shows what Ray's workers print, as ``fedray run --verbose`` does, when this call starts Ray.
    ``callbacks`` are :class:`fedray.Callback` instances: hooks at the start, at each evaluation row (whose
    ``on_evaluation`` may return columns to add to it: a macro-F1, a per-class accuracy), after each round (one that
    returns True stops the run at its next evaluation row, a complete run whose last row's ``stopped_early`` is true)
    and at the end.
    """
    from fedray.engine.callbacks import Callbacks
    from fedray.engine.run_config import run as run_config  # the engine imports Ray and torch: only when a run starts

    federation = dataset if isinstance(dataset, Federation) else None
    if federation is not None:
        dataset = federation.spec or memory_label(federation)
    elif not isinstance(dataset, str):
        raise FedrayError(f"{RUN}: dataset must be a spec ('synthetic:…', 'parquet:PATH', 'file.py:function', ...) "
                          f"or a fedray.Federation, got {shown(dataset)}")
    values = {**run_options, "method": _spec(method, "method"), "dataset": dataset, "out": _folder(out, RUN),
              "options": options}
    if server_optimizer is not None:
        values["server_optimizer"] = _spec(server_optimizer, "server optimizer")
    if postprocessor is not None:
        values["postprocessor"] = _postprocessors(postprocessor)
    resume, address, verbose = RESUME.coerce(resume, RUN), ADDRESS.coerce(address, RUN), VERBOSE.coerce(verbose, RUN)
    if on_evaluation is not None and not callable(on_evaluation):
        raise FedrayError(f"{RUN}: on_evaluation must be a function (row, classifier), got {shown(on_evaluation)}")
    researcher = Callbacks.checked(callbacks, RUN)
    config = resolve(typed_options(values, RUN, KEYWORD_SPELLING), {}, named=run_options)  # None is a value, as in a file
    listener = None if on_evaluation is None else lambda point, classifier: on_evaluation(point.columns(), classifier)
    completed = run_config(config, address=address, resume=resume, on_point=listener, federation=federation,
                           verbose=verbose, callbacks=researcher, command=RUN)
    arrays = dict(completed.arrays)
    weight, bias = arrays.pop("W"), arrays.pop("bias", None)
    classifier = Classifier(torch.from_numpy(weight), None if bias is None else torch.from_numpy(bias))
    return RunResult(pl.read_parquet(Path(config.out) / METRICS), classifier, arrays, completed.rounds, Path(config.out))


def sweep(
    config: str | Path | dict,
    out: str | Path = "results/sweeps",
    resume: bool = False,
    address: str | None = None,
    quiet: bool = False,
    callbacks: list | None = None,
) -> pl.DataFrame:
    """Run (or ``resume``) a sweep, as ``fedray sweep`` does: its results table, also written to ``out/NAME/results.parquet``.

    ``config`` is a sweep file (YAML) or its content as a mapping (``{"name": ..., "base": {...}, "grid": {...}}``).
    ``callbacks``: :class:`fedray.Callback` instances, as :func:`run` takes them; each trial runs a copy, and the
    columns their ``on_evaluation`` returns are columns of the table.
    The arguments are checked as :func:`run`'s are, before any work.
    """
    from fedray.engine.callbacks import Callbacks
    from fedray.app.sweeps.spec import load_sweep, sweep_spec
    from fedray.app.sweeps.tuning import sweep as run_sweep  # Ray Tune: only when a sweep starts

    if not isinstance(config, (str, os.PathLike, dict)):
        raise FedrayError(f"{SWEEP}: config must be a sweep file (a str or pathlib.Path) or its content as a dict, "
                          f"got {shown(config)}")
    out = _folder(out, SWEEP)
    resume, quiet, address = RESUME.coerce(resume, SWEEP), QUIET.coerce(quiet, SWEEP), ADDRESS.coerce(address, SWEEP)
    researcher = Callbacks.checked(callbacks, SWEEP)
    spec = sweep_spec(config, Path("sweep")) if isinstance(config, dict) else load_sweep(config)
    return run_sweep(spec, out, resume=resume, address=address, quiet=quiet, callbacks=researcher.callbacks,
                     command=SWEEP)
