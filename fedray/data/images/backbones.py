"""torchvision backbones as feature extractors: the pooled penultimate activation.

Weights come from a local state-dict file (``--weights PATH``, no network),
from torchvision's ImageNet weights enum (``--weights imagenet``: read from the
torch hub cache, downloaded only where the network allows), or are a seeded
random initialization (``--weights random``: for tests; never pre-trained).

Besides torchvision's ImageNet models, TCT's (Yu et al. 2022) networks, which
its experiments train from scratch (no ImageNet weights; ``--weights random``
or a file):

- ``resnet18_cifar`` (ResNet-18-BN, Section 5) and ``resnet18_cifar_gn``
  (ResNet-18-GN, Appendix B.2, GroupNorm with 2 groups): the CIFAR ResNet-18
  — a 3 × 3 stride-1 first convolution and no max pooling before the four
  stages of two basic blocks (64 … 512 channels), global average pooling;
  torchvision's ResNet with those two layers changed (its parameter names).
- ``tct_cnn``: the small CNN of TCT's published code (``mnist/utils.py``,
  ``Net``): three 3 × 3 stride-2 convolutions (32, 64, 128 channels, ReLU),
  then fc1 (2048 → 128, ReLU) and the classifier, on 28 × 28 images. The
  paper's FMNIST "SimpleCNN" (two convolutions with max pooling, two fully
  connected layers) is not published; this follows the code. On grayscale
  images (MNIST, FMNIST) its first convolution takes 1 channel, as the
  authors' network does (P = 355,073 with TCT's one-output head); on RGB
  images 3.

The networks trained from scratch take the images' channels: 1 on a dataset
of grayscale images (:func:`images_backbone`: every probed image has a
grayscale mode), 3 otherwise. The ImageNet backbones always take RGB, a
grayscale image replicated to 3 channels, as their weights expect.
Every replica of a pool is built from the one state dict the driver loaded,
so all replicas hold bitwise the same weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torchvision
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedray.core.errors import FedrayError
from fedray.core.federation import Federation
from fedray.data.images.decode import grayscale_images


def _strip_mobilenet(model: nn.Module) -> None:
    model.classifier = nn.Identity()


def _strip_resnet(model: nn.Module) -> None:
    model.fc = nn.Identity()


def _strip_squeezenet(model: nn.Module) -> None:
    # the ReLU'd output of the last Fire module, average-pooled; torchvision flattens after the classifier
    model.classifier = nn.AdaptiveAvgPool2d(1)


def _strip_vit(model: nn.Module) -> None:
    model.heads = nn.Identity()


class TctCnn(nn.Module):
    """TCT code's ``Net`` (mnist/utils.py) on 28 × 28 images of ``channels`` channels; ``fc2`` is the classifier."""

    def __init__(self, num_classes: int = 10, channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(64, 128, kernel_size=3, stride=2, padding=1)
        self.fc1 = nn.Linear(2048, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in (self.conv1, self.conv2, self.conv3):
            x = nn.functional.relu(conv(x))
        return self.fc2(nn.functional.relu(self.fc1(torch.flatten(x, 1))))


def _cifar_resnet18(norm_layer: Callable[[int], nn.Module] | None = None, channels: int = 3) -> nn.Module:
    """torchvision's ResNet-18 made the CIFAR ResNet-18: a 3 × 3 stride-1 stem (on ``channels`` channels), no max pooling."""
    model = torchvision.models.resnet18(weights=None, norm_layer=norm_layer)
    model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


def _group_norm(channels: int) -> nn.Module:
    return nn.GroupNorm(2, channels)


def _strip_tct_cnn(model: nn.Module) -> None:
    model.fc2 = nn.Identity()


@dataclass(frozen=True)
class Backbone:
    name: str
    dim: int
    weights_enum: str | None
    """torchvision's ImageNet weights (``--weights imagenet``); None where the papers train from scratch."""
    strip_head: Callable[[nn.Module], None]
    fixed_size: int | None = None
    build: Callable[..., nn.Module] | None = None
    """The architecture on ``channels`` input channels, when it is not ``torchvision.models.<name>``."""
    channels: int = 3
    """Input channels: 3, or 1 for a network trained from scratch on grayscale images (:func:`images_backbone`)."""

    def architecture(self) -> nn.Module:
        """The full model (classifier included), randomly initialized."""
        if self.build is not None:
            return self.build(channels=self.channels)
        if self.channels != 3:
            raise FedrayError(f"{self.name} takes RGB images (3 channels), not {self.channels}")
        return getattr(torchvision.models, self.name)(weights=None)


BACKBONES = {
    b.name: b
    for b in (
        Backbone("mobilenet_v2", 1280, "MobileNet_V2_Weights.IMAGENET1K_V1", _strip_mobilenet),
        Backbone("squeezenet1_1", 512, "SqueezeNet1_1_Weights.IMAGENET1K_V1", _strip_squeezenet),
        Backbone("resnet18", 512, "ResNet18_Weights.IMAGENET1K_V1", _strip_resnet),
        Backbone("vit_b_16", 768, "ViT_B_16_Weights.IMAGENET1K_V1", _strip_vit, fixed_size=224),
        Backbone("resnet18_cifar", 512, None, _strip_resnet, build=_cifar_resnet18),
        Backbone("resnet18_cifar_gn", 512, None, _strip_resnet, build=partial(_cifar_resnet18, _group_norm)),
        Backbone("tct_cnn", 128, None, _strip_tct_cnn, fixed_size=28, build=TctCnn),
    )
}


def get_backbone(name: str) -> Backbone:
    if name not in BACKBONES:
        raise FedrayError(f"unknown backbone {name!r}; known: {', '.join(BACKBONES)}")
    return BACKBONES[name]


def for_images(backbone: Backbone, paths: Sequence[str | None]) -> Backbone:
    """``backbone`` on the images at ``paths``: one input channel when it is trained from scratch (no ImageNet weights)
    and the images are grayscale (:func:`~fedray.data.images.decode.grayscale_images`), else as it is (RGB)."""
    if backbone.weights_enum is None and grayscale_images(paths):
        return replace(backbone, channels=1)
    return backbone


def images_backbone(name: str, federation: Federation) -> Backbone:
    """The backbone ``name`` as a run fine-tunes it on ``federation``'s training images (:func:`for_images`)."""
    backbone = get_backbone(name)
    if "image_path" not in federation.train.column_names:
        return backbone
    return for_images(backbone, federation.train.column("image_path").to_pylist())


@dataclass(frozen=True)
class Weights:
    """A backbone's full state dict and what identifies it in a cache key."""

    state_dict: dict[str, torch.Tensor]
    weights_id: str
    pretrained: bool
    """False only for the seeded random initialization (a file is taken to hold trained weights)."""


def load_weights(backbone: Backbone, spec: str, seed: int = 0) -> Weights:
    """``spec``: a state-dict file, ``imagenet`` or ``random`` (seeded by ``seed``)."""
    if spec == "random":
        torch.manual_seed(seed)
        return Weights(backbone.architecture().state_dict(), f"random-seed{seed}", pretrained=False)
    if spec == "imagenet":
        if backbone.weights_enum is None:
            raise FedrayError(f"{backbone.name} has no ImageNet weights (its paper trains it from scratch): "
                              f"use --weights random or a state-dict file")
        return Weights(_imagenet_state_dict(backbone), backbone.weights_enum, pretrained=True)
    state_dict = _file_state_dict(backbone, Path(spec))
    return Weights(state_dict, f"sha256-{content_hash(state_dict)}", pretrained=True)


def content_hash(state_dict: dict[str, torch.Tensor]) -> str:
    """A hash of the names, shapes, types and values: the same weights saved twice hash the same."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()[:16]


def _imagenet_state_dict(backbone: Backbone) -> dict[str, torch.Tensor]:
    enum_name, member = backbone.weights_enum.split(".")
    weights = getattr(getattr(torchvision.models, enum_name), member)
    try:
        state_dict = weights.get_state_dict(progress=False)
    except Exception as error:  # noqa: BLE001 - any download/read failure means the same to the user
        cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
        raise FedrayError(
            f"cannot load torchvision {backbone.weights_enum} ({type(error).__name__}); put {Path(weights.url).name} "
            f"in {cached.parent} or pass --weights PATH"
        ) from None
    return state_dict


def _file_state_dict(backbone: Backbone, path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FedrayError(f"{path}: no such weights file (or use --weights imagenet|random)")
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises many types for a bad file
        raise FedrayError(f"{path}: not a loadable state dict ({type(error).__name__}: {str(error)[:120]})") from None
    if not isinstance(state_dict, dict):
        raise FedrayError(f"{path}: expected a state dict, got {type(state_dict).__name__}")
    expected = backbone.architecture().state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[:2]}" if missing else f"unexpected {unexpected[:2]}"
        raise FedrayError(f"{path}: not a state dict of torchvision {backbone.name} ({detail})")
    wrong = [k for k in expected if state_dict[k].shape != expected[k].shape]
    if wrong:
        raise FedrayError(f"{path}: {wrong[0]} has shape {tuple(state_dict[wrong[0]].shape)}, expected {tuple(expected[wrong[0]].shape)}")
    return state_dict


def forward_flops(module: nn.Module, image_size: int, channels: int = 3) -> float:
    """FLOPs of ``module``'s forward pass on one image of ``channels`` channels, by torch's FlopCounterMode: 2 per
    multiply-add of its convolutions and matrix products (batch norm, activations and additions are not counted)."""
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        module.eval()(torch.zeros(1, channels, image_size, image_size))
    return float(counter.get_total_flops())


def forward_macs(backbone: Backbone, image_size: int) -> float:
    """F_φ: multiply-adds of one image's forward pass through the feature extractor (half :func:`forward_flops`).

    MobileNetV2 at 224 pixels: 299.5e6, where Fed3R's Table 5 gives 332.9e6
    (the paper does not say what its count includes beyond these).
    """
    model = backbone.architecture()
    backbone.strip_head(model)
    return forward_flops(model, image_size, backbone.channels) / 2


def feature_model(backbone: Backbone, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """The backbone with ``state_dict`` loaded and its classifier removed, in eval mode."""
    model = backbone.architecture()
    model.load_state_dict(state_dict)
    backbone.strip_head(model)
    return model.eval()
