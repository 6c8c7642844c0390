"""``fedray methods``: every built-in method, training algorithm and server optimizer with its options, read from their definitions."""

from __future__ import annotations

import inspect
import re

from fedray.core.errors import FedrayError
from fedray.core.options import options_of
from fedray.core.plugins import is_plugin, load_class, names_subclass
from fedray.methods import METHODS
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.base import ClosedFormMethod
from fedray.engine.config import TCT
from fedray.methods.postprocessor import BUILT_IN as POSTPROCESSORS, Postprocessor, postprocessor_class
from fedray.methods.training.client_optimizer import ClientOptimizer
from fedray.methods.training.server import SERVER_OPTIMIZERS, ServerOptimizer
from fedray.methods.training_algorithms import ALIASES, BUILT_IN as ALGORITHMS, algorithm_class, own_server_optimizer

MARKUP = ((re.compile(r":[\w:]+:`([^`]+)`"), r"'\1'"), (re.compile(r"``([^`]+)``"), r"'\1'"),
          (re.compile(r"`([^`]+)`"), r"'\1'"))
"""A docstring's reStructuredText literals and roles (``x``, `x`, :mod:`x`), as a terminal shows them: 'x'."""


def _summary(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring, whole, on one line and without its markup."""
    if not cls.__doc__:
        return ""
    text = " ".join(inspect.cleandoc(cls.__doc__).split("\n\n")[0].split())
    for pattern, replacement in MARKUP:
        text = pattern.sub(replacement, text)
    return text


def _entry(name: str, cls: type) -> list[str]:
    return [f"  {name:<14} {_summary(cls)}", *(f"      {option.describe()}" for option in options_of(cls).values())]


def _training_algorithm(name: str) -> list[str]:
    cls, alias = algorithm_class(name), ALIASES.get(name)
    options = [f"      {option.describe()}" for option in options_of(cls).values()]
    summary = _summary(cls) if alias is None else alias.summary
    return [f"  {name:<14} {summary} (server optimizer: {own_server_optimizer(name)})", *options]


KINDS = (("closed-form method", ClosedFormMethod, "--method"), ("training algorithm", FederatedAlgorithm, "--method"),
         ("server optimizer", ServerOptimizer, "--server-optimizer"), ("postprocessor", Postprocessor, "--postprocessor"))
"""What a researcher's class may be, its base class and the option a run takes it with."""


def entry(spec: str) -> str:
    """``fedray methods SPEC``: one built-in by name, or a researcher's class (``path/to/file.py:Class``,
    ``module:Class``), what it is and its options, as :func:`catalogue` lists the built-ins'."""
    if spec in METHODS or spec in SERVER_OPTIMIZERS:
        return "\n".join(_entry(spec, METHODS.get(spec) or SERVER_OPTIMIZERS[spec]))
    if spec in ALGORITHMS:
        return "\n".join(_training_algorithm(spec))
    if spec in POSTPROCESSORS:
        return "\n".join(_entry(spec, postprocessor_class(spec)))
    if not is_plugin(spec):
        raise FedrayError(f"fedray methods: unknown class {spec!r}; give a built-in's name (fedray methods lists them) "
                          f"or your own as path/to/file.py:Class or module:Class")
    for what, base, flag in KINDS:
        if names_subclass(spec, base):
            cls = load_class(spec, base, {}, what)
            options = [f"      {option.describe()}" for option in options_of(cls).values()] or ["      (no options)"]
            summary = f"; {_summary(cls)}" if _summary(cls) else ""
            return "\n".join([f"  {spec}: a {what} ({flag} {spec}){summary}", *options,
                              f"    set as --option key=value (or {cls.__name__}.key=value), options: {{key: value}} in YAML, "
                              "options.KEY: [...] in a sweep"])
    bases = ", ".join(f"fedray.{base.__name__}" for _, base, _ in KINDS)
    raise FedrayError(f"{spec}: {spec.rpartition(':')[2]} is not a subclass of any of {bases}")


def catalogue() -> str:
    lines = ["closed-form methods (--method NAME; options as --lam, --gamma, ... or --option lam=...):"]
    for name, cls in METHODS.items():
        lines += _entry(name, cls)
    lines += ["", "training algorithms (--method NAME; options as --option key=value, or --prox-mu ...), training a softmax head "
              "(or the backbone with --finetune):"]
    lines += [line for name in ALGORITHMS for line in _training_algorithm(name)]
    lines += ["    local SGD of every gradient method:"]
    lines += [f"      {option.describe()}" for option in options_of(ClientOptimizer).values()]
    lines += [f"  {TCT:<14} TCT: fine-tune (--base), eNTK features, stage 2 by SCAFFOLD and/or in closed form (see --help)"]
    lines += ["", "server optimizers (--server-optimizer NAME, any gradient method; default: the method's own; options as "
              "--server-momentum ... or --option server_momentum=...):"]
    for name, cls in SERVER_OPTIMIZERS.items():
        lines += _entry(name, cls)
    if POSTPROCESSORS:
        lines += ["", "postprocessors (--postprocessor NAME[,NAME...], any method, every upload; options as --option key=value):"]
        for name in POSTPROCESSORS:
            lines += _entry(name, postprocessor_class(name))
    lines += ["", "your own: --method (a fedray.ClosedFormMethod or fedray.FederatedAlgorithm subclass: a client's own",
              "loss or gradient correction is one), --server-optimizer (a fedray.ServerOptimizer), --postprocessor",
              "(a fedray.Postprocessor) as module:Class or path/to/file.py:Class (see examples/);",
              "its options: --option key=value, options: {key: value} in YAML, options.KEY: [...] in a sweep grid;",
              "--option Class.key=value gives one to that class only (when two of the run's classes declare key)"]
    return "\n".join(lines)
