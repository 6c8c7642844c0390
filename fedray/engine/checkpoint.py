"""A training run's checkpoint: ``OUT/checkpoint.pt``, written atomically, read back only for the same run.

The file is plain data: ``{"format", "config", "state"}`` with the state as
tensors, numbers, strings, lists and dicts, read with ``weights_only=True`` so
that loading it never runs code from the file. A file that is not such a
checkpoint (empty, truncated, foreign, of an older fedray) is refused in one line.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch

from fedray.core.accounting import PaperTotals
from fedray.methods.config import RunConfig
from fedray.data.registry import canonical_spec
from fedray.core.errors import FedrayError
from fedray.engine.training import CLIENT_STATES, Accounting, TrainingState
from fedray.core.results import EvalPoint, payload_bytes, write_atomically

CHECKPOINT = "checkpoint.pt"
FORMAT = 2
"""Format 1 (older fedray) pickled fedray's classes; format 2 holds plain data only."""
FREE_OPTIONS = ("out", "quiet", "checkpoint_every")
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
    write_atomically(out / CHECKPOINT, lambda path: _save(path, contents), payload_bytes(contents))


def _save(path: Path, contents: dict) -> None:
    with open(path, "wb") as handle:  # through a Python file, so a full disk raises its OSError (a path: a bare RuntimeError)
        torch.save(contents, handle)


def load_checkpoint(out: Path, config: dict) -> TrainingState:
    """The state saved in ``out``, if it was saved by a run with the same configuration."""
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
        return _training_state(saved["state"])
    except KeyError as error:
        raise FedrayError(f"{path}: not a complete fedray checkpoint (its state lacks {error}); {START_OVER}") from None
    except (TypeError, AttributeError) as error:
        raise FedrayError(f"{path}: not a fedray checkpoint (its state is malformed: {error}); {START_OVER}") from None
    except FedrayError as error:
        raise FedrayError(f"{path}: {error}; {START_OVER}") from None


def remove_checkpoint(out: Path) -> None:
    """The checkpoint and the files of its clients' states."""
    (out / CHECKPOINT).unlink(missing_ok=True)
    for path in out.glob(f"{CLIENT_STATES}-r*.pt"):
        path.unlink(missing_ok=True)


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
    return PaperTotals(**accounting["paper"])


def _algorithm_state(plain: dict) -> tuple[dict, list[str]]:
    """The algorithm's server state and the client-state files; a checkpoint of an earlier fedray has instead the
    backend's state, empty unless it was SCAFFOLD's (whose clients' states the driver kept then)."""
    if "algorithm" in plain:
        return plain["algorithm"], plain["client_states"]
    if plain["backend"]:
        raise FedrayError("written by an earlier fedray whose driver kept SCAFFOLD's control variates; "
                          "this fedray keeps them with the clients and cannot continue it")
    return {}, []


def _training_state(plain: dict) -> TrainingState:
    accounting = plain["accounting"]
    algorithm, client_states = _algorithm_state(plain)
    names = [field.name for field in fields(EvalPoint)]
    return TrainingState(
        params=plain["params"],
        server=plain["server"],
        algorithm=algorithm,
        accounting=Accounting(accounting["seen"].numpy(), accounting["samples_seen"], accounting["bytes_up"],
                              accounting["bytes_down"], accounting["flops"], _paper_totals(accounting)),
        points=[EvalPoint(**{name: point[name] for name in names if name in point}) for point in plain["points"]],
        done=plain["done"],
        loss_sum=plain["loss_sum"],
        loss_samples=plain["loss_samples"],
        wall_s=plain["wall_s"],
        eval_s=plain["eval_s"],
        client_states=client_states,
        postprocessors=plain.get("postprocessors", []),
    )
