"""A researcher's callbacks: on_start, on_evaluation, after_round (True stops the run at its next evaluation row, a
complete run) and on_end, on every stage, with the rounds numbered as the rows are."""

import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

import fedray
from fedray.core.errors import FedrayError

DATASET = "synthetic:inat-geo-100?dim=8&scale=0.2&classes=6"
SMALL = {"dataset": DATASET, "clients_per_round": 4, "num_shards": 1, "cpus_per_shard": 0.5, "quiet": True}
TRAIN = {**SMALL, "client_lr": 0.05}


class Log(fedray.Callback):
    """Records every call; stops after round ``stop_after`` (None: never)."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after, self.calls = stop_after, []

    def on_start(self, config):
        self.calls.append(("start", config["method"]))

    def on_stage(self, stage, name, rounds, done):
        self.calls.append(("stage", stage, name, rounds, done))

    def on_evaluation(self, row, classifier):
        self.calls.append(("row", row["round"], row["stage"], classifier is not None))

    def after_round(self, round, stage):
        self.calls.append(("round", round, stage))
        return self.stop_after is not None and round >= self.stop_after

    def on_end(self, rows):
        self.calls.append(("end", len(rows)))


def test_every_hook_is_called_in_order_on_a_training_run(ray_session, tmp_path):
    log = Log()
    fedray.run(method="fedavg", out=tmp_path / "run", rounds=3, eval_every=2, callbacks=[log], **TRAIN)
    assert log.calls == [("start", "fedavg"), ("stage", "train", "fedavg", range(1, 4), 0), ("row", 0, "train", True), ("round", 1, "train"), ("row", 2, "train", True),
                         ("round", 2, "train"), ("row", 3, "train", True), ("round", 3, "train"), ("end", 3)]
    assert "stopped_early" not in pl.read_parquet(tmp_path / "run" / "metrics.parquet").columns


def test_a_callback_stops_training_at_the_next_evaluation_row_as_a_complete_run(ray_session, tmp_path):
    full = fedray.run(method="fedavg", out=tmp_path / "full", rounds=6, eval_every=2, **TRAIN)
    log = Log(stop_after=3)
    stopped = fedray.run(method="fedavg", out=tmp_path / "stopped", rounds=6, eval_every=2, callbacks=[log], **TRAIN)
    rows = stopped.metrics
    assert rows["round"].to_list() == [0, 2, 4]               # asked after round 3: stopped at the row of round 4
    assert rows["stopped_early"].to_list() == [False, False, True]
    assert [call for call in log.calls if call[0] == "round"][-1] == ("round", 4, "train")
    kept = ["round", "accuracy", "bytes_up", "train_loss", "clients_seen"]
    assert rows.select(kept).rows() == full.metrics.filter(pl.col("round") <= 4).select(kept).rows()
    assert len(stopped.rounds) == 4 and all(np.array_equal(a, b) for a, b in zip(stopped.rounds, full.rounds))
    assert not (Path(tmp_path / "stopped") / "checkpoint.pt").exists()
    assert stopped.classifier.weight.shape == full.classifier.weight.shape


def test_a_stop_in_the_closed_form_stage_ends_a_two_stage_run_there(ray_session, tmp_path):
    log = Log(stop_after=1)
    result = fedray.run(method="fedavg", init="fed3r", init_rounds=4, out=tmp_path / "two", rounds=3, eval_every=2,
                        callbacks=[log], **TRAIN)
    assert result.metrics.select("round", "stage").rows() == [(2, "closed_form")]
    assert [call for call in log.calls if call[0] == "round"] == [("round", 1, "closed_form"), ("round", 2, "closed_form")]
    assert result.metrics["stopped_early"].to_list() == [True] and len(result.rounds) == 2


def test_after_round_numbers_the_rounds_of_both_stages_as_the_rows_do(ray_session, tmp_path):
    log = Log()
    fedray.run(method="fedavg", init="fed3r", init_rounds=2, out=tmp_path / "two", rounds=2, eval_every=2,
               callbacks=[log], **TRAIN)
    assert [call[1:] for call in log.calls if call[0] == "round"] == \
        [(1, "closed_form"), (2, "closed_form"), (3, "train"), (4, "train")]
    assert [call[1:] for call in log.calls if call[0] == "stage"] == \
        [("closed_form", "fed3r", range(1, 3), 0), ("train", "fedavg", range(3, 5), 0)]


def test_a_closed_form_run_stops_too(ray_session, tmp_path):
    result = fedray.run(method="fedncm", out=tmp_path / "ncm", rounds=9, eval_every=3, callbacks=[Log(stop_after=4)],
                        **SMALL)
    assert result.metrics["round"].to_list() == [3, 6] and result.metrics["stopped_early"].to_list() == [False, True]
    assert len(result.rounds) == 6


class Scores(fedray.Callback):
    """A researcher's metrics as columns: a number from the classifier at every row, a label from round 2 on."""

    def on_evaluation(self, row, classifier):
        columns = {"weight_norm": float(classifier.weight.double().norm())}
        if row["round"] >= 2:
            columns["phase"] = "late" if row["round"] >= 4 else "early"
        return columns


def test_a_callbacks_columns_land_in_the_rows_and_metrics_parquet(ray_session, tmp_path):
    heard = []
    result = fedray.run(method="fedavg", out=tmp_path / "run", rounds=4, eval_every=2, callbacks=[Scores()],
                        on_evaluation=lambda row, classifier: heard.append(
                            (row["weight_norm"], row.get("phase"), float(classifier.weight.double().norm()))),
                        **TRAIN)
    rows = pl.read_parquet(tmp_path / "run" / "metrics.parquet")
    assert rows["phase"].to_list() == [None, "early", "late"]
    assert rows["weight_norm"].to_list() == [norm for norm, _, norm in heard]  # the norm of each row's head
    assert [phase for _, phase, _ in heard] == [None, "early", "late"]
    assert result.metrics.equals(rows)


class Returns(fedray.Callback):
    def __init__(self, *returned):
        self.returned = list(returned)

    def on_evaluation(self, row, classifier):
        return self.returned.pop(0)


@pytest.mark.parametrize("returned, error", [
    (([1.0],), r"at round 0 returned \[1.0\]; expected None or a dict of columns \{name: number or string\}$"),
    (({"accuracy": 0.5},), r"at round 0 returned a column named 'accuracy': a column of the run already; name it "
                           r"otherwise$"),
    (({"seed": 0.5},), r"at round 0 returned a column named 'seed': a column of the run already"),
    (({"lam": 0.5},), r"at round 0 returned a column named 'lam': a column of the run already"),
    (({"f1": float("nan")},), r"at round 0 returned f1: nan; expected a number \(not NaN; ±inf is one, as a DP run's ε = ∞ without "
                                r"noise\) or a one-line string$"),
    (({"f1": True},), r"at round 0 returned f1: True; expected a number"),
    (({"note": "x" * 201},), r"at round 0 returned note: a 201-character string; a string column holds one line of "
                             r"at most 200 characters$"),
    (({"note": "a\nb"},), r"at round 0 returned note: a 3-character string of several lines"),
    (({"f1": 0.5}, {"f1": "high"}), r"at round 2 returned f1='high', a string, where earlier rows had a number: a "
                                    r"column holds one kind$"),
])
def test_a_callbacks_columns_are_checked_in_one_line_naming_it_and_the_row(returned, error):
    from fedray.core.results import EvalPoint
    from fedray.engine.callbacks import Callbacks

    callbacks = Callbacks((Returns(*returned),))
    callbacks.start({"method": "fedavg", "seed": 0, "options": {"lam": 0.1}})
    with pytest.raises(FedrayError, match=rf"^Returns.on_evaluation {error}"):
        for number in range(len(returned)):
            callbacks.evaluation(EvalPoint(number * 2, 4, 40, 0.5, 1.0, 1.0, 1.0, 0.1, "train"), None)


def test_inf_is_a_number_a_callback_may_return():
    from fedray.core.results import EvalPoint
    from fedray.engine.callbacks import Callbacks

    point = EvalPoint(2, 4, 40, 0.5, 1.0, 1.0, 1.0, 0.1, "train")
    Callbacks((Returns({"loss_bound": float("inf"), "n": 3}),)).evaluation(point, None)
    assert point.callback_columns == {"loss_bound": float("inf"), "n": 3.0}
    assert point.columns()["n"] == 3.0


def test_callbacks_must_be_callback_instances(tmp_path):
    with pytest.raises(FedrayError, match=r"^fedray.run: callbacks must be a list of fedray.Callback instances, got"):
        fedray.run(method="fedavg", out=tmp_path / "bad", callbacks=[print])
    assert not (tmp_path / "bad").exists()


def test_the_progress_bar_is_a_callback_over_each_stages_rounds(ray_session, tmp_path, capsys):
    """``fedray run``'s bar: one per stage, named by what it runs, its last state the stage's last row."""
    fedray.run(method="fedavg", init="fed3r", init_rounds=2, out=tmp_path / "two", rounds=4, eval_every=2,
               **{**TRAIN, "quiet": False})
    states = [state for line in capsys.readouterr().err.splitlines() for state in line.split("\r") if "round" in state]
    last = {state.partition(":")[0]: state for state in states}  # each bar's last state
    assert list(last) == ["fed3r", "fedavg"], states
    bars = list(last.values())
    assert bars[0].startswith("fed3r: 100%") and "2/2" in bars[0] and bars[0].endswith(
        "at round 2: test accuracy " + bars[0].rpartition("test accuracy ")[2])
    assert bars[1].startswith("fedavg: 100%") and "4/4" in bars[1] and "at round 6:" in bars[1]


def test_a_quiet_run_has_no_bar_and_a_resumed_stage_starts_at_its_done_rounds(capsys):
    from fedray.engine.callbacks import Callbacks, ProgressBar

    assert Callbacks.of_run(None, quiet=True).callbacks == ()
    bar = ProgressBar()
    bar.on_stage("train", "fedavg", range(11, 21), done=4)
    bar.on_evaluation({"round": 14, "accuracy": 0.125, "clients_seen": 7}, None)
    bar.after_round(15, "train")
    assert bar.bar.n == 5
    bar.on_stage_end("train")
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.startswith("fedavg:  50%") and last.endswith(", at round 14: test accuracy 0.1250, 7 clients seen]\n")


def test_a_finished_stage_draws_its_full_bar_once(capsys):
    """A log (``ray job logs``, a file) keeps every drawing of the bar: the last evaluation's (at 927/928, shown as
    100 %), the last round's and the closing one were three."""
    from fedray.engine.callbacks import ProgressBar

    bar = ProgressBar()
    bar.on_stage("train", "fedavg", range(1, 4), done=0)
    for round in range(1, 4):  # as a run calls them: a round's evaluation, then its end
        bar.on_evaluation({"round": round, "accuracy": 0.5, "clients_seen": round}, None)
        time.sleep(0.15)  # past tqdm's minimum interval: each update may draw
        bar.after_round(round, "train")
    bar.on_stage_end("train")
    drawings = capsys.readouterr().err.split("\r")
    assert [drawing for drawing in drawings if "100%" in drawing] == [drawings[-1]]
    assert drawings[-1].startswith("fedavg: 100%") and "3/3" in drawings[-1]


def test_checkpoints_are_a_callback_saving_every_kth_training_round_but_not_after_the_last():
    from fedray.engine.callbacks import Checkpoints

    heard: list[int] = []
    current = [0]
    checkpoints = Checkpoints(2, range(4, 11), lambda: heard.append(current[0]))  # 7 training rounds after 3 others
    for number, stage in [(1, "closed_form"), (2, "closed_form"), (3, "closed_form"), *((r, "train") for r in range(4, 11))]:
        current[0] = number
        checkpoints.after_round(number, stage)
    assert heard == [5, 7, 9], "the 2nd, 4th and 6th training rounds; the 7th is the last: the results are written"
    heard.clear()
    last = Checkpoints(3, range(1, 7), lambda: heard.append(current[0]))
    for number in range(1, 7):
        current[0] = number
        last.after_round(number, "train")
    assert heard == [3]


def test_a_stage_is_opened_inside_the_loop_and_closed_however_it_ends():
    """``on_stage`` comes from the round loop, inside the part that ends with ``on_stage_end``: an interrupt between
    preparing a stage and its first round leaves no bar open to print after the stop's last line (CI saw the bar's
    last state after ``fedray: stopped by SIGTERM``)."""
    from fedray.engine.callbacks import Callbacks
    from fedray.engine.round_loop import run_rounds

    class Ends(Log):
        def on_stage_end(self, stage):
            self.calls.append(("stage end", stage))

    class Interrupted:
        def point(self, number, diverged=False):
            raise KeyboardInterrupt

    log = Ends()
    loop = Callbacks((log,)).loop("train", "fedavg", 3, first_round=2)
    assert log.calls == [], "preparing a stage opens nothing"
    with pytest.raises(KeyboardInterrupt):
        run_rounds(Interrupted(), [np.arange(2)] * 3, {0, 3}, [loop])
    assert log.calls == [("stage", "train", "fedavg", range(3, 6), 0), ("stage end", "train")]
