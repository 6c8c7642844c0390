"""A training run's checkpoint: ``OUT/checkpoint.pt``, written atomically, read back only for the same run."""

from __future__ import annotations

from pathlib import Path

import torch

from fedray.errors import FedrayError
from fedray.gradient.training import TrainingState
from fedray.results import write_atomically

CHECKPOINT = "checkpoint.pt"
FREE_OPTIONS = ("out", "quiet", "checkpoint_every")
"""Options a resumed run may change: they do not change its results."""


def _identity(config: dict) -> dict:
    return {key: value for key, value in config.items() if key not in FREE_OPTIONS}


def save_checkpoint(out: Path, config: dict, state: TrainingState) -> None:
    write_atomically(out / CHECKPOINT, lambda path: torch.save({"config": _identity(config), "state": state}, path))


def load_checkpoint(out: Path, config: dict) -> TrainingState:
    """The state saved in ``out``, if it was saved by a run with the same configuration."""
    path = out / CHECKPOINT
    if not path.is_file():
        raise FedrayError(f"{path}: no checkpoint to resume from")
    saved = torch.load(path, weights_only=False)
    differing = sorted(k for k in {*saved["config"], *_identity(config)} if saved["config"].get(k) != config.get(k))
    if differing:
        raise FedrayError(f"{path}: saved by a run with other options ({', '.join(differing)}); resume with the same ones")
    return saved["state"]


def remove_checkpoint(out: Path) -> None:
    (out / CHECKPOINT).unlink(missing_ok=True)
