"""``fedray run --finetune``: a closed-form head on embedded images, then federated fine-tuning, then the ridge probe."""

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from fedray.app.cli import main
from fedray.data.registry import load_federation
from fedray.data.images.reader import ImageReader
from fedray.methods.training.images import backbone_features
from fedray.methods.finetune_model import MODES, build_model
from fedray.methods.training.modes import FINETUNE_MODES
from fedray.data.images.backbones import feature_model, get_backbone, load_weights
from fedray.data.images.decode import ImageTransform
from fedray.methods.sphere import fixed_classifier
from tests.images import write_image_folder, write_inat_split


def test_the_configuration_knows_the_backends_modes():
    assert FINETUNE_MODES == tuple(MODES)


@pytest.mark.slow
def test_ftfeat_from_a_fed3r_head_on_images(ray_session, tmp_path, capsys):
    train_csv, images = write_inat_split(tmp_path / "data", users=4, images_per_user=3, classes=3, test_images=6)
    out = tmp_path / "run"
    rc = main(["run", "--method", "fedavg", "--finetune", "ftfeat", "--init", "fed3r", "--probe-ridge",
               "--dataset", f"hsu:{train_csv}?images={images}", "--backbone", "squeezenet1_1", "--weights", "random",
               "--image-size", "64", "--clients-per-round", "2", "--rounds", "2", "--eval-every", "1",
               "--batch-size", "4", "--local-epochs", "1", "--client-lr", "0.01", "--num-trainers", "1",
               "--cpus-per-trainer", "1", "--num-shards", "1", "--cpus-per-shard", "0.5", "--quiet", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    closed_form = [row for row in rows if row["stage"] == "closed_form"]
    training = [row for row in rows if row["stage"] == "train"]
    first = closed_form[-1]["round"]
    assert closed_form[-1]["clients_seen"] == 4
    assert [row["round"] for row in training] == [first, first + 1, first + 2]
    assert abs(training[0]["accuracy"] - closed_form[-1]["accuracy"]) <= 1 / 6, "the same head on the same images"
    assert rows[-1]["ridge_probe_accuracy"] is not None and all(r["ridge_probe_accuracy"] is None for r in rows[:-1])

    # FTFEAT trains and sends the backbone only: a participation moves its floats, no classifier.
    backbone = get_backbone("squeezenet1_1")
    backbone_floats = sum(p.numel() for p in feature_model(backbone, load_weights(backbone, "random").state_dict).parameters())
    assert training[-1]["bytes_down"] == 2 * 2 * backbone_floats * 4
    assert training[-1]["bytes_up"] == closed_form[-1]["bytes_up"] + 2 * 2 * backbone_floats * 4

    model = torch.load(out / "model.pt")
    with np.load(out / "classifier.npz") as arrays:
        assert np.array_equal(arrays["W"], model["head.weight"].T.numpy())
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["finetune"], config["init"], config["backbone"]) == ("ftfeat", "fed3r", "squeezenet1_1")


@pytest.mark.slow
def test_spherefed_with_scaffold_on_label_skewed_images(ray_session, tmp_path, capsys):
    """SphereFed on images: the backbone trains under the fixed classifier (never sent), then FFC on its embeddings."""
    root = write_image_folder(tmp_path / "data", classes=4, train_per_class=6, test_per_class=3)
    dataset = f"imagefolder:{root}?split=classes&classes_per_client=2&clients=6"
    out = tmp_path / "run"
    rc = main(["run", "--method", "scaffold", "--head", "sphere", "--finetune", "ftfeat", "--dataset", dataset,
               "--backbone", "squeezenet1_1", "--weights", "random", "--image-size", "64", "--clients-per-round", "3",
               "--rounds", "2", "--eval-every", "1", "--batch-size", "4", "--local-epochs", "1", "--client-lr", "0.01",
               "--lam", "0.01", "--num-trainers", "1", "--cpus-per-trainer", "1", "--num-shards", "1", "--cpus-per-shard", "0.5",
               "--quiet", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    assert [(row["round"], row["stage"]) for row in rows] == [(0, "train"), (1, "train"), (2, "train"), (3, "calibrated")]
    federation = load_federation(dataset)
    dim, classes = 512, federation.num_classes
    held = float(federation.client_num_classes.sum())
    assert rows[-1]["bytes_up"] - rows[-2]["bytes_up"] == (federation.num_clients * dim * dim + held * dim) * 4

    model = torch.load(out / "model.pt")
    assert torch.equal(model["head.weight"], fixed_classifier(classes, dim, 0).to(torch.float32))
    assert not model["head.bias"].any()
    backbone = get_backbone("squeezenet1_1")
    net = build_model(backbone, classes)
    embeddings = {}
    for split, table in (("train", federation.train), ("test", federation.test)):
        reader = ImageReader(table.column("image_path").to_pylist(), ImageTransform(64), threads=1)
        features = backbone_features(net, model, reader, 64, torch.device("cpu")).double()
        embeddings[split] = torch.nn.functional.normalize(features, dim=1)
    train = embeddings["train"]
    targets = torch.nn.functional.one_hot(torch.from_numpy(federation.train.column("label").to_numpy().astype(np.int64)), classes).double()
    expected = torch.linalg.solve(train.T @ train + 0.01 * torch.eye(dim, dtype=torch.float64), train.T @ targets)
    with np.load(out / "classifier.npz") as arrays:
        calibrated, fixed = torch.from_numpy(arrays["W"]), arrays["fixed_classifier"]
    assert np.array_equal(fixed, model["head.weight"].numpy())
    assert torch.allclose(calibrated, expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    test_labels = federation.test.column("label").to_numpy()
    accuracy = float(((embeddings["test"] @ calibrated).argmax(dim=1).numpy() == test_labels).mean())
    assert rows[-1]["accuracy"] == pytest.approx(accuracy, abs=1e-12)
