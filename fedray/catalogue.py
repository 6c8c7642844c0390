"""``fedray methods``: every built-in method, client algorithm and server optimizer with its options, read from their definitions."""

from __future__ import annotations

from fedray.config import RUN_OPTIONS, TCT
from fedray.gradient.algorithms import ALGORITHMS
from fedray.gradient.server import SERVER_OPTIMIZERS
from fedray.methods import METHODS
from fedray.options import options_of

CLIENT_OPTIONS = ("client_lr", "weight_decay", "batch_size", "local_epochs", "client_momentum", "lr_schedule",
                  "lr_milestones", "lr_gamma", "temperature")
"""Options of every gradient method's local SGD (run options for now)."""


def _summary(cls: type) -> str:
    return cls.__doc__.strip().splitlines()[0] if cls.__doc__ else ""


def _entry(name: str, cls: type) -> list[str]:
    return [f"  {name:<14} {_summary(cls)}", *(f"      {option.describe()}" for option in options_of(cls).values())]


def _gradient_method(name: str) -> str:
    algorithm = ALGORITHMS[name]
    client = "SGD" + (" + (μ/2)‖θ − θ_global‖² (--prox-mu, default 0.01)" if algorithm.proximal else "") + \
        (" with SCAFFOLD control variates" if algorithm.scaffold else "")
    return f"  {name:<14} client {client}; server {algorithm.server}"


def catalogue() -> str:
    lines = ["closed-form methods (--method NAME; options as --lam, --gamma, ...):"]
    for name, cls in METHODS.items():
        lines += _entry(name, cls)
    lines += ["", "gradient methods (--method NAME), training a softmax head (or the backbone with --finetune):"]
    lines += [_gradient_method(name) for name in ALGORITHMS]
    lines += ["    local SGD of every gradient method:"]
    lines += [f"      {RUN_OPTIONS[name].describe()}" for name in CLIENT_OPTIONS]
    lines += [f"  {TCT:<14} TCT: fine-tune (--base), eNTK features, stage 2 by SCAFFOLD and/or in closed form (see --help)"]
    lines += ["", "server optimizers (--server-optimizer NAME, any gradient method; default: the method's own):"]
    for name, cls in SERVER_OPTIMIZERS.items():
        lines += _entry(name, cls)
    lines += ["", "your own: --method / --server-optimizer / --client-algorithm (a fedray.ClientAlgorithm subclass: the",
              "clients' loss and gradient hooks, on every path that trains) as module:Class or path/to/file.py:Class",
              "(see examples/);",
              "its options: --option key=value, options: {key: value} in YAML, options.KEY: [...] in a sweep grid"]
    return "\n".join(lines)
