"""dp (sample-level DP for FedNCM and Fed3R): ε from dp-accounting against the analytic Gaussian mechanism (Balle & Wang
2018) computed here with scipy, calibration, the clip, central and distributed noise of the same variance, runs whose
rows carry dp_epsilon and dp_delta, and the one-line refusals."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.optimize
import scipy.stats
import torch

import fedray
from fedray.core.errors import FedrayError
from fedray.core.reports import reporting
from fedray.engine.config import RunConfig, resolve
from fedray.engine.plan import postprocessing
from fedray.engine.run_config import run
from fedray.methods import Fed3R, FedCOF, FedNCM
from fedray.methods.base import ClientBatch
from fedray.methods.fedcof import MeanBlock, MeanRows
from fedray.methods.ncm import ClassSums
from fedray.methods.postprocessor import Postprocessing, Sampling, StageUploads
from fedray.methods.ridge import RidgeStatistics
from fedray.postprocessors.dp import GaussianMechanism, calibrated, epsilon

SPEC = "fedray.postprocessors.dp:GaussianMechanism"
DATASET = "synthetic:inat-geo-100?dim=24&scale=0.3&classes=20"
NCM_PARTS, RIDGE_PARTS, COF_PARTS = FedNCM(5, 4).upload_parts(), Fed3R(5, 4).upload_parts(), FedCOF(3, 4).upload_parts()


def analytic_epsilon(mu: float, delta: float) -> float:
    """The exact ε(δ) of a Gaussian mechanism whose sensitivity is ``mu`` standard deviations (Balle & Wang 2018, Thm 8):
    δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ), solved for ε."""
    norm = scipy.stats.norm
    return scipy.optimize.brentq(lambda eps: norm.cdf(mu / 2 - eps / mu) - math.exp(eps + norm.logcdf(-mu / 2 - eps / mu))
                                 - delta, 0.0, 200.0, xtol=1e-12)


def one_release(noise: float) -> float:
    """An upload's two tensors, each of multiplier σ, are one Gaussian mechanism of sensitivity √2/σ std devs."""
    return math.sqrt(2) / noise


@pytest.mark.parametrize("noise, delta", [(0.7, 1e-5), (1.0, 1e-5), (2.0, 1e-6), (5.0, 1e-3), (3.0, 1e-8)])
def test_the_accountants_epsilon_is_the_analytic_gaussian_mechanisms(noise, delta):
    """PLD: within 0.5% and not below (it is an upper bound); RDP: an upper bound, looser."""
    exact = analytic_epsilon(one_release(noise), delta)
    pld = epsilon(noise, delta, "pld")
    assert exact * (1 - 1e-6) <= pld <= exact * 1.005
    assert exact < epsilon(noise, delta, "rdp") < exact * 1.5


@pytest.mark.parametrize("target, delta", [(0.5, 1e-5), (2.0, 1e-5), (8.0, 1e-6)])
def test_a_calibrated_noise_gives_back_its_budget(target, delta):
    noise = calibrated(target, delta)
    assert target * 0.99 <= analytic_epsilon(one_release(noise), delta) <= target
    built = GaussianMechanism(clip_norm=1.0, dp_delta=delta, dp_epsilon=target)
    assert built.noise == noise


def test_the_clip_bounds_each_row_and_leaves_rows_within_it_bit_for_bit():
    rows = torch.from_numpy(np.random.default_rng(0).normal(size=(50, 7)) * np.linspace(0.05, 1.0, 50)[:, None])
    clipped = GaussianMechanism(clip_norm=1.5, dp_delta=1e-5, dp_noise=1.0).features(rows)
    norms = torch.linalg.vector_norm(rows, dim=1)
    inside = norms <= 1.5
    assert 0 < int(inside.sum()) < 50
    assert torch.equal(clipped[inside], rows[inside])
    assert torch.allclose(torch.linalg.vector_norm(clipped[~inside], dim=1), torch.full(((~inside).sum(),), 1.5,
                                                                                          dtype=torch.float64), atol=1e-12)
    cos = torch.nn.functional.cosine_similarity(clipped[~inside], rows[~inside], dim=1)
    assert torch.allclose(cos, torch.ones_like(cos), atol=1e-12)


KAPPA, NOISE, CLIP = 8, 1.3, 0.7


def noise_draws(placement: str, upload, parts: fedray.UploadParts, blocks: int = 300) -> dict[str, np.ndarray]:
    """The noise in ``blocks`` blocks' sums of κ zero uploads, by tensor name."""
    pipeline = Postprocessing((GaussianMechanism(clip_norm=CLIP, dp_delta=1e-5, dp_noise=NOISE, dp_placement=placement),),
                              seed=3).sampled(100, KAPPA, False)
    pipeline.features(torch.zeros(1, upload.sums.shape[1] if hasattr(upload, "sums") else upload.gram.shape[0],
                                  dtype=torch.float64))
    draws: dict[str, list] = {}
    for block in range(blocks):
        total = None
        for client in range(KAPPA):
            stats = pipeline.statistics(upload, block * KAPPA + client, block, parts)
            total = stats if total is None else type(stats)(*(a + b for a, b in zip(vars(total).values(), vars(stats).values())))
        with reporting({}):
            noisy = pipeline.aggregate(total, block, KAPPA, parts)
        for name, value in vars(noisy).items():
            draws.setdefault(name, []).append(value.numpy())
    return {name: np.stack(values) for name, values in draws.items()}


def test_central_and_distributed_noise_have_the_same_total_variance():
    """κ clients' shares σΔ/√κ sum to the central σΔ: both placements' block noise is N(0, (σΔ)²) per entry (KS over
    thousands of draws), Δ = R for FedNCM's sums and Fed3R's ZᵀY, R² for ZᵀZ (diagonal and off-diagonal alike); a
    distribution of the wrong variance (σΔ/√κ, one client's share) is rejected. Counts: clamped at 0 after the noise."""
    ncm = ClassSums(torch.zeros(4, dtype=torch.float64), torch.zeros(4, 5, dtype=torch.float64))
    ridge = RidgeStatistics(torch.zeros(5, 5, dtype=torch.float64), torch.zeros(5, 4, dtype=torch.float64))
    for placement in ("central", "distributed"):
        sums, gram = noise_draws(placement, ncm, NCM_PARTS), noise_draws(placement, ridge, RIDGE_PARTS, blocks=120)
        expected = {"sums": NOISE * CLIP, "targets": NOISE * CLIP}
        for name, values in (("sums", sums["sums"]), ("targets", gram["targets"])):
            assert scipy.stats.kstest(values.ravel(), scipy.stats.norm(scale=expected[name]).cdf).pvalue > 1e-3
        assert scipy.stats.kstest(sums["sums"].ravel(),
                                  scipy.stats.norm(scale=NOISE * CLIP / math.sqrt(KAPPA)).cdf).pvalue < 1e-9
        counts = sums["counts"].ravel()  # max(N(0, σ²), 0): half zeros, the rest the positive half of N(0, σ²)
        assert abs((counts == 0).mean() - 0.5) < 0.05
        assert scipy.stats.kstest(counts[counts > 0], scipy.stats.halfnorm(scale=NOISE).cdf).pvalue > 1e-3
        # ZᵀZ: symmetric noise, projected onto the PSD cone; before the projection each upper entry is N(0, (σR²)²):
        # checked on the symmetric part's eigenvalues being ≥ 0 and on the unprojected draws below.
        assert np.allclose(gram["gram"], np.swapaxes(gram["gram"], 1, 2))
        assert np.linalg.eigvalsh(gram["gram"]).min() > -1e-12


def test_the_gram_noise_is_symmetric_with_every_upper_entry_of_variance_sigma_r_squared_squared():
    from fedray.postprocessors.dp import noisy
    generator = torch.Generator().manual_seed(0)
    scale = NOISE * CLIP**2
    zeros = {"gram": torch.zeros(6, 6, dtype=torch.float64)}
    draws = np.stack([noisy(zeros, {"gram": scale}, generator, RIDGE_PARTS)["gram"].numpy() for _ in range(400)])
    assert np.array_equal(draws, np.swapaxes(draws, 1, 2))
    upper = np.triu_indices(6, 1)
    for values in (draws[:, upper[0], upper[1]].ravel(), np.diagonal(draws, axis1=1, axis2=2).ravel()):
        assert scipy.stats.kstest(values, scipy.stats.norm(scale=scale).cdf).pvalue > 1e-3


def runs(tmp_path: Path, name: str, method: str, **options) -> list[dict]:
    config = resolve({}, {"method": method, "dataset": DATASET, "out": str(tmp_path / name), "clients_per_round": 8,
                          "rounds": 6, "eval_every": 3, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
                          "postprocessor": SPEC, "options": {key: str(value) for key, value in options.items()}})
    run(config)
    return pq.read_table(tmp_path / name / "metrics.parquet").to_pylist()


class ClipOnly(fedray.Postprocessor):
    """Only the features hook: each row clipped to ``radius`` (no noise)."""

    def __init__(self, radius: float = 1.0) -> None:
        super().__init__()
        self.radius = radius

    def features(self, features: torch.Tensor) -> torch.Tensor:
        norms = torch.linalg.vector_norm(features, dim=1, keepdim=True)
        return torch.where(norms > self.radius, features * (self.radius / norms), features)


def classifier_of(tmp_path: Path, name: str, **values) -> dict[str, np.ndarray]:
    config = resolve({}, {"method": "fedncm", "dataset": DATASET, "out": str(tmp_path / name), "clients_per_round": 8,
                          "rounds": 6, "eval_every": 3, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True, **values})
    run(config)
    return dict(np.load(tmp_path / name / "classifier.npz"))


def test_a_features_hook_that_reaches_no_row_is_the_plain_run_bit_for_bit_and_one_that_does_is_not(ray_session, tmp_path):
    """Through the shards: a clip above every row's norm changes no bit (the batched sum stands), a clip below does."""
    clip = {"postprocessor": "tests.postprocessors.test_dp:ClipOnly"}
    plain = classifier_of(tmp_path, "plain")
    loose = classifier_of(tmp_path, "loose", **clip, options={"radius": "1e9"})
    tight = classifier_of(tmp_path, "tight", **clip, options={"radius": "0.01"})
    assert plain.keys() == loose.keys() and all(np.array_equal(plain[key], loose[key]) for key in plain)
    assert np.abs(plain["W"] - tight["W"]).max() > 1e-3


@pytest.mark.parametrize("budget", [{"dp_noise": "0"}, {"dp_noise": "0", "dp_placement": "distributed"}])
def test_no_noise_with_a_clip_no_row_reaches_is_the_plain_run_bit_for_bit(ray_session, tmp_path, budget):
    """σ = 0 draws nothing and projects nothing: the classifier is the plain run's, every row says ε = ∞."""
    plain = classifier_of(tmp_path, "plain")
    private = classifier_of(tmp_path, "private", postprocessor=SPEC,
                            options={"clip_norm": "1e9", "dp_delta": "1e-5", **budget})
    assert plain.keys() == private.keys() and all(np.array_equal(plain[key], private[key]) for key in plain)
    rows = pq.read_table(tmp_path / "private" / "metrics.parquet").to_pylist()
    assert rows and all(row["dp_epsilon"] == math.inf and row["dp_delta"] == 1e-5 for row in rows)


def test_a_fed3r_run_reports_the_epsilon_of_one_release_in_every_row(ray_session, tmp_path):
    rows = runs(tmp_path, "central", "fed3r", clip_norm=2.0, dp_noise=2.0, dp_delta=1e-5)
    exact = analytic_epsilon(one_release(2.0), 1e-5)
    assert [row["round"] for row in rows] == [3, 6]
    assert all(row["dp_delta"] == 1e-5 and exact <= row["dp_epsilon"] <= exact * 1.005 for row in rows)
    assert all(0 < row["accuracy"] <= 1 for row in rows)
    assert "dp_rdp_orders" not in rows[0]  # a PLD run's


def test_an_rdp_run_names_the_orders_its_epsilon_was_minimized_over_all_of_them_for_a_gaussian(ray_session, tmp_path):
    rows = runs(tmp_path, "rdp", "fed3r", clip_norm=2.0, dp_noise=2.0, dp_delta=1e-5, dp_accountant="rdp")
    assert [row["dp_rdp_orders"] for row in rows] == ["1.1-1024", "1.1-1024"]


def test_a_distributed_fedncm_run_reports_each_blocks_own_noise(ray_session, tmp_path):
    """Blocks of 24 new uploaders at κ = 8 carry 3 κ-shares of noise: multiplier σ√3."""
    rows = runs(tmp_path, "distributed", "fedncm", clip_norm=2.0, dp_noise=1.0, dp_delta=1e-5, dp_placement="distributed")
    exact = analytic_epsilon(one_release(math.sqrt(3)), 1e-5)
    assert all(exact <= row["dp_epsilon"] <= exact * 1.005 for row in rows)
    assert all(0 < row["accuracy"] <= 1 for row in rows)


def test_an_upload_that_is_not_a_sum_stops_at_its_first_upload(ray_session, tmp_path):
    """fedcof-oracle's covariances: refused on the first client, nothing written."""
    with pytest.raises(FedrayError, match=r"^--postprocessor dp: an upload of counts, sums, gram is not supported"):
        runs(tmp_path, "oracle", "fedcof-oracle", clip_norm=1.0, dp_noise=1.0, dp_delta=1e-5)
    assert not (tmp_path / "oracle" / "metrics.parquet").exists()


# --- FedCOF: per mean row, noisy count and sum, released above a threshold


def mean_rows(classes: list[int], counts: list[float], sums: np.ndarray, num_classes: int) -> MeanRows:
    """A FedCOF client's upload holding ``classes`` with ``counts`` and class ``sums`` (rows), as client_statistics
    makes it."""
    totals = torch.zeros(num_classes, dtype=torch.float64)
    totals[classes] = torch.tensor(counts, dtype=torch.float64)
    class_sums = torch.zeros(num_classes, sums.shape[1], dtype=torch.float64)
    class_sums[classes] = torch.from_numpy(sums)
    block = MeanBlock(torch.tensor(classes), totals[classes], class_sums[classes] / totals[classes].unsqueeze(1))
    return MeanRows(totals, class_sums, (totals > 0).to(torch.float64), [block])


def test_fedcofs_rows_are_the_gaussian_mechanism_with_thresholding_written_out():
    """The client hook against the mechanism written out here from the same seeded generator: r count draws N(0, σ²),
    then r × d sum draws N(0, (σR)²); rows with ñ ≥ τ = 1 + σ Φ⁻¹(1 − δ/2) released as (ñ, s̃/ñ), the others count 0,
    mean 0, not received; the class totals those of the released rows."""
    noise, clip, delta = 2.0, 1.5, 1e-5
    sums = np.random.default_rng(1).normal(size=(4, 3))
    stats = mean_rows([1, 2, 4, 6], [1.0, 3.0, 12.0, 7.0], sums, 8)
    pipeline = Postprocessing((GaussianMechanism(clip_norm=clip, dp_delta=delta, dp_noise=noise,
                                                 dp_placement="distributed"),), seed=5).sampled(100, 10, False)
    pipeline.features(torch.zeros(1, 3, dtype=torch.float64))
    out = pipeline.statistics(stats, 17, 2, COF_PARTS)

    generator = pipeline._generator(2, 17, 0)()  # made when a hook draws
    count = np.array([1.0, 3.0, 12.0, 7.0]) + noise * torch.randn(4, generator=generator, dtype=torch.float64).numpy()
    total = sums + noise * clip * torch.randn((4, 3), generator=generator, dtype=torch.float64).numpy()
    threshold = 1 + noise * scipy.stats.norm.isf(delta / 2)
    released = count >= threshold
    assert 0 < released.sum() < 4  # the seed releases some rows and not others
    block = out.blocks[0]
    assert block.classes.tolist() == [1, 2, 4, 6]
    assert np.allclose(block.counts.numpy(), np.where(released, count, 0), rtol=0, atol=1e-12)
    assert np.allclose(block.means.numpy(), np.where(released[:, None], total / np.where(released, count, 1)[:, None], 0),
                       rtol=1e-12, atol=1e-12)
    expected_counts, expected_sums = np.zeros(8), np.zeros((8, 3))
    expected_counts[[1, 2, 4, 6]] = np.where(released, count, 0)
    expected_sums[[1, 2, 4, 6]] = np.where(released[:, None], total, 0)
    assert np.allclose(out.counts.numpy(), expected_counts, rtol=0, atol=1e-12)
    assert np.allclose(out.sums.numpy(), expected_sums, rtol=0, atol=1e-12)
    expected_received = np.zeros(8)
    expected_received[[1, 2, 4, 6]] = released
    assert out.received.numpy().tolist() == expected_received.tolist()


@pytest.mark.parametrize("noise, delta, share", [(1.0, 1e-5, 0.5), (3.0, 1e-6, 0.2), (0.5, 1e-3, 0.9)])
def test_the_threshold_lets_an_absent_class_appear_with_probability_delta_tau(noise, delta, share):
    """τ = 1 + σΦ⁻¹(1 − δ_τ), δ_τ = share·δ: a row of one sample (the neighbour where the class is absent has no row)
    clears τ with probability P(1 + N(0, σ²) ≥ τ) = δ_τ, computed here with scipy."""
    mechanism = GaussianMechanism(clip_norm=1.0, dp_delta=delta, dp_noise=noise, dp_threshold_share=share)
    tau = mechanism.threshold()
    assert scipy.stats.norm.sf(tau - 1, scale=noise) == pytest.approx(share * delta, rel=1e-9)


def test_fedcofs_epsilon_is_one_release_at_the_accountants_share_of_delta():
    """With a budget, FedCOF's rows get the σ that meets ε at δ − δ_τ (the analytic Gaussian mechanism's, within PLD's
    0.5%); the run's FedNCM/Fed3R σ is calibrated at the whole δ."""
    mechanism = GaussianMechanism(clip_norm=1.0, dp_delta=1e-5, dp_epsilon=2.0, dp_placement="distributed")
    assert mechanism.rows_noise > mechanism.noise
    assert 2.0 * 0.99 <= analytic_epsilon(one_release(mechanism.rows_noise), 0.5e-5) <= 2.0


def fedcof_classifier(tmp_path: Path, name: str, **values) -> tuple[dict[str, np.ndarray], list[dict]]:
    config = resolve({}, {"method": "fedcof", "dataset": DATASET, "out": str(tmp_path / name), "clients_per_round": 8,
                          "rounds": 6, "eval_every": 3, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True, **values})
    run(config)
    return dict(np.load(tmp_path / name / "classifier.npz")), pq.read_table(tmp_path / name / "metrics.parquet").to_pylist()


def test_a_fedcof_run_without_noise_is_the_plain_run_bit_for_bit_and_one_with_noise_reports_its_epsilon(ray_session,
                                                                                                        tmp_path):
    """σ = 0 (τ = 1: every row, n ≥ 1, released as it is) with a clip no row reaches: FedCOF's classifier bit for bit,
    ε = ∞ in every row. σ = 2: every row carries one release's ε at δ/2 and the threshold, and the classifier moved."""
    plain, _ = fedcof_classifier(tmp_path, "plain")
    free, free_rows = fedcof_classifier(tmp_path, "free", postprocessor=SPEC, options={
        "clip_norm": "1e9", "dp_delta": "1e-5", "dp_noise": "0", "dp_placement": "distributed"})
    assert plain.keys() == free.keys() and all(np.array_equal(plain[key], free[key]) for key in plain)
    assert free_rows and all(row["dp_epsilon"] == math.inf and row["dp_delta"] == 1e-5 for row in free_rows)
    noisy_run, rows = fedcof_classifier(tmp_path, "noisy", postprocessor=SPEC, options={
        "clip_norm": "2", "dp_delta": "1e-5", "dp_noise": "2", "dp_placement": "distributed"})
    exact = analytic_epsilon(one_release(2.0), 0.5e-5)
    assert [row["round"] for row in rows] == [3, 6]
    assert all(row["dp_delta"] == 1e-5 and exact <= row["dp_epsilon"] <= exact * 1.005 for row in rows)
    assert all(row["dp_threshold"] == pytest.approx(1 + 2 * scipy.stats.norm.isf(0.5e-5)) for row in rows)
    assert all(0 < row["accuracy"] <= 1 for row in rows)
    assert np.isfinite(noisy_run["W"]).all() and np.abs(noisy_run["W"] - plain["W"]).max() > 1e-3


@pytest.mark.parametrize("options, error", [
    ({}, r"the closed form stage's uploads \(like fedcof's mean rows\) reach the server client by client, not summed, "
         r".* use dp_placement=distributed"),
    ({"dp_unit": "client", "dp_client_samples": "10", "dp_placement": "distributed"},
     r"dp_unit=client with the closed form stage's uploads \(like fedcof's mean rows\), which reach the server client "
     r"by client"),
])
def test_fedcof_with_central_noise_or_at_client_level_is_refused_before_any_work(tmp_path, options, error):
    """The plan tells dp that FedCOF's uploads are not summed (:attr:`StageUploads.summed`): refused in ``start``,
    before Ray or a shard is started."""
    with pytest.raises(FedrayError, match=rf"^--postprocessor {SPEC}: {error}"):
        run(fedcof_config(tmp_path, {}, {"dp_noise": "1", **options}))
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("options, error", [
    ({}, r"fedcof's mean rows reach the server client by client, not summed, .* use dp_placement=distributed"),
    ({"dp_unit": "client", "dp_client_samples": 10, "dp_placement": "distributed"},
     r"dp_unit=client with fedcof: its mean rows reach the server client by client"),
])
def test_fedcofs_upload_is_refused_at_the_client_where_start_was_not_called(options, error):
    """Postprocessing driven directly (not through a run, whose ``start`` refuses first) stops at FedCOF's upload."""
    pipeline = Postprocessing((GaussianMechanism(clip_norm=1.0, dp_delta=1e-5, dp_noise=1.0, **options),),
                              seed=5).sampled(100, 10, False)
    pipeline.features(torch.zeros(1, 3, dtype=torch.float64))
    with pytest.raises(FedrayError, match=rf"^--postprocessor dp: {error}"):
        pipeline.statistics(mean_rows([1, 2], [2.0, 3.0], np.ones((2, 3)), 4), 17, 2, COF_PARTS)


def test_fedcof_with_several_means_per_class_stops_at_its_first_upload(ray_session, tmp_path):
    with pytest.raises(FedrayError, match=r"^--postprocessor dp: fedcof's upload has several means for a class "
                                          r"\(--means-per-class > 1\)"):
        run(fedcof_config(tmp_path, {"means_per_class": 2}, {"dp_noise": "1", "dp_placement": "distributed"}))
    assert not (tmp_path / "refused" / "metrics.parquet").exists()


def fedcof_config(tmp_path: Path, values: dict, options: dict) -> RunConfig:
    """A FedCOF run through dp into ``tmp_path``/refused, with ``values`` and dp's ``options`` (R = 1, δ = 1e-5)."""
    return resolve({}, {"method": "fedcof", "dataset": DATASET, "out": str(tmp_path / "refused"),
                        "clients_per_round": 8, "rounds": 6, "eval_every": 3, "num_shards": 2,
                        "cpus_per_shard": 0.5, "quiet": True, "postprocessor": SPEC, **values,
                        "options": {"clip_norm": "1", "dp_delta": "1e-5", **options}})


# --- client level: at most m samples a client, sensitivities m times the sample's


def test_client_level_keeps_m_random_samples_of_a_larger_client_the_same_on_any_layout():
    """A client of n > m samples keeps the first m of a permutation drawn from its select stream (the run's seed, its
    round, the client, the place, stream 1), sorted; a client of n ≤ m keeps all (the batch itself); the same rows
    whether the client is batched with others or alone."""
    m = 3
    mechanism = GaussianMechanism(clip_norm=1.0, dp_delta=1e-5, dp_noise=1.0, dp_unit="client", dp_client_samples=m)
    pipeline = Postprocessing((mechanism,), seed=11).sampled(50, 5, False)
    sizes, clients, rounds = [7, 2, 5], [4, 9, 30], [1, 1, 2]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    batch = ClientBatch(torch.arange(14, dtype=torch.float64).unsqueeze(1), torch.arange(14) % 4, offsets,
                        np.array(clients))
    kept = pipeline.selected(batch, rounds)

    expected = []
    for client, size, start, round_number in zip(clients, sizes, offsets, rounds):
        if size <= m:
            expected.append(np.arange(start, start + size))
            continue
        permutation = torch.randperm(size, generator=torch.Generator().manual_seed(
            int(np.random.SeedSequence((11, round_number, client + 1, 0, 1)).generate_state(2, np.uint64)[0]) & (2**63 - 1)))
        expected.append(start + np.sort(permutation[:m].numpy()))
    assert kept.features.flatten().tolist() == np.concatenate(expected).astype(float).tolist()
    assert kept.offsets.tolist() == [0, 3, 5, 8]
    alone = pipeline.selected(ClientBatch(batch.features[7:9], batch.labels[7:9], np.array([0, 2]), np.array([9])), [1])
    assert alone.features.data_ptr() == batch.features[7:9].data_ptr()
    first = pipeline.selected(ClientBatch(batch.features[:7], batch.labels[:7], np.array([0, 7]), np.array([4])), [1])
    assert torch.equal(first.features, kept.features[:3])


@pytest.mark.parametrize("unit, bound", [("sample", 1), ("client", 40)])
def test_the_noise_scale_is_sigma_times_the_units_sensitivity(unit, bound):
    """Sample: Δ = 1, R (FedNCM), R², R (Fed3R). Client of at most m samples: m times each (counts ≤ m in L2 since
    Σ n_c ≤ m; ‖Σ z e_yᵀ‖_F ≤ Σ ‖z‖ ≤ mR; ‖Σ zzᵀ‖_F ≤ Σ ‖z‖² ≤ mR²)."""
    options = {"dp_unit": unit, "dp_client_samples": bound} if unit == "client" else {}
    mechanism = GaussianMechanism(clip_norm=1.5, dp_delta=1e-5, dp_noise=2.0, **options)
    assert mechanism.scales({"counts": None, "sums": None}, NCM_PARTS) == {"counts": 2.0 * bound,
                                                                            "sums": 2.0 * bound * 1.5}
    assert mechanism.scales({"gram": None, "targets": None}, RIDGE_PARTS) == {"gram": 2.0 * bound * 1.5**2,
                                                                              "targets": 2.0 * bound * 1.5}


def test_a_client_level_run_bounds_each_client_and_without_noise_and_bound_is_the_plain_run(ray_session, tmp_path):
    """m above every client's size and σ = 0: the plain FedNCM run bit for bit. m = 5 (most clients hold more) at
    σ = 0: the classifier moves (rows dropped), and is the same on 1 and 2 shards (the choice is the client's)."""
    plain = classifier_of(tmp_path, "plain")
    private = {"clip_norm": "1e9", "dp_delta": "1e-5", "dp_noise": "0", "dp_unit": "client"}
    everything = classifier_of(tmp_path, "everything", postprocessor=SPEC,
                               options={**private, "dp_client_samples": "1000000"})
    assert all(np.array_equal(plain[key], everything[key]) for key in plain)
    bounded = classifier_of(tmp_path, "bounded", postprocessor=SPEC, options={**private, "dp_client_samples": "5"})
    assert np.abs(plain["W"] - bounded["W"]).max() > 1e-3
    one_shard = classifier_of(tmp_path, "one-shard", postprocessor=SPEC, num_shards=1,
                              options={**private, "dp_client_samples": "5"})
    assert np.allclose(one_shard["W"], bounded["W"], rtol=0, atol=1e-12)


def test_a_client_level_fed3r_run_reports_one_releases_epsilon(ray_session, tmp_path):
    """Client level changes Δ, not the multiplier: the same ε as sample level at the same σ."""
    rows = runs(tmp_path, "client", "fed3r", clip_norm=1.0, dp_noise=2.0, dp_delta=1e-5, dp_unit="client",
                dp_client_samples=20)
    exact = analytic_epsilon(one_release(2.0), 1e-5)
    assert rows and all(row["dp_delta"] == 1e-5 and exact <= row["dp_epsilon"] <= exact * 1.005 for row in rows)
    assert all(0 < row["accuracy"] <= 1 for row in rows)


def test_training_updates_are_refused_before_any_work():
    told = (StageUploads("init", False, Sampling(10, 2, True), 5, 4, None),
            StageUploads("training", True, Sampling(10, 2, True), 3, 2, 2))
    pipeline = Postprocessing((GaussianMechanism(clip_norm=1.0, dp_delta=1e-5, dp_noise=1.0),), seed=0, names=("dp",))
    pipeline.start(told[:1])  # a closed form alone is served
    with pytest.raises(FedrayError, match=r"^--postprocessor dp: the training stage uploads training updates, .* "
                                          r"DP for training is --postprocessor dp-fedavg"):
        pipeline.start(told)


def test_an_upload_is_read_through_its_declared_parts_not_its_field_names():
    """Fed3R's statistics under other names (in the same sorted order, the order of the draws), declared as its sums,
    get Fed3R's noise bit for bit, client and server side; the same tensors undeclared (the default: sums of unknown
    degree) are refused on the first upload."""
    moments = {"outer": fedray.SampleSum(2, symmetric=True, width_axis=0), "scores": fedray.SampleSum(1, width_axis=0)}
    renamed = fedray.UploadParts(moments)
    stats = RidgeStatistics(torch.eye(5, dtype=torch.float64), torch.ones(5, 4, dtype=torch.float64))
    for placement in ("central", "distributed"):
        pipeline = Postprocessing((GaussianMechanism(clip_norm=CLIP, dp_delta=1e-5, dp_noise=NOISE,
                                                     dp_placement=placement),), seed=3).sampled(100, KAPPA, False)
        pipeline.features(torch.zeros(1, 5, dtype=torch.float64))
        plain = pipeline.statistics(stats, 4, 1, RIDGE_PARTS)
        own = pipeline.statistics({"outer": stats.gram, "scores": stats.targets}, 4, 1, renamed)
        assert torch.equal(own["outer"], plain.gram) and torch.equal(own["scores"], plain.targets)
        with reporting({}):
            plain, own = pipeline.aggregate(plain, 1, KAPPA, RIDGE_PARTS), pipeline.aggregate(own, 1, KAPPA, renamed)
        assert torch.equal(own["outer"], plain.gram) and torch.equal(own["scores"], plain.targets)
    with pytest.raises(FedrayError, match=r"^--postprocessor dp: an upload of gram, targets is not supported"):
        pipeline.statistics(stats, 4, 1, fedray.UploadParts())


def test_a_bias_column_the_clip_does_not_bound_is_refused():
    pipeline = Postprocessing((GaussianMechanism(clip_norm=1.0, dp_delta=1e-5, dp_noise=1.0),), seed=0)
    pipeline.features(torch.zeros(3, 5, dtype=torch.float64))
    stats = RidgeStatistics(torch.zeros(6, 6, dtype=torch.float64), torch.zeros(6, 2, dtype=torch.float64))
    with pytest.raises(FedrayError, match=r"^--postprocessor dp: statistics of width 6 from clipped features of width 5"):
        pipeline.statistics(stats, 0, 1, RIDGE_PARTS)


@pytest.mark.parametrize("options, error", [
    ({"clip_norm": "1", "dp_epsilon": "1"}, "option dp_delta is required"),
    ({"dp_delta": "1e-5", "dp_epsilon": "1"}, "option clip_norm is required"),
    ({"clip_norm": "1", "dp_delta": "1e-5"}, r"give one of option dp_epsilon .* got neither"),
    ({"clip_norm": "1", "dp_delta": "1e-5", "dp_epsilon": "1e-4"},
     r"no noise multiplier up to 1000 meets dp_epsilon=0.0001 at dp_delta=1e-05"),
    ({"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "-1"}, r"option dp_noise must be ≥ 0 \(0: no privacy, ε = ∞\)"),
    ({"clip_norm": "1", "dp_delta": "1e-5", "dp_epsilon": "0"}, r"option dp_epsilon must be > 0 \(no privacy: dp_noise=0\)"),
    ({"clip_norm": "1", "dp_delta": "1.5", "dp_noise": "1"}, r"option dp_delta must be in \(0, 1\), got 1.5"),
    ({"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "1", "dp_unit": "user"},
     "option dp_unit must be sample or client, got 'user'"),
    ({"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "1", "dp_unit": "client"},
     r"option dp_client_samples is required with dp_unit=client: .* got None"),
    ({"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "1", "dp_client_samples": "10"},
     "option dp_client_samples bounds a client's contribution: it needs dp_unit=client"),
    ({"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "1", "dp_threshold_share": "1"},
     r"option dp_threshold_share must be in \(0, 1\), got 1.0"),
    ({"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "1", "dp_placement": "local"},
     "option dp_placement must be central or distributed"),
])
def test_options_are_checked_before_any_work(options, error):
    with pytest.raises(FedrayError, match=rf"^--postprocessor {SPEC}: {error}"):
        postprocessing(resolve({}, {"method": "fed3r", "postprocessor": SPEC, "options": options}))


@pytest.mark.parametrize("options, error", [
    pytest.param(["dp_epsilon=1e-4", "dp_delta=1e-5"],
                 "no noise multiplier up to 1000 meets dp_epsilon=0.0001 at dp_delta=1e-05", marks=pytest.mark.slow),
    pytest.param(["dp_epsilon=1"], "option dp_delta is required", marks=pytest.mark.slow),
    (["dp_noise=1", "dp_delta=1e-5", "dp_unit=user"], "option dp_unit must be sample or client, got 'user'"),
])  # whole processes: the fast layer keeps one; test_options_are_checked_before_any_work checks every message
def test_the_cli_refuses_bad_options_in_one_line_and_writes_nothing(tmp_path, options, error):
    """``python -m fedray run`` in a fresh process: exit 2, one line on stderr naming the postprocessor, no output."""
    out = tmp_path / "out"
    arguments = ["run", "--method", "fed3r", "--dataset", DATASET, "--out", str(out), "--postprocessor", "dp",
                 "--option", "clip_norm=1"]
    for option in options:
        arguments += ["--option", option]
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "fedray", *arguments], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedray: error: --postprocessor dp: {error}"), done.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []

