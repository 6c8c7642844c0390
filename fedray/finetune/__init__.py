"""Federated fine-tuning of torchvision backbones on images: a training backend for the FedAvg-family loop."""

from fedray.finetune.backend import FineTuneBackend
from fedray.finetune.model import MODES
from fedray.finetune.pool import TrainerPool

__all__ = ["MODES", "FineTuneBackend", "TrainerPool"]
