"""``fedray methods``: every built-in method, client algorithm and server optimizer with its options, read from their definitions."""

from __future__ import annotations

from fedray.methods.config import RUN_OPTIONS, TCT
from fedray.methods.training_algorithms import BUILT_IN as ALGORITHMS, algorithm_class
from fedray.methods.training.server import SERVER_OPTIMIZERS
from fedray.methods import METHODS
from fedray.core.options import options_of

CLIENT_OPTIONS = ("client_lr", "weight_decay", "batch_size", "local_epochs", "client_momentum", "lr_schedule",
                  "lr_milestones", "lr_gamma", "temperature")
"""Options of every gradient method's local SGD (run options for now)."""


def _summary(cls: type) -> str:
    return cls.__doc__.strip().splitlines()[0] if cls.__doc__ else ""


def _entry(name: str, cls: type) -> list[str]:
    return [f"  {name:<14} {_summary(cls)}", *(f"      {option.describe()}" for option in options_of(cls).values())]


def _training_algorithm(name: str) -> list[str]:
    cls = algorithm_class(name)
    options = [f"      {option.describe()}" for option in options_of(cls).values()]
    return [f"  {name:<14} {_summary(cls)} (server optimizer: {cls.server_optimizer})", *options]


def catalogue() -> str:
    lines = ["closed-form methods (--method NAME; options as --lam, --gamma, ... or --option lam=...):"]
    for name, cls in METHODS.items():
        lines += _entry(name, cls)
    lines += ["", "training algorithms (--method NAME; options as --option key=value, or --prox-mu ...), training a softmax head "
              "(or the backbone with --finetune):"]
    lines += [line for name in ALGORITHMS for line in _training_algorithm(name)]
    lines += ["    local SGD of every gradient method:"]
    lines += [f"      {RUN_OPTIONS[name].describe()}" for name in CLIENT_OPTIONS]
    lines += [f"  {TCT:<14} TCT: fine-tune (--base), eNTK features, stage 2 by SCAFFOLD and/or in closed form (see --help)"]
    lines += ["", "server optimizers (--server-optimizer NAME, any gradient method; default: the method's own; options as "
              "--server-momentum ... or --option server_momentum=...):"]
    for name, cls in SERVER_OPTIMIZERS.items():
        lines += _entry(name, cls)
    lines += ["", "your own: --method (a fedray.ClosedFormMethod or fedray.FederatedAlgorithm subclass), --server-optimizer",
              "(a fedray.ServerOptimizer), --client-algorithm (a fedray.ClientAlgorithm: the clients' loss and gradient",
              "hooks beside a built-in) as module:Class or path/to/file.py:Class (see examples/);",
              "its options: --option key=value, options: {key: value} in YAML, options.KEY: [...] in a sweep grid"]
    return "\n".join(lines)
