"""The memory estimate: its stages, and that it bounds what a run's shards really grow by."""

import os
from dataclasses import replace

import numpy as np
import pytest

from fedray.engine.config import RunConfig
from fedray.data import synthetic
from fedray.runtime.evaluator import Evaluator
from fedray.engine.plan import build_method
from fedray.engine.run_config import simulate
from fedray.methods.evaluation import eval_bounds
from fedray.engine.plan import Training, footprints, plan
from fedray.runtime.footprint import FLOAT32, INT64
from fedray.runtime.shards import ShardPool

GB = 1e9


@pytest.fixture(scope="module")
def federation():
    return synthetic.build("inat-user-120k", dim=64, scale=0.1, classes=100, seed=3)


def estimate(config, federation, algorithm=None):
    """The plan's footprints of ``config``, training with ``algorithm`` (the run's own when not given)."""
    run = plan(config, federation)
    if algorithm is not None:
        run = replace(run, stages=tuple(replace(stage, algorithm=algorithm) if isinstance(stage, Training) else stage
                                        for stage in run.stages))
    return footprints(run, federation)


def training(footprints):
    """The training stage's footprint (the closed-form stages are labelled with their flag)."""
    return next(footprint for footprint in footprints if "(" not in footprint.stage)


def stages(federation, **options):
    return [footprint.stage for footprint in estimate(RunConfig(**options).validate().resolved(), federation)]


def test_each_stage_of_a_run_is_estimated(federation):
    assert stages(federation, method="fedcof") == ["fedcof"]
    assert stages(federation, method="fedavg", init="fedcof", probe_ridge=True) == \
        ["fedcof (--init)", "fedavg", "fed3r (--probe-ridge)"]
    assert stages(federation, method="scaffold", head="sphere") == ["scaffold", "ffc (SphereFed's calibration)"]
    assert stages(federation, method="fedavg", finetune="ft") == [], "fine-tuning on images is not estimated"


def test_the_largest_term_names_what_to_lower(federation):
    samples = np.array([federation.train.num_rows])
    rf = estimate(RunConfig(method="fed3r-rf", rf_dim=20_000).validate().resolved(), federation)[0]
    assert rf.largest(samples, federation.test.num_rows).remedy == "lower --rf-dim"
    means = estimate(RunConfig(method="fedcof", means_per_class=10_000).validate().resolved(), federation)[0]
    assert means.largest(samples, federation.test.num_rows).remedy == "lower --means-per-class"
    scaffold = estimate(RunConfig(method="scaffold").validate().resolved(), federation)[-1]
    state = federation.train.num_rows * federation.num_classes * FLOAT32  # the clients' gradient rows, in the shards
    assert scaffold.shard(federation.train.num_rows, 0) > state and scaffold.driver < state


def test_the_oracle_holds_d_by_d_matrices_in_its_shards_only_with_full_covariances(federation):
    d, classes = federation.dim, federation.num_classes
    held = {covariance: estimate(RunConfig(method="fedcof-oracle", covariance=covariance).validate().resolved(),
                                 federation)[0].shard(0, 0) for covariance in ("full", "diagonal", "spherical")}
    # 5 copies of a shard's statistics: Σ zzᵀ (d × d) for full covariances, Σ z∘z (C × d) or Σ ‖z‖² (C) otherwise
    assert held["full"] - held["diagonal"] == 5 * 8 * (d * d - classes * d)
    assert held["diagonal"] - held["spherical"] == 5 * 8 * classes * (d - 1)


@pytest.mark.parametrize("method, options", [pytest.param("fed3r-rf", {"rf_dim": 3000}, marks=pytest.mark.slow), ("fedcof", {})])
def test_the_estimate_bounds_the_shards_measured_growth(ray_session, federation, method, options):
    """Run the method on 2 shards and compare each shard's peak memory growth past its features with the estimate."""
    pool = ShardPool.start(federation, num_shards=2, cpus_per_shard=1)
    try:
        loaded = np.array(pool.peak_memory_bytes())
        config = RunConfig(method=method, quiet=True, **options).validate().resolved()
        footprint, = estimate(config, federation)
        simulate(config, build_method(config, federation), pool, Evaluator(pool))
        grown = np.array(pool.peak_memory_bytes()) - loaded
        samples = np.diff(federation.client_offsets[pool.bounds])
        tests = np.diff(eval_bounds(federation.test.num_rows, pool.num_shards))
    finally:
        pool.shutdown()
    held = FLOAT32 * federation.dim + INT64  # a row's features and label, loaded before ``loaded`` was measured
    estimated = np.array([footprint.shard(int(n), int(t)) - (n + t) * held for n, t in zip(samples, tests)])
    assert (grown <= estimated + 0.05 * GB).all(), (grown / GB, estimated / GB)  # a few MB of BLAS buffers aside
    assert (estimated <= grown + 0.5 * GB).all(), "an estimate, not a wild upper bound"


def feddyn_state_bytes(federation, **options) -> float:
    """What FedDyn's clients' states add to a shard holding every training row: its estimate less FedAvg's."""
    samples = federation.train.num_rows
    feddyn = training(estimate(RunConfig(method="feddyn", **options).validate().resolved(), federation))
    fedavg = training(estimate(RunConfig(method="fedavg", **options).validate().resolved(), federation))
    return feddyn.shard(samples, 0) - fedavg.shard(samples, 0)


def test_a_stateful_algorithms_client_states_are_counted_in_the_shards(federation):
    """FedDyn keeps ∇L_k, one copy of the head, for every client it samples: d × C + C float32 each."""
    d, classes, clients = federation.dim, federation.num_classes, federation.num_clients

    assert feddyn_state_bytes(federation) == pytest.approx(clients * (d * classes + classes) * FLOAT32)
    assert feddyn_state_bytes(federation, rounds=3, clients_per_round=10) == \
        pytest.approx(30 * (d * classes + classes) * FLOAT32)
    assert feddyn_state_bytes(federation, head="sphere", sphere_dim=16) == \
        pytest.approx(clients * (d * 16 + 16) * FLOAT32)


def test_scaffolds_client_states_are_counted_as_the_path_that_trains_it_keeps_them(federation):
    """The dual form's SCAFFOLD keeps the gradient rows G (samples × C); the same SCAFFOLD by autograd (a subclass)
    keeps c_i itself, one copy of the head per client: the estimate asks the same decision
    as training (fedray.methods.training.dual_form)."""
    from dataclasses import dataclass

    from fedray.methods.training_algorithms import Scaffold

    @dataclass(frozen=True)
    class MyScaffold(Scaffold):
        pass

    d, classes, clients, samples = federation.dim, federation.num_classes, federation.num_clients, federation.train.num_rows
    config = RunConfig(method="scaffold").validate().resolved()
    fedavg = training(estimate(RunConfig(method="fedavg").validate().resolved(), federation)).shard(samples, 0)

    def states(algorithm=None):
        return training(estimate(config, federation, algorithm)).shard(samples, 0) - fedavg

    dense = clients * (d * classes + classes) * FLOAT32
    rows = samples * classes * FLOAT32                        # G: samples × C, plus a block's two copies in flight
    assert rows <= states() == states(Scaffold()) <= 3 * rows < dense
    assert states(MyScaffold()) == states(Scaffold(variant="II")) == pytest.approx(dense)   # option II: autograd


def test_scaffolds_gradient_rows_are_those_of_the_clients_its_rounds_can_sample(federation):
    """G holds the rows of the clients sampled at least once: with 3 rounds of 10 clients, 30 of the K clients' share of
    a shard's samples (the rows of a round's block in flight are a term of their own)."""
    classes, clients, samples = federation.num_classes, federation.num_clients, federation.train.num_rows

    def states(**options):
        scaffold = training(estimate(RunConfig(method="scaffold", **options).validate().resolved(), federation))
        rows, = (term for term in scaffold.terms if term.what.startswith("SCAFFOLD's client states"))
        return rows.in_shard(samples, 0, 0)

    every = states()
    short = states(rounds=3, clients_per_round=10)
    assert every - short == pytest.approx(samples * classes * FLOAT32 * (1 - 30 / clients))


@pytest.mark.parametrize("cpus_per_shard", [1.0, 0.5, 64.0])
def test_the_received_means_a_shard_keeps_are_counted_up_to_its_share_of_the_machine(federation, cpus_per_shard):
    """FedCOF's kept means: the shards filling a machine keep an eighth of its memory between them (each in
    proportion to its CPUs), not an eighth each: sixteen 1-CPU shards on 16 CPUs would otherwise keep twice it."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    config = RunConfig(method="fedcof", means_per_class=10_000, cpus_per_shard=cpus_per_shard).validate().resolved()
    means = next(term for term in estimate(config, federation)[0].terms if term.remedy == "lower --means-per-class")
    assert means.per_shard == int(machine // 8 * min(1.0, cpus_per_shard / os.cpu_count()))
    assert means.per_shard < int(federation.client_num_classes.sum()) * 10_000 * (federation.dim + 2) * 8


def test_the_client_states_a_shard_keeps_in_memory_are_counted_up_to_its_budget(federation):
    """Beyond ``--client-state-memory`` the states spill to disk: a shard's estimate counts at most that."""
    d, classes, clients = federation.dim, federation.num_classes, federation.num_clients

    every_state = clients * (d * classes + classes) * FLOAT32
    assert 1e5 < every_state
    assert feddyn_state_bytes(federation, client_state_memory=1e-4) == pytest.approx(1e5)  # 0.1 MB
    assert feddyn_state_bytes(federation, client_state_memory=0.0) == 0
    assert feddyn_state_bytes(federation, client_state_memory=1.0) == pytest.approx(every_state)


def test_feddyn_on_the_full_stand_in_over_2000_rounds_fits_24_gb():
    """Every one of the 9,275 clients' ∇L_k (1,281 × 1,203 float32: 57 GB) was refused; the shards now keep at most
    their budget in memory (--client-state-memory 1.5: two shards, 3 GB) and the estimate fits 24 GB."""
    full = synthetic.build("inat-user-120k")
    config = RunConfig(method="feddyn", sampling="without", rounds=2000, num_shards=2, client_state_memory=1.5)
    footprint = training(estimate(config.validate().resolved(), full))
    halves = np.diff(full.client_offsets[[0, full.num_clients // 2, full.num_clients]])
    total = sum(footprint.shard(int(n), full.test.num_rows // 2) for n in halves) + footprint.driver
    states = next(term for term in footprint.terms if term.what.startswith("the client states"))
    assert "9,275 clients" in states.what and total < 24 * GB, total / GB
    uncapped = replace(states, shard_cap=float("inf"))
    assert sum(uncapped.in_shard(int(n), 0, 0) for n in halves) > 56 * GB, "what it was refused for"


def test_a_round_s_block_is_the_largest_round_the_schedule_draws():
    """Not the κ largest clients of the population: among 10⁶ clients the 100 largest hold ~250,000 samples, a round of
    100 drawn ones ~1,300, and a fedavg run there was refused for 15 GB of logits."""
    from fedray.data.registry import load_federation

    spec = "synthetic:inat-user-120k?clients=1000000"
    population = load_federation(spec)
    config = RunConfig(method="fedavg", dataset=spec, clients_per_round=100, rounds=100).validate().resolved()
    run = plan(config, population)
    training, = run.stages
    largest = max(int(population.client_sizes[clients].sum()) for clients in training.schedule(run))
    footprint, = footprints(run, population)
    assert footprint.block_samples == largest < 10_000 < np.sort(population.client_sizes)[-100:].sum()
