"""Backbones: the feature is the pooled penultimate activation; weights from a file, the hub cache, or a seed."""

from pathlib import Path

import pytest
import torch
import torchvision

from fedray.core.errors import FedrayError
from fedray.data.images.backbones import BACKBONES, feature_model, get_backbone, images_backbone, load_weights
from fedray.data.registry import load_federation
from fedray.methods.entk import coordinate_index, entk_features, entk_num_parameters, num_parameters, reinitialize_last_layer
from fedray.methods.finetune_model import build_model
from tests.images import write_image_folder


def penultimate(name: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The pooled penultimate activation of a full torchvision model, computed by hand."""
    if name == "mobilenet_v2":
        return torch.nn.functional.adaptive_avg_pool2d(model.features(x), 1).flatten(1)
    if name == "squeezenet1_1":
        return torch.nn.functional.adaptive_avg_pool2d(model.features(x), 1).flatten(1)
    if name == "tct_cnn":
        for conv in (model.conv1, model.conv2, model.conv3):
            x = torch.relu(conv(x))
        return torch.relu(model.fc1(x.flatten(1)))
    if name.startswith("resnet18"):
        body = torch.nn.Sequential(*list(model.children())[:-1])
        return body(x).flatten(1)
    tokens = model.encoder(torch.cat([model.class_token.expand(len(x), -1, -1), model._process_input(x)], dim=1))
    return tokens[:, 0]


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name == "vit_b_16" else name
                                  for name in sorted(BACKBONES)])
def test_features_are_the_pooled_penultimate_activation(name):
    backbone = get_backbone(name)
    weights = load_weights(backbone, "random", seed=1)
    assert not weights.pretrained and weights.weights_id == "random-seed1"
    full = backbone.architecture()
    full.load_state_dict(weights.state_dict)
    full.eval()
    size = {"tct_cnn": 28, "resnet18_cifar": 32, "resnet18_cifar_gn": 32}.get(name, 224)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = feature_model(backbone, weights.state_dict)(x)
        expected = penultimate(name, full, x)
    assert ours.shape == (2, backbone.dim)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_tcts_networks_have_the_published_architectures():
    cifar = get_backbone("resnet18_cifar").architecture()
    cifar.fc = torch.nn.Linear(512, 10)
    assert sum(p.numel() for p in cifar.parameters()) == 11_173_962, "the CIFAR ResNet-18 (kuangliu/pytorch-cifar) with 10 classes"
    assert cifar.conv1.kernel_size == (3, 3) and cifar.conv1.stride == (1, 1)
    gn = get_backbone("resnet18_cifar_gn").architecture()
    assert gn.bn1.num_groups == 2 and isinstance(gn.layer4[1].bn2, torch.nn.GroupNorm), "ResNet-18-GN: 2 groups (TCT B.2)"
    cnn = get_backbone("tct_cnn").architecture()
    cnn.fc2 = torch.nn.Linear(128, 1)
    rgb_filters = 2 * 32 * 3 * 3
    assert sum(p.numel() for p in cnn.parameters()) - rgb_filters == 355_073, "on RGB: two more input channels' filters"


AUTHORS_ENTK_PARAMETERS = 355_073
"""P of TCT's MNIST network with its one-output head (the authors' code): conv1 1·32·3·3 + 32 = 320, conv2
32·64·3·3 + 64 = 18,496, conv3 64·128·3·3 + 128 = 73,856, fc1 2048·128 + 128 = 262,272, head 128 + 1 = 129."""


def test_tct_cnn_on_grayscale_images_is_the_authors_network(tmp_path):
    assert 320 + 18_496 + 73_856 + 262_272 + 129 == AUTHORS_ENTK_PARAMETERS
    gray = load_federation(f"imagefolder:{write_image_folder(tmp_path / 'gray', 2, 3, 1, mode='L')}")
    color = load_federation(f"imagefolder:{write_image_folder(tmp_path / 'color', 2, 3, 1)}")
    backbone = images_backbone("tct_cnn", gray)
    assert backbone.channels == 1 and backbone.architecture().conv1.in_channels == 1
    model = build_model(backbone, num_classes=10)
    assert entk_num_parameters(model) == AUTHORS_ENTK_PARAMETERS
    assert num_parameters(reinitialize_last_layer(model, seed=0)) == AUTHORS_ENTK_PARAMETERS
    features = entk_features(reinitialize_last_layer(model, seed=0), torch.randn(2, 1, 28, 28),
                             coordinate_index(entk_num_parameters(model), 10**6, seed=0))
    assert features.shape == (2, AUTHORS_ENTK_PARAMETERS), "the eNTK features have P coordinates"
    assert images_backbone("tct_cnn", color).channels == 3
    assert images_backbone("resnet18_cifar", gray).architecture().conv1.in_channels == 1
    assert images_backbone("squeezenet1_1", gray).channels == 3, "a pretrained RGB network sees RGB replicas"
    assert get_backbone("tct_cnn").channels == 3


def test_networks_trained_from_scratch_have_no_imagenet_weights():
    with pytest.raises(FedrayError, match="resnet18_cifar has no ImageNet weights"):
        load_weights(get_backbone("resnet18_cifar"), "imagenet")


def test_random_weights_are_fixed_by_the_seed():
    backbone = get_backbone("squeezenet1_1")
    a, b, c = (load_weights(backbone, "random", seed) for seed in (4, 4, 5))
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert not torch.equal(a.state_dict["features.0.weight"], c.state_dict["features.0.weight"])


def test_a_weights_file_is_loaded_and_identified_by_its_content(tmp_path):
    backbone = get_backbone("resnet18")
    torch.manual_seed(7)
    state = torchvision.models.resnet18().state_dict()
    torch.save(state, tmp_path / "a.pt")
    torch.save(state, tmp_path / "b.pt")
    weights = load_weights(backbone, str(tmp_path / "a.pt"))
    assert all(torch.equal(weights.state_dict[k], state[k]) for k in state)
    assert weights.weights_id == load_weights(backbone, str(tmp_path / "b.pt")).weights_id
    state["fc.bias"][0] += 1
    torch.save(state, tmp_path / "c.pt")
    assert load_weights(backbone, str(tmp_path / "c.pt")).weights_id != weights.weights_id


def test_imagenet_weights_come_from_the_torch_hub_cache(tmp_path, monkeypatch):
    """No network here: a state dict placed where torchvision caches its download is what gets loaded."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    backbone = get_backbone("squeezenet1_1")
    url = torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1.url
    torch.manual_seed(3)
    state = torchvision.models.squeezenet1_1().state_dict()
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(state, tmp_path / "hub" / "checkpoints" / Path(url).name)
    weights = load_weights(backbone, "imagenet")
    assert weights.pretrained and weights.weights_id == "SqueezeNet1_1_Weights.IMAGENET1K_V1"
    assert torch.equal(weights.state_dict["features.0.weight"], state["features.0.weight"])


def test_bad_weights_are_named(tmp_path):
    backbone = get_backbone("resnet18")
    with pytest.raises(FedrayError, match="no such weights file"):
        load_weights(backbone, str(tmp_path / "none.pt"))
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(FedrayError, match="junk.pt: not a loadable state dict"):
        load_weights(backbone, str(tmp_path / "junk.pt"))
    torch.save(torchvision.models.squeezenet1_1().state_dict(), tmp_path / "other.pt")
    with pytest.raises(FedrayError, match="other.pt: not a state dict of torchvision resnet18"):
        load_weights(backbone, str(tmp_path / "other.pt"))
    with pytest.raises(FedrayError, match="unknown backbone 'vgg'"):
        get_backbone("vgg")
