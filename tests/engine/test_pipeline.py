"""The plan runs itself: the engine runs a plan's stages in order, each after what the one before it left, and looks
at none of them; a kind of stage the engine has never seen is one class."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, replace

import numpy as np
import pyarrow.parquet as pq
import pytest

import fedray.engine.pipeline
import fedray.engine.run_config
from fedray.core.results import EvalPoint
from fedray.engine.config import RunConfig
from fedray.engine.parts import Sampler, Shards
from fedray.engine.pipeline import RunPlan, Stage, StageContext, StageResult, footprints, run_stages
from fedray.engine.plan import stages
from fedray.methods.postprocessor import Postprocessing, Sampling, StageUploads
from fedray.runtime.footprint import Footprint

DATASET = "synthetic:inat-geo-100?dim=12&scale=0.2&classes=10"
"""721 clients."""


@dataclass(frozen=True)
class Echo(Stage):
    """A stage the engine has never seen: one more row after the last, what it was handed in its arrays."""

    told: tuple[StageUploads, ...] = ()
    estimated: tuple[Footprint, ...] | None = ()

    def run(self, context: StageContext, previous: StageResult) -> StageResult:
        last = previous.points[-1]
        row = replace(last, round=last.round + 1, stage="echo")
        context.on_point(row, None)
        handed = {"handed_round": np.array([previous.round]), "handed_rows": np.array([len(previous.points)])}
        return replace(previous, points=[*previous.points, row], arrays={**previous.arrays, **handed},
                       last_columns={**previous.last_columns, "ridge_probe_accuracy": 0.25})

    def uploads(self, run: RunPlan) -> tuple[StageUploads, ...]:
        return self.told

    def footprints(self, run, federation) -> tuple[Footprint, ...] | None:
        return self.estimated


def test_the_runner_and_the_run_dispatch_on_no_kind_of_stage():
    for function in (run_stages, fedray.engine.run_config.run_started, fedray.engine.pipeline.footprints,
                     RunPlan.stage_uploads, RunPlan.checkpoint_shape):
        calls = [node.func.id for node in ast.walk(ast.parse(inspect.getsource(function).strip()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
        assert "isinstance" not in calls and "type" not in calls, function.__qualname__


def test_stages_run_in_order_each_after_the_one_before():
    heard = []

    @dataclass(frozen=True)
    class Count(Stage):
        name: str

        def run(self, context, previous):
            heard.append((self.name, len(previous.points), previous.round))
            return replace(previous, points=[*previous.points, replace(start, round=previous.round + 2)])

    start = EvalPoint(0, 0, 0, 0.5, 0.0, 0.0, 0.0, 0.0)
    result = run_stages((Count("a"), Count("b"), Count("c")), context=None)
    assert heard == [("a", 0, 0), ("b", 1, 2), ("c", 2, 4)]
    assert [point.round for point in result.points] == [2, 4, 6]


def test_a_plan_is_told_and_estimated_stage_by_stage():
    sampler = Sampler(10, 5, False, 0)
    told, other = (StageUploads(name, False, Sampling(10, 10, False), 1, 10, 10) for name in ("echo", "other"))
    first, second = Echo(told=(told,), estimated=("a",)), Echo(told=(other, told), estimated=("b", "c"))
    run = RunPlan(None, {}, 0, 1, True, None, sampler, Postprocessing(), Shards(1, 1.0), (first, second))
    assert run.stage_uploads() == (told, other, told)
    assert run.checkpoint_shape(None) is None, "no stage writes a checkpoint"
    assert footprints(run, None) == ["a", "b", "c"]
    assert footprints(replace(run, stages=(first, Echo(estimated=None))), None) == [], "a stage not estimated"

    class Unasked(Echo):
        def footprints(self, run, federation):
            raise AssertionError("a stage after one not estimated runs on what it leaves (images: no features)")

    assert footprints(replace(run, stages=(first, Echo(estimated=None), Unasked())), None) == []
    assert run.rounds(3) is run.rounds(3), "drawn once"


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_new_kind_of_stage_runs_through_the_engine_after_a_closed_form(ray_session, tmp_path, monkeypatch):
    told = StageUploads("echo", False, Sampling(721, 721, False), 1, 721, 721)
    monkeypatch.setattr(fedray.engine.run_config, "stages", lambda config: (*stages(config), Echo(told=(told,))))
    heard = []
    config = RunConfig(method="fed3r", dataset=DATASET, out=str(tmp_path / "echo"), clients_per_round=100,
                       eval_every=4, num_shards=2, cpus_per_shard=0.5, quiet=True)
    completed = fedray.engine.run_config.run(config, on_point=lambda point, classifier: heard.append(point.stage))
    rows = pq.read_table(tmp_path / "echo" / "metrics.parquet").to_pylist()
    assert [row["round"] for row in rows] == [4, 8, 9] and [row["stage"] for row in rows] == [
        "closed_form", "closed_form", "echo"]
    assert heard == ["closed_form", "closed_form", "echo"]
    assert rows[-1]["ridge_probe_accuracy"] == 0.25 and rows[0]["ridge_probe_accuracy"] is None
    with np.load(tmp_path / "echo" / "classifier.npz") as arrays:
        assert arrays["handed_round"].tolist() == [8] and arrays["handed_rows"].tolist() == [2]
        assert arrays["W"].shape == (12, 10)
    assert completed.rows == rows and len(completed.rounds) == 8
