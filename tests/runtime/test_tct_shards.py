"""TCT stage 2 in the sharded runtime equals the in-memory solvers of ``fedray.methods.tct_stage2`` on the same clients.

Models are ψ = [W; bᵀ] ((p + 1) × C, the bias as the last row); test scores are Z̃W + 1bᵀ.
"""

import numpy as np
import pytest
import ray
import torch

from fedray.engine.config import RunConfig
from fedray.engine.training import Accounting
from fedray.core.results import EvalPoint
from fedray.runtime import sampling
from fedray.engine.plan import Sampler, stages
from fedray.engine.tct import Stage2Run
from fedray.runtime.tct_shards import Projection, Stage2Pool
from fedray.methods.tct_stage2 import normalize, random_projection
from tests.methods.tct_stage2_reference import ClientData, ScaffoldStage2, closed_form_stage2, normalization, standardize_clients
from tests.methods.test_tct_stage2 import NUM_CLASSES, label_skewed, stable_lr

BOUNDS = np.array([0, 2, 6])
"""Two shards: clients 0–1 and 2–5."""


@pytest.fixture(scope="module")
def clients() -> list[ClientData]:
    return label_skewed(seed=4)


@pytest.fixture(scope="module")
def held_out() -> ClientData:
    clients = label_skewed(seed=5, num_clients=4)
    return ClientData(torch.cat([c.features for c in clients]), torch.cat([c.labels for c in clients]))


def start_pool(ray_session, clients: list[ClientData], held_out: ClientData, projection: Projection | None = None,
               bounds: np.ndarray = BOUNDS) -> Stage2Pool:
    sizes = np.array([len(c.labels) for c in clients])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    train, train_labels, test, test_labels = [], [], [], []
    test_bounds = np.linspace(0, len(held_out.labels), len(bounds)).astype(int)
    for s in range(len(bounds) - 1):
        mine = clients[bounds[s] : bounds[s + 1]]
        train.append(ray.put(torch.cat([c.features for c in mine])))
        train_labels.append(torch.cat([c.labels for c in mine]).numpy())
        test.append(ray.put(held_out.features[test_bounds[s] : test_bounds[s + 1]]))
        test_labels.append(held_out.labels[test_bounds[s] : test_bounds[s + 1]].numpy())
    return Stage2Pool.start(train, train_labels, test, test_labels, bounds, offsets, NUM_CLASSES, {"CPU": 0.5}, projection)


def stage2_run(pool: Stage2Pool, clients: list[ClientData], config: RunConfig, width: int) -> Stage2Run:
    sizes = np.array([len(c.labels) for c in clients])
    start = EvalPoint(7, 0, 0, 0.5, 0.0, 0.0, 0.0, 0.0, "train")
    config = config.resolved()  # stage 2 alone: the eNTK's width is the test's, not --entk-dim's
    sampler = Sampler(len(sizes), config.per_round(len(sizes)), config.sampling == "with", config.seed)
    return Stage2Run(stages(config)[-1], sampler, config.eval_every, pool, sizes, NUM_CLASSES, width,
                     [start], Accounting(np.zeros(len(sizes), dtype=bool)))


@pytest.mark.parametrize("per_round", [pytest.param(6, marks=pytest.mark.slow), 3])
def test_sharded_scaffold_equals_in_memory(ray_session, clients, held_out, per_round):
    standardized, _, _ = standardize_clients(clients)
    lr = stable_lr(standardized)
    config = RunConfig(method="tct", tct_rounds=8, tct_local_steps=5, tct_lr=lr, clients_per_round=per_round, eval_every=4, seed=3)
    pool = start_pool(ray_session, clients, held_out)
    try:
        run = stage2_run(pool, clients, config, width=20)
        model = run.scaffold(run.normalize())
        accuracy = pool.accuracy(ray.put(run.normalization), ray.put(model))
    finally:
        pool.shutdown()

    reference = ScaffoldStage2(standardized, NUM_CLASSES, local_steps=5, lr=lr)
    for participants in sampling.schedule(6, per_round, True, 3, 8, past_coverage=True):
        reference.step(participants.tolist())
    assert model.shape == (20 + 1, NUM_CLASSES) and model[-1].abs().max() > 1e-3, "the bias is trained"
    assert torch.allclose(model, reference.model, rtol=0, atol=1e-10)

    mean, std = normalization(clients)
    scores = normalize(held_out.features, mean, std) @ model[:-1] + model[-1]
    assert accuracy == (scores.argmax(dim=1) == held_out.labels).double().mean().item()

    rows = run.points[1:]
    assert [row.round for row in rows] == [7 + 1 + 4, 7 + 1 + 8] and {row.stage for row in rows} == {"tct_scaffold"}
    assert rows[-1].accuracy == accuracy
    floats = (20 + 1) * NUM_CLASSES
    normalization_up, normalization_down = 6 * (2 * 20 + 1) * 4, 6 * 2 * 20 * 4
    assert rows[-1].bytes_up == normalization_up + 8 * per_round * floats * 4
    assert rows[-1].bytes_down == normalization_down + 8 * per_round * floats * 4 * (1 if per_round == 6 else 2)
    assert 0 < rows[-1].train_loss < rows[0].train_loss


@pytest.mark.slow  # three pools' starts (21 s); the fast layer keeps test_sharded_scaffold_equals_in_memory[3]
def test_shard_layouts_give_the_same_bits(ray_session, clients, held_out):
    """The moments, the closed form's statistics and SCAFFOLD's rounds are summed in the tree with one client a leaf:
    one, two or three stage-2 shards give the same normalization, models and rows, bit for bit."""
    lr = stable_lr(standardize_clients(clients)[0])
    config = RunConfig(method="tct", tct_solver="both", tct_rounds=4, tct_local_steps=5, tct_lr=lr, clients_per_round=4,
                       eval_every=2, seed=3)
    results = []
    for bounds in (np.array([0, 6]), BOUNDS, np.array([0, 1, 4, 6])):
        pool = start_pool(ray_session, clients, held_out, bounds=bounds)
        try:
            run = stage2_run(pool, clients, config, width=20)
            normalization_ref = run.normalize()
            closed = run.closed_form(normalization_ref)
            scaffold = run.scaffold(normalization_ref)
        finally:
            pool.shutdown()
        results.append((run.normalization, closed, scaffold, [(row.round, row.train_loss, row.accuracy) for row in run.points]))
    (normalization_1, closed_1, scaffold_1, rows_1) = results[0]
    assert len(rows_1) == 1 + 1 + 2 and scaffold_1.abs().max() > 0
    for normalization_s, closed_s, scaffold_s, rows_s in results[1:]:
        assert torch.equal(normalization_s.mean, normalization_1.mean) and torch.equal(normalization_s.std, normalization_1.std)
        assert torch.equal(closed_s, closed_1) and torch.equal(scaffold_s, scaffold_1)
        assert rows_s == rows_1


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_sharded_closed_form_equals_in_memory(ray_session, clients, held_out):
    pool = start_pool(ray_session, clients, held_out)
    try:
        run = stage2_run(pool, clients, RunConfig(method="tct", tct_solver="closed_form"), width=20)
        model = run.closed_form(run.normalize())
        accuracy = pool.accuracy(ray.put(run.normalization), ray.put(model))
    finally:
        pool.shutdown()
    standardized = standardize_clients(clients)[0]
    expected = closed_form_stage2(standardized, NUM_CLASSES)
    assert model.shape == (20 + 1, NUM_CLASSES) and expected[-1].abs().max() > 1e-3
    assert torch.allclose(model, expected, rtol=0, atol=1e-10 * expected.abs().max().item())
    mean, std = normalization(clients)
    scores = normalize(held_out.features, mean, std) @ expected[:-1] + expected[-1]
    assert accuracy == (scores.argmax(dim=1) == held_out.labels).double().mean().item()
    row = run.points[-1]
    objective, _ = ScaffoldStage2(standardized, NUM_CLASSES).loss_and_accuracy(expected)
    assert row.train_loss == pytest.approx(objective, rel=1e-10)
    assert (row.round, row.stage, row.clients_seen) == (7 + 2, "tct_closed_form", 6)
    assert row.bytes_up == 6 * (2 * 20 + 1) * 4 + 6 * (21 * 21 + 21 * NUM_CLASSES) * 4


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_shards_project_with_the_shared_seed(ray_session, clients, held_out):
    pool = start_pool(ray_session, clients, held_out, Projection(8, seed=5))
    try:
        sharded = pool.normalization()
    finally:
        pool.shutdown()
    projected = [ClientData(random_projection(c.features, 8, seed=5), c.labels) for c in clients]
    mean, std = normalization(projected)
    assert torch.allclose(sharded.mean, mean, rtol=0, atol=1e-10) and torch.allclose(sharded.std, std, rtol=0, atol=1e-10)


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_float16_storage_is_standardized_and_solved_in_float32(ray_session, clients, held_out):
    halved = [ClientData(c.features.half(), c.labels) for c in clients]
    pool = start_pool(ray_session, halved, ClientData(held_out.features.half(), held_out.labels))
    try:
        run = stage2_run(pool, clients, RunConfig(method="tct", tct_rounds=3, tct_local_steps=4, tct_lr=1e-3, clients_per_round=6), width=20)
        normalization_ref = run.normalize()
        model = run.scaffold(normalization_ref)
    finally:
        pool.shutdown()
    widened = [ClientData(c.features.double(), c.labels) for c in halved]
    mean, std = normalization(widened)
    assert torch.allclose(run.normalization.mean, mean, rtol=0, atol=1e-12)
    assert torch.allclose(run.normalization.std, std, rtol=0, atol=1e-12)
    reference = ScaffoldStage2([ClientData(normalize(c.features, mean, std, torch.float32), c.labels) for c in widened],
                               NUM_CLASSES, local_steps=4, lr=1e-3)
    for _ in range(3):
        reference.step(list(range(6)))
    assert torch.allclose(model, reference.model.double(), rtol=1e-5, atol=1e-6)


# --- TCT's ablations (§5.4, App. B.7) against stage 2 written out in numpy -----------------------------------------


def plain_stage2(clients: list[ClientData], schedule, steps: int, lr: float, *, loss: str = "mse",
                 control_variates: bool = True, normalized: bool = True) -> tuple[np.ndarray, float]:
    """Stage 2 as a plain loop over clients: (global ψ = [W; bᵀ], the mean F_k at the last round's start, weighted).

    Standardize with the pooled population std floored at 1e-8 (or not at all), append the constant 1, then per round
    every participant takes ``steps`` full-batch steps y ← y − η (g_k(y) − h_k), g_k the squared loss's
    X_kᵀ(X_k y − (onehot − 1/C))/n_k or cross-entropy's X_kᵀ(softmax(X_k y) − onehot)/n_k, h_k = c_k − c (SCAFFOLD's
    option II, c_k⁺ = c_k − c − Δ_k/(Kη)) or 0 (FedAvg); the server averages the deltas by n_k.
    """
    raw = [c.features.double().numpy() for c in clients]
    if normalized:
        pooled = np.concatenate(raw)
        mean, std = pooled.mean(axis=0), np.maximum(pooled.std(axis=0), 1e-8)
        raw = [(z - mean) / std for z in raw]
    designs = [np.hstack([z, np.ones((len(z), 1))]) for z in raw]
    onehots = [np.eye(NUM_CLASSES)[c.labels.numpy()] for c in clients]
    sizes = np.array([len(c.labels) for c in clients], dtype=float)
    weights = sizes / sizes.sum()

    def gradient(k: int, y: np.ndarray) -> np.ndarray:
        scores = designs[k] @ y
        if loss == "ce":
            exp = np.exp(scores - scores.max(axis=1, keepdims=True))
            residual = exp / exp.sum(axis=1, keepdims=True) - onehots[k]
        else:
            residual = scores - (onehots[k] - 1 / NUM_CLASSES)
        return designs[k].T @ residual / sizes[k]

    def objective(k: int, y: np.ndarray) -> float:
        scores = designs[k] @ y
        if loss == "ce":
            top = scores.max(axis=1)
            return float(np.mean(top + np.log(np.exp(scores - top[:, None]).sum(axis=1)) - (scores * onehots[k]).sum(axis=1)))
        return float(((scores - (onehots[k] - 1 / NUM_CLASSES)) ** 2).sum() / (2 * sizes[k]))

    model = np.zeros((designs[0].shape[1], NUM_CLASSES))
    control, own = np.zeros_like(model), [np.zeros_like(model) for _ in clients]
    loss_at_start = 0.0
    for participants in schedule:
        participants = sorted(participants.tolist())
        deltas, change = [], np.zeros_like(model)
        loss_at_start = sum(weights[k] * objective(k, model) for k in participants) / weights[participants].sum()
        for k in participants:
            correction = own[k] - control if control_variates else 0.0
            y = model
            for _ in range(steps):
                y = y - lr * (gradient(k, y) - correction)
            deltas.append(y - model)
            if control_variates:
                updated = own[k] - control - deltas[-1] / (steps * lr)
                change += weights[k] * (updated - own[k])
                own[k] = updated
        model = model + sum(weights[k] * delta for k, delta in zip(participants, deltas)) / weights[participants].sum()
        control = control + change
    return model, loss_at_start


def plain_stable_lr(clients: list[ClientData], normalized: bool) -> float:
    """Half the inverse of the largest local curvature of the squared loss on the (raw or standardized) designs."""
    return stable_lr(standardize_clients(clients)[0] if normalized else clients)


@pytest.mark.parametrize("ablation", [pytest.param("tct_fedavg", marks=pytest.mark.slow), "tct_no_normalization",
                                      pytest.param("tct_loss_ce", marks=pytest.mark.slow)])
def test_each_ablation_equals_plain_stage2(ray_session, clients, held_out, ablation):
    options = {"tct_fedavg": {"tct_fedavg": True}, "tct_no_normalization": {"tct_no_normalization": True},
               "tct_loss_ce": {"tct_loss": "ce"}}[ablation]
    normalized = ablation != "tct_no_normalization"
    lr = plain_stable_lr(clients, normalized)
    config = RunConfig(method="tct", tct_rounds=6, tct_local_steps=5, tct_lr=lr, clients_per_round=3, eval_every=1,
                       seed=3, **options)
    pool = start_pool(ray_session, clients, held_out)
    try:
        run = stage2_run(pool, clients, config, width=20)
        normalization_ref = run.normalize()
        model = run.scaffold(normalization_ref)
    finally:
        pool.shutdown()

    schedule = sampling.schedule(6, 3, True, 3, 6, past_coverage=True)
    expected, loss = plain_stage2(clients, schedule, 5, lr, loss="ce" if ablation == "tct_loss_ce" else "mse",
                                  control_variates=ablation != "tct_fedavg", normalized=normalized)
    assert np.allclose(model.numpy(), expected, rtol=0, atol=1e-10 * np.abs(expected).max())
    rows = run.points[1:]
    assert rows[-1].train_loss == pytest.approx(loss, rel=1e-10)
    floats = (20 + 1) * NUM_CLASSES
    normalization_up, normalization_down = (6 * (2 * 20 + 1) * 4, 6 * 2 * 20 * 4) if normalized else (0, 0)
    # with sampling, SCAFFOLD sends c with the model (2 models down); FedAvg has no c to send
    assert rows[-1].bytes_down == normalization_down + 6 * 3 * floats * 4 * (1 if ablation == "tct_fedavg" else 2)
    assert rows[-1].bytes_up == normalization_up + 6 * 3 * floats * 4
    assert [row.round for row in rows] == [7 + (1 if normalized else 0) + r for r in range(1, 7)]
    if ablation == "tct_no_normalization":
        assert torch.equal(run.normalization.mean, torch.zeros(20, dtype=torch.float64))
        assert torch.equal(run.normalization.std, torch.ones(20, dtype=torch.float64))
    if ablation == "tct_loss_ce":
        assert rows[0].train_loss == pytest.approx(np.log(NUM_CLASSES), rel=1e-12), "ψ = 0 scores every class alike"


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_closed_form_on_raw_features_equals_plain_least_squares(ray_session, clients, held_out):
    pool = start_pool(ray_session, clients, held_out)
    try:
        run = stage2_run(pool, clients, RunConfig(method="tct", tct_solver="closed_form", tct_no_normalization=True),
                         width=20)
        model = run.closed_form(run.normalize())
    finally:
        pool.shutdown()
    features = torch.cat([c.features for c in clients]).numpy()
    labels = torch.cat([c.labels for c in clients]).numpy()
    design = np.hstack([features, np.ones((len(features), 1))])
    expected = np.linalg.lstsq(design, np.eye(NUM_CLASSES)[labels] - 1 / NUM_CLASSES, rcond=None)[0]
    assert np.allclose(model.numpy(), expected, rtol=0, atol=1e-10 * np.abs(expected).max())
    row = run.points[-1]
    assert (row.round, row.stage) == (7 + 1, "tct_closed_form"), "no normalization round before it"
    assert row.bytes_up == 6 * (21 * 21 + 21 * NUM_CLASSES) * 4
