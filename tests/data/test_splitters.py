import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from fedray.data import splitters
from fedray.core.federation import TEST, TRAIN, Federation, split_table
from fedray.data.splitters import PROBE_DRAWS, UNASSIGNED, classes_per_client_split, dirichlet_split, hsu_dirichlet_split, resplit
from fedray.core.errors import FedrayError
from scipy import stats


def balanced_labels(num_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    """Shuffled labels with ``per_class`` samples of each class."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def histograms(assignment: np.ndarray, labels: np.ndarray, num_clients: int) -> np.ndarray:
    """(clients × classes) sample counts."""
    counts = np.zeros((num_clients, labels.max() + 1), dtype=np.int64)
    np.add.at(counts, (assignment, labels), 1)
    return counts


def assert_partition(assignment: np.ndarray, num_samples: int, num_clients: int) -> None:
    assert assignment.dtype == np.int64
    assert assignment.shape == (num_samples,)
    assert assignment.min() >= 0 and assignment.max() < num_clients


# Dirichlet, Hsu et al.'s protocol (split=dirichlet)


def test_hsu_dirichlet_gives_equal_clients_and_drops_the_leftovers():
    labels = balanced_labels(7, 143)  # N = 1001 over K = 10: 100 each, one sample left over
    assignment = hsu_dirichlet_split(labels, 10, 0.5, seed=3)
    assert assignment.dtype == np.int64 and assignment.shape == (1001,)
    assert np.bincount(assignment[assignment != UNASSIGNED], minlength=10).tolist() == [100] * 10
    assert (assignment == UNASSIGNED).sum() == 1
    assert np.array_equal(assignment, hsu_dirichlet_split(labels, 10, 0.5, seed=3))
    assert not np.array_equal(assignment, hsu_dirichlet_split(labels, 10, 0.5, seed=4))


def test_hsu_dirichlet_renormalizes_when_a_class_runs_out():
    """Class 0 has 5 samples, class 1 has 95: once class 0 is used up every later draw is class 1."""
    labels = np.repeat([0, 1], [5, 95])
    for seed in range(20):
        counts = histograms(hsu_dirichlet_split(labels, 10, 1000.0, seed=seed), labels, 10)
        assert counts.sum(axis=1).tolist() == [10] * 10
        assert counts.sum(axis=0).tolist() == [5, 95]


def test_hsu_dirichlet_client_draws_follow_its_proportions():
    """With α huge, q_k ≈ uniform: the first client (no class has run out yet) is multinomial(n, uniform)."""
    labels = balanced_labels(10, 2000)
    firsts = np.stack([histograms(hsu_dirichlet_split(labels, 10, 1e6, seed=s), labels, 10)[0] for s in range(30)])
    assert firsts.sum(axis=1).tolist() == [2000] * 30
    assert stats.chisquare(firsts.sum(axis=0)).pvalue > 1e-3


def test_hsu_dirichlet_small_alpha_gives_few_classes_per_client():
    labels = balanced_labels(10, 100)
    counts = histograms(hsu_dirichlet_split(labels, 10, 0.01, seed=0), labels, 10)
    assert counts.sum(axis=1).tolist() == [100] * 10
    assert (counts > 0).sum(axis=1).mean() <= 2.5


# Dirichlet per class (split=dirichlet_per_class)


def test_dirichlet_assigns_every_sample_once_deterministically():
    labels = balanced_labels(10, 100)
    first = dirichlet_split(labels, 8, 0.5, seed=3)

    assert_partition(first, len(labels), 8)
    assert np.bincount(first, minlength=8).min() >= 1
    assert np.array_equal(first, dirichlet_split(labels, 8, 0.5, seed=3))
    assert not np.array_equal(first, dirichlet_split(labels, 8, 0.5, seed=4))


def test_dirichlet_keeps_class_sizes():
    labels = balanced_labels(5, 60)
    counts = histograms(dirichlet_split(labels, 6, 1.0, seed=0), labels, 6)
    assert counts.sum(axis=0).tolist() == [60] * 5


def test_large_alpha_gives_nearly_iid_clients():
    labels = balanced_labels(10, 500)
    counts = histograms(dirichlet_split(labels, 10, 100.0, seed=0), labels, 10)
    client_dist = counts / counts.sum(axis=1, keepdims=True)
    global_dist = np.bincount(labels) / len(labels)
    total_variation = 0.5 * np.abs(client_dist - global_dist).sum(axis=1)

    assert total_variation.max() < 0.1
    assert counts.sum(axis=1).min() > 400  # ~500 each


def test_small_alpha_gives_clients_dominated_by_one_class():
    # Each class goes (almost) whole to one client, so with many more clients
    # than classes most clients hold a single class; many get nothing at all.
    labels = balanced_labels(5, 600)
    mean_max_fractions = []
    for seed in range(5):
        counts = histograms(dirichlet_split(labels, 50, 0.01, seed=seed, min_client_size=0), labels, 50)
        held = counts[counts.sum(axis=1) > 0]
        mean_max_fractions.append((held.max(axis=1) / held.sum(axis=1)).mean())
        assert (counts.max(axis=0) / 600).mean() > 0.5  # the top client's share of each class

    assert np.mean(mean_max_fractions) > 0.9


def test_min_client_size_is_respected():
    labels = balanced_labels(10, 100)
    assignment = dirichlet_split(labels, 20, 0.1, seed=0, min_client_size=20)
    assert np.bincount(assignment, minlength=20).min() >= 20


def test_impossible_min_client_size_fails_after_bounded_attempts():
    labels = balanced_labels(2, 10)
    with pytest.raises(FedrayError, match="1000 attempts"):
        dirichlet_split(labels, 10, 0.001, seed=0, min_client_size=2)
    with pytest.raises(FedrayError, match="min_client_size=3"):
        dirichlet_split(labels, 10, 1.0, seed=0, min_client_size=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": -1.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"num_clients": 0}, "num_clients"),
        ({"num_clients": 41}, "num_clients"),
    ],
)
def test_dirichlet_rejects_bad_options(kwargs, match):
    options = {"labels": balanced_labels(4, 10), "num_clients": 4, "alpha": 1.0, "seed": 0, **kwargs}
    with pytest.raises(FedrayError, match=match):
        dirichlet_split(**options)


# classes per client


def test_each_client_gets_exactly_its_classes_and_every_class_is_held():
    labels = balanced_labels(10, 60)
    assignment = classes_per_client_split(labels, 12, 2, seed=1)
    counts = histograms(assignment, labels, 12)

    assert_partition(assignment, len(labels), 12)
    assert ((counts > 0).sum(axis=1) == 2).all()
    assert ((counts > 0).sum(axis=0) >= 1).all()
    for c in range(10):
        shares = counts[:, c][counts[:, c] > 0]
        assert shares.max() - shares.min() <= 1  # split evenly among holders


def test_classes_per_client_is_deterministic():
    labels = balanced_labels(10, 30)
    first = classes_per_client_split(labels, 7, 3, seed=5)
    assert np.array_equal(first, classes_per_client_split(labels, 7, 3, seed=5))
    assert not np.array_equal(first, classes_per_client_split(labels, 7, 3, seed=6))


def test_all_classes_per_client_is_iid():
    labels = balanced_labels(4, 25)
    counts = histograms(classes_per_client_split(labels, 5, 4, seed=0), labels, 5)
    assert (counts == 5).all()


def test_fewer_slots_than_classes_leaves_samples_unassigned():
    labels = balanced_labels(10, 20)
    assignment = classes_per_client_split(labels, 3, 2, seed=0)
    assigned = assignment != UNASSIGNED
    counts = histograms(assignment[assigned], labels[assigned], 3)

    assert ((counts > 0).sum(axis=1) == 2).all()
    assert len(np.unique(labels[assigned])) == 6
    assert len(np.unique(labels[~assigned])) == 4
    assert not np.isin(labels[assigned], labels[~assigned]).any()


def test_labels_need_not_be_contiguous():
    labels = np.repeat(np.array([3, 17, 40]), 10)
    assignment = classes_per_client_split(labels, 3, 1, seed=0)
    assert sorted(len(np.unique(labels[assignment == k])) for k in range(3)) == [1, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"classes_per_client": 0}, "classes_per_client"),
        ({"classes_per_client": 5}, "classes_per_client"),
        ({"num_clients": 0}, "num_clients"),
        ({"num_clients": 41}, "num_clients"),
    ],
)
def test_classes_per_client_rejects_bad_options(kwargs, match):
    options = {"labels": balanced_labels(4, 10), "num_clients": 4, "classes_per_client": 2, "seed": 0, **kwargs}
    with pytest.raises(FedrayError, match=match):
        classes_per_client_split(**options)


def test_client_left_without_samples_is_an_error():
    # every client holds both classes, but 2 samples each cannot reach 4 clients
    labels = np.array([0, 0, 1, 1])
    with pytest.raises(FedrayError, match="client 2 gets no sample"):
        classes_per_client_split(labels, 4, 2, seed=0)


# resplit


def small_federation() -> Federation:
    """8 train rows (2 clients) with a test row in the middle and an extra column."""
    split = [TRAIN] * 4 + [TEST] + [TRAIN] * 4 + [TEST]
    client_id = ["a", "a", "b", "b", None, "a", "b", "a", "b", None]
    table = split_table(
        client_id,
        sample_id=np.arange(10),
        label=np.array([0, 1, 2, 0, 1, 2, 2, 1, 0, 2]),
        split=split,
        image_id=pa.array([f"img{i}" for i in range(10)]),
    )
    return Federation("small", 3, table)


def test_resplit_reassigns_train_rows_and_keeps_test_rows():
    fed = small_federation()
    new = resplit(fed, np.array([2, 0, 1, 0, 2, 2, 1, 0]), name="small-resplit")

    assert new.name == "small-resplit"
    assert new.num_classes == fed.num_classes
    assert new.source is fed.source
    assert new.client_ids == ["0", "1", "2"]
    assert new.client_sizes.tolist() == [3, 2, 3]
    assert new.test.equals(fed.test)
    sample_ids, labels, offsets = new.train_arrays(0, 3)
    assert sample_ids.tolist() == [1, 3, 8, 2, 7, 0, 5, 6]
    assert offsets.tolist() == [0, 3, 5, 8]
    original = dict(zip(fed.table.column("sample_id").to_pylist(), fed.table.column("label").to_pylist()))
    assert labels.tolist() == [original[s] for s in sample_ids.tolist()]
    images = dict(zip(new.table.column("sample_id").to_pylist(), new.table.column("image_id").to_pylist()))
    assert images == {i: f"img{i}" for i in range(10)}


def test_resplit_drops_unassigned_rows():
    new = resplit(small_federation(), np.array([0, 0, UNASSIGNED, 1, 1, UNASSIGNED, 0, 1]), name="x")
    assert new.client_sizes.tolist() == [3, 3]
    assert sorted(new.train.column("sample_id").to_pylist()) == [0, 1, 3, 5, 7, 8]
    assert new.test.num_rows == 2


def test_resplit_of_classes_per_client_split_holds_those_classes():
    fed = small_federation()
    train_labels = fed.table.filter(pc.equal(fed.table.column("split"), TRAIN)).column("label").to_numpy()
    assignment = classes_per_client_split(train_labels, 3, 1, seed=0)
    new = resplit(fed, assignment, name="c1")
    assert new.client_num_classes.tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    "assignment", [np.zeros(7, dtype=int), np.zeros(9, dtype=int), np.zeros(8), np.full(8, -2)]
)
def test_resplit_rejects_a_bad_assignment(assignment):
    with pytest.raises(FedrayError):
        resplit(small_federation(), assignment, name="bad")


def test_an_infeasible_split_is_refused_after_a_few_draws_saying_why():
    labels = balanced_labels(20, 400)  # 8000 samples of 20 classes: α = 0.0001 gives each class to about one client
    start = time.monotonic()
    with pytest.raises(FedrayError) as error:
        dirichlet_split(labels, 5000, 0.0001, seed=0)
    assert time.monotonic() - start < 10, "not a thousand draws"
    message = str(error.value)
    for needle in ("alpha=0.0001", "8000 samples of 20 classes", "5000 clients", f"first {PROBE_DRAWS} draws",
                   "raise alpha", "min_client_size=0"):
        assert needle in message, (needle, message)
    assert len(np.unique(dirichlet_split(labels, 5000, 0.0001, seed=0, min_client_size=0))) < 500  # most clients empty


def test_the_draws_are_bounded_by_time(monkeypatch):
    labels = balanced_labels(2, 10)  # 8 of 10 clients short in every draw: below the early refusal, never feasible
    monkeypatch.setattr(splitters, "DIRICHLET_TIME_LIMIT_S", 0.0)
    with pytest.raises(FedrayError, match=r"no Dirichlet split in 1 attempts \(0 s\)"):
        dirichlet_split(labels, 10, 0.001, seed=0, min_client_size=2)


def test_a_hard_but_feasible_split_is_not_refused_early(monkeypatch):
    draws = []
    draw = splitters._dirichlet_draw
    monkeypatch.setattr(splitters, "_dirichlet_draw", lambda *args: draws.append(1) or draw(*args))
    labels = balanced_labels(10, 100)
    assignment = dirichlet_split(labels, 20, 0.1, seed=0, min_client_size=20)  # 3 to 8 clients short per early draw
    assert np.bincount(assignment, minlength=20).min() >= 20
    assert len(draws) > 10 * PROBE_DRAWS
