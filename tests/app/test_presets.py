"""Every preset in presets/ loads, names its target in a leading comment, and runs at reduced size; key values are the papers'.

The fast layer loads every preset and runs two of them; the full suite runs them all (image presets, fine-tuning
and TCT, take 15–35 s each).
"""

from pathlib import Path

import pytest

from fedray.engine.config import resolve
from fedray.engine.config_files import load_config_file
from fedray.engine.run_config import run
from tests.images import write_image_folder

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "presets").glob("*/*.yaml"))
SMALL_FEATURES = "synthetic:inat-user-120k?dim=16&scale=0.01&classes=20&seed=1"
FIXED_SIZE = {"tct_cnn": 28, "resnet18_cifar": 32, "resnet18_cifar_gn": 32}


def preset(path: str) -> dict:
    return load_config_file(ROOT / "presets" / path)


def on_images(values: dict) -> bool:
    return values.get("method") == "tct" or values.get("finetune") is not None


def test_there_is_a_preset_per_paper():
    assert {path.parent.name for path in PRESETS} == {"fedcof", "fed3r", "fedncm", "spherefed", "tct"}


def on_images_file(path: Path) -> bool:
    return on_images(load_config_file(path))


FAST_RUNS = ("fed3r/inat-user-120k.yaml", "fedcof/cifar100-squeezenet.yaml")
"""The runs the fast layer keeps; every preset still loads and resolves there (``test_each_preset_loads_and_names_its_target``)."""


def test_each_preset_loads_and_names_its_target():
    for path in PRESETS:
        assert path.read_text().startswith("# "), f"{path.name}: a preset starts with a comment naming the paper's table or figure"
        resolve(load_config_file(path), {})  # valid as shipped


@pytest.mark.parametrize("path", [pytest.param(path, marks=[] if f"{path.parent.name}/{path.name}" in FAST_RUNS else [pytest.mark.slow],
                                               id=f"{path.parent.name}/{path.name}") for path in PRESETS])
def test_each_preset_names_its_target_and_runs_at_reduced_size(ray_session, tmp_path, path):
    assert path.read_text().startswith("# "), "a preset starts with a comment naming the paper's table or figure"
    values = load_config_file(path)
    resolve(values, {})  # valid as shipped
    reduced = {"out": str(tmp_path / "run"), "quiet": True, "rounds": 2, "init_rounds": 2, "eval_every": 1,
               "local_epochs": 1, "rf_dim": 50, "num_shards": 1, "cpus_per_shard": 0.5}
    if on_images(values):
        root = write_image_folder(tmp_path / "data", classes=4, train_per_class=6, test_per_class=2)
        reduced |= {"dataset": f"imagefolder:{root}?split=classes&classes_per_client=2&clients=4", "weights": "random",
                    "image_size": FIXED_SIZE.get(values.get("backbone"), 64), "batch_size": 4, "clients_per_round": 2,
                    "rounds": 1, "init_rounds": 1, "num_trainers": 1, "entk_dim": 200, "entk_chunk": 8, "tct_rounds": 2,
                    "tct_local_steps": 5}
    else:
        reduced["dataset"] = SMALL_FEATURES
    config = resolve(values, reduced, drop_unused=True)  # one reduction for every preset: each takes what applies to it
    assert config.dataset == reduced["dataset"] and config.rounds == reduced["rounds"], "the command line wins"
    rows = run(config).rows
    assert rows and not rows[-1]["diverged"] and 0 <= rows[-1]["accuracy"] <= 1


def test_fedcof_presets_use_the_papers_shrinkage_and_participation():
    # Goswami et al., Section 5: γ = 1 for SqueezeNet and ViT-B/16, 0.1 for MobileNetV2; 30% of the clients per round
    assert preset("fedcof/cifar100-squeezenet.yaml")["gamma"] == 1.0
    assert preset("fedcof/imagenet-r-vit_b_16.yaml")["gamma"] == 1.0
    assert preset("fedcof/cub200-mobilenet_v2.yaml")["gamma"] == 0.1
    assert preset("fedcof/inat-user-120k-mobilenet_v2.yaml")["gamma"] == 0.1
    assert all(preset(f"fedcof/{path.name}")["participation"] == 0.3 for path in PRESETS if path.parent.name == "fedcof")
    assert "alpha=0.1&clients=100" in preset("fedcof/cars-squeezenet.yaml")["dataset"]
    ft = preset("fedcof/ft-imagenet-r-fedadam.yaml")  # Appendix J
    assert (ft["method"], ft["client_lr"], ft["server_lr"], ft["local_epochs"], ft["rounds"]) == ("fedadam", 1e-4, 1e-4, 1, 100)
    lp = preset("fedcof/lp-inat-user-120k-squeezenet.yaml")  # Appendix J
    assert (lp["rounds"], lp["local_epochs"], lp["client_lr"]) == (5000, 3, 1e-5)


def test_fed3r_presets_use_appendix_c():
    rf = preset("fed3r/inat-user-120k-rf.yaml")
    assert (rf["lam"], rf["rf_sigma"], rf["rf_dim"], rf["clients_per_round"]) == (0.01, 1000.0, 10000, 10)
    lp = preset("fed3r/inat-user-120k-fedavg-lp.yaml")
    assert (lp["client_lr"], lp["weight_decay"], lp["batch_size"], lp["local_epochs"], lp["server_lr"], lp["rounds"]) == \
        (0.1, 4e-5, 50, 5, 1.0, 5000)
    ft = preset("fed3r/inat-user-120k-fed3r-ft.yaml")
    assert (ft["init"], ft["temperature"], ft["finetune"]) == ("fed3r", 0.1, "ft")


def test_spherefed_and_tct_presets_use_their_papers_settings():
    sphere = preset("spherefed/cifar100-fedavg.yaml")  # Dong et al., Section 5.1
    assert (sphere["client_momentum"], sphere["lr_schedule"], sphere["weight_decay"], sphere["batch_size"],
            sphere["local_epochs"], sphere["rounds"], sphere["lam"]) == (0.9, "cosine", 1e-5, 64, 10, 100, 0.0)
    tct = preset("tct/cifar10-resnet18.yaml")  # Yu et al., Section 5.1 and Algorithm 3
    assert (tct["rounds"], tct["weight_decay"], tct["batch_size"], tct["tct_local_steps"], tct["tct_lr"], tct["tct_rounds"],
            tct["backbone"]) == (100, 1e-5, 64, 500, 5e-5, 100, "resnet18_cifar")
    assert preset("tct/fmnist-cnn.yaml")["backbone"] == "tct_cnn"
