"""Checkpoint files: plain data loaded without running code from the file, bad files refused in one line, dataset
specs compared canonically, a checkpoint that does not fit on the disk refused in one line with the previous one kept."""

import math
import os
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from fedray.core.accounting import PaperTotals
from fedray.engine.config import RunConfig
from fedray.core.errors import FedrayError
from fedray.engine.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from fedray.methods.training.backend import ClientLosses
from fedray.methods.training.server import ServerAdam
from fedray.engine.training import Accounting, TrainingState
from fedray.core.results import EvalPoint
from tests.app.test_cli import expect_error
from tests.engine.test_run_start import no_ray_start
from tests.images import write_image_folder
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
    server = ServerAdam(server_lr=0.01)
    server.step(params, {name: torch.full_like(value, 0.5) for name, value in params.items()})
    control = {f"control.{name}": torch.full_like(value, 0.07) for name, value in params.items()}
    seen = np.zeros(371, dtype=bool)
    seen[[3, 10]] = True
    accounting = Accounting(seen, 42, 1e6, 2e6, 3.5e9, PaperTotals(800.0, None, 7e9, 84.0))
    points = [EvalPoint(0, 0, 0, 0.01, 0.0, 0.0, 0.0, 0.1, "train"),
              EvalPoint(4, 2, 42, 0.25, 1e6, 2e6, 1.75e9, 2.5, "train", 3.2, False, reported={"eta_g": 1.5},
                        callback_columns={"macro_f1": 0.125, "phase": "early"})]
    return TrainingState(params, server.state, control, accounting, points, done=4, loss_sum=12.5, loss_samples=40,
                         wall_s=2.5, eval_s=0.5, client_states=["checkpoint-clients-r4-0.pt", "checkpoint-clients-r4-1.pt"],
                         reported={"eta_g": 1.5})


def saved_with_client_states(out: Path, config: dict, state: TrainingState | None = None) -> Path:
    """The state above (or ``state``) saved in ``out``, with the files of its clients' states beside it (no client has
    one yet, none spilled)."""
    out.mkdir(exist_ok=True)
    state = state or state_as_every_backend_keeps_it()
    for name in state.client_states:
        torch.save({"kept": {}, "spilled": []}, out / name)
    save_checkpoint(out, config, state)
    return out / CHECKPOINT


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
    saved_with_client_states(tmp_path, run_config(tmp_path), state)
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
    assert loaded.points == state.points and loaded.points[-1].reported == {"eta_g": 1.5}
    assert loaded.points[-1].callback_columns == {"macro_f1": 0.125, "phase": "early"}  # a researcher's columns
    assert [getattr(loaded, f) for f in ("done", "loss_sum", "loss_samples", "wall_s", "eval_s")] == [4, 12.5, 40, 2.5, 0.5]
    assert loaded.reported == {"eta_g": 1.5}   # what plugins reported: a resumed run's rows carry it on


def test_a_checkpoint_keeps_the_losses_each_round_measured(tmp_path):
    """What a clock's selector read (Oort's utilities): a resumed run replays its rounds with them."""
    state = state_as_every_backend_keeps_it()
    state.client_losses = {1: ClientLosses(np.array([3, 10]), np.array([2.5, 0.25])),
                           4: ClientLosses(np.array([7]), np.array([1e-3]))}
    saved_with_client_states(tmp_path, run_config(tmp_path), state)
    loaded = load_checkpoint(tmp_path, run_config(tmp_path)).client_losses
    assert {number: (losses.clients.tolist(), losses.squares.tolist()) for number, losses in loaded.items()} == \
        {1: ([3, 10], [2.5, 0.25]), 4: ([7], [1e-3])}
    assert load_checkpoint(tmp_path, run_config(tmp_path)).client_losses[1].clients.dtype == np.int64
    saved_with_client_states(tmp_path, run_config(tmp_path), state_as_every_backend_keeps_it())
    assert load_checkpoint(tmp_path, run_config(tmp_path)).client_losses == {}


def test_a_checkpoint_keeps_an_infinite_reported_number_as_fedray_report_takes_it(tmp_path):
    state = state_as_every_backend_keeps_it()
    state.reported = {"dp_epsilon": math.inf, "dp_delta": 1e-5}  # DP without noise: ε = ∞
    saved_with_client_states(tmp_path, run_config(tmp_path), state)
    assert load_checkpoint(tmp_path, run_config(tmp_path)).reported == {"dp_epsilon": math.inf, "dp_delta": 1e-5}


def test_a_checkpoint_keeps_a_reported_string(tmp_path):
    state = state_as_every_backend_keeps_it()
    state.reported = {"dp_epsilon": 7.5, "dp_rdp_orders": "1.8-1024"}  # the RDP orders ε was minimized over
    saved_with_client_states(tmp_path, run_config(tmp_path), state)
    assert load_checkpoint(tmp_path, run_config(tmp_path)).reported == {"dp_epsilon": 7.5, "dp_rdp_orders": "1.8-1024"}


def test_resume_compares_the_canonical_dataset_spec(tmp_path):
    config = run_config(tmp_path)
    saved_with_client_states(tmp_path, config)
    reordered = "synthetic:inat-user-120k?classes=60&scale=0.04&dim=24"
    assert load_checkpoint(tmp_path, {**config, "dataset": reordered}).done == 4
    with pytest.raises(FedrayError, match=r"saved by a run with other options \(dataset\)"):
        load_checkpoint(tmp_path, {**config, "dataset": "synthetic:inat-user-120k?classes=60&scale=0.05&dim=24"})


def test_a_checkpoint_from_before_an_option_existed_resumes_only_at_its_default(tmp_path):
    """client_momentum came after this checkpoint's fedray: the saved run trained with 0.0, today's default."""
    config = run_config(tmp_path)
    saved_with_client_states(tmp_path, config)
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
        ("malformed-state", ["its accounting's seen is a list, not a bool vector (one entry per client)"]),
    ],
)
def test_a_bad_checkpoint_is_refused_in_one_line(monkeypatch, tmp_path, capsys, kind, needles):
    no_ray_start(monkeypatch, at_join=lambda: pytest.fail("a bad checkpoint was accepted"))
    out = tmp_path / "run"
    out.mkdir()
    checkpoint = out / CHECKPOINT
    write_bad_checkpoint(kind, checkpoint, run_config(out))
    written = checkpoint.read_bytes()
    expect_error(capsys, [*RUN, "--out", out, "--resume"], f"{checkpoint}: ", *needles, START_OVER)
    assert os.listdir(out) == [CHECKPOINT] and checkpoint.read_bytes() == written, "the file is left as it was"
    assert not (out / "code-ran").exists()


# --- a checkpoint edited by hand: one line before any work, not a traceback after the shards started -------------

SCAFFOLD_RUN = ["run", "--method", "scaffold", "--dataset", SMALL, "--rounds", "10", "--num-shards", "2",
                "--cpus-per-shard", "0.5", "--quiet"]
"""A run the state above is a checkpoint of: SCAFFOLD (its server control variate) on SMALL's 24 × 60 head, 371
clients, 10 training rounds."""


def scaffold_config(out: Path) -> dict:
    config = RunConfig(method="scaffold", dataset=SMALL, out=str(out), rounds=10, num_shards=2, cpus_per_shard=0.5,
                       quiet=True)
    return config.validate().resolved().to_dict()


def ray_would_start() -> None:
    raise FedrayError("the checkpoint was accepted: Ray would start here")


EDITS = {
    "wrong-shape": (lambda state: state["params"].update(weight=torch.zeros(24, 59)),
                    "'weight' of its parameters is 24×59 float32, this run's is 24×60 float32"),
    "nan-parameters": (lambda state: state["params"]["weight"][:2, 3].fill_(float("nan")),
                       "'weight' of its parameters holds 2 of 1440 values that are NaN or infinite"),
    "infinite-server-state": (lambda state: state["server"]["bias"].update(v=torch.full((60,), float("inf"))),
                              "'v' of its server optimizer's state of 'bias' holds 60 of 60 values that are NaN or infinite"),
    "nan-algorithm-state": (lambda state: state["algorithm"]["control.bias"].fill_(float("nan")),
                            "'control.bias' of its training algorithm's state holds 60 of 60 values that are NaN or infinite"),
    "wrong-dtype": (lambda state: state["params"].update(bias=torch.zeros(60, dtype=torch.float64)),
                    "'bias' of its parameters is 60 float64, this run's is 60 float32"),
    "string-parameter": (lambda state: state["params"].update(bias="0.0"), "'bias' in its parameters is a str, not a tensor"),
    "another-model": (lambda state: state["params"].update({"head.weight": state["params"].pop("weight")}),
                      "its parameters are not this run's ('weight' is missing, 'head.weight' is not one of them)"),
    "negative-done": (lambda state: state.update(done=-3), "its number of training rounds done is -3, not a count (an integer ≥ 0)"),
    "fractional-done": (lambda state: state.update(done=2.5), "its number of training rounds done is 2.5, not a count"),
    "done-beyond-the-rounds": (lambda state: state.update(done=99, client_states=[]), "it is after training round 99"),
    "done-at-the-last-round": (lambda state: state.update(done=10, client_states=[]), "it is after training round 10, but this run has 10 "
                               "training rounds and a checkpoint comes before the last one"),
    "negative-counter": (lambda state: state["accounting"].update(samples_seen=-1),
                         "its accounting's samples_seen is -1, not a count"),
    "infinite-traffic": (lambda state: state["accounting"].update(bytes_up=float("inf")),
                         "its accounting's bytes_up is inf, not a finite number"),
    "negative-paper-total": (lambda state: state["accounting"]["paper"].update(fed3r_macs=-1.0),
                             "its accounting's fed3r_macs is -1.0, not a number ≥ 0"),
    "other-clients": (lambda state: state["accounting"].update(seen=torch.zeros(370, dtype=torch.bool)),
                      "its accounting's seen has 370 entries, this run has 371 clients"),
    "seen-of-floats": (lambda state: state["accounting"].update(seen=torch.zeros(371)),
                       "its accounting's seen is a 371 float32 tensor, not a bool vector (one entry per client)"),
    "server-state-of-strings": (lambda state: state["server"]["weight"].update(m="0"),
                                "'m' in its server optimizer's state of 'weight' is a str, not a tensor"),
    "server-state-of-another-model": (lambda state: state["server"].update(w=state["server"].pop("weight")),
                                      "its server optimizer keeps a state of 'w', not a parameter of this run's model"),
    "server-state-of-another-shape": (lambda state: state["server"]["bias"].update(v=torch.zeros(59)),
                                      "its server optimizer's 'v' of 'bias' is 59, the parameter is 60"),
    "algorithm-state-of-another-shape": (lambda state: state["algorithm"].update({"control.bias": torch.zeros(59)}),
                                         "'control.bias' of its training algorithm's state is 59 float32, this run's is 60 float32"),
    "point-without-accuracy": (lambda state: state["points"][1].pop("accuracy"), "its point 1 lacks accuracy"),
    "point-of-strings": (lambda state: state["points"][1].update(bytes_up="1e6"),
                         "its point 1's bytes_up is '1e6', not a finite number"),
    "points-out-of-order": (lambda state: state["points"].reverse(), "its points are not in the order of their rounds ([4, 0])"),
    "client-states-elsewhere": (lambda state: state["client_states"].append("../elsewhere/checkpoint-clients-r4-2.pt"),
                                "its client_states name '../elsewhere/checkpoint-clients-r4-2.pt', not a file of the "
                                "clients' states after training round 4 (checkpoint-clients-r4-I.pt)"),
    "client-states-of-another-round": (lambda state: state.update(done=8), "its client_states name "
                                       "'checkpoint-clients-r4-0.pt', not a file of the clients' states after training round 8"),
    "client-states-missing": (lambda state: state["client_states"].append("checkpoint-clients-r4-2.pt"),
                              "the clients' states it names are not beside it ("),
    "client-losses-of-strings": (lambda state: state.update(client_losses=[{"round": "1"}]),
                                 "its clients' losses hold {'round': '1'}, not a round's clients (int64) and their "
                                 "squared losses (float64)"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_a_checkpoint_edited_by_hand_is_refused_in_one_line_before_ray_starts(monkeypatch, tmp_path, capsys, edit):
    """Wrong shapes, string parameters and ``done = -3`` failed with tracebacks half a minute in (once the shards had
    started); ``done`` at or beyond --rounds wrote the checkpoint's rows out as a complete run."""
    no_ray_start(monkeypatch, at_join=ray_would_start)
    out = tmp_path / "run"
    checkpoint = saved_with_client_states(out, scaffold_config(out))
    contents = torch.load(checkpoint, weights_only=True)
    change, message = EDITS[edit]
    change(contents["state"])
    torch.save(contents, checkpoint)
    written = hashes(out)
    err = expect_error(capsys, [*SCAFFOLD_RUN, "--out", out, "--resume"], f"fedray: error: {checkpoint}: {message}",
                       f"; {START_OVER}\n")
    assert "Ray would start" not in err
    assert hashes(out) == written, "the files are left as they were"


def test_a_checkpoint_as_a_run_writes_it_is_accepted(monkeypatch, tmp_path, capsys):
    no_ray_start(monkeypatch, at_join=ray_would_start)
    out = tmp_path / "run"
    saved_with_client_states(out, scaffold_config(out))
    expect_error(capsys, [*SCAFFOLD_RUN, "--out", out, "--resume"], "the checkpoint was accepted: Ray would start here")


def test_a_damaged_file_of_clients_states_stops_a_resumed_run_in_one_line_before_ray_starts(monkeypatch, tmp_path,
                                                                                              capsys):
    """The clients' states are checked with the rest of the checkpoint: a damaged file ended in a 53-72-line traceback
    (before the shards read their states before any round)."""
    no_ray_start(monkeypatch, at_join=ray_would_start)
    out = tmp_path / "run"
    saved_with_client_states(out, scaffold_config(out))
    for name in ("checkpoint-clients-r4-0.pt", "checkpoint-clients-r4-1.pt"):
        (out / name).write_bytes(b"the states of an actor's clients")
    written = hashes(out)
    err = expect_error(capsys, [*SCAFFOLD_RUN, "--out", out, "--resume"])
    damaged = re.escape(str(out / "checkpoint-clients-r4-")) + "[01]" + re.escape(".pt: damaged file of clients' states (")
    assert re.fullmatch(f"fedray: error: {damaged}[^\n]*\\); {START_OVER}\n", err), err
    assert hashes(out) == written, "no round ran: the files are left as they were"


def test_a_checkpoint_from_before_the_training_algorithms_is_accepted_by_a_run(monkeypatch, tmp_path, capsys):
    """``backend: {}`` instead of the algorithm's state and the client-state files: FedAvg's, which keeps neither."""
    no_ray_start(monkeypatch, at_join=ray_would_start)
    out = tmp_path / "run"
    out.mkdir()
    save_checkpoint(out, run_config(out), state_as_every_backend_keeps_it())
    contents = torch.load(out / CHECKPOINT, weights_only=True)
    del contents["state"]["algorithm"], contents["state"]["client_states"]
    contents["state"]["backend"] = {}
    torch.save(contents, out / CHECKPOINT)
    expect_error(capsys, [*RUN, "--out", out, "--resume"], "the checkpoint was accepted: Ray would start here")


TCT_CNN_ON_4_CLASSES = {
    "backbone.conv1.weight": (32, 3, 3, 3), "backbone.conv1.bias": (32,), "backbone.conv2.weight": (64, 32, 3, 3),
    "backbone.conv2.bias": (64,), "backbone.conv3.weight": (128, 64, 3, 3), "backbone.conv3.bias": (128,),
    "backbone.fc1.weight": (128, 2048), "backbone.fc1.bias": (128,), "head.weight": (4, 128), "head.bias": (4,),
}
"""The state dict of TCT's CNN (its classifier fc2 removed) with a linear head on 4 classes."""


def resume_finetuning(tmp_path: Path, capsys, params: dict[str, torch.Tensor]) -> tuple[Path, str]:
    """``fedray run --finetune ft --backbone tct_cnn --resume`` from a checkpoint whose parameters are ``params``: the
    checkpoint and the one line of error."""
    root = write_image_folder(tmp_path / "data", classes=4, train_per_class=2, test_per_class=1)
    dataset, out = f"imagefolder:{root}?split=classes&classes_per_client=2&clients=2", tmp_path / "run"
    config = RunConfig(method="fedavg", dataset=dataset, finetune="ft", backbone="tct_cnn", weights="random",
                       image_size=28, rounds=3, clients_per_round=1, out=str(out), quiet=True)
    state = TrainingState(params, {}, {}, Accounting(np.zeros(2, dtype=bool)), done=2)
    checkpoint = saved_with_client_states(out, config.validate().resolved().to_dict(), state)
    return checkpoint, expect_error(capsys, [
        "run", "--method", "fedavg", "--dataset", dataset, "--finetune", "ft", "--backbone", "tct_cnn", "--weights",
        "random", "--image-size", "28", "--rounds", "3", "--clients-per-round", "1", "--out", out, "--quiet", "--resume"])


def test_a_fine_tuning_checkpoint_holds_the_network_s_state_dict(monkeypatch, tmp_path, capsys):
    no_ray_start(monkeypatch, at_join=ray_would_start)
    params = {name: torch.zeros(shape) for name, shape in TCT_CNN_ON_4_CLASSES.items()}
    checkpoint, err = resume_finetuning(tmp_path / "right", capsys, params)
    assert "the checkpoint was accepted: Ray would start here" in err
    checkpoint, err = resume_finetuning(tmp_path / "head", capsys, {**params, "head.weight": torch.zeros(3, 128)})
    assert err == f"fedray: error: {checkpoint}: 'head.weight' of its parameters is 3×128 float32, this run's is 4×128 float32; {START_OVER}\n"
    without_conv3 = {name: value for name, value in params.items() if not name.startswith("backbone.conv3")}
    checkpoint, err = resume_finetuning(tmp_path / "other", capsys, {**without_conv3, "backbone.layer1.0.bn1.weight": torch.zeros(64)})
    assert err == (f"fedray: error: {checkpoint}: its parameters are not this run's ('backbone.conv3.bias' is missing, "
                   f"'backbone.conv3.weight' is missing, 'backbone.layer1.0.bn1.weight' is not one of them); {START_OVER}\n")


def test_a_spherefed_checkpoint_holds_the_projection(monkeypatch, tmp_path, capsys):
    """SphereFed trains an l × d projection (l = --sphere-dim), not the d × C head."""
    no_ray_start(monkeypatch, at_join=ray_would_start)
    out = tmp_path / "run"
    config = RunConfig(method="fedavg", dataset=SMALL, out=str(out), rounds=10, head="sphere", sphere_dim=8, num_shards=2,
                       cpus_per_shard=0.5, quiet=True).validate().resolved().to_dict()
    state = TrainingState({"weight": torch.zeros(24, 60), "bias": torch.zeros(60)}, {}, {},
                          Accounting(np.zeros(371, dtype=bool)), done=2)
    checkpoint = saved_with_client_states(out, config, state)
    err = expect_error(capsys, [*RUN, "--rounds", "10", "--head", "sphere", "--sphere-dim", "8", "--out", out, "--resume"])
    assert err == f"fedray: error: {checkpoint}: 'weight' of its parameters is 24×60 float32, this run's is 8×24 float32; {START_OVER}\n"


# --- a full disk: the previous checkpoint as it was, one line, no temporary --------------------------------------


def checkpoint_error(path: Path, free: str = "[0-9.]+ [kM]B") -> str:
    """The error's pattern: the state above takes a few kB."""
    return rf"disk full: writing {re.escape(str(path))} needed [0-9.]+ kB, {free} free"


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


def test_a_checkpoint_onto_a_full_disk_leaves_the_previous_one_and_says_what_it_needed(small_disk):
    """The need is the new checkpoint's bytes (the same as the previous one's here) in whole blocks, not its tensors'
    bytes (which said 4.1 kB for a 5.2 kB file)."""
    config = run_config(small_disk)
    save_checkpoint(small_disk, config, state_as_every_backend_keeps_it())
    size, block = (small_disk / CHECKPOINT).stat().st_size, os.statvfs(small_disk).f_frsize
    fill(small_disk)
    previous = hashes(small_disk)
    with pytest.raises(FedrayError) as error:
        save_checkpoint(small_disk, config, state_as_every_backend_keeps_it())
    needed = -(-size // block) * block  # the file's bytes in whole blocks (its size moves with the run's options)
    assert block == 4096 and needed > 4096
    assert str(error.value) == f"disk full: writing {small_disk / CHECKPOINT} needed {needed / 1000:.1f} kB, 0 kB free"
    assert hashes(small_disk) == previous


def test_a_training_run_onto_a_full_disk_stops_in_one_line(ray_session, small_disk, capsys):
    """Its first checkpoint does not fit: the run stops there, the checkpoint it found is left as it was."""
    out = small_disk / "training"
    out.mkdir()
    (out / CHECKPOINT).write_bytes(b"another training run's checkpoint")
    fill(small_disk)
    previous = hashes(small_disk)
    err = expect_error(capsys, [*RUN, "--out", out, "--rounds", "2", "--checkpoint-every", "1"])
    assert re.fullmatch(f"fedray: error: {checkpoint_error(out / CHECKPOINT, free='0 kB')}\n", err), err
    assert hashes(small_disk) == previous
