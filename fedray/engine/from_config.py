"""A closed-form method built from a run's configuration."""

from __future__ import annotations

from fedray.engine.config import RunConfig, postprocessor_class
from fedray.core.federation import Federation
from fedray.methods import method_class
from fedray.methods.base import ClosedFormMethod
from fedray.methods.postprocessor import Postprocessing
from fedray.core.options import build


def build_method(config: RunConfig, federation: Federation) -> ClosedFormMethod:
    """``config.method`` (a built-in or a plugin) for the federation's dimension and classes, with the run's seed."""
    return build(method_class(config.method), config.option_values(), f"--method {config.method}",
                 dim=federation.dim, num_classes=federation.num_classes, seed=config.seed)


def postprocessing(config: RunConfig) -> Postprocessing:
    """``--postprocessor``'s classes with their options, in order, and the run's seed for their random draws."""
    return Postprocessing(tuple(build(postprocessor_class(spec), config.option_values(), f"--postprocessor {spec}",
                                      seed=config.seed) for spec in config.postprocessor_specs()), config.seed)
