"""A training run's checkpoint: ``OUT/checkpoint.pt``, written atomically, read back only for the same run.

The file is plain data: ``{"format", "config", "state"}`` with the state as
tensors, numbers, strings, lists and dicts, read with ``weights_only=True`` so
that loading it never runs code from the file. A file that is not such a
checkpoint (empty, truncated, foreign, of an older fedray) is refused in one line,
and so is one whose state is not what a run writes (a file edited by hand):
every value of the wrong type or out of its range, and, against the run that
resumes it (:class:`RunShape`, before any work), parameters of other names,
shapes or dtypes, other clients, training rounds beyond the run's, clients'
states missing or not finite.
"""

from __future__ import annotations

import math
import pickle
import re
import zipfile
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from fedray.core.accounting import PaperTotals
from fedray.engine.config import RunConfig
from fedray.data.registry import canonical_spec
from fedray.core.errors import FedrayError
from fedray.methods.training.backend import ClientLosses, Params
from fedray.engine.training import CLIENT_STATES, Accounting, TrainingState
from fedray.runtime.client_states import check_saved, remove_saved
from fedray.core.results import EvalPoint, torch_size, write_atomically

CHECKPOINT = "checkpoint.pt"
FORMAT = 2
"""Format 1 (older fedray) pickled fedray's classes; format 2 holds plain data only."""
FREE_OPTIONS = ("out", "quiet", "checkpoint_every", "client_state_memory")
"""Options a resumed run may change: they do not change its results."""
START_OVER = "delete it and run without --resume to start over"


def _identity(config: dict) -> dict:
    """The options that make a run's results, the dataset as its canonical spec (options in any order are one dataset)."""
    identity = {key: value for key, value in config.items() if key not in FREE_OPTIONS}
    identity["dataset"] = canonical_spec(identity["dataset"])
    return identity


def save_checkpoint(out: Path, config: dict, state: TrainingState) -> None:
    """A new checkpoint in place of the previous one, which stays as it was when this one cannot be written in full."""
    contents = {"format": FORMAT, "config": _identity(config), "state": _plain_state(state)}
    write_atomically(out / CHECKPOINT, lambda path: _save(path, contents), lambda: torch_size(contents))


def _save(path: Path, contents: dict) -> None:
    with open(path, "wb") as handle:  # through a Python file, so a full disk raises its OSError (a path: a bare RuntimeError)
        torch.save(contents, handle)


@dataclass(frozen=True)
class RunShape:
    """What the state of a run's checkpoint must fit: the model the run trains (tensors for their names, shapes and
    dtypes, on the meta device for a large one), its training algorithm's server state, its clients and rounds."""

    params: Params
    algorithm: Params
    num_clients: int
    rounds: int


def load_checkpoint(out: Path, config: dict, run: RunShape | None = None) -> TrainingState:
    """The state saved in ``out``, if it was saved by a run with the same configuration and, given the ``run`` that
    resumes it, fits that run."""
    path = out / CHECKPOINT
    if not path.is_file():
        raise FedrayError(f"{path}: no checkpoint to resume from")
    saved = _read(path)
    identity = _identity(config)
    # An option the saved run's fedray did not have yet ran as its default does now (new options keep the old behaviour).
    defaults = RunConfig().to_dict()
    differing = sorted(k for k in {*saved["config"], *identity}
                       if saved["config"].get(k, defaults.get(k)) != identity.get(k))
    if differing:
        raise FedrayError(f"{path}: saved by a run with other options ({', '.join(differing)}); resume with the same ones")
    try:
        state = _training_state(saved["state"], out)
        if run is not None:
            _check_fits(state, run)
    except KeyError as error:
        raise FedrayError(f"{path}: not a complete fedray checkpoint (its state lacks {error}); {START_OVER}") from None
    except (TypeError, AttributeError) as error:
        raise FedrayError(f"{path}: not a fedray checkpoint (its state is malformed: {error}); {START_OVER}") from None
    except FedrayError as error:
        raise FedrayError(f"{path}: {error}; {START_OVER}") from None
    if run is not None:  # the clients' states as the rest: complete, finite (each error names its file)
        for name in state.client_states:
            check_saved(out / name)
    return state


def remove_checkpoint(out: Path) -> None:
    """The checkpoint and the files of its clients' states."""
    (out / CHECKPOINT).unlink(missing_ok=True)
    for path in out.glob(f"{CLIENT_STATES}-r*.pt"):
        remove_saved(path)


def checkpoint_stamp(out: Path) -> tuple[int, int] | None:
    """Which file ``OUT/checkpoint.pt`` is now (inode, modification time), None without one.

    Every save writes a new file, so a stamp that changed since a run started
    means the run wrote the checkpoint itself.
    """
    try:
        status = (out / CHECKPOINT).stat()
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_mtime_ns


def _read(path: Path) -> dict:
    """The file's contents as tensors and plain values, or a one-line error saying what is wrong with it."""
    damage = _damage(path)
    if damage:
        raise FedrayError(f"{path}: {damage}; {START_OVER}")
    try:
        contents = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        what = "was written by an older fedray (checkpoint format 1)" if "fedray." in str(error) else "is not a fedray checkpoint"
        raise FedrayError(f"{path}: {what}: it holds objects other than tensors and plain values, which are not loaded "
                          f"(that would run code from the file); {START_OVER}") from None
    except Exception as error:  # the zip and pickle readers raise RuntimeError, EOFError, ValueError, ... on damaged files
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise FedrayError(f"{path}: damaged ({first_line}); {START_OVER}") from None
    if not (isinstance(contents, dict) and {"format", "config", "state"} <= contents.keys()
            and isinstance(contents["config"], dict) and isinstance(contents["state"], dict)):
        raise FedrayError(f"{path}: not a fedray checkpoint (a PyTorch file without its format, config and state); {START_OVER}")
    if contents["format"] != FORMAT:
        raise FedrayError(f"{path}: checkpoint format {contents['format']!r}, this fedray reads format {FORMAT}; {START_OVER}")
    return contents


def _damage(path: Path) -> str | None:
    """What makes ``path`` unreadable as a PyTorch (zip) file, None when it is one."""
    try:
        if path.stat().st_size == 0:
            return "empty file"
        if zipfile.is_zipfile(path):
            return None
        with open(path, "rb") as handle:
            start = handle.read(4)
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    return "truncated (an interrupted copy?)" if start == b"PK\x03\x04" else "not a PyTorch checkpoint file"


def _plain_state(state: TrainingState) -> dict:
    """``state`` as tensors, numbers, strings, lists and dicts (parameters and optimizer states are already tensors in dicts)."""
    accounting = state.accounting
    return {
        "params": state.params,
        "server": state.server,
        "algorithm": state.algorithm,
        "client_states": list(state.client_states),
        "postprocessors": list(state.postprocessors),
        "reported": dict(state.reported),
        "client_losses": [{"round": number, "clients": torch.from_numpy(losses.clients),
                           "squares": torch.from_numpy(losses.squares)}
                          for number, losses in state.client_losses.items()],
        "accounting": {"seen": torch.from_numpy(accounting.seen), "samples_seen": int(accounting.samples_seen),
                       "bytes_up": float(accounting.bytes_up), "bytes_down": float(accounting.bytes_down),
                       "flops": float(accounting.flops), "paper": accounting.paper.to_dict()},
        "points": [{key: _plain(value) for key, value in asdict(point).items()} for point in state.points],
        "done": int(state.done),
        "loss_sum": float(state.loss_sum),
        "loss_samples": int(state.loss_samples),
        "wall_s": float(state.wall_s),
        "eval_s": float(state.eval_s),
    }


def _plain(value: object) -> object:
    """A NumPy scalar as the Python number it holds (the same value), anything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _paper_totals(accounting: dict) -> PaperTotals:
    """The papers' running totals; a checkpoint from before fedray kept them has none (its paper columns stay null)."""
    if "paper" not in accounting:
        return PaperTotals(None, None, None, None)
    paper, names = accounting["paper"], [field.name for field in fields(PaperTotals)]
    if not isinstance(paper, dict) or sorted(paper) != sorted(names):
        raise FedrayError(f"its accounting's paper totals are {paper!r}, not a mapping of {', '.join(names)}")
    return PaperTotals(**{name: None if paper[name] is None else _amount(paper[name], f"accounting's {name}")
                          for name in names})


def _algorithm_state(plain: dict) -> tuple[dict, list[str]]:
    """The algorithm's server state and the client-state files; a checkpoint of an earlier fedray has instead the
    backend's state, empty unless it was SCAFFOLD's (whose clients' states the driver kept then)."""
    if "algorithm" in plain:
        return plain["algorithm"], plain["client_states"]
    if plain["backend"]:
        raise FedrayError("written by an earlier fedray whose driver kept SCAFFOLD's control variates; "
                          "this fedray keeps them with the clients and cannot continue it")
    return {}, []


def _training_state(plain: dict, out: Path) -> TrainingState:
    accounting = plain["accounting"]
    algorithm, client_states = _algorithm_state(plain)
    done = _count(plain["done"], "number of training rounds done")
    return TrainingState(
        params=_tensors(plain["params"], "parameters", finite=True),
        server=_server_state(plain["server"]),
        algorithm=_tensors(algorithm, "training algorithm's state", finite=True),
        accounting=Accounting(_seen(accounting["seen"]), _count(accounting["samples_seen"], "accounting's samples_seen"),
                              *(_amount(accounting[name], f"accounting's {name}") for name in ("bytes_up", "bytes_down", "flops")),
                              _paper_totals(accounting)),
        points=_points(plain["points"]),
        done=done,
        loss_sum=_number(plain["loss_sum"], "loss_sum"),
        loss_samples=_count(plain["loss_samples"], "loss_samples"),
        wall_s=_amount(plain["wall_s"], "wall_s"),
        eval_s=_amount(plain["eval_s"], "eval_s"),
        client_states=_client_states(client_states, done, out),
        postprocessors=[_tensors(state, "a postprocessor's state") for state in plain.get("postprocessors", [])],
        reported=_reported(plain.get("reported", {}), "reported numbers"),
        client_losses=_client_losses(plain.get("client_losses", [])),
    )


def _reported(value: object, name: str) -> dict[str, float | str]:
    """The numbers (and strings) plugins reported by name (a checkpoint from before they could has none): numbers but
    NaN, or strings, as :func:`fedray.report` takes them (±inf is one: a DP run's ε without noise)."""
    if not isinstance(value, dict) or not all(isinstance(key, str) and (type(reported) is str or type(reported) is float
                                                                        and not math.isnan(reported))
                                              for key, reported in value.items()):
        raise FedrayError(f"its {name} are {value!r}, not a mapping of names to numbers (not NaN) or strings")
    return dict(value)


def _client_losses(value: object) -> dict[int, ClientLosses]:
    """Each round's clients' squared losses (a run that measured none, or a checkpoint from before, has none)."""
    if not isinstance(value, list):
        raise FedrayError(f"its clients' losses are {type(value).__name__}, not a list of rounds")
    losses = {}
    for entry in value:
        if not (isinstance(entry, dict) and type(entry.get("round")) is int
                and isinstance(entry.get("clients"), torch.Tensor) and entry["clients"].dtype == torch.int64
                and isinstance(entry.get("squares"), torch.Tensor) and entry["squares"].dtype == torch.float64
                and entry["clients"].dim() == 1 and entry["squares"].shape == entry["clients"].shape):
            raise FedrayError(f"its clients' losses hold {entry!r}, not a round's clients (int64) and their squared "
                              f"losses (float64)")
        losses[entry["round"]] = ClientLosses(entry["clients"].numpy(), entry["squares"].numpy())
    return losses


def _callback_columns(value: object, where: str) -> dict[str, float | str]:
    """The columns a researcher's callbacks added to a row (a checkpoint from before they could has none)."""
    if not isinstance(value, dict) or not all(isinstance(key, str) and type(column) in (float, str)
                                              for key, column in value.items()):
        raise FedrayError(f"its {where} callback columns are {value!r}, not a mapping of names to numbers or strings")
    return dict(value)


def _clock_columns(value: object, where: str) -> dict[str, float | int]:
    """A row's clock columns (a run without a clock, or a checkpoint from before the clock, has none)."""
    if not isinstance(value, dict) or not all(isinstance(key, str) and type(column) in (float, int)
                                              for key, column in value.items()):
        raise FedrayError(f"its {where} clock columns are {value!r}, not a mapping of names to numbers")
    return dict(value)


def _count(value: object, name: str) -> int:
    if type(value) is not int or value < 0:
        raise FedrayError(f"its {name} is {value!r}, not a count (an integer ≥ 0)")
    return value


def _number(value: object, name: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise FedrayError(f"its {name} is {value!r}, not a finite number")
    return value


def _amount(value: object, name: str) -> float:
    if _number(value, name) < 0:
        raise FedrayError(f"its {name} is {value!r}, not a number ≥ 0")
    return value


def _tensors(value: object, what: str, finite: bool = False) -> Params:
    """``value``, a mapping of names to tensors; with ``finite``, of finite floating-point values (a model a run
    resumes: NaN in it would only show as a divergence rounds later)."""
    if not isinstance(value, dict):
        raise FedrayError(f"its {what} are {type(value).__name__}, not a mapping of names to tensors")
    for name, tensor in value.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise FedrayError(f"{name!r} in its {what} is a {type(tensor).__name__}, not a tensor")
        if finite and tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise FedrayError(f"{name!r} of its {what} holds {bad} of {tensor.numel()} values that are NaN or "
                                  f"infinite")
    return value


def _server_state(value: object) -> dict[str, Params]:
    """The server optimizer's state: a mapping of parameter names to mappings of tensors."""
    if not isinstance(value, dict):
        raise FedrayError(f"its server optimizer's state is {type(value).__name__}, not a mapping")
    for name, slots in value.items():
        _tensors(slots, f"server optimizer's state of {name!r}", finite=True)
    return value


def _seen(value: object) -> np.ndarray:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.dim() != 1:
        what = f"{_described(value)} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise FedrayError(f"its accounting's seen is a {what}, not a bool vector (one entry per client)")
    return value.numpy()


def _points(value: object) -> list[EvalPoint]:
    """The evaluation rows so far, each with its fields of their types, in the order of their rounds."""
    if not isinstance(value, list):
        raise FedrayError(f"its points are {type(value).__name__}, not a list of rows")
    points = [_point(row, index) for index, row in enumerate(value)]
    if any(later.round < earlier.round for earlier, later in zip(points, points[1:])):
        raise FedrayError(f"its points are not in the order of their rounds ({[point.round for point in points]})")
    return points


POINT_COUNTS = ("round", "clients_seen", "samples_seen")
POINT_AMOUNTS = ("bytes_up", "bytes_down", "flops_client_avg", "wall_s")
POINT_PAPER_AMOUNTS = ("comm_floats_fedcof", "comm_floats_fed3r", "macs_client_avg_fed3r", "forward_passes")
"""An evaluation row's fields by what they hold (counts, amounts ≥ 0, amounts or null); the others are checked by name."""


def _point(row: object, index: int) -> EvalPoint:
    if not isinstance(row, dict):
        raise FedrayError(f"its point {index} is {type(row).__name__}, not a row (a mapping)")
    missing = [field.name for field in fields(EvalPoint)
               if field.default is MISSING and field.default_factory is MISSING and field.name not in row]
    if missing:
        raise FedrayError(f"its point {index} lacks {missing[0]}")
    values = {field.name: row.get(field.name, field.default) for field in fields(EvalPoint)
              if field.name not in ("reported", "callback_columns", "clock_columns")}
    where = f"point {index}'s"
    values["clock_columns"] = _clock_columns(row.get("clock_columns", {}), where)
    values["reported"] = _reported(row.get("reported", {}), f"{where} reported numbers")
    values["callback_columns"] = _callback_columns(row.get("callback_columns", {}), where)
    for name in POINT_COUNTS:
        _count(values[name], f"{where} {name}")
    for name in (*POINT_AMOUNTS, *(name for name in POINT_PAPER_AMOUNTS if values[name] is not None)):
        _amount(values[name], f"{where} {name}")
    if values["train_loss"] is not None:
        _number(values["train_loss"], f"{where} train_loss")
    for name, kind in (("stage", str), ("diverged", bool), ("accuracy", float)):  # accuracy: NaN where diverged
        if type(values[name]) is not kind:
            raise FedrayError(f"its {where} {name} is {values[name]!r}, not a {kind.__name__}")
    return EvalPoint(**values)


def _client_states(names: object, done: int, out: Path) -> list[str]:
    """The files of the clients' states after training round ``done``, beside the checkpoint."""
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise FedrayError(f"its client_states are {names!r}, not a list of file names")
    for name in names:
        if not re.fullmatch(rf"{re.escape(CLIENT_STATES)}-r{done}-[0-9]+\.pt", name):
            raise FedrayError(f"its client_states name {name!r}, not a file of the clients' states after training "
                              f"round {done} ({CLIENT_STATES}-r{done}-I.pt)")
        if not (out / name).is_file():
            raise FedrayError(f"the clients' states it names are not beside it ({out / name})")
    return names


def _shape(tensor: torch.Tensor) -> str:
    return "×".join(map(str, tensor.shape)) or "scalar"


def _described(tensor: torch.Tensor) -> str:
    return f"{_shape(tensor)} {str(tensor.dtype).removeprefix('torch.')}"


def _check_tensors(saved: Params, expected: Params, what: str) -> None:
    """``saved`` has the names of ``expected``, each tensor of its shape and dtype."""
    if saved.keys() != expected.keys():
        missing = [f"{name!r} is missing" for name in sorted(expected.keys() - saved.keys())[:3]]
        foreign = [f"{name!r} is not one of them" for name in sorted(saved.keys() - expected.keys())[:3]]
        raise FedrayError(f"its {what} are not this run's ({', '.join(missing + foreign)})")
    for name, tensor in saved.items():
        if tensor.shape != expected[name].shape or tensor.dtype != expected[name].dtype:
            raise FedrayError(f"{name!r} of its {what} is {_described(tensor)}, this run's is {_described(expected[name])}")


def _check_fits(state: TrainingState, run: RunShape) -> None:
    """``state`` is one of ``run``: its model, its algorithm's state, its clients, a training round before its last."""
    _check_tensors(state.params, run.params, "parameters")
    _check_tensors(state.algorithm, run.algorithm, "training algorithm's state")
    for name, slots in state.server.items():
        if name not in run.params:
            raise FedrayError(f"its server optimizer keeps a state of {name!r}, not a parameter of this run's model")
        for key, tensor in slots.items():
            if tensor.shape != run.params[name].shape:
                raise FedrayError(f"its server optimizer's {key!r} of {name!r} is {_shape(tensor)}, "
                                  f"the parameter is {_shape(run.params[name])}")
    if len(state.accounting.seen) != run.num_clients:
        raise FedrayError(f"its accounting's seen has {len(state.accounting.seen)} entries, this run has "
                          f"{run.num_clients} clients")
    if state.done >= run.rounds:
        raise FedrayError(f"it is after training round {state.done}, but this run has {run.rounds} training rounds "
                          f"and a checkpoint comes before the last one")
