"""``fedray run --method tct`` end to end on generated images with a label-skewed split of 10 clients.

The run's saved outputs are checked against a recomputation outside Ray: the
eNTK features of every image at the saved stage-1 weights (the same
functions, one process), standardized with the saved μ and σ, give the run's
normalization, its closed-form model (weights and bias) and its test accuracy. The backbone has
seeded random weights (no pre-trained weights can be downloaded here).
"""

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torchvision
import yaml

from fedray.app.cli import main
from fedray.clock.devices import Devices
from fedray.clock.rounds import SynchronousRounds
from fedray.clock.run_clock import RunClock
from fedray.clock.selector import UniformSelector
from fedray.core.results import EvalPoint
from fedray.engine.clocked import FirstPassClock
from fedray.engine.plan import Sampler, stages
from fedray.engine.tct import Stage2Run
from fedray.engine.training import Accounting
from fedray.engine.config import RunConfig
from fedray.data.registry import load_federation
from fedray.core.errors import FedrayError
from fedray.data.images.reader import ImageReader
from fedray.methods.training.images import images_entk
from fedray.methods.finetune_model import build_model
from fedray.data.images.backbones import get_backbone
from fedray.data.images.decode import ImageTransform, load_image
from fedray.runtime.actor_group import balanced_bounds
from fedray.data.images.backbones import images_backbone
from fedray.methods.entk import EntkSpec, coordinate_index
from fedray.methods.tct_stage2 import normalize
from tests.methods.tct_stage2_reference import ClientData, closed_form_stage2, normalization
from tests.methods.test_tct_stage2 import NUM_CLASSES, label_skewed
from tests.runtime import test_tct_shards as tct_shards
from tests.images import write_image_folder


def recomputed_entk(table, bounds, model, params, index) -> torch.Tensor:
    """The features of ``table``'s rows, computed in the trainers' row ranges and batches with one thread, as they were.

    A random network's eNTK features change by up to 1e-3 (relative) with the
    batch they are computed in (a near-tie in a max-pool or ReLU flips), so
    the recomputation repeats the run's batches to compare closely.
    """
    paths = table.column("image_path").to_pylist()
    spec = EntkSpec(0, torch.from_numpy(index), chunk_size=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.cat([
            images_entk(model, params, ImageReader(paths[start:stop], ImageTransform(64), threads=1), spec, torch.device("cpu"))
            for start, stop in zip(bounds[:-1], bounds[1:])
        ])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_tct_on_a_label_skewed_split_matches_a_recomputation(ray_session, tmp_path, capsys):
    root = write_image_folder(tmp_path / "data", classes=4, train_per_class=10, test_per_class=4)
    dataset = f"imagefolder:{root}?split=classes&classes_per_client=2&clients=10"
    out = tmp_path / "run"
    rc = main(["run", "--method", "tct", "--dataset", dataset, "--backbone", "squeezenet1_1", "--weights", "random",
               "--image-size", "64", "--rounds", "2", "--eval-every", "2", "--batch-size", "4", "--local-epochs", "1",
               "--client-lr", "0.01", "--num-trainers", "2", "--cpus-per-trainer", "1", "--entk-dim", "300",
               "--entk-chunk", "8", "--tct-rounds", "4", "--tct-local-steps", "20", "--tct-lr", "1e-3",
               "--tct-solver", "both", "--quiet", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    assert [(row["round"], row["stage"]) for row in rows] == [
        (0, "train"), (2, "train"), (4, "tct_closed_form"), (5, "tct_scaffold"), (7, "tct_scaffold")]
    assert rows[-1]["train_loss"] < rows[-2]["train_loss"]
    assert min(row["train_loss"] for row in rows[-2:]) >= rows[2]["train_loss"] - 1e-9, "the closed form is the minimum"
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["method"], config["base"], config["finetune"]) == ("tct", "fedavg", "ft")

    federation = load_federation(dataset)
    assert federation.num_clients == 10
    params = torch.load(out / "model.pt")
    model = build_model(get_backbone("squeezenet1_1"), federation.num_classes)
    with np.load(out / "classifier.npz") as saved:
        arrays = dict(saved)
    assert arrays["entk_index"].shape == (300,) and arrays["W"].shape == arrays["W_closed_form"].shape == (300, 4)
    assert arrays["bias"].shape == arrays["bias_closed_form"].shape == (4,)
    # drawn from P of the network with TCT's one-output head: squeezenet1_1 less its 1000-class conv, plus 512 → 1
    reference = torchvision.models.squeezenet1_1()
    one_output = sum(p.numel() for p in reference.parameters()) - (512 * 1000 + 1000) + (512 + 1)
    assert np.array_equal(arrays["entk_index"], coordinate_index(one_output, 300, seed=0).numpy())
    offsets = federation.client_offsets
    train = recomputed_entk(federation.train, offsets[balanced_bounds(offsets, 2)], model, params, arrays["entk_index"])
    labels = torch.from_numpy(federation.train.column("label").to_numpy().copy())
    clients = [ClientData(train[offsets[k] : offsets[k + 1]], labels[offsets[k] : offsets[k + 1]]) for k in range(10)]
    mean, std = normalization(clients)
    assert np.allclose(arrays["entk_mean"], mean.numpy(), rtol=1e-12, atol=0)
    assert np.allclose(arrays["entk_std"], std.numpy(), rtol=1e-12, atol=0)

    standardized = [ClientData(normalize(c.features, mean, std, torch.float64), c.labels) for c in clients]
    expected = closed_form_stage2(standardized, federation.num_classes)
    tolerance = 1e-8 * expected.abs().max().item()
    assert np.allclose(arrays["W_closed_form"], expected[:-1].numpy(), rtol=0, atol=tolerance)
    assert np.allclose(arrays["bias_closed_form"], expected[-1].numpy(), rtol=0, atol=tolerance)

    test_bounds = np.linspace(0, federation.test.num_rows, 3).astype(np.int64)
    test = recomputed_entk(federation.test, test_bounds, model, params, arrays["entk_index"])
    test_labels = federation.test.column("label").to_numpy()
    for stage, suffix in (("tct_closed_form", "_closed_form"), ("tct_scaffold", "")):
        features = normalize(test, torch.from_numpy(arrays["entk_mean"]), torch.from_numpy(arrays["entk_std"]), torch.float64)
        scores = features.numpy() @ arrays[f"W{suffix}"] + arrays[f"bias{suffix}"]
        accuracy = float(scores.argmax(axis=1).__eq__(test_labels).mean())
        assert [row["accuracy"] for row in rows if row["stage"] == stage][-1] == pytest.approx(accuracy, abs=1e-12)


AUTHORS_ENTK_PARAMETERS = 355_073
"""P of TCT's MNIST network with the one-output head: 320 + 18,496 + 73,856 + 262,272 + 129 (conv1 on 1 channel ... head)."""


def tct_on_grayscale(tmp_path, capsys, *options: str) -> tuple[list[dict], dict, dict, str]:
    """A small ``fedray run --method tct`` of tct_cnn on generated 28-pixel grayscale images: rows, arrays, config."""
    root = write_image_folder(tmp_path / "data", classes=4, train_per_class=40, test_per_class=4, mode="L")
    dataset = f"imagefolder:{root}?split=classes&classes_per_client=2&clients=10"
    out = tmp_path / "run"
    rc = main(["run", "--method", "tct", "--dataset", dataset, "--backbone", "tct_cnn", "--weights", "random",
               "--image-size", "28", "--rounds", "2", "--eval-every", "2", "--batch-size", "8", "--local-epochs", "1",
               "--client-lr", "0.01", "--num-trainers", "1", "--entk-chunk", "16", "--tct-rounds", "2",
               "--tct-local-steps", "10", "--tct-lr", "1e-3", "--quiet", "--out", str(out), *options])
    assert rc == 0, capsys.readouterr().err
    with np.load(out / "classifier.npz") as saved:
        arrays = dict(saved)
    return (pq.read_table(out / "metrics.parquet").to_pylist(), arrays, yaml.safe_load((out / "config.yaml").read_text()),
            dataset)


@pytest.mark.slow
def test_tct_last_layer_raw_features_fedavg_on_grayscale_images(ray_session, tmp_path, capsys):
    """TCT-last-layer, without normalization, stage 2 by FedAvg: the closed form is the ridge solution on the raw
    penultimate features of the saved network (a plain forward pass), the features' coordinates the head's weights."""
    rows, arrays, config, dataset = tct_on_grayscale(
        tmp_path, capsys, "--entk-params", "last_layer", "--tct-no-normalization", "--tct-fedavg", "--entk-dim", "1000",
        "--tct-solver", "both", "--tct-lam", "0.1")
    assert [(row["round"], row["stage"]) for row in rows] == [
        (0, "train"), (2, "train"), (3, "tct_closed_form"), (4, "tct_scaffold")], "no normalization round"
    assert (config["entk_params"], config["tct_no_normalization"], config["tct_fedavg"], config["tct_loss"]) == \
        ("last_layer", True, True, "mse")
    assert (rows[-1]["entk_params"], rows[-1]["tct_no_normalization"], rows[-1]["tct_fedavg"]) == ("last_layer", True, True)
    # the head's 128 weights follow conv1 … fc1 of the one-channel network, P − 129 of them
    assert np.array_equal(arrays["entk_index"], np.arange(AUTHORS_ENTK_PARAMETERS - 129, AUTHORS_ENTK_PARAMETERS - 1))
    assert not arrays["entk_mean"].any() and (arrays["entk_std"] == 1).all()

    federation = load_federation(dataset)
    model = build_model(images_backbone("tct_cnn", federation), federation.num_classes)
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt"))
    transform = ImageTransform(28, channels=1)
    images = torch.stack([load_image(path, transform, transform.pipeline())
                          for path in federation.train.column("image_path").to_pylist()])
    with torch.no_grad():
        features = model.eval().backbone(images).double().numpy()
    labels = federation.train.column("label").to_numpy()
    design = np.hstack([features, np.ones((len(features), 1))])
    penalty = np.diag([1.0] * 128 + [0.0])
    expected = np.linalg.solve(design.T @ design + 0.1 * len(design) * penalty,
                               design.T @ (np.eye(4)[labels] - 1 / 4))
    assert np.allclose(arrays["W_closed_form"], expected[:-1], rtol=0, atol=1e-4 * np.abs(expected).max())
    assert np.allclose(arrays["bias_closed_form"], expected[-1], rtol=0, atol=1e-4 * np.abs(expected).max())
    assert arrays["W"].shape == (128, 4) and not np.array_equal(arrays["W"], arrays["W_closed_form"])


@pytest.mark.slow
def test_tct_with_cross_entropy_on_grayscale_images(ray_session, tmp_path, capsys):
    rows, arrays, config, _ = tct_on_grayscale(tmp_path, capsys, "--tct-loss", "ce", "--entk-dim", "500",
                                               "--tct-rounds", "3", "--eval-every", "1")
    stage2 = [row for row in rows if row["stage"] == "tct_scaffold"]
    assert [row["round"] for row in stage2] == [2 + 1 + 1, 2 + 1 + 2, 2 + 1 + 3]
    assert stage2[0]["train_loss"] == pytest.approx(np.log(4), rel=1e-6), "cross-entropy of ψ = 0: log C"
    assert stage2[-1]["train_loss"] < stage2[0]["train_loss"]
    assert config["tct_loss"] == "ce" and rows[-1]["tct_loss"] == "ce"
    # drawn from the P of the authors' one-channel network
    assert np.array_equal(arrays["entk_index"], coordinate_index(AUTHORS_ENTK_PARAMETERS, 500, seed=0).numpy())


def test_the_ablations_refuse_what_they_cannot_do():
    with pytest.raises(FedrayError, match="--tct-loss ce has no closed form"):
        RunConfig(method="tct", tct_loss="ce", tct_solver="both", entk_dim=100).validate()
    with pytest.raises(FedrayError, match="--tct-loss ce has no closed form"):
        RunConfig(method="tct", tct_loss="ce", tct_solver="closed_form", entk_dim=100).validate()
    with pytest.raises(FedrayError, match="--tct-fedavg .* not closed_form"):
        RunConfig(method="tct", tct_fedavg=True, tct_solver="closed_form", entk_dim=100).validate()
    with pytest.raises(FedrayError, match="--tct-loss must be one of mse, ce"):
        RunConfig(method="tct", tct_loss="hinge").validate()
    with pytest.raises(FedrayError, match="--entk-params must be one of all, last_layer"):
        RunConfig(method="tct", entk_params="first_layer").validate()
    with pytest.raises(FedrayError, match="--tct-fedavg applies to --method tct"):
        RunConfig(method="fedavg", tct_fedavg=True).validate()
    RunConfig(method="tct", tct_fedavg=True, tct_no_normalization=True, tct_solver="both", entk_dim=100).validate()
    RunConfig(method="tct", tct_loss="ce").validate()
    # the last layer's p ≤ d coordinates (1,280 for mobilenet_v2) fit the closed form whatever --entk-dim says
    RunConfig(method="tct", entk_params="last_layer", tct_solver="both").validate()


def test_closed_form_stage2_needs_a_width_it_can_solve():
    with pytest.raises(FedrayError, match="--tct-projection"):
        RunConfig(method="tct", tct_solver="both").validate()
    RunConfig(method="tct", tct_solver="closed_form", tct_projection=2000).validate()
    with pytest.raises(FedrayError, match="--base"):
        RunConfig(method="tct", base="fedsgd").validate()


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_stage2_rounds_are_on_the_clock_with_each_clients_pass_counted(ray_session):
    """Stage 2 (both solvers) of six clients on the uniform device (1,305,366,530 multiply-adds/s, 33,943,262 bit/s
    down, 26,037,371 up), after a stage 1 of 7 rounds: the normalization round, the closed form's and SCAFFOLD's are
    rounds of the clock in that order, each as long as its slowest client, a client's eNTK pass (here 1,000
    multiply-adds a sample) counted in its first; the rows' clock columns are their rounds' ends."""
    clients, held_out = label_skewed(seed=4), label_skewed(seed=5, num_clients=4)
    held_out = ClientData(torch.cat([c.features for c in held_out]), torch.cat([c.labels for c in held_out]))
    sizes = np.array([len(c.labels) for c in clients])
    config = RunConfig(method="tct", tct_solver="both", tct_rounds=3, tct_local_steps=2, tct_lr=0.05,
                       clients_per_round=3, eval_every=1, seed=3).resolved()
    sampler = Sampler(len(sizes), 3, False, config.seed)
    clock = RunClock(Devices("uniform"), None, SynchronousRounds(), UniformSelector(), "uniform", len(sizes), 3, 3)
    start = EvalPoint(7, 0, 0, 0.5, 0.0, 0.0, 0.0, 0.0, "train")
    # the same stage 2 under a deadline no client meets: SCAFFOLD's rounds keep no upload and change nothing
    late = RunClock(Devices("uniform"), None, SynchronousRounds(deadline=1e-9), UniformSelector(), "uniform",
                    len(sizes), 3, 3)
    pool = tct_shards.start_pool(None, clients, held_out)
    try:
        stage2 = Stage2Run(stages(config)[-1], sampler, config.eval_every, pool, sizes, NUM_CLASSES, 20, [start],
                           Accounting(np.zeros(len(sizes), dtype=bool)), clock=FirstPassClock(clock, 1000.0 * sizes))
        normalization = stage2.normalize()
        stage2.closed_form(normalization)
        stage2.scaffold(normalization)
        unheard = Stage2Run(stages(config)[-1], sampler, config.eval_every, pool, sizes, NUM_CLASSES, 20, [start],
                            Accounting(np.zeros(len(sizes), dtype=bool)), clock=FirstPassClock(late, 1000.0 * sizes))
        unchanged = unheard.scaffold(unheard.normalize())
    finally:
        pool.shutdown()
    assert not unchanged.any() and [len(clients) for clients in unheard.scaffold_rounds] == [0, 0, 0]
    # the normalization asks every client until it has lost MAX_LOST = 10 uploads of each (6 · 10 asks: its round
    # of six, then rounds of up to κ = 3 clients still to hear), SCAFFOLD's rounds numbered after them
    late_rounds = late.table().to_pylist()
    normalization = [row for row in late_rounds if row["stage"] == "tct_normalization"]
    assert [row["stage"] for row in late_rounds] == ["tct_normalization"] * len(normalization) + ["tct_scaffold"] * 3
    assert [row["round"] for row in late_rounds] == list(range(8, 8 + len(late_rounds)))
    assert normalization[0]["stragglers"] == 6 and all(0 < row["stragglers"] <= 3 for row in normalization[1:])
    assert sum(row["stragglers"] for row in normalization) == 60
    assert [row["stragglers"] for row in late_rounds[-3:]] == [3, 3, 3]
    last = 7 + len(normalization)
    assert [(row.round, row.train_loss) for row in unheard.points[1:]] == [(last + 1, None), (last + 2, None),
                                                                            (last + 3, None)]
    p, c = 20, NUM_CLASSES

    def seconds(macs, down_floats, up_floats):
        return macs / 1305366530 + down_floats * 4 * 8 / 33943262 + up_floats * 4 * 8 / 26037371

    normalize_s = max(seconds(1000.0 * n + 3 * n * p / 2, 2 * p, 2 * p + 1) for n in sizes)
    closed_form_s = max(seconds(n * (p + 1) * (p + 1 + c), 0, (p + 1) ** 2 + (p + 1) * c) for n in sizes)
    rounds = clock.table().to_pylist()
    assert [(row["round"], row["stage"]) for row in rounds] == [
        (8, "tct_normalization"), (9, "tct_closed_form"), (9, "tct_scaffold"), (10, "tct_scaffold"),
        (11, "tct_scaffold")]
    assert [row["selected"] for row in rounds] == [6, 6, 3, 3, 3]
    assert rounds[0]["end_s"] - rounds[0]["start_s"] == pytest.approx(normalize_s, rel=1e-12)
    assert rounds[1]["end_s"] - rounds[1]["start_s"] == pytest.approx(closed_form_s, rel=1e-12)
    for row, drawn in zip(rounds[2:], stage2.scaffold_rounds):  # ψ and c down (κ < K), Δ up
        expected = max(seconds(2 * 2 * sizes[k] * (p + 1) * c, 2 * (p + 1) * c, (p + 1) * c) for k in drawn)
        assert row["end_s"] - row["start_s"] == pytest.approx(expected, rel=1e-12)
    assert all(later["start_s"] == earlier["end_s"] for earlier, later in zip(rounds, rounds[1:]))
    rows = stage2.points[1:]
    assert [(row.stage, row.round) for row in rows] == [("tct_closed_form", 9), ("tct_scaffold", 9),
                                                       ("tct_scaffold", 10), ("tct_scaffold", 11)]
    assert [row.clock_columns["clock_s"] for row in rows] == [row["end_s"] for row in rounds[1:]]


@pytest.mark.slow
def test_a_clock_that_changes_nothing_changes_no_bit_of_tct_and_times_each_stage(ray_session, tmp_path, capsys):
    """TCT with both solvers on the uniform device (no deadline, everyone online) gives the run without a clock bit for
    bit, its rows with the clock's columns: non-null, at their rounds' ends, in order; rounds.parquet holds stage 1's
    rounds, then stage 2's (no normalization round here) with their stage names."""
    options = ("--entk-params", "last_layer", "--tct-no-normalization", "--entk-dim", "1000", "--tct-solver", "both",
               "--tct-lam", "0.1")
    plain_rows, plain_arrays, _, _ = tct_on_grayscale(tmp_path / "plain", capsys, *options)
    rows, arrays, _, _ = tct_on_grayscale(tmp_path / "clocked", capsys, *options, "--devices", "uniform")
    assert plain_arrays.keys() == arrays.keys()
    assert all(np.array_equal(plain_arrays[name], arrays[name]) for name in arrays)
    clock_columns = {"clock_s", "clock_compute_s", "clock_comm_s", "clients_straggled", "clients_dropped"}
    for before, after in zip(plain_rows, rows, strict=True):
        kept = set(before) - {"wall_s", "dataset"}  # the same images, generated in each run's folder
        assert {name: before[name] for name in kept} == {name: after[name] for name in kept}
    rounds = pq.read_table(tmp_path / "clocked" / "run" / "rounds.parquet").to_pylist()
    assert [(row["round"], row["stage"]) for row in rounds] == [
        (1, "train"), (2, "train"), (3, "tct_closed_form"), (3, "tct_scaffold"), (4, "tct_scaffold")]
    assert all(later["start_s"] == earlier["end_s"] < later["end_s"] for earlier, later in zip(rounds, rounds[1:]))
    assert [row["clock_s"] for row in rows] == [0.0, rounds[1]["end_s"], rounds[2]["end_s"], rounds[4]["end_s"]]
    assert all(clock_columns <= set(row) and None not in [row[name] for name in clock_columns] for row in rows)
