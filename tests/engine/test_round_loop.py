"""The one round loop: which rows, checkpoints and stops it produces, on a path that only records its calls."""

import numpy as np
import pytest
import torch

from fedray.methods.base import Classifier
from fedray.core.results import EvalPoint
from fedray.engine.round_loop import Callback, EvalRounds, Report, run_rounds


class RecordingPath:
    """Runs nothing; logs ``round N`` and ``point N`` calls; diverges at round ``diverge_at``."""

    def __init__(self, diverge_at: int | None = None) -> None:
        self.calls: list[str] = []
        self.diverge_at = diverge_at

    def run_round(self, number: int, clients: np.ndarray) -> bool:
        self.calls.append(f"round {number} {clients.tolist()}")
        return number != self.diverge_at

    def point(self, number: int, diverged: bool = False) -> EvalPoint:
        self.calls.append(f"point {number}")
        return EvalPoint(number, 0, 0, float("nan") if diverged else number / 10, 0.0, 0.0, 0.0, 0.0,
                         diverged=diverged)


class AfterRounds(Callback):
    def __init__(self) -> None:
        self.numbers: list[int] = []

    def after_round(self, number: int) -> None:
        self.numbers.append(number)


ROUNDS = [np.array([number, number + 10]) for number in range(1, 8)]


def test_eval_rounds_are_every_kth_the_last_and_optionally_the_start():
    def evaluated(*args, **initial):
        return [number for number in range(-1, 10) if number in EvalRounds(*args, **initial)]

    assert evaluated(7, 3) == [3, 6, 7]
    assert evaluated(7, 3, initial=True) == [0, 3, 6, 7]
    assert evaluated(7, 100) == [7]
    assert evaluated(0, 3) == [0], "a schedule of no rounds has its row 0"
    assert 10**18 in EvalRounds(10**18, 10**6) and 10**18 - 1 not in EvalRounds(10**18, 10**6)


def test_rows_at_the_start_every_kth_round_and_the_last_in_order():
    path, points, after = RecordingPath(), [], AfterRounds()
    diverged = run_rounds(path, ROUNDS, {0, 3, 6, 7}, [Report(points), after])
    assert not diverged
    assert [p.round for p in points] == [0, 3, 6, 7]
    assert after.numbers == [1, 2, 3, 4, 5, 6, 7]
    assert path.calls[:5] == ["point 0", "round 1 [1, 11]", "round 2 [2, 12]", "round 3 [3, 13]", "point 3"]


def test_a_diverged_round_gives_one_marked_row_and_stops():
    path, points, after = RecordingPath(diverge_at=5), [], AfterRounds()
    assert run_rounds(path, ROUNDS, {3, 6, 7}, [Report(points), after])
    assert [(p.round, p.diverged) for p in points] == [(3, False), (5, True)]
    assert np.isnan(points[-1].accuracy)
    assert after.numbers == [1, 2, 3, 4]
    assert path.calls[-1] == "point 5"


def test_resuming_after_round_4_runs_rounds_5_to_7_without_an_initial_row():
    path, points = RecordingPath(), []
    run_rounds(path, ROUNDS, {0, 3, 6, 7}, [Report(points)], done=4)
    assert [p.round for p in points] == [6, 7]
    assert path.calls[0] == "round 5 [5, 15]"


def test_report_forwards_every_row_to_its_listener_with_the_classifier_evaluated_there():
    heard, points, path = [], [], RecordingPath()
    classifier = lambda: Classifier(torch.tensor([[float(len(path.calls))]]))  # noqa: E731: the calls so far, as a weight
    run_rounds(path, ROUNDS, {2, 7}, [Report(points, lambda point, head: heard.append((point, head)), classifier)])
    assert [point for point, _ in heard] == points and [p.round for p in points] == [2, 7]
    assert [head.weight.item() for _, head in heard] == [3.0, 9.0]  # asked right after "point 2" (call 3), "point 7" (call 9)


class Closing(Callback):
    closed = 0

    def close(self) -> None:
        self.closed += 1


class FailingPath(RecordingPath):
    def run_round(self, number: int, clients: np.ndarray) -> bool:
        if number == 3:
            raise KeyboardInterrupt
        return super().run_round(number, clients)


def test_callbacks_are_closed_once_however_the_loop_ends():
    for path, ends in ((RecordingPath(), None), (RecordingPath(diverge_at=2), None), (FailingPath(), KeyboardInterrupt)):
        closing = Closing()
        if ends is None:
            run_rounds(path, ROUNDS, {7}, [closing])
        else:
            with pytest.raises(ends):
                run_rounds(path, ROUNDS, {7}, [closing])
        assert closing.closed == 1
