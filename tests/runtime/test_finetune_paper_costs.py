"""Fine-tuning's counts under the papers' conventions, on hand numbers: b = 1000 backbone parameters, d = 4, C = 5
(a d·C = 20-float head), E = 2 local epochs, two clients of 3 and 5 samples, F_φ = 100 multiply-adds per sample."""

from types import SimpleNamespace

import numpy as np
import pytest

from fedray.core.accounting import PaperTotals
from fedray.runtime.finetune.backend import FineTuneBackend
from fedray.methods.finetune_model import MODES
from fedray.methods.training_algorithms import FedAvg, Scaffold

SIZES = np.array([3.0, 5.0])


def backend(mode: str, scaffold: bool = False, sphere: bool = False) -> SimpleNamespace:
    """The attributes paper_costs reads, without starting a trainer pool."""
    return SimpleNamespace(
        mode=MODES[mode], backbone_parameters=1000, algorithm=Scaffold() if scaffold else FedAvg(),
        training=SimpleNamespace(sphere_loss="mse" if sphere else None, sgd=SimpleNamespace(epochs=2)),
        pool=SimpleNamespace(backbone=SimpleNamespace(dim=4), federation=SimpleNamespace(num_classes=5)),
    )


def totals(mode: str, **kind) -> dict:
    """The columns after one participation of each client, K = 2."""
    paper = PaperTotals()
    paper.add(FineTuneBackend.paper_costs(backend(mode, **kind), SIZES), np.array([0, 1]), backbone_macs=100.0)
    return paper.columns(2)


@pytest.mark.parametrize("mode, fedcof, fed3r, macs", [
    # ft: 2(b + dC) floats each; Fed3R App. E: 3·E·n_k·(F_φ + dC) = 3·2·8·120 = 5760 over both, / K = 2880
    ("ft", 2 * 2 * 1020.0, 2 * 2 * 1020.0, 3 * 2 * 8 * 120 / 2),
    # ftlp: 2·dC each; E·n_k·(F_φ + 3·dC) = 2·8·160 = 2560, / 2
    ("ftlp", 2 * 2 * 20.0, 2 * 2 * 20.0, 2 * 8 * 160 / 2),
    # ftfeat: FedCOF defines no count; Fed3R 2·b each; the frozen head still runs forward and backward: as ft
    ("ftfeat", None, 2 * 2 * 1000.0, 3 * 2 * 8 * 120 / 2),
])
def test_each_mode_counts_as_the_papers_do(mode, fedcof, fed3r, macs):
    columns = totals(mode)
    assert columns["comm_floats_fedcof"] == fedcof
    assert columns["comm_floats_fed3r"] == fed3r
    assert columns["macs_client_avg_fed3r"] == macs
    assert columns["forward_passes"] == 2 * 8  # E passes over each of the 8 samples


def test_scaffold_doubles_fed3r_floats_and_has_no_fedcof_count():
    columns = totals("ft", scaffold=True)
    assert columns["comm_floats_fed3r"] == 4 * 2 * 1020.0 and columns["comm_floats_fedcof"] is None


def test_spherefed_training_has_no_paper_counts():
    assert set(totals("ft", sphere=True).values()) == {None}
