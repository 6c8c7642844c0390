"""A run configuration's gradient settings: the clients' local SGD and objective, the server optimizer.

Built once before any work (by the engine, and per trial by a sweep's checks),
so a plugin's bad option is a one-line error, and again where each path trains.
"""

from __future__ import annotations

from fedray.config import RunConfig
from fedray.gradient.client_sgd import CrossEntropy
from fedray.gradient.local import LocalSGD
from fedray.gradient.server import ServerOptimizer
from fedray.methods.from_config import option_values
from fedray.options import build, options_of


def local_sgd(config: RunConfig) -> LocalSGD:
    """The clients' optimizer and objective; a ``--client-algorithm`` is built here with a stand-in loss to check its options."""
    plugin, options = None, ()
    if config.client_algorithm is not None:
        plugin = config.client_algorithm_class()
        built = build(plugin, option_values(config), f"--client-algorithm {config.client_algorithm}",
                      loss=CrossEntropy(), prox_mu=0.0)
        options = tuple((name, getattr(built, name)) for name in options_of(plugin))
    return LocalSGD(config.client_lr, config.weight_decay, config.batch_size, config.local_epochs,
                    config.prox_mu or 0.0, config.temperature, config.client_momentum, config.lr_schedule_of_run(),
                    plugin, options)


def server_optimizer(config: RunConfig) -> ServerOptimizer:
    """``--server-optimizer`` (or the method's own) with its options, fresh: no state."""
    return build(config.server_optimizer_class(), option_values(config), f"--server-optimizer {config.server_optimizer}")
