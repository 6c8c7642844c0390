"""fedray.report: named numbers (or short strings) from a plugin's server-side hooks become columns of
metrics.parquet, the last value reported at or before each row's round, None before the first."""

from dataclasses import dataclass

import polars as pl
import pytest
import torch

import fedray
from fedray.core.errors import FedrayError
from fedray.core.reports import report, reporting
from fedray.engine.run_config import run
from fedray.engine.config import resolve

DATASET = "synthetic:inat-geo-100?dim=8&scale=0.2&classes=6"
SMALL = {"dataset": DATASET, "clients_per_round": 4, "num_shards": 1, "cpus_per_shard": 0.5, "quiet": True}


@dataclass(frozen=True)
class StepSize(fedray.FederatedAlgorithm):
    """FedAvg reporting the norm of its server step and the round it took it in."""

    def server_update(self, params, total, state, population):
        delta, state = super().server_update(params, total, state, population)
        fedray.report(step_norm=float(torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values()))),
                      clients=total.clients)
        return delta, state


class Sums(fedray.Postprocessor):
    """Reports the number of uploads each aggregate sums, and how many aggregates it saw (its state)."""

    def aggregate(self, total, context):
        seen = self.state.get("seen", torch.zeros((), dtype=torch.int64)) + 1
        self.state = {"seen": seen}
        fedray.report(summed=context.clients, aggregates=int(seen))
        return total


def test_reported_numbers_are_collected_where_the_engine_listens_and_refused_elsewhere():
    into = {}
    with reporting(into, frozenset({"accuracy"})):
        report(eta=2, eps=0.5)
        report(eta=3)
        with pytest.raises(FedrayError, match=r"^fedray.report\(accuracy=...\): accuracy is a column of metrics.parquet "
                                              r"already; report under another name$"):
            report(accuracy=1.0)
        with pytest.raises(FedrayError, match=r"expected a number \(not NaN"):
            report(eps=float("nan"))
        with pytest.raises(FedrayError, match=r"expected a number \(not NaN; ±inf is one, as a DP run's ε = ∞ without "
                                              r"noise\) or a one-line string$"):
            report(flag=True)
        report(epsilon=float("inf"))  # a DP run without noise: ε = ∞
    assert into == {"eta": 3.0, "eps": 0.5, "epsilon": float("inf")}
    with pytest.raises(FedrayError, match=r"^fedray.report\(...\) is for the server's hooks"):
        report(eta=1.0)


def test_a_short_string_is_reported_as_a_column_of_one_kind():
    """A one-line string of at most 200 characters (the RDP orders a DP run's ε was minimized over); a name holds one
    kind in every row."""
    into = {}
    with reporting(into):
        report(dp_rdp_orders="1.7-1024", dp_epsilon=3.5)
        report(dp_rdp_orders="1.8-1024")
        with pytest.raises(FedrayError, match=r"^fedray.report\(note=...\): got a 201-character string; a string column "
                                              r"holds one line of at most 200 characters$"):
            report(note="x" * 201)
        with pytest.raises(FedrayError, match=r"^fedray.report\(note=...\): got a 3-character string of several lines"):
            report(note="a\nb")
        with pytest.raises(FedrayError, match=r"^fedray.report\(dp_epsilon=...\): got 'inf', where dp_epsilon was 3.5 "
                                              r"before: a column holds numbers or strings, not both$"):
            report(dp_epsilon="inf")
        with pytest.raises(FedrayError, match=r"^fedray.report\(dp_rdp_orders=...\): got 2, where dp_rdp_orders was "
                                              r"'1.8-1024' before"):
            report(dp_rdp_orders=2)
    assert into == {"dp_rdp_orders": "1.8-1024", "dp_epsilon": 3.5}


def test_a_training_algorithm_and_a_postprocessor_report_columns_of_every_row(ray_session, tmp_path):
    seen = []
    config = resolve({}, {**SMALL, "method": f"{__name__}:StepSize", "postprocessor": f"{__name__}:Sums",
                          "out": str(tmp_path / "run"), "rounds": 4, "eval_every": 2, "client_lr": 0.05})
    run(config, on_point=lambda point, _: seen.append(point.columns()))
    rows = pl.read_parquet(tmp_path / "run" / "metrics.parquet").to_dicts()
    assert [(r["round"], r["clients"], r["summed"], r["aggregates"]) for r in rows] == \
        [(0, None, None, None), (2, 4.0, 4.0, 2.0), (4, 4.0, 4.0, 4.0)]
    assert rows[1]["step_norm"] > 0 and rows[2]["step_norm"] > 0 and rows[1]["step_norm"] != rows[2]["step_norm"]
    assert [row.get("aggregates") for row in seen] == [None, 2.0, 4.0]
    assert seen[-1]["step_norm"] == rows[-1]["step_norm"]   # on_evaluation's rows carry them too


class CountingNCM(fedray.ClosedFormMethod):
    """Class means, reporting in solve how many samples its statistics hold."""

    def client_statistics(self, batch):
        sums = torch.zeros(self.num_classes, self.dim, dtype=torch.float64).index_add_(0, batch.labels, batch.features.double())
        return sums, torch.bincount(batch.labels, minlength=self.num_classes).double()

    def combine(self, a, b):
        return a[0] + b[0], a[1] + b[1]

    def solve(self, stats):
        fedray.report(samples=float(stats[1].sum()))
        return fedray.Classifier((stats[0] / stats[1].clamp(min=1)[:, None]).T.contiguous())


def test_a_closed_form_methods_solve_reports_per_evaluation_block(ray_session, tmp_path):
    config = resolve({}, {**SMALL, "method": f"{__name__}:CountingNCM", "out": str(tmp_path / "ncm"), "rounds": 5,
                          "eval_every": 2})
    rows = run(config).rows
    assert [row["samples"] for row in rows] == [float(row["samples_seen"]) for row in rows]
