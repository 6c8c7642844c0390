"""The engine knows no built-in by name: it asks the classes it runs, so a built-in is a component like a plugin.

An AST scan of every module under ``fedray/engine/``: no string constant equal
to a built-in registry name (a closed-form method, a training algorithm or one
of its aliases, a server optimizer, a postprocessor, ``tct``) or to an option a
built-in class or component declares, no keyword argument and no attribute
access ``<anything>.<option>`` by such an option's name. What a stage needs to
know of a built-in (which closed form calibrates SphereFed, which one probes,
what shapes a footprint, what a method resolved) is the built-in's to say.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fedray.clock.asynchronous import AsynchronousRounds
from fedray.clock.choices import ClockChoices
from fedray.clock.devices import Devices
from fedray.clock.rounds import SynchronousRounds
from fedray.core.options import options_of
from fedray.methods import METHODS
from fedray.methods.postprocessor import BUILT_IN as POSTPROCESSORS, postprocessor_class
from fedray.methods.sphere import SphereHead
from fedray.methods.tct_stage2 import TctStage2Options
from fedray.methods.training.client_optimizer import ClientOptimizer
from fedray.methods.training.modes import FineTuning
from fedray.methods.training.server import SERVER_OPTIMIZERS
from fedray.methods.training_algorithms import BUILT_IN as ALGORITHMS, algorithm_class

ENGINE = Path(__file__).resolve().parents[2] / "fedray" / "engine"

ALLOWED: set[tuple[str, str]] = set()
"""(module, name) pairs that cannot move out of the engine, each with its reason. None."""

COMPONENTS = (ClientOptimizer, SphereHead, FineTuning, TctStage2Options, Devices, ClockChoices, SynchronousRounds,
              AsynchronousRounds)
"""The built-in components a run has by its kind: local SGD, SphereFed's head, the network on images, TCT's stage 2,
the clock's devices, choices and rounds (synchronous and asynchronous)."""

REGISTRY_NAMES = frozenset({*METHODS, *ALGORITHMS, *SERVER_OPTIMIZERS, *POSTPROCESSORS, "tct"})
BUILT_IN_CLASSES = (*METHODS.values(), *(algorithm_class(name) for name in ALGORITHMS), *SERVER_OPTIMIZERS.values(),
                    *(postprocessor_class(name) for name in POSTPROCESSORS), *COMPONENTS)
OPTION_NAMES = frozenset(name for cls in BUILT_IN_CLASSES for name in options_of(cls)) | \
    frozenset(flag.name for name in POSTPROCESSORS for flag in postprocessor_class(name).flags)
"""Every built-in class's and component's option, and the run options that add a built-in postprocessor
(``--secure-aggregation``)."""


def named_builtins(source: str) -> list[tuple[int, str]]:
    """Where ``source`` names a built-in: (line, what) for each string constant equal to a registry or option name,
    each keyword argument and each attribute access by an option's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value in REGISTRY_NAMES | OPTION_NAMES:
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Attribute) and node.attr in OPTION_NAMES:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.keyword) and node.arg in OPTION_NAMES:
            found.append((node.lineno, f"{node.arg}="))
    return found


def engine_modules() -> list[Path]:
    return sorted(ENGINE.rglob("*.py"))


def test_the_scan_sees_what_it_looks_for():
    """Written out plainly: a method's name, an option read off a component, passed by keyword or given as a key."""
    source = 'plan("fed3r")\nhead.sphere_dim\nbuild(lam=1)\nvalues["rf_dim"]\nf"{x}scaffold"\n'
    assert sorted(named_builtins(source)) == [(1, "'fed3r'"), (2, ".sphere_dim"), (3, "lam="), (4, "'rf_dim'"),
                                              (5, "'scaffold'")]
    assert named_builtins('plan(x)\nhead.width(d)\nbuild(dim=1)\nvalues["W"]\n"fed3r is a method"\n') == []


def test_the_names_cover_every_kind_of_built_in():
    assert {"fedncm", "fed3r", "ffc", "fedavg", "fedadam", "fedavgm", "scaffold", "dp", "secagg", "tct"} <= \
        REGISTRY_NAMES
    assert {"lam", "rf_sigma", "prox_mu", "server_momentum", "clip_norm", "secure_aggregation", "sphere_dim",
            "backbone", "tct_rounds", "client_lr"} <= OPTION_NAMES


@pytest.mark.parametrize("path", engine_modules(), ids=lambda path: path.name)
def test_no_engine_module_names_a_built_in(path):
    found = [(line, name) for line, name in named_builtins(path.read_text()) if (path.name, name) not in ALLOWED]
    assert not found, f"{path.name} names built-ins (ask the class that owns them): " + \
        ", ".join(f"line {line}: {name}" for line, name in sorted(found))
