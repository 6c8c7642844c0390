"""A run configuration's gradient settings: the training algorithm, the clients' local SGD, the server optimizer.

Built once before any work (by the engine, and per trial by a sweep's checks),
so a plugin's bad option is a one-line error, and again where each path trains.
"""

from __future__ import annotations

from fedray.engine.config import RunConfig
from fedray.methods.training.client_optimizer import ClientOptimizer
from fedray.methods.training.local import LocalSGD
from fedray.methods.training.server import ServerOptimizer
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.core.options import build


def local_sgd_settings(config: RunConfig) -> LocalSGD:
    """The clients' optimizer (:class:`ClientOptimizer`) built from its options, over the run's training rounds."""
    return config.component(ClientOptimizer).local_sgd(config.rounds)


def training_algorithm(config: RunConfig) -> FederatedAlgorithm:
    """``--method`` (TCT: ``--base``) with its options."""
    cls = config.algorithm_class()
    return build(cls, config.option_values(cls), f"--method {config.training_algorithm}", seed=config.seed)


def server_optimizer(config: RunConfig) -> ServerOptimizer:
    """``--server-optimizer`` (or the method's own) with its options, fresh: no state."""
    cls = config.server_optimizer_class()
    return build(cls, config.option_values(cls), f"--server-optimizer {config.server_optimizer}")
