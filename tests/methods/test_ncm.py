"""FedNCM's Euclidean rule (``distance=euclidean``) against the nearest class mean written out in numpy."""

import numpy as np
import pytest
import torch

import fedray
from fedray.core.errors import FedrayError
from fedray.methods import FedNCM
from tests.conftest import all_clients_batch

SPEC = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60"


def numpy_means(federation) -> tuple[np.ndarray, np.ndarray]:
    """Each class's mean feature (C × d, float64) and whether the class has samples, one class at a time."""
    sample_ids, labels, _ = federation.train_arrays(0, federation.num_clients)
    z = federation.source.features("train", sample_ids).double().numpy()
    means = np.zeros((federation.num_classes, federation.dim))
    seen = np.zeros(federation.num_classes, dtype=bool)
    for c in range(federation.num_classes):
        if (labels == c).any():
            means[c], seen[c] = z[labels == c].mean(0), True
    return means, seen


def nearest_mean(z: np.ndarray, means: np.ndarray) -> np.ndarray:
    """argmin_c ‖z − μ_c‖ by the distances themselves."""
    return np.linalg.norm(z[:, None, :] - means[None, :, :], axis=2).argmin(1)


def test_euclidean_ncm_is_the_nearest_class_mean(small_inat):
    means, seen = numpy_means(small_inat)
    assert seen.all()  # every class is a candidate, as in argmin over the class means
    method = FedNCM(small_inat.dim, small_inat.num_classes, distance="euclidean")
    classifier = method.solve(method.client_statistics(all_clients_batch(small_inat)))
    assert np.abs(classifier.weight.numpy() - means.T).max() <= 1e-13 * np.abs(means).max()
    half_norms = np.array([-0.5 * float(m @ m) for m in means])
    assert np.abs(classifier.bias.numpy() - half_norms).max() <= 1e-13 * np.abs(half_norms).max()

    sample_ids, _ = small_inat.test_arrays()
    z = small_inat.source.features("test", sample_ids).double().numpy()
    scores = z @ classifier.weight.numpy() + classifier.bias.numpy()
    assert np.array_equal(scores.argmax(1), nearest_mean(z, means))
    assert not np.array_equal((z @ classifier.weight.numpy()).argmax(1), nearest_mean(z, means))  # the bias matters


def test_the_default_distance_is_todays_cosine_classifier(small_inat):
    batch = all_clients_batch(small_inat)
    plain = FedNCM(small_inat.dim, small_inat.num_classes)
    cosine = FedNCM(small_inat.dim, small_inat.num_classes, distance="cosine")
    default = plain.solve(plain.client_statistics(batch))
    assert default.bias is None and torch.equal(default.weight, cosine.solve(cosine.client_statistics(batch)).weight)
    means, _ = numpy_means(small_inat)
    assert np.abs(default.weight.numpy() - (means / np.linalg.norm(means, axis=1, keepdims=True)).T).max() <= 1e-13


def test_a_run_through_shards_scores_with_the_bias(ray_session, tmp_path):
    result = fedray.run(method="fedncm", options={"distance": "euclidean"}, dataset=SPEC, num_shards=2,
                        cpus_per_shard=0.5, quiet=True, out=tmp_path / "run")
    federation = fedray.load_federation(SPEC)
    method = FedNCM(federation.dim, federation.num_classes, distance="euclidean")
    alone = method.solve(method.client_statistics(all_clients_batch(federation)))
    assert np.abs(result.classifier.weight.numpy() - alone.weight.numpy()).max() <= 1e-12
    assert np.abs(result.classifier.bias.numpy() - alone.bias.numpy()).max() <= 1e-12 * np.abs(alone.bias.numpy()).max()

    means, seen = numpy_means(federation)
    assert seen.all()
    sample_ids, labels = federation.test_arrays()
    z = federation.source.features("test", sample_ids).double().numpy()
    expected = float((nearest_mean(z, means) == labels).mean())
    assert abs(result.metrics["accuracy"][-1] - expected) <= 2 / len(labels)  # float32 scores: a near tie may differ


@pytest.mark.parametrize("value", ["manhattan", "Euclidean", ""])
def test_an_unknown_distance_is_refused_in_one_line(ray_session, tmp_path, value):
    with pytest.raises(FedrayError) as refused:
        fedray.run(method="fedncm", options={"distance": value}, dataset=SPEC, quiet=True, out=tmp_path / "run")
    assert str(refused.value) == f"--distance must be cosine or euclidean, got '{value}'"
    assert not (tmp_path / "run").exists()
