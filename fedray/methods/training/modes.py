"""What a gradient-based run starts from and what it trains on images."""

from __future__ import annotations

INITS = ("random", "fedncm", "fed3r", "fedcof", "ccvr")
FINETUNE_MODES = ("ft", "ftlp", "ftfeat")
"""Fine-tuning on images: backbone and head, head only (linear probing on images), backbone only."""
