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
from fedray.engine.config import RunConfig
from fedray.data.registry import load_federation
from fedray.core.errors import FedrayError
from fedray.data.images.reader import ImageReader
from fedray.methods.training.images import images_entk
from fedray.methods.finetune_model import build_model
from fedray.data.images.backbones import get_backbone
from fedray.data.images.decode import ImageTransform
from fedray.runtime.actor_group import balanced_bounds
from fedray.methods.entk import EntkSpec, coordinate_index
from fedray.methods.tct_stage2 import normalize
from tests.methods.tct_stage2_reference import ClientData, closed_form_stage2, normalization
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


def test_closed_form_stage2_needs_a_width_it_can_solve():
    with pytest.raises(FedrayError, match="--tct-projection"):
        RunConfig(method="tct", tct_solver="both").validate()
    RunConfig(method="tct", tct_solver="closed_form", tct_projection=2000).validate()
    with pytest.raises(FedrayError, match="--base"):
        RunConfig(method="tct", base="fedsgd").validate()
