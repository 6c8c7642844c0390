"""count-noise (FedCOF App. I): each client's class counts ñ = max(n + σ, 0) with the documented draws, its sums ñ·μ,
its dropped classes out of FedCOF's estimator; σ has the paper's three distributions; a run with it is reproducible,
draws the same noise on any shard layout, and at zero width is the plain run bit for bit; it refuses uploads without
class counts."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.stats
import torch

import fedray
from fedray.core.errors import FedrayError
from fedray.engine.config import resolve
from fedray.engine.plan import postprocessing
from fedray.engine.run_config import run
from fedray.methods import CCVR, Fed3R, FedCOF, FedCOFOracle, FedNCM
from fedray.methods.base import ClientBatch
from fedray.methods.fedcof import MeanBlock, MeanRows
from fedray.methods.ncm import ClassSums
from fedray.methods.postprocessor import Postprocessing
from fedray.postprocessors.count_noise import ClassCountNoise

DATASET = "synthetic:inat-geo-100?dim=24&scale=0.3&classes=20"
SEED, ROUND = 7, 3
NCM_PARTS, COF_PARTS = FedNCM(3, 6).upload_parts(), FedCOF(3, 6).upload_parts()


def generator(seed: int, round_number: int, client: int) -> torch.Generator:
    """The generator of a client's upload for the first postprocessor of the list (Postprocessing's documented seeding)."""
    state = np.random.SeedSequence((seed, round_number, client + 1, 0)).generate_state(2, np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


def reference_counts(kind: str, epsilon: float, counts: torch.Tensor, client: int) -> torch.Tensor:
    """ñ_c = max(n_c + σ_c, 0) for a class held, else 0; σ drawn for every class, class 0 first, as documented."""
    g, size = generator(SEED, ROUND, client), (len(counts),)
    if kind == "uniform":
        u = torch.rand(size, generator=g, dtype=torch.float64)
        sigma = [(1 - epsilon) * float(n) * (2 * float(x) - 1) for n, x in zip(counts, u)]
    elif kind == "gaussian":
        z = torch.randn(size, generator=g, dtype=torch.float64)
        sigma = [float(x) / epsilon**0.5 for x in z]
    else:
        u = torch.rand(size, generator=g, dtype=torch.float64)
        v = torch.rand(size, generator=g, dtype=torch.float64)
        sigma = [float(a - b) / epsilon for a, b in zip(torch.log1p(-v), torch.log1p(-u))]
    return torch.tensor([max(float(n) + s, 0.0) if n > 0 else 0.0 for n, s in zip(counts, sigma)], dtype=torch.float64)


def client_counts(client: int, classes: int = 6) -> torch.Tensor:
    """A client's class counts, some classes absent."""
    rng = np.random.default_rng(client)
    return torch.from_numpy(rng.integers(0, 9, classes) * (rng.random(classes) < 0.7)).to(torch.float64)


def class_sums(client: int, dim: int = 3) -> ClassSums:
    counts = client_counts(client)
    means = torch.from_numpy(np.random.default_rng(100 + client).normal(size=(len(counts), dim)))
    return ClassSums(counts, means * counts.unsqueeze(1))


def mean_rows(client: int) -> MeanRows:
    """A FedCOF client's upload: the class totals and one mean per class held (count > 0), as FedCOF sends them."""
    stats = class_sums(client)
    classes = torch.nonzero(stats.counts > 0).flatten()
    means = stats.sums[classes] / stats.counts[classes].unsqueeze(1)
    return MeanRows(stats.counts, stats.sums, (stats.counts > 0).to(torch.float64),
                    [MeanBlock(classes, stats.counts[classes], means)])


def noisy(kind: str, epsilon: float) -> Postprocessing:
    return Postprocessing((ClassCountNoise(kind, epsilon),), SEED)


KINDS = [("uniform", 0.3), ("gaussian", 0.05), ("laplace", 0.2)]


@pytest.mark.parametrize("kind, epsilon", KINDS)
def test_a_clients_counts_are_the_documented_draws_and_its_sums_n_tilde_times_its_means(kind, epsilon):
    dropped = kept = 0
    for client in range(30):
        stats, rows = class_sums(client), mean_rows(client)
        counts = reference_counts(kind, epsilon, stats.counts, client)
        scale = torch.tensor([float(m) / float(n) if n > 0 else 0.0 for m, n in zip(counts, stats.counts)],
                             dtype=torch.float64)
        sent = counts > 0
        for out in (noisy(kind, epsilon).statistics(stats, client, ROUND, NCM_PARTS),
                    noisy(kind, epsilon).statistics(rows, client, ROUND, COF_PARTS)):
            assert torch.equal(out.counts, counts)
            assert torch.equal(out.sums, stats.sums * scale.unsqueeze(1))
            assert torch.allclose(out.sums[sent] / counts[sent].unsqueeze(1),
                                  stats.sums[sent] / stats.counts[sent].unsqueeze(1), rtol=1e-13, atol=0)
        block, classes = out.blocks[0], rows.blocks[0].classes
        assert torch.equal(out.received, sent.to(torch.float64))
        assert torch.equal(block.classes, classes) and torch.equal(block.counts, counts[classes])
        assert torch.equal(block.means, torch.where(sent[classes].unsqueeze(1), rows.blocks[0].means, 0.0))
        dropped += int((stats.counts > 0).sum() - sent.sum())
        kept += int(sent.sum())
    assert kept > 0 and (dropped > 0) == (kind != "uniform")   # uniform noise keeps ñ ≥ εn > 0


def fedcof_reference(rows: list[tuple[int, float, np.ndarray]], num_classes: int, gamma: float) -> np.ndarray:
    """FedCOF from the (class, ñ, μ) rows the server received: N_c = Σ ñ, K_c rows, μ_c = Σ ñμ / N_c,
    G = Σ_c (N_c − 1)/(K_c − 1) Σ ñ (μ − μ_c)(μ − μ_c)ᵀ (K_c > 1) + γ Σ_c (N_c − 1)⁺ I + N μ_g μ_gᵀ, W = G⁻¹[N_c μ_c]."""
    dim = len(rows[0][2])
    totals, g = np.zeros(num_classes), np.zeros((dim, dim))
    b = np.zeros((dim, num_classes))
    for c, n, mean in rows:
        totals[c] += n
        b[:, c] += n * mean
    for c in range(num_classes):
        own = [(n, mean) for k, n, mean in rows if k == c]
        if len(own) > 1:
            mu = b[:, c] / totals[c]
            g += (totals[c] - 1) / (len(own) - 1) * sum(n * np.outer(mean - mu, mean - mu) for n, mean in own)
    g += gamma * np.maximum(totals - 1, 0).sum() * np.eye(dim)
    g += np.outer(b.sum(1), b.sum(1)) / totals.sum()
    w = np.linalg.solve(g, b)
    norms = np.linalg.norm(w, axis=0)
    return w / np.where(norms > 0, norms, 1)


def test_fedcofs_server_weights_each_mean_by_its_noisy_count_and_leaves_out_the_dropped_ones():
    method, process, total = FedCOF(3, 6, gamma=0.1), noisy("laplace", 0.2), None
    sent = []
    for client in range(40):
        out = process.statistics(mean_rows(client), client, ROUND, COF_PARTS)
        block = out.blocks[0]
        sent += [(int(c), float(n), m.numpy()) for c, n, m in zip(block.classes, block.counts, block.means) if n > 0]
        total = out if total is None else method.combine(total, out)
    assert len(sent) < sum(len(mean_rows(client).blocks[0].classes) for client in range(40))   # some were dropped
    expected = fedcof_reference(sent, 6, 0.1)
    assert np.allclose(method.solve(total).weight.numpy(), expected, rtol=1e-9, atol=1e-12)


def test_a_noisy_class_total_below_one_still_divides_the_sums_into_their_mean():
    mean = torch.tensor([3.0, -1.5], dtype=torch.float64)
    stats = ClassSums(torch.tensor([0.25, 0.0], dtype=torch.float64), torch.stack([0.25 * mean, torch.zeros(2)]))
    classifier = FedNCM(2, 2, distance="euclidean").solve(stats)
    assert torch.equal(classifier.weight[:, 0], mean) and float(classifier.bias[0]) == -0.5 * float(mean @ mean)


def drawn_noise(kind: str, epsilon: float, count: float = 1000.0) -> np.ndarray:
    """ñ − n over 200 clients × 50 classes of n = ``count`` each (never clipped at 0 for the noise tested here)."""
    counts = torch.full((50,), count, dtype=torch.float64)
    stats = ClassSums(counts, torch.ones(50, 2, dtype=torch.float64))
    return np.concatenate([(noisy(kind, epsilon).statistics(stats, client, ROUND, NCM_PARTS).counts - counts).numpy()
                           for client in range(200)])


def test_the_noise_has_the_papers_distributions():
    """Kolmogorov-Smirnov over 10,000 draws each: uniform on ±(1−ε)n, N(0, 1/ε) (variance 1/ε), Laplace of scale 1/ε;
    the other reading of N(0, 1/ε), standard deviation 1/ε, is rejected."""
    epsilon = 0.25
    assert scipy.stats.kstest(drawn_noise("uniform", epsilon) / ((1 - epsilon) * 1000), scipy.stats.uniform(-1, 2).cdf).pvalue > 1e-3
    gaussian = drawn_noise("gaussian", epsilon)
    assert scipy.stats.kstest(gaussian, scipy.stats.norm(scale=epsilon**-0.5).cdf).pvalue > 1e-3
    assert scipy.stats.kstest(gaussian, scipy.stats.norm(scale=1 / epsilon).cdf).pvalue < 1e-9
    assert scipy.stats.kstest(drawn_noise("laplace", epsilon), scipy.stats.laplace(scale=1 / epsilon).cdf).pvalue > 1e-3


def runs(tmp_path: Path, name: str, method: str = "fedcof", **values) -> tuple[list[dict], dict[str, np.ndarray]]:
    config = resolve({}, {"method": method, "dataset": DATASET, "out": str(tmp_path / name), "clients_per_round": 8,
                          "rounds": 6, "eval_every": 3, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True, **values})
    run(config)
    rows = pq.read_table(tmp_path / name / "metrics.parquet").to_pylist()
    keep = ("round", "accuracy", "bytes_up", "bytes_down", "clients_seen", "samples_seen")
    return [{key: row[key] for key in keep} for row in rows], dict(np.load(tmp_path / name / "classifier.npz"))


def same(a: tuple[list[dict], dict[str, np.ndarray]], b: tuple[list[dict], dict[str, np.ndarray]]) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(np.array_equal(a[1][key], b[1][key]) for key in a[1])


NOISE = {"postprocessor": "count-noise", "options": {"count_noise": "laplace", "count_noise_epsilon": "0.1"}}


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_fedcof_run_with_noisy_counts_is_reproducible_its_draws_the_same_on_any_shard_layout(ray_session, tmp_path):
    """The same run twice is the same bit for bit; on one shard its noisy counts are the same, so only the order of
    the float sums differs (as a plain run's does: W within 1e-12), and it is not the plain run."""
    two = runs(tmp_path, "two", **NOISE)
    assert same(two, runs(tmp_path, "again", **NOISE))
    one = runs(tmp_path, "one", **NOISE, num_shards=1)
    plain = runs(tmp_path, "plain")
    assert [row["round"] for row in two[0]] == [3, 6] and all(0 < row["accuracy"] <= 1 for row in two[0])
    assert one[0] == two[0] and np.allclose(one[1]["W"], two[1]["W"], rtol=0, atol=1e-12)
    assert np.abs(two[1]["W"] - plain[1]["W"]).max() > 1e-3


@pytest.mark.parametrize("method", ["fedcof", "fedncm"])
def test_zero_width_noise_is_the_plain_run_bit_for_bit(ray_session, tmp_path, method):
    none = {"postprocessor": "count-noise", "options": {"count_noise": "uniform", "count_noise_epsilon": "1"}}
    assert same(runs(tmp_path, "none", method, **none), runs(tmp_path, "plain", method))


def batch(labels: list[int], dim: int = 3) -> ClientBatch:
    features = torch.from_numpy(np.random.default_rng(0).normal(size=(len(labels), dim)))
    return ClientBatch(features, torch.tensor(labels), np.array([0, len(labels)]), np.array([5]))


@pytest.mark.parametrize("method, upload", [
    (Fed3R(3, 4), "gram, targets"),
    (FedCOFOracle(3, 4), "counts, sums, gram"),
    (FedCOFOracle(3, 4, covariance="diagonal"), "counts, sums, squares"),
    (CCVR(3, 4), "counts, sums, second"),
])
def test_uploads_without_class_counts_are_refused_naming_them(method, upload):
    stats = method.client_statistics(batch([0, 0, 1, 2, 2]))
    with pytest.raises(FedrayError, match=rf"^--postprocessor count-noise: an upload of {upload} has no class counts to "
                                          r"perturb; it applies to fedncm's class sums and fedcof's class means"):
        noisy("laplace", 0.5).statistics(stats, 0, 1, method.upload_parts())


@dataclass
class Tallies:
    """FedNCM's statistics under other field names."""

    seen: torch.Tensor
    totals: torch.Tensor


class RenamedNCM(FedNCM):
    """A plugin whose statistics are FedNCM's under its own names, declared as class counts and sums."""

    def client_statistics(self, batch):
        stats = super().client_statistics(batch)
        return Tallies(stats.counts, stats.sums)

    def upload_parts(self):
        return fedray.UploadParts({"seen": fedray.SampleSum(0, by_class=True),
                                   "totals": fedray.SampleSum(1, by_class=True, width_axis=1)})


class UndeclaredNCM(FedNCM):
    """FedNCM's statistics, their parts not declared (the default: sums over samples, nothing more said)."""

    def upload_parts(self):
        return fedray.ClosedFormMethod.upload_parts(self)


def test_the_upload_is_read_through_its_declared_parts_not_its_field_names():
    stats = class_sums(4)
    renamed = RenamedNCM(3, 6)
    out = noisy("laplace", 0.2).statistics(Tallies(stats.counts, stats.sums), 4, ROUND, renamed.upload_parts())
    assert torch.equal(out.seen, reference_counts("laplace", 0.2, stats.counts, 4))
    assert torch.equal(out.totals, noisy("laplace", 0.2).statistics(stats, 4, ROUND, NCM_PARTS).sums)
    with pytest.raises(FedrayError, match=r"^--postprocessor count-noise: an upload of counts, sums has no class "):
        noisy("laplace", 0.2).statistics(stats, 4, ROUND, UndeclaredNCM(3, 6).upload_parts())


def test_several_means_per_class_and_training_updates_are_refused():
    method = FedCOF(3, 4, means_per_class=2)
    stats = method.client_statistics(batch([0, 0, 0, 0, 1, 2]))
    with pytest.raises(FedrayError, match=r"^--postprocessor count-noise: fedcof's upload has several means for a class "
                                          r"\(--means-per-class > 1\)"):
        noisy("uniform", 0.5).statistics(stats, 0, 1, method.upload_parts())
    update = fedray.Upload({"W": torch.zeros(3, 4), "bias": torch.zeros(4)}, 5.0)
    with pytest.raises(FedrayError, match=r"^--postprocessor count-noise: an upload of W, bias has no class counts"):
        noisy("gaussian", 0.5).client(update, 0, 1)


def test_a_run_of_a_method_without_class_counts_stops_at_its_first_upload(ray_session, tmp_path):
    with pytest.raises(FedrayError, match=r"^--postprocessor count-noise: an upload of gram, targets has no class counts"):
        runs(tmp_path, "fed3r", "fed3r", **NOISE)
    assert not (tmp_path / "fed3r" / "metrics.parquet").exists()


@pytest.mark.parametrize("options, error", [
    ({"count_noise": "poisson", "count_noise_epsilon": "0.5"},
     "option count_noise must be uniform, gaussian or laplace, got 'poisson'"),
    ({"count_noise": "laplace"}, "option count_noise_epsilon is required"),
    ({"count_noise": "gaussian", "count_noise_epsilon": "0"}, "option count_noise_epsilon must be > 0, got 0.0"),
    ({"count_noise": "uniform", "count_noise_epsilon": "1.5"},
     "option count_noise_epsilon must be ≤ 1 with uniform noise, got 1.5"),
])
def test_options_are_checked_before_any_work(options, error):
    with pytest.raises(FedrayError, match=rf"^--postprocessor count-noise: {error}"):
        postprocessing(resolve({}, {"method": "fedcof", "postprocessor": "count-noise", "options": options}))
