"""CCVR (Luo et al. 2021; FedCOF App. K): its class Gaussians against numpy's pooled class moments, its virtual
features against those Gaussians' moments within sampling error, its classifier against a plain softmax fit written
out here, its seeding, and whole runs through shards."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fedray
from fedray.core.errors import FedrayError
from fedray.methods import CCVR, METHODS
from fedray.methods.base import ClientBatch
from fedray.runtime.footprint import closed_form_footprint
from tests.conftest import all_clients_batch

SPEC = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60"


def relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def client_batch(features: np.ndarray, labels: np.ndarray) -> ClientBatch:
    return ClientBatch(torch.from_numpy(features), torch.from_numpy(labels), np.array([0, len(labels)]), np.array([0]))


def test_the_class_gaussians_are_numpys_pooled_class_means_and_covariances(small_inat):
    """Statistics summed client by client (as a run sums uploads) give each class's mean and unbiased covariance of
    all its features, as numpy computes them from the features themselves (np.cov, ddof 1), to float64 round-off."""
    sample_ids, labels, offsets = small_inat.train_arrays(0, small_inat.num_clients)
    z = small_inat.source.features("train", sample_ids).double().numpy()
    method = CCVR(small_inat.dim, small_inat.num_classes)
    total = None
    for k in range(small_inat.num_clients):
        rows = slice(offsets[k], offsets[k + 1])
        stats = method.client_statistics(client_batch(z[rows], labels[rows].astype(np.int64)))
        total = stats if total is None else method.combine(total, stats)
    means, covariances = method.gaussians(total)
    for c in range(small_inat.num_classes):
        zc = z[labels == c]
        assert relative(means[c], zc.mean(0)) <= 1e-12
        if len(zc) >= 2:
            assert relative(covariances[c], np.cov(zc.T, ddof=1)) <= 1e-10
    # and the statistics of all clients at once (what a shard computes) are the same Gaussians
    at_once = method.gaussians(method.client_statistics(all_clients_batch(small_inat)))
    assert relative(at_once[1], covariances) <= 1e-10


def gaussian_data() -> tuple[np.ndarray, np.ndarray]:
    """d = 3, four classes: a correlated full-rank one, a singular one (2 samples: rank 1), one of a single sample
    (covariance 0: every virtual feature is that sample), and class 3 absent (no virtual features)."""
    rng = np.random.default_rng(7)
    mixing = np.array([[2.0, 0.0, 0.0], [1.5, 0.5, 0.0], [-1.0, 0.8, 0.3]])
    class0 = rng.standard_normal((500, 3)) @ mixing.T + np.array([1.0, -2.0, 0.5])
    class1 = np.array([[0.0, 1.0, 2.0], [1.0, 3.0, 2.5]])
    class2 = np.array([[4.0, -1.0, 0.25]])
    features = np.concatenate([class0, class1, class2])
    labels = np.array([0] * 500 + [1] * 2 + [2], dtype=np.int64)
    return features, labels


def test_the_virtual_features_have_the_class_gaussians_moments_within_sampling_error():
    """n = 200,000 virtual features of each class. Bounds, five standard errors of each estimate under the Gaussian
    N(μ, Σ) (a false alarm about 6e-7 per entry; the draw is seeded, so the test is deterministic anyway): the sample
    mean's coordinate i has standard error √(Σ_ii / n), the sample covariance's entry ij √((Σ_ij² + Σ_ii Σ_jj) / n)
    (Isserlis). The moments are those numpy computes from the data (np.mean, np.cov), not the method's."""
    features, labels = gaussian_data()
    n = 200_000
    method = CCVR(3, 4, virtual_per_class=n, seed=11)
    virtual, virtual_labels = method.virtual_features(method.client_statistics(client_batch(features, labels)))
    assert virtual.dtype == torch.float64
    assert np.array_equal(virtual_labels.numpy(), np.repeat([0, 1, 2], n))  # class after class; class 3 has none
    v = virtual.numpy()
    for c in (0, 1):
        mean, sigma = features[labels == c].mean(0), np.cov(features[labels == c].T, ddof=1)
        sample = v[virtual_labels.numpy() == c]
        mean_error = 5 * np.sqrt(np.diag(sigma) / n)
        assert np.all(np.abs(sample.mean(0) - mean) <= mean_error + 1e-12)
        covariance_error = 5 * np.sqrt((sigma**2 + np.outer(np.diag(sigma), np.diag(sigma))) / n)
        assert np.all(np.abs(np.cov(sample.T, ddof=1) - sigma) <= covariance_error + 1e-12)
    assert np.allclose(v[virtual_labels.numpy() == 2], features[labels == 2], rtol=0, atol=1e-12)
    # the singular class's features lie on its line through its two samples
    line = features[labels == 1][1] - features[labels == 1][0]
    offsets = v[virtual_labels.numpy() == 1] - features[labels == 1][0]
    residual = offsets - np.outer(offsets @ line / (line @ line), line)
    assert np.abs(residual).max() <= 1e-6


def plain_softmax_fit(x: torch.Tensor, y: torch.Tensor, num_classes: int, seed: int, epochs: int, lr: float,
                      batch_size: int, momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax regression by mini-batch SGD with heavy-ball momentum, from zero, written out: each epoch a permutation
    from a generator seeded with the seed's shuffling stream (SeedSequence([seed, 1]), 63 bits), batches in its order,
    v ← μ v + ∇, θ ← θ − η v."""
    state = int(np.random.SeedSequence([seed, 1]).generate_state(1, np.uint64)[0] >> np.uint64(1))
    generator = torch.Generator().manual_seed(state)
    x = x.to(torch.float32)
    w = torch.zeros(x.shape[1], num_classes, requires_grad=True)
    b = torch.zeros(num_classes, requires_grad=True)
    velocity = [torch.zeros_like(w), torch.zeros_like(b)]
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), batch_size):
            rows = order[start : start + batch_size]
            loss = F.cross_entropy(x[rows] @ w + b, y[rows])
            grads = torch.autograd.grad(loss, [w, b])
            with torch.no_grad():
                for parameter, v, g in zip((w, b), velocity, grads):
                    v.mul_(momentum).add_(g)
                    parameter.sub_(lr * v)
    return w.detach(), b.detach()


def test_the_classifier_is_a_plain_softmax_fit_on_the_virtual_features(small_inat):
    """Same virtual features, same seed: the same W and b up to float32 round-off (the fit runs in float32, its
    logits a GEMM in another layout than here; ~500 contracting SGD steps keep the difference near float32's 6e-8)."""
    options = dict(virtual_per_class=50, virtual_epochs=8, virtual_lr=0.05, virtual_batch_size=32, virtual_momentum=0.5)
    method = CCVR(small_inat.dim, small_inat.num_classes, seed=5, **options)
    stats = method.client_statistics(all_clients_batch(small_inat))
    classifier = method.solve(stats)
    x, y = method.virtual_features(stats)
    w, b = plain_softmax_fit(x, y, small_inat.num_classes, seed=5, epochs=8, lr=0.05, batch_size=32, momentum=0.5)
    assert classifier.weight.shape == (small_inat.dim, small_inat.num_classes)
    assert relative(classifier.weight, w) <= 1e-5
    assert relative(classifier.bias, b) <= 1e-5
    assert float(w.abs().max()) > 0.1  # it trained


def test_the_same_seed_gives_the_same_classifier_bitwise_and_another_seed_another(small_inat):
    batch = all_clients_batch(small_inat)
    options = dict(virtual_per_class=20, virtual_epochs=2)
    fits = {}
    for name, seed in (("first", 0), ("again", 0), ("other", 1)):
        method = CCVR(small_inat.dim, small_inat.num_classes, seed=seed, **options)
        fits[name] = method.solve(method.client_statistics(batch))
    assert torch.equal(fits["first"].weight, fits["again"].weight)
    assert torch.equal(fits["first"].bias, fits["again"].bias)
    assert relative(fits["first"].weight, fits["other"].weight) > 1e-3


def test_the_upload_is_a_mean_and_a_covariance_per_class_held(small_inat):
    """FedCOF App. H: M·(d + d²) floats, M the (client, class) pairs: each client's classes held times d + d²."""
    d = small_inat.dim
    sample_ids, labels, offsets = small_inat.train_arrays(0, small_inat.num_clients)
    held = np.array([len(np.unique(labels[offsets[k] : offsets[k + 1]])) for k in range(small_inat.num_clients)])
    method = CCVR(d, small_inat.num_classes)
    assert np.array_equal(method.upload_floats(small_inat), held * (d + d * d))
    assert np.array_equal(method.paper_costs(small_inat).fedcof_floats, held * (d + d * d))


def test_the_memory_estimate_counts_the_class_second_moments_and_the_virtual_features(small_inat):
    """The driver holds C × d × d float64 five times (three statistics objects, the scatter and the covariances) and
    the C·V virtual features (float64 and float32, and an int64 label each): written out, against fedcof-oracle's."""
    d, classes = small_inat.dim, small_inat.num_classes
    ccvr = closed_form_footprint("ccvr", "ccvr", small_inat, d, 1000, virtual_per_class=300)
    oracle = closed_form_footprint("fedcof-oracle", "fedcof-oracle", small_inat, d, 1000)
    moments = classes * d * d * 8
    virtual = classes * 300 * (8 * d + 4 * d + 8)
    gram = d * d * 8
    assert ccvr.driver - oracle.driver == 5 * moments + virtual - 6 * gram
    assert ccvr.shard(5000, 100) - oracle.shard(5000, 100) == 5 * moments - 5 * gram + 1000 * 8 * d


def test_a_run_through_shards_is_the_solve_in_one_process(ray_session, tmp_path):
    """Two shards sum the statistics in another order than one process: the class moments differ by float64
    round-off (~1e-16 relative), so do the Gaussians and, Σ_c^½ being continuous in Σ_c, the virtual features (the
    square root of a round-off eigenvalue of a singular class adds ~1e-8 of the class's scale at most); cast to float32
    they differ in at most a last bit here and there, and the convex SGD fit carries that along without growing it:
    1e-5 relative on W and b, against classifiers that differ by O(1) between seeds (test above)."""
    result = fedray.run(method="ccvr", dataset=SPEC, num_shards=2, cpus_per_shard=0.5, quiet=True, out=tmp_path / "run")
    federation = fedray.load_federation(SPEC)
    alone = METHODS["ccvr"](federation.dim, federation.num_classes, seed=0)
    expected = alone.solve(alone.client_statistics(all_clients_batch(federation)))
    assert relative(result.classifier.weight, expected.weight) <= 1e-5
    assert relative(result.classifier.bias, expected.bias) <= 1e-5
    assert result.metrics["bytes_up"][-1] == 4 * alone.upload_floats(federation).sum()
    # 60 classes (chance 1.7%); on these features FedCOF-oracle reaches 14.8%, this CCVR run 13.0%
    assert result.metrics["accuracy"][-1] >= 0.12


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_ccvr_initializes_a_training_run(ray_session, tmp_path):
    """--init ccvr: the CCVR classifier is the head, then FedAvg trains it; the first training row has CCVR's
    accuracy (the logits' temperature leaves the argmax alone)."""
    result = fedray.run(method="fedavg", init="ccvr", rounds=3, eval_every=1, dataset=SPEC, quiet=True,
                        options={"virtual_per_class": 30}, out=tmp_path / "run")
    stages = list(result.metrics["stage"])
    assert stages[0] == "closed_form" and stages[-1] == "train"
    assert result.metrics["init"][-1] == "ccvr" and result.metrics["virtual_per_class"][-1] == 30
    closed = stages.index("train") - 1
    assert result.metrics["accuracy"][closed] >= 0.10
    assert result.metrics["accuracy"][closed + 1] == result.metrics["accuracy"][closed]
    assert all(math.isfinite(value) for value in result.metrics["accuracy"])


@pytest.mark.parametrize("options, message", [
    ({"virtual_per_class": 0}, "--virtual-per-class must be ≥ 1, got 0"),
    ({"virtual_epochs": 0}, "--virtual-epochs must be ≥ 1, got 0"),
    ({"virtual_lr": 0.0}, "--virtual-lr must be > 0, got 0.0"),
    ({"virtual_batch_size": -1}, "--virtual-batch-size must be ≥ 1, got -1"),
    ({"virtual_momentum": 1.0}, "--virtual-momentum must be in [0, 1), got 1.0"),
    ({"virtual_per_class": 2.5}, "fedray.run: option virtual_per_class must be an integer, got 2.5"),
])
def test_bad_values_are_refused_in_one_line_before_any_work(ray_session, tmp_path, options, message):
    with pytest.raises(FedrayError) as refused:
        fedray.run(method="ccvr", options=options, dataset=SPEC, quiet=True, out=tmp_path / "run")
    assert str(refused.value) == message
    assert not (tmp_path / "run").exists()


def test_the_plan_estimates_ccvr_with_its_virtual_features_alone_and_as_init(small_inat):
    """The run's plan passes --virtual-per-class to the estimate, for --method ccvr and for --init ccvr."""
    from fedray.engine.config import RunConfig
    from fedray.engine.plan import footprints, plan

    def estimated(**options):
        return footprints(plan(RunConfig(**options).validate().resolved(), small_inat), small_inat)

    few, many = estimated(method="ccvr", virtual_per_class=10)[0], estimated(method="ccvr", virtual_per_class=1010)[0]
    d, classes = small_inat.dim, small_inat.num_classes
    assert many.driver - few.driver == classes * 1000 * (8 * d + 4 * d + 8)
    assert [footprint.stage for footprint in estimated(method="fedavg", init="ccvr")] == ["ccvr (--init)", "fedavg"]


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_the_estimate_bounds_the_shards_measured_growth(ray_session):
    """As tests/runtime/test_footprint.py checks fedcof: on 2 shards, each shard's peak memory growth past its
    features is at most the estimate (+ 50 MB of buffers) and not 0.5 GB below it; d = 128 and C = 200 make the class
    second moments 26 MB a statistics object, 131 MB in a shard's five copies."""
    from fedray.data import synthetic
    from fedray.engine.config import RunConfig
    from fedray.engine.plan import build_method, footprints, plan
    from fedray.engine.run_config import simulate
    from fedray.methods.evaluation import eval_bounds
    from fedray.runtime.evaluator import Evaluator
    from fedray.runtime.shards import ShardPool

    federation = synthetic.build("inat-user-120k", dim=128, scale=0.05, classes=200, seed=3)
    pool = ShardPool.start(federation, num_shards=2, cpus_per_shard=0.5)
    try:
        loaded = np.array(pool.peak_memory_bytes())
        config = RunConfig(method="ccvr", quiet=True, virtual_per_class=5, virtual_epochs=1).validate().resolved()
        footprint, = footprints(plan(config, federation), federation)
        simulate(config, build_method(config, federation), pool, Evaluator(pool))
        grown = np.array(pool.peak_memory_bytes()) - loaded
        samples = np.diff(federation.client_offsets[pool.bounds])
        tests = np.diff(eval_bounds(federation.test.num_rows, pool.num_shards))
    finally:
        pool.shutdown()
    held = 4 * federation.dim + 8  # a row's features and label, loaded before ``loaded`` was measured
    estimated = np.array([footprint.shard(int(n), int(t)) - (n + t) * held for n, t in zip(samples, tests)])
    assert (grown <= estimated + 0.05e9).all(), (grown / 1e9, estimated / 1e9)
    assert (estimated <= grown + 0.5e9).all(), (grown / 1e9, estimated / 1e9)
