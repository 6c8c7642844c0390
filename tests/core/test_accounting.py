"""The papers' accounting columns equal their formulas, computed here by hand on small federations.

Federation UNEVEN (d = 4, C = 5, K = 3 clients):
  client a: class 0 ×2, class 1 ×1        n = 3, C_k = 2
  client b: class 1 ×2, class 2 ×2, 3 ×1  n = 5, C_k = 3
  client c: class 4 ×4                    n = 4, C_k = 1
so N = 12 samples and M = 2 + 3 + 1 = 6 (client, class) pairs.
Federation EVEN: 4 clients of 3 samples each (d = 4, C = 5), for Fed3R's 𝒯·t·κ/K.
F_φ (--backbone-macs) is 1000 multiply-adds per sample.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fedray.engine.config import RunConfig
from fedray.data.registry import recorded_backbone_macs
from fedray.engine.run_config import run
from fedray.data.images.backbones import forward_flops

D, C, F_PHI = 4, 5, 1000.0
UNEVEN = {"a": [0, 0, 1], "b": [1, 1, 2, 2, 3], "c": [4, 4, 4, 4]}
EVEN = {"a": [0, 1, 2], "b": [1, 2, 3], "c": [3, 4, 0], "d": [4, 4, 1]}
PAPER = ("comm_floats_fedcof", "comm_floats_fed3r", "macs_client_avg_fed3r", "forward_passes")


def write_federation(path, clients):
    rng = np.random.default_rng(0)
    client_ids = [name for name, labels in clients.items() for _ in labels] + [None] * C
    labels = [label for labels in clients.values() for label in labels] + list(range(C))
    x = rng.standard_normal((len(labels), D)).astype(np.float32)
    pq.write_table(pa.table({
        "client_id": pa.array(client_ids, pa.string()),
        "split": pa.array(["train" if c is not None else "test" for c in client_ids]),
        "label": pa.array(labels, pa.int64()),
        "features": pa.array(list(x), pa.list_(pa.float32())),
    }), path)
    return f"parquet:{path}"


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    return write_federation(tmp_path_factory.mktemp("uneven") / "fed.parquet", UNEVEN)


@pytest.fixture(scope="module")
def even(tmp_path_factory):
    return write_federation(tmp_path_factory.mktemp("even") / "fed.parquet", EVEN)


def rows_of(tmp_path, dataset, **options):
    config = RunConfig(**{"dataset": dataset, "out": str(tmp_path / "out"), "quiet": True, "num_shards": 1,
                          "cpus_per_shard": 0.5, "clients_per_round": 3, **options})
    return run(config).rows


def paper(row):
    return tuple(row[name] for name in PAPER)


# closed-form methods on UNEVEN, every client once: (fedcof floats, fed3r floats, fed3r MACs over all K, forward passes)
CLOSED_FORM = {
    # FedCOF App. H: M·d; FedNCM: one forward pass per sample; Fed3R's paper counts neither.
    "fedncm": ({}, (6 * 4, None, None, 12)),
    "fedcof": ({}, (6 * 4, None, None, 12)),
    # FedCOF App. E, two means per class: class 4 of client c (4 samples) sends 2 means, so 7 means.
    "fedcof-2means": ({"method": "fedcof", "means_per_class": 2}, (7 * 4, None, None, 12)),
    # FedCOF App. H, the oracle: M·(d + d²).
    "fedcof-oracle": ({}, (6 * (4 + 16), None, None, 12)),
    # FedCOF App. H M·d + K·d²; Fed3R App. D K·(d² + d·C); App. E Σ n_k (F_φ + ½d(d+1) + d·C) / K.
    "fed3r": ({}, (6 * 4 + 3 * 16, 3 * (16 + 20), 12 * (1000 + 10 + 20) / 3, 12)),
    # With a bias the design has p = d + 1 = 5 columns.
    "fed3r-bias": ({"method": "fed3r", "bias": True}, (6 * 5 + 3 * 25, 3 * (25 + 25), 12 * (1000 + 15 + 25) / 3, 12)),
    # Fed3R-RF, D = 7: D² + D·C per client, n_k (F_φ + ½D(D+1) + D·C) (the paper does not count the map).
    "fed3r-rf": ({"rf_dim": 7}, (6 * 7 + 3 * 49, 3 * (49 + 35), 12 * (1000 + 28 + 35) / 3, 12)),
}


# the fast layer runs one method of each paper's count; the variants run in the full suite
FAST = ("fedncm", "fedcof", "fed3r")


@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if name in FAST else [pytest.mark.slow]) for name in CLOSED_FORM])
def test_closed_form_columns_are_the_papers_formulas(ray_session, tmp_path, uneven, name):
    options, expected = CLOSED_FORM[name]
    rows = rows_of(tmp_path, uneven, **{"method": name, "backbone_macs": F_PHI, **options})
    last = rows[-1]
    assert last["clients_seen"] == 3 and last["samples_seen"] == 12
    assert paper(last) == pytest.approx(expected)
    assert last["bytes_up"] == 4 * expected[0]  # fedray's default counts uploads as FedCOF does, unchanged
    assert last["backbone_macs"] == F_PHI


def test_fed3r_default_columns_keep_their_values(ray_session, tmp_path, uneven):
    last = rows_of(tmp_path, uneven, method="fed3r")[-1]
    # fedray's flops_client_avg: 2 FLOPs per multiply-add of ZᵀZ (n·d² of them) plus n·d for ZᵀY, over the clients seen.
    assert last["flops_client_avg"] == (2 * 12 * 16 + 12 * 4) / 3
    assert last["bytes_down"] == 0.0


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_macs_are_null_without_a_backbone_count(ray_session, tmp_path, uneven):
    last = rows_of(tmp_path, uneven, method="fed3r")[-1]
    assert last["backbone_macs"] is None and last["macs_client_avg_fed3r"] is None
    assert last["comm_floats_fed3r"] == 3 * (16 + 20)


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_fed3r_macs_average_over_all_clients_as_t_kappa_over_k(ray_session, tmp_path, even):
    rows = rows_of(tmp_path, even, method="fed3r", clients_per_round=1, eval_every=1, backbone_macs=F_PHI)
    per_round = 3 * (1000 + 10 + 20)  # 𝒯 = n_k (F_φ + ½d(d+1) + d·C), n_k = 3
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert [r["macs_client_avg_fed3r"] for r in rows] == pytest.approx([per_round * t * 1 / 4 for t in (1, 2, 3, 4)])
    assert [r["forward_passes"] for r in rows] == [3, 6, 9, 12]


def test_linear_probing_columns(ray_session, tmp_path, even):
    # FedAvg-LP, E = 2 local epochs, κ = 2 of K = 4 clients a round, 3 rounds.
    rows = rows_of(tmp_path, even, method="fedavg", clients_per_round=2, rounds=3, eval_every=1, local_epochs=2,
                   backbone_macs=F_PHI)
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert paper(rows[0]) == (0, 0, 0, 0)
    for t, row in enumerate(rows):
        # FedCOF App. H and Fed3R App. D: the head (d·C = 20 floats) down and up for each of κ·t participations.
        assert row["comm_floats_fedcof"] == 2 * 20 * 2 * t
        assert row["comm_floats_fed3r"] == 2 * 20 * 2 * t
        # Fed3R App. E: 𝒯 = E·n_k(F_φ + 3·d·C) = 2·3·(1000 + 60), times t·κ/K.
        assert row["macs_client_avg_fed3r"] == pytest.approx(2 * 3 * 1060 * t * 2 / 4)
        assert row["forward_passes"] == 2 * 3 * 2 * t
    assert rows[-1]["bytes_up"] == 4 * 3 * 2 * (4 + 1) * 5  # fedray's own count (the head with its bias), unchanged


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_scaffold_probing_doubles_fed3r_traffic_and_has_no_fedcof_count(ray_session, tmp_path, even):
    last = rows_of(tmp_path, even, method="scaffold", clients_per_round=2, rounds=3, local_epochs=1)[-1]
    assert last["comm_floats_fed3r"] == 4 * 20 * 2 * 3
    assert last["comm_floats_fedcof"] is None and last["macs_client_avg_fed3r"] is None
    assert last["forward_passes"] == 3 * 2 * 3


def test_a_closed_form_init_adds_its_costs_before_training(ray_session, tmp_path, uneven):
    rows = rows_of(tmp_path, uneven, method="fedavg", init="fed3r", rounds=1, local_epochs=1, backbone_macs=F_PHI)
    stage1 = [r for r in rows if r["stage"] == "closed_form"][-1]
    assert paper(stage1) == pytest.approx((72, 108, 12 * 1030 / 3, 12))
    last = rows[-1]
    # one round of 3 participations with E = 1: 40 floats each way-pair, E·n_k(F_φ + 60) over the 12 samples.
    assert paper(last) == pytest.approx((72 + 3 * 40, 108 + 3 * 40, (12 * 1030 + 12 * 1060) / 3, 12 + 12))


def test_the_cache_manifest_gives_f_phi(tmp_path):
    entry = tmp_path / "cache"
    entry.mkdir()
    (entry / "manifest.json").write_text(json.dumps({"backbone_macs": 299_494_272.0}))
    assert recorded_backbone_macs(f"features:{entry}") == 299_494_272.0
    (entry / "manifest.json").write_text(json.dumps({}))  # a cache written before fedray recorded it
    assert recorded_backbone_macs(f"features:{entry}") is None
    assert recorded_backbone_macs("synthetic:inat-user-120k") is None


def test_forward_flops_count_two_per_multiply_add():
    # A 3×3 convolution, 3 → 2 channels, on a 16×16 image: 14·14 outputs × 2 channels × 3·3·3 multiply-adds each.
    conv = torch.nn.Conv2d(3, 2, kernel_size=3, bias=False)
    assert forward_flops(conv, 16) == 2 * 14 * 14 * 2 * 27
