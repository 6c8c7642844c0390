"""Whole runs on the clock: a clock that changes nothing changes no bit on every method path, the same events on one
shard or two (and the classifier up to the order of float sums, as without a clock), a FedAvg run with a deadline
against a plain loop, rows every S virtual seconds and the upload groups they make, the stages after training on the
clock, rounds.parquet, and bad input refused in one line before any work."""

import json
from pathlib import Path
from typing import Annotated

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import fedray
from fedray.core.errors import FedrayError
from fedray.data.registry import load_federation
from fedray.engine.config import RunConfig
from fedray.engine.run_config import run
from fedray.methods.base import Classifier
from fedray.methods.training.local import LocalSGD, random_head
from fedray.runtime import sampling
from tests.reference import fedavg_by_autograd

TINY = "synthetic:inat-user-120k?dim=16&scale=0.005&classes=10&seed=3"  # 46 clients, d = 16, 10 classes
COMMON = {"dataset": TINY, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True, "clients_per_round": 5,
          "eval_every": 2}
CLOCK_COLUMNS = {"clock_s", "clock_compute_s", "clock_comm_s", "clients_straggled", "clients_dropped"}
CLOCK_OPTIONS = {"devices", "availability", "selector", "eval_every_s", "over_commit", "deadline", "stragglers"}
"""The clock's option columns (``stragglers`` is the policy; the counts are ``clients_straggled``, ``clients_dropped``)."""

PATHS = {
    "fedncm": {"method": "fedncm"},
    "fed3r": {"method": "fed3r"},
    "fedcof": {"method": "fedcof"},
    "fedavg": {"method": "fedavg", "rounds": 3},
    "scaffold": {"method": "scaffold", "rounds": 3},
    "fed3r-then-fedavg": {"method": "fedavg", "init": "fed3r", "rounds": 2},
    "spherefed": {"method": "fedavg", "head": "sphere", "sphere_dim": 8, "rounds": 2, "probe_ridge": True},
    "calibrate": {"method": "fedavg", "calibrate": "fed3r", "rounds": 2},
    "fed3r-secagg": {"method": "fed3r", "secure_aggregation": True, "options": {"secagg_clip": 10.0}},
}
AFTER_TRAINING = {"spherefed": ["calibrated", "ridge_probe"], "calibrate": ["calibrated"]}
"""The rounds.parquet stages of the paths' rounds after training's."""


def rows_of(out: Path) -> list[dict]:
    return pq.read_table(out / "metrics.parquet").to_pylist()


@pytest.mark.parametrize("path", PATHS)
def test_a_clock_that_changes_nothing_changes_no_bit(ray_session, tmp_path, path):
    plain = run(RunConfig(out=str(tmp_path / "plain"), **COMMON, **PATHS[path]))
    clocked = run(RunConfig(out=str(tmp_path / "clocked"), devices="uniform", **COMMON, **PATHS[path]))
    assert plain.arrays.keys() == clocked.arrays.keys()
    for name, array in plain.arrays.items():
        assert np.array_equal(array, clocked.arrays[name]), name
    assert [len(clients) for clients in plain.rounds] == [len(clients) for clients in clocked.rounds]
    assert all(np.array_equal(a, b) for a, b in zip(plain.rounds, clocked.rounds))
    assert not (CLOCK_COLUMNS | CLOCK_OPTIONS) & set(plain.rows[0])
    assert not (tmp_path / "plain" / "rounds.parquet").exists()
    for before, after in zip(plain.rows, clocked.rows, strict=True):
        assert CLOCK_COLUMNS <= set(after)
        kept = set(before) - {"wall_s"}
        assert {name: before[name] for name in kept} == {name: after[name] for name in kept}
    per_round = pq.read_table(tmp_path / "clocked" / "rounds.parquet").to_pylist()
    assert [row["round"] for row in per_round] == list(range(1, len(per_round) + 1))
    assert all(row["stragglers"] == row["dropped"] == 0 for row in per_round)
    assert all(later["start_s"] == earlier["end_s"] for earlier, later in zip(per_round, per_round[1:]))
    ends = {row["round"]: row["end_s"] for row in per_round}
    assert [row["clock_s"] for row in clocked.rows] == [ends.get(row["round"], 0.0) for row in clocked.rows]
    stages = [row["stage"] for row in per_round]
    after = AFTER_TRAINING.get(path, [])
    assert stages[len(stages) - len(after):] == after
    if "secure_aggregation" in PATHS[path]:  # each upload timed as the last block's participants sent theirs
        assert per_round[-1]["bytes_up"] == per_round[-1]["finished"] * clocked.rows[-1]["secagg_bytes_per_participant"]


@pytest.mark.parametrize(("method", "deadline"),  # about the median task's
                         [("fed3r", 3e-4), pytest.param("fedavg", 1.5e-3, marks=pytest.mark.slow)])
def test_one_shard_or_two_give_the_same_events_and_bits(ray_session, tmp_path, method, deadline):
    clock = {"devices": "phones", "availability": "diurnal:0.005,0.7", "over_commit": 1.4, "deadline": deadline}
    extra = {"rounds": 6} if method == "fedavg" else {}
    one = run(RunConfig(method=method, out=str(tmp_path / "one"), **{**COMMON, "num_shards": 1}, **clock, **extra))
    two = run(RunConfig(method=method, out=str(tmp_path / "two"), **COMMON, **clock, **extra))
    events = pq.read_table(tmp_path / "one" / "rounds.parquet")
    assert events.equals(pq.read_table(tmp_path / "two" / "rounds.parquet"))
    assert sum(events.column("stragglers").to_pylist()) > 0 and sum(events.column("dropped").to_pylist()) > 0
    assert [row.tolist() for row in one.rounds] == [row.tolist() for row in two.rounds]
    assert [{name: row[name] for name in CLOCK_COLUMNS | {"round"}} for row in one.rows] == \
        [{name: row[name] for name in CLOCK_COLUMNS | {"round"}} for row in two.rows]
    # the same clients summed in another grouping: only the order of the float sums differs, as a run without a
    # clock's does (float64 statistics, a float32 head)
    tolerance = 1e-12 if method == "fed3r" else 1e-6
    for name, array in one.arrays.items():
        assert np.allclose(array, two.arrays[name], rtol=0, atol=tolerance), name


def test_a_fedavg_run_with_a_deadline_equals_the_plain_loop_over_the_clients_in_time(ray_session, tmp_path):
    """Even clients on a fast device, odd ones on a device that cannot finish by the deadline: each round trains the
    schedule's even clients only, in its order; its odd ones are stragglers."""
    federation = load_federation(TINY)
    clients = np.arange(federation.num_clients)
    table = tmp_path / "devices.csv"
    table.write_text("client_id,macs_per_s,down_bps,up_bps\n" + "".join(
        f"{client},{1e15 if client % 2 == 0 else 1.0},1e15,1e15\n" for client in clients))
    config = RunConfig(method="fedavg", out=str(tmp_path / "run"), rounds=4, seed=5, devices=str(table),
                       deadline=1.0, client_lr=0.1, batch_size=8, local_epochs=2,
                       **{**COMMON, "eval_every": 4})
    completed = run(config)
    schedule = list(sampling.schedule(federation.num_clients, 5, True, 5, 4, past_coverage=True))
    expected = [row[row % 2 == 0] for row in schedule]
    assert [row.tolist() for row in completed.rounds] == [row.tolist() for row in expected]
    head = Classifier(**random_head(federation.dim, federation.num_classes, seed=5))
    reference = fedavg_by_autograd(federation, expected, LocalSGD(lr=0.1, batch_size=8, epochs=2), 5, head,
                                   server_lr=1.0)
    torch.testing.assert_close(torch.from_numpy(completed.arrays["W"]), reference.weight.to(torch.float32),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(completed.arrays["bias"]), reference.bias.to(torch.float32),
                               rtol=0, atol=1e-6)
    per_round = pq.read_table(tmp_path / "run" / "rounds.parquet").to_pylist()
    assert [(row["selected"], row["finished"], row["stragglers"]) for row in per_round] == \
        [(5, int((row % 2 == 0).sum()), int((row % 2 == 1).sum())) for row in schedule]
    late = [row for row in schedule if (row % 2 == 1).any()]
    assert all(row["end_s"] - row["start_s"] == 1.0 for row, drawn in zip(per_round, schedule) if (drawn % 2).any())
    assert late and completed.rows[-1]["clients_straggled"] == sum(int((row % 2 == 1).sum()) for row in schedule)
    # a straggler downloaded the model too: the rows count every selected client's download, as rounds.parquet does
    model_bytes = (federation.dim + 1) * federation.num_classes * 4
    assert [row["bytes_down"] for row in per_round] == [5 * model_bytes] * 4
    assert completed.rows[-1]["bytes_down"] == sum(row["bytes_down"] for row in per_round) == 20 * model_bytes


def test_rows_every_s_virtual_seconds_are_the_first_rounds_ending_at_or_after_each_multiple(ray_session, tmp_path):
    every = 5e-4  # a tenth of a fed3r round's on the uniform device, a third of a FedAvg round's
    for path in ("fed3r", "fedavg"):
        out = tmp_path / path
        completed = run(RunConfig(out=str(out), eval_every_s=every, **COMMON, **PATHS[path]))
        ends = [row["end_s"] for row in pq.read_table(out / "rounds.parquet").to_pylist()]
        expected = {next(number for number, end in enumerate(ends, start=1) if end >= k * every)
                    for k in range(1, int(ends[-1] / every) + 1)} | {len(ends)}
        if path == "fedavg":
            expected |= {0}
        assert [row["round"] for row in completed.rows] == sorted(expected)
        assert len(expected) > 2
        assert [row["clock_s"] for row in completed.rows] == [0.0 if number == 0 else ends[number - 1]
                                                              for number in sorted(expected)]


def test_bad_clock_options_are_refused_in_one_line_before_any_work(tmp_path):
    plugin = tmp_path / "not_a_selector.py"
    plugin.write_text("class Picky:\n    pass\n")
    bad = [({"over_commit": 0.5}, r"^--over-commit must be a finite number ≥ 1, got 0.5$"),
           ({"deadline": 1e-12}, r"^--deadline 1e-12: no device can meet it"),
           ({"availability": "markov:1,1000"}, r"^--availability markov:1,1000 keeps .* a round of 5 fills at fewer"),
           ({"selector": f"{plugin}:Picky"}, r"Picky is not a subclass of fedray.Selector$"),
           ({"eval_every_s": -1.0}, r"^--eval-every-s must be a finite number of seconds > 0, got -1.0$")]
    for given, message in bad:
        out = tmp_path / "out"
        with pytest.raises(FedrayError, match=message) as refused:
            run(RunConfig(method="fed3r", out=str(out), **COMMON, **given))
        assert "\n" not in str(refused.value)
        assert not out.exists()


def test_partial_stragglers_send_the_steps_they_finished_by_the_deadline(ray_session, tmp_path):
    """Odd clients compute at a rate that finishes a few of their local steps by the deadline (a small one may finish
    all): with ``--stragglers partial`` every selected client's upload is kept (the late ones' partial work, FedNova's
    setting), with ``drop`` the late ones' are lost, and the partial run's head is neither the dropping run's nor the
    unhurried one's."""
    federation = load_federation(TINY)
    table = tmp_path / "devices.csv"
    table.write_text("client_id,macs_per_s,down_bps,up_bps\n" + "".join(
        f"{client},{1e15 if client % 2 == 0 else 8e3},1e15,1e15\n" for client in range(federation.num_clients)))
    common = {**COMMON, "method": "fednova", "rounds": 3, "seed": 5, "devices": str(table), "local_epochs": 2,
              "batch_size": 4, "eval_every": 3}
    runs = {policy: run(RunConfig(out=str(tmp_path / policy), deadline=1.0, stragglers=policy, **common))
            for policy in ("partial", "drop")}
    unhurried = run(RunConfig(out=str(tmp_path / "unhurried"), **common))
    partial = pq.read_table(tmp_path / "partial" / "rounds.parquet").to_pylist()
    dropped = pq.read_table(tmp_path / "drop" / "rounds.parquet").to_pylist()
    assert [row["finished"] for row in partial] == [5, 5, 5]
    assert [row["stragglers"] for row in partial] == [row["stragglers"] for row in dropped]
    assert [row["finished"] for row in dropped] == [5 - row["stragglers"] for row in dropped]
    assert sum(row["stragglers"] for row in dropped) > 0
    heads = [completed.arrays["W"] for completed in (runs["partial"], runs["drop"], unhurried)]
    assert not np.array_equal(heads[0], heads[1]) and not np.array_equal(heads[0], heads[2])


def heard_once_each(rounds) -> list[int]:
    return sorted(np.concatenate(list(rounds)).tolist())


@pytest.mark.parametrize(("method", "availability"), [("fedncm", "diurnal:86400,0.3"), ("fed3r", "markov:3600,1800")])
def test_a_closed_form_under_availability_hears_every_client_and_solves_the_run_without_a_clock(ray_session, tmp_path,
                                                                                                method, availability):
    """Its ⌈46 / 5⌉ = 10 scheduled rounds find some clients offline at their turn: it asks only clients not heard yet,
    waits for them to come online, and goes on after the schedule until it has heard all 46, each once."""
    plain = run(RunConfig(method=method, out=str(tmp_path / "plain"), **COMMON))
    clocked = run(RunConfig(method=method, out=str(tmp_path / "clocked"), devices="phones", availability=availability,
                            **COMMON))
    num_clients = load_federation(TINY).num_clients
    assert heard_once_each(clocked.rounds) == list(range(num_clients)) == heard_once_each(plain.rounds)
    assert clocked.rows[-1]["clients_seen"] == plain.rows[-1]["clients_seen"] == num_clients
    per_round = pq.read_table(tmp_path / "clocked" / "rounds.parquet").to_pylist()
    assert [row["round"] for row in per_round] == list(range(1, len(clocked.rounds) + 1))
    assert len(per_round) > len(plain.rounds) == 10
    assert any(later["start_s"] > earlier["end_s"] for earlier, later in zip(per_round, per_round[1:]))  # a wait
    assert clocked.rows[-1]["round"] == len(per_round) and clocked.rows[-1]["clock_s"] == per_round[-1]["end_s"]
    # the same clients' statistics, summed in other blocks and orders: FedNCM's class sums of float32 features in
    # float64 need fewer than 53 bits here, so they are exact in any order; Fed3R's Gram matrix rounds differently
    tolerance = 0.0 if method == "fedncm" else 1e-12
    for name, array in plain.arrays.items():
        assert np.allclose(array, clocked.arrays[name], rtol=0, atol=tolerance), name


def test_fed3r_then_fedavg_hears_every_client_in_its_first_stage_and_trains_after_it(ray_session, tmp_path):
    clocked = run(RunConfig(method="fedavg", init="fed3r", rounds=2, out=str(tmp_path / "clocked"), devices="phones",
                            availability="diurnal:86400,0.3", **COMMON))
    first = [row for row in clocked.rows if row["stage"] == "closed_form"]
    per_round = pq.read_table(tmp_path / "clocked" / "rounds.parquet").to_pylist()
    closed_form = [row for row in per_round if row["stage"] == "closed_form"]
    assert first[-1]["clients_seen"] == load_federation(TINY).num_clients
    assert first[-1]["round"] == len(closed_form) and first[-1]["clock_s"] == closed_form[-1]["end_s"]
    assert [row["round"] for row in per_round] == list(range(1, len(closed_form) + 3))
    assert [row["stage"] for row in per_round[len(closed_form):]] == ["train", "train"]
    assert clocked.rows[-1]["round"] == len(closed_form) + 2 and len(clocked.rounds) == len(per_round)


def test_a_calibration_of_three_clients_lasts_its_slowest_clients_pass_and_upload(ray_session, tmp_path):
    """One FedAvg round of all three clients, then ``--calibrate fedncm``, every client on the uniform device: a client
    computes its class sums (n_k·d FLOPs, n_k·d / 2 multiply-adds) at 1,305,366,530 multiply-adds/s and uploads its
    M_k means of d float32s at 26,037,371 bit/s; it downloads nothing. The calibration's round starts when training's
    ends and lasts as long as its slowest client."""
    dataset = "synthetic:inat-geo-100?clients=3&dim=8&classes=4&seed=2"
    sizes, classes_held, dim = [8, 23, 60], [1, 2, 3], 8  # the federation's, checked below
    federation = load_federation(dataset)
    assert federation.client_sizes.tolist() == sizes and federation.client_num_classes.tolist() == classes_held
    completed = run(RunConfig(method="fedavg", dataset=dataset, out=str(tmp_path / "run"), rounds=1, eval_every=1,
                              clients_per_round=3, calibrate="fedncm", devices="uniform", num_shards=1,
                              cpus_per_shard=0.5, quiet=True))
    compute = [n * dim / 2 / 1305366530 for n in sizes]
    upload = [m * dim * 4 * 8 / 26037371 for m in classes_held]
    slowest = max(range(3), key=lambda k: compute[k] + upload[k])
    train, calibration = pq.read_table(tmp_path / "run" / "rounds.parquet").to_pylist()
    assert (calibration["round"], calibration["stage"], calibration["selected"], calibration["finished"]) == \
        (2, "calibrated", 3, 3)
    assert (calibration["bytes_up"], calibration["bytes_down"]) == (sum(classes_held) * dim * 4, 0.0)
    assert calibration["start_s"] == train["end_s"] > 0
    assert calibration["end_s"] - calibration["start_s"] == pytest.approx(compute[slowest] + upload[slowest], rel=1e-12)
    rows = completed.rows
    assert [(row["round"], row["stage"]) for row in rows] == [(0, "train"), (1, "train"), (2, "calibrated")]
    assert [row["clock_s"] for row in rows] == [0.0, train["end_s"], calibration["end_s"]]
    assert rows[2]["clock_compute_s"] - rows[1]["clock_compute_s"] == pytest.approx(compute[slowest], rel=1e-12)
    assert rows[2]["clock_comm_s"] - rows[1]["clock_comm_s"] == pytest.approx(upload[slowest], rel=1e-12)


class Recorder(fedray.Postprocessor):
    """Writes to ``log`` (JSON lines) the closed form's upload groups it is told before the run, and the round and
    size of each aggregate it then sees; changes nothing."""

    def __init__(self, log: Annotated[str, "the file it writes to"] = "") -> None:
        super().__init__()
        self.log = log

    def write(self, entry: list) -> None:
        with open(self.log, "a") as log:
            log.write(json.dumps(entry) + "\n")

    def start(self, stages):
        for told in stages:
            self.write(["told", told.group, told.smallest_group])

    def aggregate(self, total, context):
        self.write(["aggregate", context.round, context.clients])
        return total


def test_evaluation_points_in_virtual_seconds_make_the_upload_groups_the_postprocessors_are_told(ray_session,
                                                                                               tmp_path):
    """Fed3R with DP's central noise and evaluation every 0.5 ms of virtual time: the rounds evaluated are uneven, each
    evaluation block's uploads are summed and noised once (one aggregate a row), and the postprocessors are told the
    largest and smallest of those blocks before the run, not κ·--eval-every."""
    log = tmp_path / "log.jsonl"
    completed = run(RunConfig(method="fed3r", out=str(tmp_path / "run"), eval_every_s=5e-4,
                              postprocessor=f"{__name__}:Recorder", options={"log": str(log)}, clip_norm=10.0,
                              dp_noise=1.0, dp_delta=1e-5, **COMMON))
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    per_round = pq.read_table(tmp_path / "run" / "rounds.parquet").to_pylist()
    evaluated = [row["round"] for row in completed.rows]
    assert len(set(np.diff(evaluated))) > 1, "uneven evaluation points"
    blocks = [sum(row["finished"] for row in per_round if start < row["round"] <= end)  # each client uploads once
              for start, end in zip([0, *evaluated], evaluated)]
    aggregates = [entry[1:] for entry in entries if entry[0] == "aggregate"]
    assert aggregates == [[number, size] for number, size in zip(evaluated, blocks)]
    assert all(row["dp_noise"] == 1.0 and row["dp_epsilon"] > 0 for row in completed.rows)
    assert [entry[1:] for entry in entries if entry[0] == "told"] == [[max(blocks), min(blocks)]]
    assert [max(blocks), min(blocks)] != [COMMON["clients_per_round"] * COMMON["eval_every"], 6]  # --eval-every's


def test_a_calibration_and_the_ridge_probe_under_availability_hear_every_client_after_training(ray_session, tmp_path):
    """SphereFed with the ridge probe on diurnal availability: the calibration's round finds some of the 46 clients
    offline, so the hearing loop asks them again in rounds numbered on until each upload has arrived once; the
    ``calibrated`` row is its last round's, and the probe's rounds come after it, hearing every client too."""
    path = PATHS["spherefed"]
    completed = run(RunConfig(out=str(tmp_path / "run"), devices="phones", availability="diurnal:86400,0.3",
                              **COMMON, **path))
    num_clients = load_federation(TINY).num_clients
    per_round = pq.read_table(tmp_path / "run" / "rounds.parquet").to_pylist()
    assert [row["round"] for row in per_round] == list(range(1, len(per_round) + 1))
    calibrated = [row for row in per_round if row["stage"] == "calibrated"]
    probe = [row for row in per_round if row["stage"] == "ridge_probe"]
    assert per_round[-len(calibrated) - len(probe):] == calibrated + probe and len(calibrated) > 1 and len(probe) > 1
    for rounds in (calibrated, probe):
        assert rounds[0]["selected"] < num_clients and sum(row["finished"] for row in rounds) == num_clients
    row = completed.rows[-1]
    assert (row["stage"], row["round"], row["clock_s"]) == ("calibrated", calibrated[-1]["round"],
                                                           calibrated[-1]["end_s"])
    assert len(completed.rounds) == row["round"]
    assert sorted(np.concatenate(completed.rounds[-len(calibrated):]).tolist()) == list(range(num_clients))
