"""The synthetic stand-ins have the real splits' shape and share one sample pool."""

from importlib import resources

import numpy as np
import pyarrow.csv as pacsv
import pytest
import torch

from fedray.data import synthetic
from fedray.core.errors import FedrayError

INAT = ["inat-user-120k", "inat-geo-100", "inat-geo-1k", "inat-geo-3k"]


@pytest.fixture(scope="module")
def full_inat():
    return {name: synthetic.build(name, dim=8) for name in INAT}


def test_user_120k_stand_in_has_the_real_shape(full_inat):
    federation = full_inat["inat-user-120k"]
    summary = federation.summary()
    assert (summary["clients_K"], summary["classes_C"], summary["train_N"], summary["test_N"]) == (9275, 1203, 120_293, 35_637)
    assert abs(summary["client_class_pairs_M"] - 54_590) <= 0.03 * 54_590
    assert summary["client_size_quantiles"]["median"] == 2
    real = pacsv.read_csv(resources.files("fedray.data") / "client_sizes" / "inaturalist_user_120k.csv")
    real_sizes = [n for c, n in zip(real.column("client").to_pylist(), real.column("num_images").to_pylist()) if c != "test"]
    assert sorted(federation.client_sizes.tolist()) == sorted(real_sizes)


def test_label_skew_and_long_tail(full_inat):
    federation = full_inat["inat-user-120k"]
    counts = np.bincount(federation.train.column("label").to_numpy(), minlength=1203)
    assert counts.min() >= 1 and counts.max() / np.median(counts) > 5
    big = federation.client_sizes >= 50
    assert np.median(federation.client_num_classes[big] / federation.client_sizes[big]) < 0.5


@pytest.mark.parametrize("name", INAT[1:])
def test_inat_stand_ins_partition_one_pool(full_inat, name):
    reference, other = full_inat["inat-user-120k"], full_inat[name]
    for split in ("train", "test"):
        a = getattr(reference, split).sort_by("sample_id")
        b = getattr(other, split).sort_by("sample_id")
        assert a.column("sample_id").equals(b.column("sample_id"))
        assert a.column("label").equals(b.column("label"))
    ids = np.array([5, 77_777, 120_292, 31])
    assert torch.equal(reference.source.features("train", ids), other.source.features("train", ids))
    assert other.client_sizes.sum() == reference.client_sizes.sum()
    assert other.num_clients == len(synthetic.real_client_sizes(synthetic.SPLITS[name].sizes_file))


def test_geo_splits_are_less_skewed_than_user_split(full_inat):
    per_sample = {name: full_inat[name].client_num_classes.sum() / full_inat[name].num_clients for name in INAT}
    assert per_sample["inat-user-120k"] < per_sample["inat-geo-100"] < per_sample["inat-geo-1k"] < per_sample["inat-geo-3k"]


def test_features_of_any_subset_equal_the_whole():
    federation = synthetic.build("inat-user-120k", dim=16, scale=0.05)
    ids = np.arange(federation.train.num_rows)
    whole = federation.source.features("train", ids)
    subset = np.random.default_rng(0).choice(ids, 500, replace=False)
    assert torch.equal(federation.source.features("train", subset), whole[subset])
    assert whole.min() >= 0 and whole.max() <= 6 and (whole == 0).any()


def test_generation_is_deterministic_by_seed():
    ids = np.arange(50)
    a = synthetic.build("inat-geo-100", dim=16, scale=0.05, seed=1)
    b = synthetic.build("inat-geo-100", dim=16, scale=0.05, seed=1)
    c = synthetic.build("inat-geo-100", dim=16, scale=0.05, seed=2)
    assert a.table.equals(b.table)
    assert torch.equal(a.source.features("test", ids), b.source.features("test", ids))
    assert not torch.equal(a.source.features("test", ids), c.source.features("test", ids))


def test_feature_shift_moves_each_client():
    plain = synthetic.build("inat-user-120k", dim=16, scale=0.05)
    shifted = synthetic.build("inat-user-120k", dim=16, scale=0.05, feature_shift=0.5)
    _, _, offsets = plain.train_arrays(0, plain.num_clients)
    ids = plain.train.column("sample_id").to_numpy()
    delta = shifted.source.features("train", ids) - plain.source.features("train", ids)
    first, second = delta[offsets[0] : offsets[1]], delta[offsets[1] : offsets[2]]
    assert delta.abs().max() > 0.1
    assert not torch.allclose(first.mean(0), second.mean(0))
    assert torch.equal(shifted.source.features("test", np.arange(9)), plain.source.features("test", np.arange(9)))


def test_landmarks_stand_in():
    federation = synthetic.build("landmarks-user-160k", dim=4)
    assert (federation.num_clients, federation.num_classes, federation.test.num_rows) == (1262, 2028, 17_964)


def test_rescaled_sizes_sum_exactly():
    sizes = synthetic.rescale_sizes(np.array([1, 1, 5, 100, 3]), 1000)
    assert sizes.sum() == 1000 and sizes.min() >= 1


@pytest.mark.parametrize("options, message", [({"dim": 0}, "dim"), ({"scale": 0.0}, "scale"), ({"classes": 0}, "classes")])
def test_bad_synthetic_options(options, message):
    with pytest.raises(FedrayError, match=message):
        synthetic.build("inat-user-120k", **options)
