"""``fedray run --finetune``: a closed-form head on embedded images, then federated fine-tuning, then the ridge probe."""

import numpy as np
import pyarrow.parquet as pq
import torch
import yaml

from fedray.cli import main
from fedray.finetune.model import MODES
from fedray.gradient.algorithms import FINETUNE_MODES
from fedray.images.backbones import feature_model, get_backbone, load_weights
from tests.images import write_inat_split


def test_the_configuration_knows_the_backends_modes():
    assert FINETUNE_MODES == tuple(MODES)


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
