"""A closed-form method built from a run's configuration."""

from __future__ import annotations

import math

from fedray.config import RunConfig
from fedray.data.federation import Federation
from fedray.methods import METHODS
from fedray.methods.base import ClosedFormMethod


def build_method(config: RunConfig, federation: Federation) -> ClosedFormMethod:
    dim, classes = federation.dim, federation.num_classes
    common = {"lam": config.lam, "bias": config.bias}
    options = {
        "fedncm": {},
        "fed3r": common,
        "ffc": common,
        "fed3r-rf": {**common, "rf_dim": config.rf_dim, "rf_sigma": math.sqrt(dim) if config.rf_sigma is None else config.rf_sigma, "seed": config.seed},
        "fedcof": {"gamma": config.gamma, "means_per_class": config.means_per_class, "seed": config.seed},
        "fedcof-oracle": {"gamma": config.gamma, "seed": config.seed},
    }[config.method]
    return METHODS[config.method](dim, classes, **options)
