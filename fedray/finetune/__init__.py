"""Federated fine-tuning of torchvision backbones on images: a training backend for the FedAvg-family loop."""
