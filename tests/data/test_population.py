"""``synthetic:<split>?clients=K``: populations of any size, generated client by client in whichever process needs them."""

import numpy as np
import pytest
import torch

import fedray
from fedray.core.errors import FedrayError
from fedray.data import population, synthetic
from fedray.data.registry import load_federation

SMALL = "synthetic:inat-user-120k?clients=300&dim=12&classes=20&seed=4"


def test_client_sizes_are_drawn_from_the_real_table_seeded():
    real = set(synthetic.real_client_sizes("inaturalist_user_120k.csv").tolist())
    a = population.build("inat-user-120k", 5000, dim=8, seed=1)
    assert a.num_clients == 5000 and set(a.client_sizes.tolist()) <= real
    assert np.array_equal(a.client_sizes, population.build("inat-user-120k", 5000, dim=8, seed=1).client_sizes)
    assert not np.array_equal(a.client_sizes, population.build("inat-user-120k", 5000, dim=8, seed=2).client_sizes)
    # the mean size is the real table's (13.0 samples a client) within sampling error: its std is 8.6 / √5000
    assert abs(a.client_sizes.mean() - 120_293 / 9_275) < 4 * 75 / np.sqrt(5000)
    assert list(a.client_offsets[:3]) == [0, a.client_sizes[0], a.client_sizes[0] + a.client_sizes[1]]


def test_a_population_of_one_client():
    one = load_federation("synthetic:inat-user-120k?clients=1&dim=4")
    sample_ids, labels, offsets = one.train_arrays(0, 1)
    assert one.num_clients == 1 and list(offsets) == [0, len(sample_ids)] and len(labels) == one.client_sizes[0]


def test_any_clients_rows_are_the_same_whichever_range_generates_them():
    federation = load_federation(SMALL)
    ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    part_ids, part_labels, part_offsets = federation.train_arrays(40, 90)
    assert np.array_equal(part_ids, ids[offsets[40]:offsets[90]])
    assert np.array_equal(part_labels, labels[offsets[40]:offsets[90]])
    assert np.array_equal(part_offsets, offsets[40:91] - offsets[40])
    whole = federation.source.features("train", ids)
    some = np.array([ids[offsets[77]], ids[3], ids[-1], ids[offsets[200]] + 1])
    assert torch.equal(federation.source.features("train", some), whole[torch.from_numpy(some)])
    part = federation.source.features("train", part_ids)
    assert torch.equal(part, whole[offsets[40]:offsets[90]])


def test_each_rows_features_are_drawn_for_its_own_label():
    """With a model whose class means are 3·e_c (no base, almost no noise), a row's largest coordinate is its label."""
    federation = load_federation("synthetic:inat-user-120k?clients=200&dim=24&classes=20&seed=4")
    ids, labels, _ = federation.train_arrays(0, federation.num_clients)
    model = dict(federation.source._model)
    model.update(means=3 * torch.eye(20, 24), base=torch.zeros(24), scales=torch.full((24,), 1e-6),
                 low_rank=torch.zeros_like(model["low_rank"]))
    federation.source.__dict__["_model"] = model
    assert np.array_equal(federation.source.features("train", ids).argmax(1).numpy(), labels)


def test_label_skew_is_the_real_splits():
    """M/K of the real iNat-User-120K is 54,590 / 9,275 = 5.89; a population of 10⁵ clients has about as many classes a
    client (measured 5.92), and far fewer than clients drawing their samples' classes uniformly from the pool would."""
    federation = population.build("inat-user-120k", 100_000, dim=4)
    per_client = federation.client_num_classes.sum() / federation.num_clients
    assert abs(per_client - 54_590 / 9_275) < 0.3
    # each class's share of the samples is its share of the pool (long-tailed), within sampling error
    counts = np.zeros(federation.num_classes)
    for _, labels, _ in federation.label_chunks():
        counts += np.bincount(labels, minlength=federation.num_classes)
    pool = np.bincount(synthetic.pool_labels(synthetic.POOLS["inat"], 0)[0], minlength=federation.num_classes)
    assert np.abs(counts / counts.sum() - pool / pool.sum()).sum() / 2 < 0.05  # total variation


def test_the_test_set_is_the_stand_ins():
    federation = load_federation("synthetic:inat-user-120k?clients=50&dim=6")
    stand_in = load_federation("synthetic:inat-user-120k?dim=6")
    assert federation.num_test == stand_in.num_test == 35_637
    ids, labels = federation.test_arrays()
    assert np.array_equal(labels, stand_in.test_arrays()[1])
    assert torch.equal(federation.source.features("test", ids[:500]), stand_in.source.features("test", ids[:500]))


def test_the_driver_holds_no_per_sample_table():
    federation = load_federation(SMALL)
    with pytest.raises(FedrayError, match="population of 300 clients has no per-sample table"):
        federation.train


def test_spec_is_canonical_and_reloads():
    federation = load_federation("synthetic:inat-user-120k?seed=4&clients=300&classes=20&dim=12")
    assert federation.spec == "synthetic:inat-user-120k?classes=20&clients=300&dim=12&seed=4"
    again = load_federation(federation.spec)
    assert np.array_equal(again.client_sizes, federation.client_sizes)


@pytest.mark.parametrize("spec, message", [
    ("synthetic:inat-user-120k?clients=0", "clients must be ≥ 1, got 0"),
    ("synthetic:inat-user-120k?clients=10&scale=0.5", "give clients=K or scale, not both"),
    ("synthetic:inat-user-120k?clients=10&feature_shift=0.1", "feature_shift applies to the real splits' stand-ins"),
    ("synthetic:cifar100?clients=10", "clients=K applies to the client splits"),
    ("synthetic:inat-user-120k?clients=ten", "option clients='ten' is not an integer"),
])
def test_bad_population_specs_are_one_line(spec, message):
    with pytest.raises(FedrayError, match=message) as error:
        load_federation(spec)
    assert "\n" not in str(error.value)


def test_a_population_whose_sizes_do_not_fit_the_machine_is_refused_before_any_allocation(monkeypatch):
    """10¹² clients would ask numpy for 7.28 TiB of sizes: refused in one line by the sizes' memory alone."""
    with pytest.raises(FedrayError, match=r"^synthetic:inat-user-120k: clients=1000000000000 needs 44,703.5 GiB on "
                       r"the driver for the clients' sizes alone \(48 bytes a client\), more than this machine's "):
        load_federation("synthetic:inat-user-120k?clients=1000000000000")
    monkeypatch.setattr(population, "machine_memory", lambda: 2**30)  # 1 GiB: 22,369,621 clients of 48 bytes
    population.check("inat-user-120k", 22_369_621, scale=1.0, feature_shift=0.0)  # fits: no error
    with pytest.raises(FedrayError) as error:
        load_federation("synthetic:inat-user-120k?clients=22369622&dim=4")
    assert str(error.value) == ("synthetic:inat-user-120k: clients=22369622 needs 1.0 GiB on the driver for the "
                                "clients' sizes alone (48 bytes a client), more than this machine's 1.0 GiB: lower "
                                "clients (at most 22,369,621 here)")


def test_a_re_split_still_takes_clients():
    federation = load_federation("synthetic:cifar100?dim=4&split=dirichlet&alpha=0.5&clients=10")
    assert federation.num_clients == 10 and not federation.streams_features


def test_fed3r_on_a_population_is_ridge_on_its_rows(ray_session, tmp_path):
    """Shards generate their own clients' rows in runs of whole clients; the sum is the centralized ridge's (written
    out here with torch on the rows the federation generates)."""
    result = fedray.run(method="fed3r", dataset=SMALL, out=tmp_path, clients_per_round=50, num_shards=2,
                        cpus_per_shard=0.5, quiet=True)
    federation = load_federation(SMALL)
    ids, labels, _ = federation.train_arrays(0, federation.num_clients)
    z = federation.source.features("train", ids).double()
    y = torch.nn.functional.one_hot(torch.from_numpy(labels.astype(np.int64)), federation.num_classes).double()
    w = torch.linalg.solve(z.T @ z + 0.01 * torch.eye(z.shape[1], dtype=torch.float64), z.T @ y)
    np.testing.assert_allclose(result.classifier.weight.numpy(), (w / w.norm(dim=0)).numpy(), rtol=1e-9, atol=1e-12)
    assert result.metrics["clients_seen"][-1] == 300
