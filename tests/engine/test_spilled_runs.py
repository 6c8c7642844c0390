"""Runs whose clients' states spill to disk (``--client-state-memory``): bitwise the runs that keep them in memory,
resumed bitwise, and their checkpoints' states checked against the run's algorithm."""

import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from fedray.app.cli import main
from fedray.core.errors import FedrayError
from fedray.core.folder_lock import LOCK
from fedray.engine.checkpoint import CHECKPOINT
from fedray.engine.config import RunConfig
from fedray.engine.run_config import run
from fedray.runtime.client_states import spilled_folder
from fedray.runtime.ray_start import RayStart

SMALL = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60"
STATE_GB = 4 * (24 * 60 + 60) / 1e9
"""One FedDyn client's state on SMALL's 24 × 60 head (∇L_k of the weight and the bias, float32), in GB."""
FEDDYN = RunConfig(method="feddyn", dataset=SMALL, rounds=12, eval_every=4, checkpoint_every=4, num_shards=2,
                   cpus_per_shard=0.5, quiet=True)
START_OVER = "delete it and run without --resume to start over"


def without_wall(out: Path) -> list[dict]:
    """The rows but for the wall time and the option that differs."""
    return [{k: v for k, v in row.items() if k not in ("wall_s", "client_state_memory")}
            for row in pq.read_table(out / "metrics.parquet").to_pylist()]


def same_results(a: Path, b: Path) -> None:
    assert without_wall(a) == without_wall(b)
    with np.load(a / "classifier.npz") as x, np.load(b / "classifier.npz") as y:
        assert x.files == y.files and all(np.array_equal(x[name], y[name]) for name in x.files)


class Interrupted(Exception):
    pass


def stop_at_round_eight(point, classifier):
    if point.round == 8:
        raise Interrupted


@pytest.mark.parametrize("method", ["feddyn", pytest.param("scaffold", marks=pytest.mark.slow)])
def test_spilled_states_give_bitwise_the_run_that_keeps_them_in_memory(ray_session, tmp_path, method):
    """FedDyn's states (trained by autograd) and SCAFFOLD's dual-form gradient rows (one per sample of the client)."""
    config = replace(FEDDYN, method=method)
    run(replace(config, out=str(tmp_path / "memory")))
    for name, gigabytes in (("all-spilled", 0.0), ("three-kept", 3 * STATE_GB)):
        run(replace(config, out=str(tmp_path / name), client_state_memory=gigabytes))
        same_results(tmp_path / "memory", tmp_path / name)


@pytest.mark.slow
def test_a_resumed_spilled_run_equals_the_uninterrupted_one(ray_session, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run(replace(FEDDYN, out=str(whole)))
    with pytest.raises(Interrupted):
        run(replace(FEDDYN, out=str(parts), client_state_memory=2 * STATE_GB), on_point=stop_at_round_eight)
    linked = sorted(path for folder in parts.glob("checkpoint-clients-r*-spilled") for path in folder.iterdir())
    assert linked and all(re.fullmatch(r"client-[0-9]+\.safetensors", path.name) for path in linked), \
        "the checkpoint holds the spilled states as files of their own"
    run(replace(FEDDYN, out=str(parts), client_state_memory=0.0), resume=True)  # another budget: the same bits
    same_results(whole, parts)
    assert not list(parts.glob("checkpoint-clients-*")), "a finished run leaves no clients' states"


def test_a_checkpoint_whose_states_were_all_re_shaped_stops_a_resumed_run_in_one_line(ray_session, tmp_path, capsys):
    """Each state alike, but not what FedDyn makes for this head: only the algorithm's shapes tell (a traceback in the
    first round that used one, before)."""
    out = tmp_path / "run"
    with pytest.raises(Interrupted):
        run(replace(FEDDYN, out=str(out)), on_point=stop_at_round_eight)
    files = sorted(out.glob("checkpoint-clients-r*.pt"))
    for path in files:
        saved = torch.load(path, weights_only=True)
        saved["kept"] = {client: {name: value.reshape(value.shape[::-1]) if value.dim() == 2 else value
                                  for name, value in state.items()} for client, state in saved["kept"].items()}
        torch.save(saved, path)
    arguments = ["run", "--method", "feddyn", "--dataset", SMALL, "--rounds", "12", "--eval-every", "4",
                 "--checkpoint-every", "4", "--num-shards", "2", "--cpus-per-shard", "0.5", "--quiet", "--out", str(out),
                 "--resume"]
    assert main(arguments) == 2
    err = capsys.readouterr().err
    shapes = re.escape("has shapes {'dyn.weight': (60, 24), 'dyn.bias': (60,)}, where this run's algorithm makes "
                       "{'dyn.weight': (24, 60), 'dyn.bias': (60,)}")
    assert re.fullmatch(rf"fedray: error: {re.escape(str(out))}/checkpoint-clients-r4-[01]\.pt: the state of client "
                        rf"[0-9]+ {shapes}; {START_OVER}\n", err), err
    assert (out / CHECKPOINT).is_file()


def checkpoint_files(out: Path) -> dict[Path, bytes]:
    """The files of ``out`` and their bytes (but the lock of the run in it)."""
    return {path: path.read_bytes() for path in out.rglob("*") if path.is_file() and path.name != LOCK}


def work_started(*args, **kwargs):
    raise AssertionError("the resumed run started Ray: its refusal was not before any work")


def test_a_resume_from_spilled_states_that_are_missing_or_not_finite_is_refused_before_any_work(ray_session, tmp_path,
                                                                                                 monkeypatch):
    """The probe's reproductions: ``rm -r OUT/checkpoint-clients-r*-spilled`` resumed (exit 0) to weights off by
    1.2e-2; NaN in a spilled state was replayed, ended "diverged" and deleted the checkpoint it had resumed from."""
    interrupted = tmp_path / "interrupted"
    with pytest.raises(Interrupted):
        run(replace(FEDDYN, out=str(interrupted), client_state_memory=0.0), on_point=stop_at_round_eight)
    monkeypatch.setattr(RayStart, "join", work_started)

    without_folders = tmp_path / "without-folders"
    shutil.copytree(interrupted, without_folders)
    spilled = sorted(without_folders.glob("checkpoint-clients-r4-*-spilled"))
    assert len(spilled) == 2, "both shards spilled every state (--client-state-memory 0)"
    for folder in spilled:
        shutil.rmtree(folder)
    first = spilled[0].name.removesuffix("-spilled")
    with pytest.raises(FedrayError, match=rf"^{re.escape(str(spilled[0]))}: missing, with the [0-9]+ spilled clients' "
                                          rf"states that {first}\.pt names; {START_OVER}$"):
        run(replace(FEDDYN, out=str(without_folders)), resume=True)

    with_nan = tmp_path / "with-nan"
    shutil.copytree(interrupted, with_nan)
    file = sorted(with_nan.glob("checkpoint-clients-r4-1-spilled/client-*.safetensors"))[-1]
    tensors = load_file(file)
    tensors["dyn.weight"][3, 5] = float("nan")
    file.unlink()
    save_file(tensors, file)
    before = checkpoint_files(with_nan)
    client = int(file.stem.removeprefix("client-"))
    with pytest.raises(FedrayError) as error:
        run(replace(FEDDYN, out=str(with_nan)), resume=True)
    assert str(error.value) == (f"{file}: 'dyn.weight' of the state of client {client} holds 1 of {24 * 60} values "
                                f"that are NaN or infinite; {START_OVER}")
    assert checkpoint_files(with_nan) == before and before.keys() > {with_nan / CHECKPOINT, file}, \
        "the checkpoint stays as it was"
