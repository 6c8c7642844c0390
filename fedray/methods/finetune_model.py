"""The fine-tuned network (backbone + linear head), what each mode trains, and its forward cost.

Parameter and buffer names are the model's ``state_dict()`` names: the
backbone's under ``backbone.`` (torchvision's names, classifier removed) and
the head's as ``head.weight`` (C × d) and ``head.bias`` (C).

BatchNorm follows plain FedAvg over the state dict, as the FL fine-tuning
papers' code does: while the backbone is trained (``ft``, ``ftfeat``) the
model is in train mode, so BN normalizes with batch statistics and updates its
running mean and variance, and those float buffers are averaged with the same
sample weights as the parameters (they are in ``RoundUpdate.delta``). With a
frozen backbone (``ftlp``) the model is in eval mode and nothing of the
backbone changes: linear probing on images. The integer ``num_batches_tracked``
counters are never aggregated (torchvision's BN layers use a fixed momentum,
so the counters change nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedray.core.errors import FedrayError
from fedray.methods.training.local import random_head
from fedray.data.images.backbones import Backbone, forward_flops

HEAD = "head."


@dataclass(frozen=True)
class Mode:
    """Which parts of the model a client trains (and therefore sends)."""

    name: str
    trains_backbone: bool
    trains_head: bool

    def trains(self, name: str) -> bool:
        return self.trains_head if name.startswith(HEAD) else self.trains_backbone


MODES = {
    mode.name: mode
    for mode in (
        Mode("ft", trains_backbone=True, trains_head=True),
        Mode("ftlp", trains_backbone=False, trains_head=True),
        Mode("ftfeat", trains_backbone=True, trains_head=False),
    )
}


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise FedrayError(f"unknown fine-tuning mode {name!r}; known: {', '.join(MODES)}")
    return MODES[name]


class FineTuneModel(nn.Module):
    """``head(backbone(x)) / temperature``; with ``sphere`` (SphereFed) ``head(normalize(backbone(x)))``, the head fixed."""

    def __init__(self, backbone: nn.Module, dim: int, num_classes: int, temperature: float = 1.0, sphere: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(dim, num_classes)
        self.temperature = temperature
        self.sphere = sphere

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        if self.sphere:
            return self.head(nn.functional.normalize(features, dim=1))
        return self.head(features) / self.temperature

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits(self.backbone(images))


def build_model(backbone: Backbone, num_classes: int, temperature: float = 1.0) -> FineTuneModel:
    """The architecture with its classifier removed and a new head; weights are whatever is loaded into it."""
    trunk = backbone.architecture()
    backbone.strip_head(trunk)
    return FineTuneModel(trunk, backbone.dim, num_classes, temperature)


def model_structure(backbone: Backbone, num_classes: int) -> FineTuneModel:
    """The network's parameters and buffers as names, shapes and dtypes only (on the meta device: no memory, no
    weights), e.g. to check a checkpoint against before any work."""
    with torch.device("meta"):
        return build_model(backbone, num_classes)


def head_init(dim: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear-probing path's random head (:func:`~fedray.methods.training.local.random_head`) in ``nn.Linear``'s C × d layout,
    so ``ftlp`` starts from the head linear probing on the backbone's cached features starts from with the same seed."""
    head = random_head(dim, num_classes, seed)
    return head["weight"].T.contiguous(), head["bias"]


def trained_names(model: nn.Module, mode: Mode) -> list[str]:
    """The parameters a client's optimizer updates."""
    return [name for name, _ in model.named_parameters() if mode.trains(name)]


def sent_names(model: nn.Module, mode: Mode) -> list[str]:
    """What a client uploads: its trained parameters, plus BN's float running statistics when the backbone is trained."""
    buffers = [name for name, buffer in model.named_buffers() if buffer.is_floating_point() and mode.trains(name)]
    return trained_names(model, mode) + buffers


def backbone_flops(model: FineTuneModel, image_size: int, channels: int = 3) -> float:
    """Forward FLOPs of the backbone on one image of ``channels`` channels (torch's counter: 2 per multiply-add of
    convolutions and matmuls)."""
    return forward_flops(model.backbone, image_size, channels)
