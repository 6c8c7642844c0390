"""secagg (SecAgg / SecAgg+ simulated): the server's unmasked sum is the plain sum of the survivors' quantized uploads
bit for bit, with and without dropouts, over all pairs or a k-regular graph; a client's upload is masked; a sum that
could overflow the ring or float64's exact integers, a threshold no client can meet, too few survivors and uploads it
cannot mask stop in one line; a Fed3R run through it is the run through plain quantized sums bit for bit."""

import json
import os
from pathlib import Path
from typing import Annotated

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch

import fedray
from fedray.core.errors import FedrayError
from fedray.core.reports import reporting
from fedray.data.registry import load_federation
from fedray.engine.config import resolve
from fedray.app.cli import main
from fedray.engine.plan import closed_form_uploads, postprocessing
from fedray.engine.run_config import run
from fedray.methods.ncm import ClassSums
from fedray.methods import postprocessor as postprocessor_module
from fedray.methods.postprocessor import Postprocessing, Sampling, StageUploads
from fedray.methods.training.client_sgd import add_upload
from fedray.methods.training_algorithms import FedAvg
from fedray.postprocessors.secagg import SecureAggregation
from fedray.core.results import EvalPoint
from fedray.engine.config import RunConfig
from fedray.engine.plan import Sampler, stages
from fedray.engine.tct import Stage2Run
from fedray.engine.training import Accounting
from tests.methods import test_tct_stage2 as tct_clients
from tests.runtime import test_tct_shards as tct_shards

SEED, ROUND = 11, 4
SPEC = "fedray.postprocessors.secagg:SecureAggregation"


def upload(client: int, scale: float = 3.0) -> ClassSums:
    """A client's class sums, some values beyond a clip of 5 when ``scale`` is large."""
    rng = np.random.default_rng(client)
    return ClassSums(torch.from_numpy(rng.integers(0, 4, 5).astype(np.float64)),
                     torch.from_numpy(rng.normal(scale=scale, size=(5, 3))))


def shared_seed(participants_round: int) -> int:
    """The group's shared seed for the first postprocessor, as UploadContext documents it."""
    return int(np.random.SeedSequence((SEED, participants_round, 0, 0)).generate_state(2, np.uint64)[0] & (2**63 - 1))


def dropped(n: int, rate: float) -> np.ndarray:
    """Who drops, as documented: one Philox U[0, 1) draw per participant (in sorted order) below the rate."""
    uniform = np.random.Generator(np.random.Philox(np.random.SeedSequence((shared_seed(ROUND), 1)))).random(n)
    return uniform < rate


def plain_quantized_sum(clients: list[int], survivors: np.ndarray, clip: float, value_bits: int, **kw) -> ClassSums:
    """Each survivor's values clipped to [−C, C], rounded to the nearest of the integers −h..h (h = 2^(v−1) − 1, a step
    Δ = C/h), summed as Python integers, decoded as their sum times Δ."""
    step = clip / (2**(value_bits - 1) - 1)
    total: dict[str, np.ndarray] = {}
    for client, alive in zip(clients, survivors):
        if alive:
            stats = upload(client, **kw)
            for name in ("counts", "sums"):
                q = np.rint(np.clip(getattr(stats, name).numpy(), -clip, clip) / step).astype(np.int64)
                total[name] = total.get(name, 0) + q.astype(object)
    return ClassSums(*(torch.from_numpy(total[name].astype(np.int64).astype(np.float64) * step)
                       for name in ("counts", "sums")))


def secure_sum(clients: list[int], reported: dict | None = None, **options) -> tuple[ClassSums, list[ClassSums]]:
    """The aggregate the server gets from ``clients``' uploads added in float64 (what it reports into ``reported``),
    and the uploads."""
    process = Postprocessing((SecureAggregation(**options),), SEED).among(clients, ROUND)
    sent = [process.statistics(upload(client), client, ROUND) for client in clients]
    total = ClassSums(sum(s.counts for s in sent), sum(s.sums for s in sent))
    with reporting({} if reported is None else reported):
        return process.aggregate(total, ROUND, len(clients)), sent


CLIENTS = [3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610]


@pytest.mark.parametrize("masks", ["model", "generate"])
@pytest.mark.parametrize("neighbours", [None, 6])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_unmasked_sum_is_the_plain_quantized_sum_bit_for_bit(neighbours, dropout, masks):
    options = dict(secagg_clip=5.0, secagg_bits=40, secagg_value_bits=20, secagg_dropout=dropout,
                   secagg_neighbours=neighbours, secagg_threshold=2, secagg_masks=masks)
    survivors = ~dropped(len(CLIENTS), dropout)
    assert survivors.all() == (dropout == 0) and survivors.sum() >= 6  # the seed drops some, not too many
    total, sent = secure_sum(CLIENTS, **options)
    expected = plain_quantized_sum(CLIENTS, survivors, 5.0, 20)
    assert torch.equal(total.counts, expected.counts) and torch.equal(total.sums, expected.sums)
    assert np.abs(upload(3).sums.numpy()).max() > 5  # clipping was exercised
    step = 5.0 / (2**19 - 1)
    for client, stats, alive in zip(CLIENTS, sent, survivors):
        values = torch.cat([stats.counts, stats.sums.flatten()])
        assert torch.equal(values, values.round())
        if not alive:
            assert not values.any()
        elif masks == "generate":  # masked: spread over the ring, far beyond the 20-bit quantized values
            assert values.min() >= 0 and values.max() < 2**40 and values.max() > 2**30
        else:  # what the masks leave once they cancel: its own integers q − h = rint(clip(x) / Δ)
            own = torch.cat([upload(client).counts, upload(client).sums.flatten()]).numpy()
            assert np.array_equal(values.numpy(), np.rint(np.clip(own, -5.0, 5.0) / step))


def through_secagg(training: bool, **options) -> tuple | str:
    """What the server decodes from CLIENTS' closed-form statistics or weighted training updates, the weight that
    reaches it, what each client sent and what the aggregate reported; or the one-line refusal."""
    process = Postprocessing((SecureAggregation(**options),), SEED).among(CLIENTS, ROUND)
    reported: dict[str, float] = {}
    try:
        if training:
            sent = [process.client(update(client), client, ROUND) for client in CLIENTS]
            sums = {name: sum(upload.tensors[name] for upload in sent) for name in ("weight", "bias")}
            weight, tensors = sum(upload.weight for upload in sent), [upload.tensors for upload in sent]
        else:
            statistics = [process.statistics(upload(client), client, ROUND) for client in CLIENTS]
            sums = ClassSums(sum(s.counts for s in statistics), sum(s.sums for s in statistics))
            weight, tensors = 1.0, [vars(s) for s in statistics]
        with reporting(reported):
            total = process.aggregate(sums, ROUND, len(CLIENTS))
    except FedrayError as error:
        return str(error)
    return (total if training else vars(total)), weight, tensors, reported


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("threshold", [None, 2])
@pytest.mark.parametrize("neighbours", [None, 6])
@pytest.mark.parametrize("dropout", [0.0, 0.3, 0.5])
def test_modelled_masks_give_the_generated_masks_sum_and_refusals_bit_for_bit(dropout, neighbours, threshold,
                                                                             training):
    """The same aggregate, weight and report, or the same refusal (too few survivors to unmask), whether the masks
    are drawn and cancelled or modelled; the clients' uploads differ by the masks only (survivors') and are zeros for
    the same dropped clients."""
    options = dict(secagg_clip=30.0 if training else 5.0, secagg_bits=40, secagg_value_bits=20,
                   secagg_dropout=dropout, secagg_neighbours=neighbours, secagg_threshold=threshold)
    modelled = through_secagg(training, secagg_masks="model", **options)
    generated = through_secagg(training, secagg_masks="generate", **options)
    # the seed's dropouts (6 of 12 at p = 0.3, 7 at 0.5) leave a client fewer surviving neighbours than a majority,
    # and, at p = 0.5 on the 6-regular graph, than 2
    assert isinstance(generated, str) == (dropout > 0 and (threshold is None or (dropout, neighbours) == (0.5, 6)))
    if isinstance(generated, str):
        assert modelled == generated
        return
    (total, weight, sent, reported), (total_g, weight_g, sent_g, reported_g) = modelled, generated
    assert total.keys() == total_g.keys() and all(torch.equal(total[name], total_g[name]) for name in total)
    assert weight == weight_g and reported == reported_g
    for own, masked, alive in zip(sent, sent_g, ~dropped(len(CLIENTS), dropout)):
        assert all(own[name].any() == alive and torch.equal(own[name], masked[name]) != alive for name in own)


@pytest.mark.parametrize("masks", ["model", "generate"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_cost_model_is_the_papers_counts(dropout, masks):
    """m = 20 values (5 counts, 5 × 3 sums) on 40 bits, 12 participants each with 11 neighbours: two 32-byte keys,
    3 · 32 bytes of shares per neighbour, the masked vector; it receives its neighbours' keys and 2 · 32 bytes of
    shares from each; it expands 12 masks of m words; 3 round trips more than a plain upload (AdvertiseKeys,
    ShareKeys, Unmasking); the server expands m values per survivor's self-mask and per (dropped, surviving) pair,
    and reconstructs one secret per participant. Reported the same whether the masks are modelled or generated."""
    reported: dict[str, float] = {}
    secure_sum(CLIENTS, reported, secagg_clip=5.0, secagg_bits=40, secagg_dropout=dropout, secagg_threshold=2,
               secagg_masks=masks)
    d = int(dropped(12, dropout).sum())
    assert reported == {"secagg_masked_bytes": 100, "secagg_key_bytes": 64, "secagg_share_bytes": 96 * 11,
                        "secagg_bytes_per_participant": 100 + 64 + 96 * 11,
                        "secagg_down_bytes_per_participant": 64 * 11 + 64 * 11,
                        "secagg_mask_words_per_participant": 12 * 20, "secagg_round_trips": 3, "secagg_dropped": d,
                        "secagg_server_prg_values": 20 * ((12 - d) + d * (12 - d)), "secagg_server_reconstructions": 12}


def test_secagg_plus_server_work_counts_each_dropped_clients_surviving_ring_neighbours():
    """k = 6: the participants on a ring in the order of a Philox permutation of the group's stream 2, each joined to
    the 3 before and the 3 after it; the server expands m values per survivor and per surviving ring neighbour of
    each dropped client; a participant expands 7 masks."""
    reported: dict[str, float] = {}
    secure_sum(CLIENTS, reported, secagg_clip=5.0, secagg_bits=40, secagg_dropout=0.3, secagg_threshold=2,
               secagg_neighbours=6)
    lost = dropped(12, 0.3)
    order = np.random.Generator(np.random.Philox(np.random.SeedSequence((shared_seed(ROUND), 2)))).permutation(12)
    pairs = 0
    for place, position in enumerate(order):
        if lost[position]:
            pairs += sum(not lost[order[(place + step) % 12]] for step in (-3, -2, -1, 1, 2, 3))
    assert 0 < pairs < 6 * lost.sum()  # some of the dropped clients' neighbours dropped too
    assert reported["secagg_server_prg_values"] == 20 * ((~lost).sum() + pairs)
    assert reported["secagg_mask_words_per_participant"] == 7 * 20 and reported["secagg_share_bytes"] == 96 * 6


def test_the_default_ring_and_value_bits_are_the_most_the_groups_sum_fits():
    total, _ = secure_sum(CLIENTS[:5], secagg_clip=5.0, secagg_bits=24)
    # 5 · (2^v − 1) ≤ 2^24 − 1: v = 21
    expected = plain_quantized_sum(CLIENTS[:5], np.ones(5, bool), 5.0, 21)
    assert torch.equal(total.sums, expected.sums) and torch.equal(total.counts, expected.counts)
    # by default b = 53 − ⌈log₂ 12⌉ = 49 and 12 · (2^v − 1) ≤ 2^49 − 1: v = 45
    total, sent = secure_sum(CLIENTS, secagg_clip=5.0)
    expected = plain_quantized_sum(CLIENTS, np.ones(12, bool), 5.0, 45)
    assert torch.equal(total.sums, expected.sums) and torch.equal(total.counts, expected.counts)
    assert max(float(stats.sums.max()) for stats in sent) == 2**44 - 1  # a value clipped to C: q − h = h
    _, masked = secure_sum(CLIENTS, secagg_clip=5.0, secagg_masks="generate")  # the masks spread over Z_2^49
    assert 2**46 < max(float(stats.sums.max()) for stats in masked) < 2**49


def test_zeros_stay_exactly_zero_and_the_grid_is_symmetric():
    """0 is on the grid (q = h): 12 clients' zeros sum to 0, not 12 · Δ/2; ±C are its ends, ±Δ/2 rounds to ±0 or ±Δ."""
    step = 5.0 / (2**19 - 1)
    zeros = [ClassSums(torch.zeros(5, dtype=torch.float64), torch.zeros(5, 3, dtype=torch.float64)) for _ in CLIENTS]
    process = Postprocessing((SecureAggregation(secagg_clip=5.0, secagg_bits=40, secagg_value_bits=20),),
                             SEED).among(CLIENTS, ROUND)
    sent = [process.statistics(stats, client, ROUND) for stats, client in zip(zeros, CLIENTS)]
    with reporting({}):
        total = process.aggregate(ClassSums(sum(s.counts for s in sent), sum(s.sums for s in sent)), ROUND, 12)
    assert not total.counts.any() and not total.sums.any()
    edges = ClassSums(torch.tensor([5.0, -5.0, 7.0, 0.6 * step, -0.4 * step], dtype=torch.float64),
                      torch.zeros(5, 3, dtype=torch.float64))
    one = Postprocessing((SecureAggregation(secagg_clip=5.0, secagg_bits=40, secagg_value_bits=20),),
                         SEED).among([0, 1], ROUND)
    sent = [one.statistics(edges, 0, ROUND), one.statistics(zeros[0], 1, ROUND)]
    with reporting({}):
        total = one.aggregate(ClassSums(sent[0].counts + sent[1].counts, sent[0].sums + sent[1].sums), ROUND, 2)
    assert total.counts.tolist() == [(2**19 - 1) * step, -(2**19 - 1) * step, (2**19 - 1) * step, step, 0.0]


def test_an_upload_from_a_client_outside_its_aggregate_stops_in_one_line_naming_it():
    secagg = SecureAggregation(secagg_clip=10.0, secagg_value_bits=8)
    contexts = [fedray.UploadContext(client, 1, 1, torch.Generator(), participants=(1, 3, 5, 8), shared_seed=7)
                for client in (8, 1, 4, 9)]
    assert secagg.group(contexts[0]).positions([8, 1, 5]).tolist() == [3, 0, 2]
    for outside in (contexts[2:], contexts[3:]):
        with pytest.raises(FedrayError, match=rf"^--postprocessor secagg: client {outside[0].client} uploads into an "
                                              rf"aggregate of 4 participants it is not one of$"):
            secagg.entry_maps(contexts[:2] + outside)


def test_a_sum_that_could_overflow_the_ring_stops_in_one_line():
    with pytest.raises(FedrayError, match=r"^--postprocessor secagg: round 4, 12 participants: their sum of 19-bit "
                                          r"values can reach 12 · \(2\^19 − 1\), which overflows the ring Z_2\^22: set "
                                          r"secagg_value_bits ≤ 18 or raise secagg_bits$"):
        secure_sum(CLIENTS, secagg_clip=5.0, secagg_bits=22, secagg_value_bits=19)


def test_a_ring_beyond_float64s_exact_integers_stops_in_one_line():
    with pytest.raises(FedrayError, match=r"^--postprocessor secagg: round 4, 12 participants: their masked sum reaches "
                                          r"12 · 2\^50, beyond float64's exact integers \(2\^53\): set secagg_bits ≤ 49$"):
        secure_sum(CLIENTS, secagg_clip=5.0, secagg_bits=50)


def test_a_threshold_above_the_neighbours_stops_in_one_line():
    with pytest.raises(FedrayError, match=r"^--postprocessor secagg: round 4, 5 participants: secagg_threshold=5 is "
                                          r"more than a client's 4 neighbours"):
        secure_sum(CLIENTS[:5], secagg_clip=5.0, secagg_threshold=5)
    with pytest.raises(FedrayError, match=r"secagg_threshold=5 is more than a client's 4 neighbours"):
        secure_sum(CLIENTS, secagg_clip=5.0, secagg_threshold=5, secagg_neighbours=4)


def test_too_few_survivors_to_unmask_stop_the_round_in_one_line():
    with pytest.raises(FedrayError, match=r"^--postprocessor secagg: round 4: client \d+ (dropped|survived) with only "
                                          r"\d surviving neighbours, fewer than secagg_threshold=6: the server cannot "
                                          r"unmask the sum \(\d+ of 12 dropped\)$"):
        secure_sum(CLIENTS, secagg_clip=5.0, secagg_bits=40, secagg_dropout=0.6)


def test_uploads_it_cannot_mask_are_refused_in_one_line():
    process = Postprocessing((SecureAggregation(secagg_clip=1.0),), SEED).among([0, 1], 1)
    indices = fedray.Upload({"W": torch.zeros(3, 4, dtype=torch.int64)}, 1.0)
    with pytest.raises(FedrayError, match=r"^--postprocessor secagg: client 0's 'W' is torch.int64: secagg masks "
                                          r"float64 uploads"):
        process.client(indices, 0, 1, weighted=False)
    unknown = Postprocessing((SecureAggregation(secagg_clip=1.0),), SEED)
    with pytest.raises(FedrayError, match=r"^--postprocessor secagg: this stage does not tell the postprocessors"):
        unknown.statistics(upload(0), 0, 1)


@pytest.mark.parametrize("options, error", [
    ({}, "option secagg_clip is required"),
    ({"secagg_clip": "1", "secagg_bits": "0"}, "option secagg_bits must be from 1 to 53, got 0"),
    ({"secagg_clip": "1", "secagg_bits": "54"}, "option secagg_bits must be from 1 to 53, got 54"),
    ({"secagg_clip": "1", "secagg_bits": "20", "secagg_value_bits": "21"},
     "option secagg_value_bits must be from 2 to secagg_bits=20, got 21"),
    ({"secagg_clip": "1", "secagg_dropout": "1"}, r"option secagg_dropout must be in \[0, 1\), got 1.0"),
    ({"secagg_clip": "1", "secagg_dropout": "-0.1"}, r"option secagg_dropout must be in \[0, 1\), got -0.1"),
    ({"secagg_clip": "1", "secagg_threshold": "0"}, "option secagg_threshold must be ≥ 1, got 0"),
    ({"secagg_clip": "1", "secagg_neighbours": "3"}, "option secagg_neighbours must be even and ≥ 2, got 3"),
    ({"secagg_clip": "1", "secagg_masks": "drawn"}, "option secagg_masks must be model or generate, got 'drawn'"),
])
def test_options_are_checked_before_any_work(options, error):
    with pytest.raises(FedrayError, match=rf"^--postprocessor {SPEC}: {error}"):
        postprocessing(resolve({}, {"method": "fed3r", "postprocessor": SPEC, "options": options}))


class QuantizedSum(fedray.Postprocessor):
    """The reference: each client sends its quantized integers in the clear, the server decodes their float64 sum."""

    def __init__(self, quantized_clip: float = 1.0, quantized_bits: int = 1) -> None:
        super().__init__()
        self.clip, self.step = quantized_clip, quantized_clip / (2**(quantized_bits - 1) - 1)

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        return fedray.Upload({name: torch.round(tensor.clamp(-self.clip, self.clip) / self.step)
                              for name, tensor in upload.tensors.items()}, upload.weight)

    def aggregate(self, total: fedray.Params, context: fedray.UploadContext) -> fedray.Params:
        return {name: tensor * self.step for name, tensor in total.items()}


def runs(tmp_path: Path, name: str, **values) -> tuple[list[dict], dict[str, np.ndarray]]:
    config = resolve({}, {"method": "fed3r", "dataset": "synthetic:inat-geo-100?dim=8&scale=0.3&classes=6",
                          "out": str(tmp_path / name), "clients_per_round": 8, "rounds": 4, "eval_every": 2,
                          "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True, **values})
    run(config)
    rows = pq.read_table(tmp_path / name / "metrics.parquet").to_pylist()
    return [{key: row[key] for key in ("round", "accuracy")} for row in rows], dict(np.load(tmp_path / name /
                                                                                             "classifier.npz"))


def test_a_fed3r_run_through_secagg_is_the_run_through_plain_quantized_sums_bit_for_bit(ray_session, tmp_path):
    secure = runs(tmp_path, "secagg", postprocessor=SPEC,
                  options={"secagg_clip": "2000", "secagg_bits": "44", "secagg_value_bits": "36"})
    quantized = runs(tmp_path, "quantized", postprocessor="tests.postprocessors.test_secagg:QuantizedSum",
                     options={"quantized_clip": "2000", "quantized_bits": "36"})
    plain = runs(tmp_path, "plain")
    assert [row["round"] for row in secure[0]] == [2, 4]
    assert secure[0] == quantized[0] and secure[1].keys() == quantized[1].keys()
    assert all(np.array_equal(secure[1][key], quantized[1][key]) for key in secure[1])
    assert not all(np.array_equal(secure[1][key], plain[1][key]) for key in secure[1])
    assert all(np.allclose(secure[1][key], plain[1][key], atol=1e-4) for key in secure[1])


@pytest.mark.parametrize("method", ["fed3r", "fedavg"])
def test_modelled_and_generated_masks_give_a_runs_classifier_and_rows_bit_for_bit(secagg_registered, ray_session,
                                                                                 tmp_path, method):
    """Through --secure-aggregation with dropouts on SecAgg+'s graph, on 2 shards: a closed form's blocks of 16
    uploads, a training round's 8; only the option and the run's timings differ."""
    options = {"secagg_clip": "1000", "secagg_dropout": "0.2", "secagg_neighbours": "4", "secagg_threshold": "2"}
    modelled = trained(tmp_path, "model", method=method, secure_aggregation=True, options=options)
    generated = trained(tmp_path, "generate", method=method, secure_aggregation=True,
                        options={**options, "secagg_masks": "generate"})
    assert modelled[1].keys() == generated[1].keys()
    assert all(np.array_equal(modelled[1][key], generated[1][key]) for key in modelled[1])
    timings = {key for key in modelled[0][0] if key.endswith("_s") or "time" in key} | {"secagg_masks"}
    assert [{key: row[key] for key in row if key not in timings} for row in modelled[0]] == \
        [{key: row[key] for key in row if key not in timings} for row in generated[0]]
    assert sum(row["secagg_dropped"] or 0 for row in modelled[0]) > 0  # round 0 has none


@pytest.fixture
def secagg_registered(monkeypatch):
    """``secagg`` by name as pyproject.toml registers it (an install made before it was added does not list it)."""
    monkeypatch.setitem(postprocessor_module.BUILT_IN, "secagg", SPEC)


@pytest.mark.parametrize("given", [{}, {"postprocessor": "secagg"}])
def test_secure_aggregation_adds_secagg_last_and_once(secagg_registered, given):
    config = resolve({}, {"method": "fed3r", "secure_aggregation": True, "options": {"secagg_clip": "3"}, **given})
    built = postprocessing(config).postprocessors
    assert config.postprocessor == "secagg" and len(built) == 1 and isinstance(built[0], SecureAggregation)
    assert built[0].clip == 3.0 and built[0].bits is None


def test_secure_aggregation_without_its_clip_stops_before_any_work(secagg_registered):
    with pytest.raises(FedrayError, match=r"^--postprocessor secagg: option secagg_clip is required"):
        postprocessing(resolve({}, {"method": "fed3r", "secure_aggregation": True}))


def training(group: int, smallest: int | None = None) -> fedray.StageUploads:
    return fedray.StageUploads("training", True, Sampling(100, group, False), 10, group,
                               group if smallest is None else smallest)


@pytest.mark.parametrize("options, stages, error", [
    # t = 5 needs ≥ 6 participants; the last round of a pass holds 100 mod 8 = 4
    ({"secagg_threshold": 5}, (training(8, 4),),
     r"the training stage's smallest aggregate of 4 uploads: secagg_threshold=5 is more than a client's 3 neighbours"),
    # by default t is a majority of a client's neighbours: a group of one has none
    ({}, (closed_form_uploads("closed form", Sampling(721, 6, False), 121, 2),),
     r"the closed form stage's smallest aggregate of 1 uploads: secagg_threshold=1 is more than a client's 0 neighbours"),
    # SecAgg+ with k = 8 neighbours: t = 6 of them
    ({"secagg_neighbours": 8, "secagg_threshold": 6}, (training(30), training(20)),
     None),
    ({"secagg_neighbours": 8, "secagg_threshold": 9}, (training(30),),
     r"the training stage's smallest aggregate of 30 uploads: secagg_threshold=9 is more than a client's 8 "
     r"neighbours: no client's seeds could ever be reconstructed$"),
    ({"secagg_neighbours": 8}, (training(30), training(8)),
     r"the training stage's aggregates of up to 8 uploads: secagg_neighbours=8 is more than a client's 7 others"),
    # 16 · 2^49 = 2^53 fits float64's integers, 2^20 · 2^49 does not
    ({"secagg_bits": 49}, (training(16), StageUploads("calibration", False, Sampling(2**20, 2**20), 1, 2**20, 2**20)),
     r"the calibration stage's aggregates of up to 1048576 uploads: their masked sum reaches 1048576 · 2\^49, beyond "
     r"float64's exact integers \(2\^53\): set secagg_bits ≤ 33"),
    ({"secagg_bits": 30, "secagg_value_bits": 27}, (training(8), training(9)),
     r"the training stage's aggregates of up to 9 uploads: their sum of 27-bit values can reach 9 · \(2\^27 − 1\), "
     r"which overflows the ring Z_2\^30: set secagg_value_bits ≤ 26 or raise secagg_bits"),
    # a group only the draws tell is checked as it forms
    ({"secagg_threshold": 5}, (closed_form_uploads("closed form", Sampling(100, 8, True), 30, 2),), None),
    # FedCOF's mean rows are never added
    ({}, (closed_form_uploads("closed form", Sampling(100, 8, False), 13, 2, summed=False),),
     r"the closed form stage's uploads \(like fedcof's mean rows\) are kept side by side by the server, never added"),
])
def test_groups_the_ring_or_threshold_cannot_serve_are_refused_before_the_run(options, stages, error):
    secagg = SecureAggregation(secagg_clip=1.0, **options)
    if error is None:
        secagg.start(stages)
        return
    with pytest.raises(ValueError, match=f"^{error}"):
        secagg.start(stages)


DATASET = "synthetic:inat-geo-100?dim=8&scale=0.2&classes=6"
"""721 clients."""


@pytest.mark.parametrize("argv, error", [
    (["--method", "fed3r", "--clients-per-round", "8", "--eval-every", "2", "--option", "secagg_threshold=4"],
     "the closed form stage's smallest aggregate of 1 uploads: secagg_threshold=4 is more than a client's 0 "
     "neighbours: no client's seeds could ever be reconstructed (a group needs ≥ t + 1 participants)"),
    (["--method", "fedavg", "--rounds", "3", "--clients-per-round", "6", "--option", "secagg_neighbours=6"],
     "the training stage's aggregates of up to 6 uploads: secagg_neighbours=6 is more than a client's 5 others: leave "
     "it out for all pairs (SecAgg)"),
    (["--method", "fedncm", "--clients-per-round", "721", "--option", "secagg_bits=45"],
     "the closed form stage's aggregates of up to 721 uploads: their masked sum reaches 721 · 2^45, beyond "
     "float64's exact integers (2^53): set secagg_bits ≤ 43"),
    (["--method", "fedavg", "--rounds", "3", "--clients-per-round", "6", "--sampling", "poisson"],
     "the training stage samples clients by --sampling poisson: each round holds a random number of them, which can "
     "be none or fewer than the secagg_threshold + 1 a group needs to be unmasked (real SecAgg aborts such a round); "
     "use --sampling without or with (κ = --clients-per-round clients every round)"),
])
def test_the_command_line_refuses_them_in_one_line_with_nothing_written(secagg_registered, capsys, tmp_path, argv,
                                                                         error):
    out = tmp_path / "refused"
    capsys.readouterr()
    rc = main(["run", "--dataset", DATASET, "--secure-aggregation", "--option", "secagg_clip=10", *argv,
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err == f"fedray: error: --postprocessor secagg: {error}\n"
    assert not out.exists()


def update(client: int) -> fedray.Upload:
    """A client's float32 training update (a head's W and b) and its weight n_k: weighted, some entries beyond 30."""
    rng = np.random.default_rng(100 + client)
    return fedray.Upload({"weight": torch.from_numpy(rng.normal(scale=0.8, size=(4, 3)).astype(np.float32)),
                          "bias": torch.from_numpy(rng.normal(scale=0.8, size=3).astype(np.float32))},
                         float(rng.integers(5, 40)))


@pytest.mark.parametrize("masks", ["model", "generate"])
@pytest.mark.parametrize("neighbours", [None, 6])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_training_rounds_unmasked_sum_is_the_plain_sum_of_the_quantized_weighted_updates(neighbours, dropout, masks):
    clip, step = 30.0, 30.0 / (2**19 - 1)
    process = Postprocessing((SecureAggregation(secagg_clip=clip, secagg_bits=40, secagg_value_bits=20,
                                                secagg_dropout=dropout, secagg_neighbours=neighbours,
                                                secagg_threshold=2, secagg_masks=masks),), SEED).among(CLIENTS, ROUND)
    sums, weight, sent = None, 0.0, []
    for client in CLIENTS:  # the shards' loop (heads.py): each upload through the hooks, added as they say
        processed = process.client(update(client), client, ROUND)
        sums, weight = add_upload(sums, processed, FedAvg(), weighted=not process.exact), weight + processed.weight
        sent.append(processed)
    with reporting({}):
        total = process.aggregate(sums, ROUND, len(CLIENTS))
    survivors = ~dropped(len(CLIENTS), dropout)
    expected: dict[str, int] = {}
    for client, alive in zip(CLIENTS, survivors):  # w_k · Δ_k in float64, clipped, quantized, added as integers
        if alive:
            own = update(client)
            for name, tensor in own.tensors.items():
                weighted = np.clip(own.weight * tensor.numpy().astype(np.float64), -clip, clip)
                expected[name] = expected.get(name, 0) + np.rint(weighted / step).astype(np.int64).astype(object)
    for name in ("weight", "bias"):
        decoded = expected[name].astype(np.int64).astype(np.float64) * step
        assert total[name].dtype == torch.float64 and torch.equal(total[name], torch.from_numpy(decoded))
    assert weight == sum(update(client).weight for client, alive in zip(CLIENTS, survivors) if alive)
    assert max(float(update(client).weight * update(client).tensors["weight"].abs().max()) for client in CLIENTS) > clip
    for client, processed, alive in zip(CLIENTS, sent, survivors):
        values = torch.cat([processed.tensors["weight"].flatten(), processed.tensors["bias"]])
        assert values.dtype == torch.float64 and torch.equal(values, values.round()) and values.max() < 2**40
        if not alive:
            assert not values.any() and processed.weight == 0
        elif masks == "generate":  # masked over the ring
            assert values.min() >= 0 and values.max() > 2**30
        else:  # the integers q − h = rint(clip(w_k · Δ_k) / Δ) the masks leave once they cancel
            own = update(client)
            weighted = [own.weight * own.tensors[name].numpy().astype(np.float64).ravel()
                        for name in ("weight", "bias")]
            assert np.array_equal(values.numpy(), np.rint(np.clip(np.concatenate(weighted), -clip, clip) / step))


def test_a_training_round_whose_sum_could_overflow_the_ring_stops_in_one_line():
    process = Postprocessing((SecureAggregation(secagg_clip=30.0, secagg_bits=24, secagg_value_bits=22),),
                             SEED).among(CLIENTS, ROUND)
    with pytest.raises(FedrayError, match=r"^--postprocessor secagg: round 4, 12 participants: their sum of 22-bit "
                                          r"values can reach 12 · \(2\^22 − 1\), which overflows the ring Z_2\^24"):
        process.client(update(3), 3, ROUND)


class QuantizedWeighted(fedray.Postprocessor):
    """The reference for training: each client sends its weighted update's quantized integers in the clear, added
    exactly; the server decodes their sum."""

    def __init__(self, quantized_clip: float = 1.0, quantized_bits: int = 1) -> None:
        super().__init__()
        self.clip, self.step = quantized_clip, quantized_clip / (2**(quantized_bits - 1) - 1)

    @property
    def exact_sum(self) -> bool:
        return True

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        return fedray.Upload({name: torch.round(tensor.clamp(-self.clip, self.clip) / self.step)
                              for name, tensor in upload.tensors.items()}, upload.weight)

    def aggregate(self, total: fedray.Params, context: fedray.UploadContext) -> fedray.Params:
        return {name: tensor * self.step for name, tensor in total.items()}


def trained(tmp_path: Path, name: str, **values) -> tuple[list[dict], dict[str, np.ndarray]]:
    config = resolve({}, {"dataset": DATASET, "out": str(tmp_path / name), "clients_per_round": 8,
                          "rounds": 4, "eval_every": 2, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
                          "client_lr": 0.05, "local_epochs": 1, "batch_size": 8, **values}, drop_unused=True)
    run(config)
    rows = pq.read_table(tmp_path / name / "metrics.parquet").to_pylist()
    return rows, dict(np.load(tmp_path / name / "classifier.npz"))


@pytest.mark.parametrize("method", ["fedavg", "scaffold", "fednova"])  # the dual form, with control variates, autograd
def test_a_training_run_through_secagg_is_the_run_through_exact_quantized_weighted_sums_bit_for_bit(ray_session,
                                                                                                   tmp_path, method):
    secure = trained(tmp_path, "secagg", method=method, postprocessor=SPEC,
                     options={"secagg_clip": "200", "secagg_bits": "48", "secagg_value_bits": "44"})
    quantized = trained(tmp_path, "quantized", method=method,
                        postprocessor="tests.postprocessors.test_secagg:QuantizedWeighted",
                        options={"quantized_clip": "200", "quantized_bits": "44"})
    assert [row["round"] for row in secure[0]] == [0, 2, 4]
    assert [row["accuracy"] for row in secure[0]] == [row["accuracy"] for row in quantized[0]]
    assert all(np.array_equal(secure[1][key], quantized[1][key]) for key in secure[1])
    assert secure[0][-1]["secagg_dropped"] == 0
    if method == "fedavg":  # W and b: 8 · 6 + 6 values on 48 bits; close to the plain run, not equal
        assert secure[0][-1]["secagg_masked_bytes"] == (8 * 6 + 6) * 48 // 8
        plain = trained(tmp_path, "plain", method=method)
        assert not all(np.array_equal(secure[1][key], plain[1][key]) for key in secure[1])
        assert all(np.allclose(secure[1][key], plain[1][key], atol=1e-5) for key in secure[1])


class Recording(SecureAggregation):
    """secagg, writing where each client's upload was masked to ``log`` (its whole upload's hook, or its entry map at
    the classes it holds): the process, the client, the round and the group."""

    def __init__(self, log: Annotated[str, "the file the hooks' places are written to"] = "",
                 secagg_clip: Annotated[float | None, "C"] = None) -> None:
        super().__init__(secagg_clip=secagg_clip, secagg_neighbours=2)
        self.log = log

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        self.record(context)
        return super().client(upload, context)

    def entry_map(self, context: fedray.UploadContext):
        self.record(context)
        return super().entry_map(context)

    def record(self, context: fedray.UploadContext) -> None:
        with open(self.log, "a") as log:
            log.write(json.dumps([os.getpid(), context.client, context.round, list(context.participants)]) + "\n")


def test_the_masks_are_drawn_in_the_shards_for_each_blocks_uploaders_only(ray_session, tmp_path):
    log = tmp_path / "hooks.log"
    config = resolve({}, {"method": "fed3r", "dataset": DATASET, "out": str(tmp_path / "run"), "clients_per_round": 8,
                          "rounds": 5, "eval_every": 2, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
                          "postprocessor": "tests.postprocessors.test_secagg:Recording",
                          "options": {"log": str(log), "secagg_clip": "2000"}})
    run(config)
    hooks = [json.loads(line) for line in log.read_text().splitlines()]
    rounds = pq.read_table(tmp_path / "run" / "metrics.parquet").column("round").to_pylist()
    assert rounds == [2, 4, 5] and len(hooks) == 40  # 5 rounds of 8 clients, each uploading once
    assert os.getpid() not in {pid for pid, *_ in hooks}  # not in the driver: in the shards
    blocks: dict[int, set[int]] = {}  # the blocks' uploaders: rounds 1–2, 3–4 and 5
    for _, client, round_number, _ in hooks:
        blocks.setdefault((round_number + 1) // 2, set()).add(client)
    assert [len(blocks[block]) for block in (1, 2, 3)] == [16, 16, 8]
    for _, client, round_number, participants in hooks:  # each hook masked among its block's uploaders, no one else
        assert participants == sorted(blocks[(round_number + 1) // 2])


def tct_stage2(clients, held_out, postprocessor: fedray.Postprocessor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """TCT's stage 2 on the six test clients (normalization, closed form, 8 SCAFFOLD rounds of 3) through
    ``postprocessor``, on shards of its own (they keep the clients' control variates): the closed form's and
    SCAFFOLD's models, and the rows."""
    sizes = np.array([len(c.labels) for c in clients])
    config = RunConfig(method="tct", tct_solver="both", tct_rounds=8, tct_local_steps=5, tct_lr=0.05,
                       clients_per_round=3, eval_every=4, seed=3).resolved()
    sampler = Sampler(len(sizes), config.per_round(len(sizes)), config.sampling == "with", config.seed)
    start = EvalPoint(7, 0, 0, 0.5, 0.0, 0.0, 0.0, 0.0, "train")
    pool = tct_shards.start_pool(None, clients, held_out)
    try:
        run = Stage2Run(stages(config)[-1], sampler, config.eval_every, pool, sizes, tct_clients.NUM_CLASSES, 20,
                        [start], Accounting(np.zeros(len(sizes), dtype=bool)),
                        postprocessing=Postprocessing((postprocessor,), 3))
        normalization = run.normalize()
        return run.closed_form(normalization), run.scaffold(normalization), run.points
    finally:
        pool.shutdown()


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_tct_stage2_through_secagg_is_stage2_through_exact_quantized_sums_bit_for_bit(ray_session, tct_clients_data,
                                                                                      tct_held_out):
    secure = tct_stage2(tct_clients_data, tct_held_out, SecureAggregation(secagg_clip=1e5, secagg_bits=47,
                                                                          secagg_value_bits=44))
    quantized = tct_stage2(tct_clients_data, tct_held_out, QuantizedWeighted(quantized_clip=1e5, quantized_bits=44))
    plain = tct_stage2(tct_clients_data, tct_held_out, fedray.Postprocessor())
    for got, expected, close in zip(secure[:2], quantized[:2], plain[:2]):
        assert torch.equal(got, expected) and not torch.equal(got, close) and torch.allclose(got, close, atol=1e-5)
    assert [row.stage for row in secure[2][1:]] == ["tct_closed_form", "tct_scaffold", "tct_scaffold"]
    assert all(row.reported["secagg_dropped"] == 0 for row in secure[2][1:])
    assert secure[2][-1].reported["secagg_server_reconstructions"] == 3  # a SCAFFOLD round's 3 clients


@pytest.fixture(scope="module")
def tct_clients_data():
    return tct_clients.label_skewed(seed=4)


@pytest.fixture(scope="module")
def tct_held_out():
    held = tct_clients.label_skewed(seed=5, num_clients=4)
    return tct_shards.ClientData(torch.cat([c.features for c in held]), torch.cat([c.labels for c in held]))


def survivors(participants: np.ndarray, group_round: int, rate: float, seed: int = 0) -> np.ndarray:
    """The documented dropouts of a group: its sorted participants, one Philox U[0, 1) draw each from stream 1 of the
    group's shared seed (the run's seed, the aggregate's round, the postprocessor's place 0), those at or above
    ``rate`` surviving."""
    shared = int(np.random.SeedSequence((seed, group_round, 0, 0)).generate_state(2, np.uint64)[0] & (2**63 - 1))
    ordered = np.sort(participants)
    uniform = np.random.Generator(np.random.Philox(np.random.SeedSequence((shared, 1)))).random(len(ordered))
    return ordered[uniform >= rate]


@pytest.mark.parametrize("method, blocks", [("fedncm", ((1, 2), (3, 4))), ("fedavg", ((1,), (2,), (3,)))])
def test_with_dropouts_the_rows_count_only_the_uploads_that_reached_the_server(ray_session, tmp_path, method, blocks):
    """fedncm: an evaluation block of 2 rounds is one aggregate; fedavg: a round is. A dropped client's upload is not
    seen, nor its samples, nor its bytes; what it computed and downloaded is counted as in the plain run."""
    common = {"method": method, "dataset": DATASET, "clients_per_round": 8, "rounds": len(blocks) * len(blocks[0]),
              "eval_every": len(blocks[0]), "num_shards": 1, "cpus_per_shard": 0.5, "quiet": True,
              **({"client_lr": 0.05} if method == "fedavg" else {})}
    secure = fedray.run(**common, out=tmp_path / "secure", postprocessor=SPEC,
                        options={"secagg_clip": 1000.0, "secagg_dropout": 0.3, "secagg_threshold": 2})
    plain = fedray.run(**common, out=tmp_path / "plain")
    rows = secure.metrics.filter(pl.col("round") > 0).to_dicts()
    plain_rows = plain.metrics.filter(pl.col("round") > 0).to_dicts()
    federation = load_federation(DATASET)  # d = 8, C = 6
    # fedncm uploads a mean of d floats per class it holds (M·d); fedavg its head, W (d × C) and b (C); float32
    floats = federation.client_num_classes * 8.0 if method == "fedncm" else np.full(federation.num_clients, 8 * 6 + 6.0)
    seen: set[int] = set()
    arrived = bytes_up = 0
    expected = []
    for block in blocks:
        participants = np.concatenate([secure.rounds[number - 1] for number in block])
        alive = survivors(participants, block[-1], 0.3)
        seen |= set(alive.tolist())
        arrived += len(alive)
        bytes_up += 4 * float(floats[alive].sum())
        expected.append((len(seen), int(federation.client_sizes[sorted(seen)].sum()), bytes_up))
    assert [(row["clients_seen"], row["samples_seen"], row["bytes_up"]) for row in rows] == expected
    assert sum(row["secagg_dropped"] for row in rows) == len(blocks) * len(blocks[0]) * 8 - arrived > 0
    assert [row["bytes_down"] for row in rows] == [row["bytes_down"] for row in plain_rows]
    assert [row["forward_passes"] for row in rows] == [row["forward_passes"] for row in plain_rows]
