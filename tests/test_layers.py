"""The package's layers: no module imports one of a higher layer.

From the ground up: core types (errors, options, result rows, atomic writes,
the federation) → data (loaders, splits, images, the feature cache) → methods
(the maths: closed-form methods, the gradient algorithms, SphereFed's and TCT's
maths, a run's configuration) → runtime (Ray: shards, pools, placement, the
cluster, joining it) → engine (the round loops and the runners that compose a
run's stages) → application (command line, sweeps, extraction, the Python API,
jobs and analysis). Every import counts, also one inside a function or under
``TYPE_CHECKING``, and importing ``a.b.c`` runs the ``__init__`` of ``a.b`` too (an empty one runs nothing).
A module takes the layer of the longest name in ``LAYER_OF`` that it starts
with; a new module that matches none fails here until it is placed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedray", "jobs", "analysis", "examples")
LAYERS = ("core", "data", "methods", "runtime", "engine", "application")

LAYER_OF = {
    # core: the types and helpers every layer uses
    "fedray.errors": "core",
    "fedray.options": "core",
    "fedray.numeric_options": "core",
    "fedray.plugins": "core",
    "fedray.results": "core",
    "fedray.writable": "core",
    "fedray.full_disk": "core",
    "fedray.interrupts": "core",
    "fedray.accounting": "core",
    "fedray.data.federation": "core",
    "fedray.data.schema": "core",
    # data: federations from files, splits and synthetic stand-ins; images and the feature cache
    "fedray.data": "data",
    "fedray.images": "data",
    # methods: what is computed, on one process
    "fedray.methods": "methods",
    "fedray.evaluation": "methods",
    "fedray.config": "methods",
    "fedray.gradient": "methods",
    "fedray.spherefed": "methods",
    "fedray.tct": "methods",
    "fedray.finetune": "methods",
    # runtime: Ray actors, pools and placement, and the backends that run the maths on them
    "fedray.runtime": "runtime",
    "fedray.round_loop": "runtime",
    "fedray.gradient.probing": "runtime",
    "fedray.spherefed.calibration": "runtime",
    "fedray.spherefed.training": "runtime",
    "fedray.finetune.backend": "runtime",
    "fedray.finetune.pool": "runtime",
    "fedray.finetune.trainer": "runtime",
    "fedray.tct.shards": "runtime",
    # engine: the round loops and the runners that compose a run's stages
    "fedray.engine": "engine",
    "fedray.gradient.training": "engine",
    "fedray.gradient.checkpoint": "engine",
    "fedray.gradient.runner": "engine",
    "fedray.tct.runner": "engine",
    # application: what a user runs
    "fedray": "application",
    "fedray.__main__": "application",
    "fedray.cli": "application",
    "fedray.api": "application",
    "fedray.catalogue": "application",
    "fedray.sweeps": "application",
    "fedray.extract": "application",
    "fedray.algorithms": "application",  # training algorithms shipped as plugins: they import the public API
    "jobs": "application",
    "analysis": "application",
    "examples": "application",
}
"""Exact for a top-level module of ``fedray``, a default for every module under a package's name."""


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


MODULES = module_files()


def layer_of(module: str) -> str | None:
    """The layer of the longest key that is ``module`` or a package above it (``fedray`` itself is no default)."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in LAYER_OF and (key != "fedray" or module == "fedray"):
            return LAYER_OF[key]
    return None


def imported(module: str, path: Path) -> set[str]:
    """The project's modules that importing ``module`` runs: every import statement, the packages' ``__init__`` above them included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    runs = set()
    for name in names:
        parts = name.split(".")
        # fedray/__init__.py loads its names on first use (importlib), so importing a submodule does not run the API
        runs.update(".".join(parts[:end]) for end in range(2 if parts[0] == "fedray" else 1, len(parts) + 1))
    return {name for name in runs if name in MODULES and name != module}


def runs_nothing(module: str) -> bool:
    """An empty package ``__init__`` (``fedray.data``'s): importing the package runs no code of any layer."""
    path = MODULES[module]
    return path.name == "__init__.py" and not path.read_text().strip()


def test_every_module_has_a_layer():
    assert [module for module in MODULES if layer_of(module) is None] == []


def test_every_key_names_a_module():
    assert [key for key in LAYER_OF if not any(m == key or m.startswith(key + ".") for m in MODULES)] == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_goes_up_a_layer(package):
    upward = []
    for module, path in MODULES.items():
        if module.split(".")[0] != package:
            continue
        level = LAYERS.index(layer_of(module))
        for target in sorted(imported(module, path)):
            if LAYERS.index(layer_of(target)) > level and not runs_nothing(target):
                upward.append(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})")
    assert upward == []


def test_walker_sees_imports_inside_functions_and_relative_ones(tmp_path):
    source = "from . import sibling\n\ndef f():\n    from fedray.engine import run\n    import fedray.cli\n"
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert imported("fedray.runtime.probe", path) >= {"fedray.runtime", "fedray.engine", "fedray.cli"}
