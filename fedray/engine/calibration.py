"""The closed forms after training, on the features at the trained parameters: a calibration and the ridge probe.

A calibration replaces the classifier. SphereFed's: clients send ZᵀZ and ZᵀY
once, Z = normalize(P x + q) of their samples; the server's ridge solution
replaces the fixed classifier. It runs through the same shards as training
(the projection is part of the method's feature map), as one round with every
client; ``--calibrate METHOD`` runs any closed-form method the same way. The
ridge probe (``--probe-ridge``) measures the features: Fed3R from every client,
its accuracy in the last row's ``ridge_probe_accuracy``.

A calibration's uploads count in the rows as a round's: the clients whose
uploads reached the server (not a secure aggregation's dropouts:
:meth:`~fedray.Postprocessor.dropped`) in ``clients_seen``, ``samples_seen``
and ``bytes_up``, every client's computation in the FLOPs. The ridge probe
measures the features: its uploads count in no column.

On the run's clock each is a round of every client (:func:`~fedray.engine.clocked.clocked_everyone`), its task the
pass its accounting counts (the statistics' FLOPs / 2, SphereFed's projection included, and the upload) and its
postprocessors' protocol in an aggregate of every client, then as many rounds more as it takes to hear every client
(the closed forms' hearing loop: under availability or a deadline a client offline or lost is asked again): a
calibration's row is its last round's, with the clock's columns at its end; the ridge probe, which has no row of its
own, is rounds of rounds.parquet after the last row's (stage ``ridge_probe``). The stage still sums every client's
statistics, in its first round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from fedray.clock.run_clock import RunClock
from fedray.core.federation import Federation
from fedray.core.reports import reporting
from fedray.engine.closed_form import everyone_uploads
from fedray.engine.clocked import ClientTasks, ClockColumns, clocked_everyone
from fedray.engine.config import COLUMNS
from fedray.engine.parts import MethodSpec, uploads_of_everyone
from fedray.engine.pipeline import RunPlan, Stage, StageContext, StageResult
from fedray.runtime.evaluator import Evaluator
from fedray.methods.base import FLOAT_BYTES, Classifier, ClosedFormMethod
from fedray.methods.postprocessor import Postprocessing, StageUploads
from fedray.methods.sphere import ProjectedCalibration, SphereHead
from fedray.runtime.footprint import Footprint, largest_clients
from fedray.runtime.shards import ShardPool


def calibrate(pool: ShardPool, evaluator: Evaluator, method: ClosedFormMethod, postprocessing: Postprocessing,
              round_number: int) -> tuple[Classifier, float, np.ndarray]:
    """The classifier ``method`` solves from every client's upload (in round ``round_number``, through
    ``postprocessing``) on the pool's features, its test accuracy, and the clients whose uploads never reached the
    server."""
    statistics, dropped = everyone_uploads(pool, method, postprocessing, round_number)
    classifier = method.solve(statistics)
    return classifier, evaluator.accuracy(method, classifier), dropped


def _block(run: RunPlan, federation: Federation) -> int:
    """The samples of the largest block of an evaluation's clients: what a closed form's estimate holds at once."""
    return largest_clients(federation, run.sampler.per_round * run.eval_every)


@dataclass(frozen=True)
class Calibration(Stage):
    """A closed form after training, on the features at the trained parameters, whose classifier becomes the run's:
    SphereFed's FFC on the normalized projection (``sphere``), or ``--calibrate METHOD``. A diverged training is not
    calibrated."""

    method: MethodSpec
    sphere: SphereHead | None = None

    def uploads(self, run: RunPlan) -> tuple[StageUploads, ...]:
        return (uploads_of_everyone("calibration", run.sampler),)

    def footprints(self, run: RunPlan, federation: Federation) -> tuple[Footprint, ...]:
        if self.sphere is None:
            label, dim = f"{self.method.name} (--calibrate)", federation.dim
        else:
            label, dim = f"{self.method.name} (SphereFed's calibration)", self.sphere.width(federation.dim)
        return (self.method.footprint(label, federation, dim, _block(run, federation), run.shards.kept_budget),)

    def run(self, context: StageContext, previous: StageResult) -> StageResult:
        if previous.points[-1].diverged:
            return previous
        backend, params = previous.backend, previous.params
        classifier, method, rounds = previous.embeddings(params, lambda pool, evaluator: self._calibrated(
            pool, evaluator, previous, context, *backend.calibration_map(params)))
        sphere = {} if self.sphere is None else backend.sphere_arrays(params)
        return replace(previous, arrays={**classifier.arrays(), **method.arrays(), **sphere},
                       rounds=previous.rounds + rounds)

    def _calibrated(self, pool: ShardPool, evaluator: Evaluator, previous: StageResult, context: StageContext,
                    weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> tuple[Classifier, ClosedFormMethod, list[np.ndarray]]:
        """The calibration's closed form on the pool's features, one round with every client: SphereFed's FFC on
        normalize(P x + q) with a trained projection (``weight`` P, ``bias`` q), else the stage's method on the
        features (SphereFed's normalize(x) of the fine-tuned embeddings, ``--calibrate``'s method); a ``calibrated``
        row; returns the calibrated classifier, the method that maps features for it and the clients of its rounds
        (on the clock, those its hearing loop heard in each; its row is its last round's)."""
        start = time.perf_counter()
        points, accounting = previous.points, previous.accounting
        reported = dict(points[-1].reported)
        federation = pool.federation
        method = self.method.build(federation)
        if weight is not None:
            method = ProjectedCalibration.around(method, weight, bias)
        everyone = np.arange(federation.num_clients)
        clock, rounds = context.run.clock, [everyone]
        if clock is not None:
            rounds = [record.clients for record in clocked_everyone(
                clock, points[-1].round, "calibrated", ClientTasks.closed_form(method, federation),
                context.postprocessing)]
        with reporting(reported, COLUMNS):  # a postprocessor's aggregate of the calibration's uploads may report
            classifier, accuracy, dropped = calibrate(pool, evaluator, method, context.postprocessing,
                                                      points[-1].round + 1)
        received = np.setdiff1d(everyone, dropped)  # every client computed its upload; these reached the server
        sizes = federation.client_sizes.astype(np.float64)
        accounting.add(everyone, federation.client_sizes,
                       float(method.upload_floats(federation)[received].sum()) * FLOAT_BYTES, 0.0,
                       float(method.statistics_flops(sizes).sum()), received=received)
        last = points[-1]
        point = accounting.point(last.round + len(rounds), accuracy, last.wall_s + time.perf_counter() - start,
                                 "calibrated", reported=reported)
        if clock is not None:
            ClockColumns(clock).on_point(point)
        points.append(point)
        if context.on_point is not None:
            context.on_point(point, classifier)
        return classifier, method, rounds


@dataclass(frozen=True)
class Probe(Stage):
    """Fed3R on the features the head was trained on, from every client (``--probe-ridge``: Fed3R Section 5.4's
    feature-quality probe), in the round after the last row; its accuracy in the last row's
    ``ridge_probe_accuracy``, with what its uploads' postprocessors report."""

    method: MethodSpec

    def uploads(self, run: RunPlan) -> tuple[StageUploads, ...]:
        return (uploads_of_everyone("ridge probe", run.sampler),)

    def footprints(self, run: RunPlan, federation: Federation) -> tuple[Footprint, ...]:
        return (self.method.footprint(f"{self.method.name} (--probe-ridge)", federation, federation.dim,
                                      _block(run, federation), run.shards.kept_budget),)

    def run(self, context: StageContext, previous: StageResult) -> StageResult:
        last = previous.points[-1]
        with reporting(last.reported, COLUMNS):  # the probe's numbers go in the last row, with its accuracy
            accuracy = previous.embeddings(previous.params, lambda pool, evaluator: self._accuracy(
                pool, evaluator, context.postprocessing, last.round + 1, context.run.clock))
        return replace(previous, last_columns={**previous.last_columns, "ridge_probe_accuracy": accuracy})

    def _accuracy(self, pool: ShardPool, evaluator: Evaluator, postprocessing: Postprocessing, round_number: int,
                  clock: RunClock | None = None) -> float:
        """The probe's accuracy; on ``clock`` its round of every client, which advances it."""
        method = self.method.build(pool.federation)
        if clock is not None:
            clocked_everyone(clock, round_number - 1, "ridge_probe", ClientTasks.closed_form(method, pool.federation),
                             postprocessing)
        statistics, _ = everyone_uploads(pool, method, postprocessing, round_number)  # a measurement: not counted
        return evaluator.accuracy(method, method.solve(statistics))
