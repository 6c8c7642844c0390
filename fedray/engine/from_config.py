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
    cls = method_class(config.method)
    return build(cls, config.option_values(cls), f"--method {config.method}", dim=federation.dim,
                 num_classes=federation.num_classes, seed=config.seed)


def postprocessing(config: RunConfig) -> Postprocessing:
    """``--postprocessor``'s classes with their options, in order, and the run's seed for their random draws."""
    classes = [(spec, postprocessor_class(spec)) for spec in config.postprocessor_specs()]
    return Postprocessing(tuple(build(cls, config.option_values(cls), f"--postprocessor {spec}", seed=config.seed)
                                for spec, cls in classes), config.seed)
