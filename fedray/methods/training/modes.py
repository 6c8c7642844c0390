"""What a gradient-based run starts from and what it trains on images."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fedray.core.numeric_options import check_positive

if TYPE_CHECKING:
    from fedray.core.federation import Federation
    from fedray.methods.finetune_model import FineTuneModel

INITS = ("random", "fedncm", "fed3r", "fedcof", "ccvr")
FINETUNE_MODES = ("ft", "ftlp", "ftfeat")
"""Fine-tuning on images: backbone and head, head only (linear probing on images), backbone only."""


@dataclass(frozen=True)
class FineTuning:
    """The network a run fine-tunes on images (``--finetune``, TCT's stage 1): a run on features has none (its
    features were extracted)."""

    backbone: Annotated[str, "mobilenet_v2, squeezenet1_1, resnet18, vit_b_16, or TCT's networks trained from scratch: "
                             "resnet18_cifar, resnet18_cifar_gn, tct_cnn (28-pixel images)"] = "mobilenet_v2"
    weights: Annotated[str, "imagenet, random (seeded, NOT pre-trained) or a state-dict file"] = "imagenet"
    image_size: Annotated[int, "center-crop size"] = 224

    def __post_init__(self) -> None:
        check_positive({"image_size": self.image_size})

    def check_backbone(self) -> None:
        """The backbone is one fedray knows (a one-line error listing them), checked only for runs on images."""
        from fedray.data.images.backbones import get_backbone  # torchvision loads only for runs on images

        get_backbone(self.backbone)

    def structure(self, federation: Federation) -> FineTuneModel:
        """The network on ``federation``'s images and classes, as names, shapes and dtypes only (no weights)."""
        from fedray.data.images.backbones import images_backbone  # torchvision loads only for runs on images
        from fedray.methods.finetune_model import model_structure

        return model_structure(images_backbone(self.backbone, federation), federation.num_classes)
