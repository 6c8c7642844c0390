"""SphereFed's fixed classifier (orthonormal rows when C ≤ d, a unit-norm tight frame at the Welch bound when C > d) and losses."""

import pytest
import torch

from fedray.core.errors import FedrayError
from fedray.methods.sphere import fixed_classifier, sphere_logits, sphere_loss


def frame_potential(rows: torch.Tensor) -> float:
    """Σ_{i≠j} ⟨w_i, w_j⟩²: 0 for orthonormal rows, ≥ C²/d − C (Welch) for C > d unit rows."""
    gram = rows @ rows.T
    return float((gram**2).sum() - (torch.diagonal(gram) ** 2).sum())


@pytest.mark.parametrize("classes, dim", [(10, 10), (60, 128), (1203, 1280)])
def test_orthonormal_rows_when_there_is_room(classes, dim):
    rows = fixed_classifier(classes, dim, seed=3)
    assert rows.shape == (classes, dim)
    torch.testing.assert_close(rows @ rows.T, torch.eye(classes, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("classes, dim", [(20, 8), (100, 24)])
def test_more_classes_than_dimensions_give_a_unit_norm_tight_frame_at_the_welch_bound(classes, dim):
    rows = fixed_classifier(classes, dim, seed=3)
    torch.testing.assert_close(rows.norm(dim=1), torch.ones(classes, dtype=torch.float64), rtol=0, atol=1e-9)
    torch.testing.assert_close(rows.T @ rows, classes / dim * torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-6)
    welch = classes**2 / dim - classes
    assert frame_potential(rows) == pytest.approx(welch, rel=1e-6)
    assert frame_potential(torch.nn.functional.normalize(torch.randn(classes, dim, dtype=torch.float64), dim=1)) > 1.2 * welch


def test_the_seed_decides_the_classifier():
    assert torch.equal(fixed_classifier(30, 16, seed=1), fixed_classifier(30, 16, seed=1))
    assert not torch.allclose(fixed_classifier(30, 16, seed=1), fixed_classifier(30, 16, seed=2))
    assert not torch.allclose(fixed_classifier(8, 16, seed=1), fixed_classifier(8, 16, seed=2))


def test_bad_sizes_are_named():
    with pytest.raises(FedrayError, match="C=0"):
        fixed_classifier(0, 4, seed=0)


def test_sphere_losses():
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(5, 6, generator=generator), torch.randn(4, 6, generator=generator), torch.randn(4, generator=generator)
    classifier = fixed_classifier(3, 4, seed=0).float()
    logits = sphere_logits(x, weight, bias, classifier)
    z = (x @ weight.T + bias) / (x @ weight.T + bias).norm(dim=1, keepdim=True)
    torch.testing.assert_close(logits, z @ classifier.T)
    labels = torch.tensor([0, 2, 1, 1, 0])
    expected_mse = sum(float(((logits[i] - torch.eye(3)[labels[i]]) ** 2).sum()) / 3 for i in range(5)) / 5
    assert float(sphere_loss(logits, labels, "mse", 1.0)) == pytest.approx(expected_mse, rel=1e-6)
    assert float(sphere_loss(logits, labels, "ce", 0.5)) == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits / 0.5, labels)), rel=1e-6)
