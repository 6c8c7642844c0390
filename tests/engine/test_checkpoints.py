"""Checkpoint files: plain data loaded without running code from the file, bad files refused in one line, dataset
specs compared canonically, a checkpoint that does not fit on the disk refused in one line with the previous one kept."""

import os
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

import fedray.engine.run_config
from fedray.core.accounting import PaperTotals
from fedray.methods.config import RunConfig
from fedray.core.errors import FedrayError
from fedray.engine.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from fedray.methods.training.server import FedAdam
from fedray.engine.training import Accounting, TrainingState
from fedray.core.results import EvalPoint
from tests.app.test_cli import expect_error
from tests.full_disk import disk_full, fill, hashes, small_disk  # noqa: F401 (a fixture)

SMALL = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60"
RUN = ["run", "--method", "fedavg", "--dataset", SMALL, "--num-shards", "2", "--cpus-per-shard", "0.5", "--quiet"]
START_OVER = "delete it and run without --resume to start over"


def run_config(out: Path) -> dict:
    """The configuration ``fedray run RUN --out OUT`` resumes with (as :func:`fedray.engine.run_config.run` resolves it)."""
    config = RunConfig(method="fedavg", dataset=SMALL, out=str(out), num_shards=2, cpus_per_shard=0.5, quiet=True)
    return config.validate().resolved().to_dict()


def state_as_every_backend_keeps_it() -> TrainingState:
    """Parameters, FedAdam's moments, SCAFFOLD's server control variate, the files of the clients' states, accounting
    and rows."""
    params = {"weight": torch.randn(24, 60, generator=torch.Generator().manual_seed(0)), "bias": torch.zeros(60)}
    server = FedAdam(server_lr=0.01)
    server.step(params, {name: torch.full_like(value, 0.5) for name, value in params.items()})
    control = {f"control.{name}": torch.full_like(value, 0.07) for name, value in params.items()}
    seen = np.zeros(371, dtype=bool)
    seen[[3, 10]] = True
    accounting = Accounting(seen, 42, 1e6, 2e6, 3.5e9, PaperTotals(800.0, None, 7e9, 84.0))
    points = [EvalPoint(0, 0, 0, 0.01, 0.0, 0.0, 0.0, 0.1, "train"),
              EvalPoint(4, 2, 42, 0.25, 1e6, 2e6, 1.75e9, 2.5, "train", 3.2, False)]
    return TrainingState(params, server.state, control, accounting, points, done=4, loss_sum=12.5, loss_samples=40,
                         wall_s=2.5, eval_s=0.5, client_states=["checkpoint-clients-r4-0.pt", "checkpoint-clients-r4-1.pt"])


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert type(a) is type(b) and a == b


def test_a_checkpoint_is_plain_data_and_gives_the_state_back(tmp_path):
    state = state_as_every_backend_keeps_it()
    save_checkpoint(tmp_path, run_config(tmp_path), state)
    plain = torch.load(tmp_path / CHECKPOINT, weights_only=True)  # tensors and plain values only
    assert sorted(plain) == ["config", "format", "state"]
    assert plain["state"]["client_states"] == ["checkpoint-clients-r4-0.pt", "checkpoint-clients-r4-1.pt"]
    loaded = load_checkpoint(tmp_path, run_config(tmp_path))
    for field in ("params", "server", "algorithm"):
        assert_same(getattr(loaded, field), getattr(state, field))
    assert loaded.client_states == state.client_states
    assert np.array_equal(loaded.accounting.seen, state.accounting.seen) and loaded.accounting.seen.dtype == bool
    counters = [f.name for f in fields(Accounting) if f.name != "seen"]
    assert [getattr(loaded.accounting, name) for name in counters] == [42, 1e6, 2e6, 3.5e9, PaperTotals(800.0, None, 7e9, 84.0)]
    assert loaded.points == state.points
    assert [getattr(loaded, f) for f in ("done", "loss_sum", "loss_samples", "wall_s", "eval_s")] == [4, 12.5, 40, 2.5, 0.5]


def test_resume_compares_the_canonical_dataset_spec(tmp_path):
    config = run_config(tmp_path)
    save_checkpoint(tmp_path, config, state_as_every_backend_keeps_it())
    reordered = "synthetic:inat-user-120k?classes=60&scale=0.04&dim=24"
    assert load_checkpoint(tmp_path, {**config, "dataset": reordered}).done == 4
    with pytest.raises(FedrayError, match=r"saved by a run with other options \(dataset\)"):
        load_checkpoint(tmp_path, {**config, "dataset": "synthetic:inat-user-120k?classes=60&scale=0.05&dim=24"})


def test_a_checkpoint_from_before_an_option_existed_resumes_only_at_its_default(tmp_path):
    """client_momentum came after this checkpoint's fedray: the saved run trained with 0.0, today's default."""
    config = run_config(tmp_path)
    save_checkpoint(tmp_path, config, state_as_every_backend_keeps_it())
    contents = torch.load(tmp_path / CHECKPOINT, weights_only=True)
    del contents["config"]["client_momentum"]
    torch.save(contents, tmp_path / CHECKPOINT)
    assert load_checkpoint(tmp_path, {**config, "client_momentum": 0.0}).done == 4
    with pytest.raises(FedrayError, match=r"saved by a run with other options \(client_momentum\)"):
        load_checkpoint(tmp_path, {**config, "client_momentum": 0.9})


def test_a_checkpoint_from_before_the_training_algorithms_resumes_without_client_states(tmp_path):
    """Before the training algorithms kept the clients' states with the clients, the state had the backend's instead:
    empty for every method but SCAFFOLD, whose driver-side control variates cannot be carried over."""
    config = run_config(tmp_path)
    save_checkpoint(tmp_path, config, state_as_every_backend_keeps_it())
    contents = torch.load(tmp_path / CHECKPOINT, weights_only=True)
    del contents["state"]["algorithm"], contents["state"]["client_states"]
    contents["state"]["backend"] = {}
    torch.save(contents, tmp_path / CHECKPOINT)
    loaded = load_checkpoint(tmp_path, config)
    assert (loaded.algorithm, loaded.client_states, loaded.done) == ({}, [], 4)
    contents["state"]["backend"] = {"weight": torch.zeros(24, 60), "bias": torch.zeros(60), "rows": torch.zeros(9, 60)}
    torch.save(contents, tmp_path / CHECKPOINT)
    with pytest.raises(FedrayError, match="driver kept SCAFFOLD's control variates") as error:
        load_checkpoint(tmp_path, config)
    assert START_OVER in str(error.value) and "\n" not in str(error.value)


class RunsCode:
    """Unpickling this would create ``marker``: what a checkpoint loaded with weights_only=False would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def write_bad_checkpoint(kind: str, path: Path, config: dict) -> None:
    if kind in ("truncated", "incomplete-state", "malformed-state", "format-99"):
        save_checkpoint(path.parent, config, state_as_every_backend_keeps_it())
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "random-bytes":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif kind == "foreign":
        torch.save(torch.nn.Linear(24, 60).state_dict(), path)
    elif kind == "older-fedray":
        torch.save({"config": config, "state": state_as_every_backend_keeps_it()}, path)  # format 1: pickled classes
    elif kind == "runs-code":
        torch.save({"format": 2, "config": config, "state": RunsCode(path.parent / "code-ran")}, path)
    else:
        contents = torch.load(path, weights_only=True)
        if kind == "incomplete-state":
            del contents["state"]["accounting"]
        elif kind == "malformed-state":
            contents["state"]["accounting"]["seen"] = [True, False]
        else:
            contents["format"] = 99
        torch.save(contents, path)


@pytest.mark.parametrize(
    "kind, needles",
    [
        ("empty", ["empty file"]),
        ("truncated", ["truncated (an interrupted copy?)"]),
        ("random-bytes", ["not a PyTorch checkpoint file"]),
        ("foreign", ["not a fedray checkpoint (a PyTorch file without its format, config and state)"]),
        ("older-fedray", ["was written by an older fedray (checkpoint format 1)", "not loaded"]),
        ("runs-code", ["is not a fedray checkpoint: it holds objects other than tensors and plain values"]),
        ("format-99", ["checkpoint format 99, this fedray reads format 2"]),
        ("incomplete-state", ["not a complete fedray checkpoint (its state lacks 'accounting')"]),
        ("malformed-state", ["not a fedray checkpoint (its state is malformed: 'list' object has no attribute 'numpy')"]),
    ],
)
def test_a_bad_checkpoint_is_refused_in_one_line(monkeypatch, tmp_path, capsys, kind, needles):
    monkeypatch.setattr(fedray.engine.run_config, "init_ray", lambda address=None: pytest.fail("a bad checkpoint was accepted"))
    out = tmp_path / "run"
    out.mkdir()
    checkpoint = out / CHECKPOINT
    write_bad_checkpoint(kind, checkpoint, run_config(out))
    written = checkpoint.read_bytes()
    expect_error(capsys, [*RUN, "--out", out, "--resume"], f"{checkpoint}: ", *needles, START_OVER)
    assert os.listdir(out) == [CHECKPOINT] and checkpoint.read_bytes() == written, "the file is left as it was"
    assert not (out / "code-ran").exists()


# --- a full disk: the previous checkpoint as it was, one line, no temporary --------------------------------------


def checkpoint_error(path: Path, free: str = "[0-9.]+") -> str:
    """The error's pattern: the state above takes some 0.0x MB."""
    return rf"disk full: writing {re.escape(str(path))} needed 0\.0[0-9]+ MB, {free} MB free"


@pytest.mark.parametrize("failing", ["torch.save", "os.replace"])
def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one(monkeypatch, tmp_path, failing):
    config = run_config(tmp_path)
    save_checkpoint(tmp_path, config, state_as_every_backend_keeps_it())
    previous = hashes(tmp_path)

    def half_written(contents, handle):
        handle.write(b"PK\x03\x04" + bytes(1000))
        raise disk_full()

    if failing == "torch.save":
        monkeypatch.setattr(torch, "save", half_written)
    else:
        monkeypatch.setattr(os, "replace", lambda source, target: (_ for _ in ()).throw(disk_full()))
    with pytest.raises(FedrayError) as error:
        save_checkpoint(tmp_path, config, state_as_every_backend_keeps_it())
    assert re.fullmatch(checkpoint_error(tmp_path / CHECKPOINT), str(error.value)), error.value
    assert hashes(tmp_path) == previous


def test_a_checkpoint_onto_a_full_disk_leaves_the_previous_one(small_disk):
    config = run_config(small_disk)
    save_checkpoint(small_disk, config, state_as_every_backend_keeps_it())
    fill(small_disk)
    previous = hashes(small_disk)
    with pytest.raises(FedrayError, match=f"^{checkpoint_error(small_disk / CHECKPOINT, free='0')}$"):
        save_checkpoint(small_disk, config, state_as_every_backend_keeps_it())
    assert hashes(small_disk) == previous


def test_a_training_run_onto_a_full_disk_stops_in_one_line(ray_session, small_disk, capsys):
    """Its first checkpoint does not fit: the run stops there, the checkpoint it found is left as it was."""
    out = small_disk / "training"
    out.mkdir()
    (out / CHECKPOINT).write_bytes(b"another training run's checkpoint")
    fill(small_disk)
    previous = hashes(small_disk)
    err = expect_error(capsys, [*RUN, "--out", out, "--rounds", "2", "--checkpoint-every", "1"])
    assert re.fullmatch(f"fedray: error: {checkpoint_error(out / CHECKPOINT, free='0')}\n", err), err
    assert hashes(small_disk) == previous
