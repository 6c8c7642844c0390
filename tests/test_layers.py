"""The package's layers: no module imports one of a higher layer, and every package is one layer.

From the ground up: ``fedray.core`` (errors, options, plugins, the federation
and its rows' schema, result rows, atomic writes) → ``fedray.data`` (loaders,
splits, synthetic stand-ins, images, the feature cache) → ``fedray.methods``
(the maths on one process: closed-form methods, training algorithms, local SGD
and its dual form, server optimizers, postprocessors, SphereFed's and TCT's
maths, a run's configuration) → ``fedray.runtime`` (Ray: shards, trainers,
pools, placement, the cluster, the clients' states) → ``fedray.engine`` (one
run, its stages, the round loop, checkpoints) → application (``fedray.app``:
command line, Python API, sweeps, extraction; ``fedray.algorithms`` and
``fedray.postprocessors``, the training algorithms and postprocessors written as
plugins; fedray's own top-level modules, the
public interface; jobs, analysis and examples). Every import counts, also one
inside a function or under ``TYPE_CHECKING``, and importing ``a.b.c`` runs the
``__init__`` of ``a.b`` too (one without imports runs nothing of any layer).
Packages only: a module takes the layer of its package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedray", "jobs", "analysis", "examples")
LAYERS = ("core", "data", "methods", "runtime", "engine", "application")

LAYER_OF = {
    "fedray.core": "core",
    "fedray.data": "data",
    "fedray.methods": "methods",
    "fedray.clock": "methods",
    "fedray.runtime": "runtime",
    "fedray.engine": "engine",
    "fedray.app": "application",
    "fedray.algorithms": "application",
    "fedray.postprocessors": "application",
    "fedray": "application",
    "jobs": "application",
    "analysis": "application",
    "examples": "application",
}
"""Each package's layer; ``fedray`` itself for its own top-level modules only (``__init__``, ``__main__``)."""


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


MODULES = module_files()


def layer_of(module: str) -> str | None:
    """The layer of the package ``module`` is in: the longest key that is a package above it or itself; ``fedray``
    only for the modules directly in it."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in LAYER_OF and (key != "fedray" or len(parts) <= 2):
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
    """A package ``__init__`` without imports (``fedray.data``'s, a docstring): importing the package runs no code of
    any layer."""
    path = MODULES[module]
    if path.name != "__init__.py":
        return False
    return not any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(ast.parse(path.read_text())))


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
    source = "from . import sibling\n\ndef f():\n    from fedray.engine.run_config import run\n    import fedray.app.cli\n"
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert imported("fedray.runtime.probe", path) >= {"fedray.runtime", "fedray.engine.run_config", "fedray.app.cli"}


def package_of(module: str) -> str:
    """The package a module belongs to in the layer map: ``fedray.methods`` for ``fedray.methods.training.local``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "fedray" and len(parts) > 2 or ".".join(parts[:2]) in LAYER_OF else parts[0]


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for target in imported(module, path):
            if package_of(target) != package_of(module) and not runs_nothing(target):
                edges.setdefault(package_of(module), set()).add(package_of(target))
    done: set[str] = set()

    def cycle_from(package: str, trail: tuple[str, ...]) -> tuple[str, ...] | None:
        if package in trail:
            return (*trail[trail.index(package):], package)
        if package in done:
            return None
        for target in sorted(edges.get(package, ())):
            found = cycle_from(target, (*trail, package))
            if found:
                return found
        done.add(package)
        return None

    assert [cycle for package in sorted(edges) if (cycle := cycle_from(package, ()))] == []


BELOW_ENGINE = ("core", "data", "methods", "runtime")


def test_nothing_below_the_engine_names_the_run_configuration():
    """A run's configuration stops at the engine: the layers below take the parts a plan built, never a ``RunConfig``
    (no parameter, annotation or name of it anywhere in them)."""
    naming = [f"{module}:{node.lineno}" for module, path in MODULES.items() if layer_of(module) in BELOW_ENGINE
              for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Name) and node.id == "RunConfig"
              or isinstance(node, ast.Attribute) and node.attr == "RunConfig"
              or isinstance(node, ast.Constant) and isinstance(node.value, str) and "RunConfig" in node.value
              or isinstance(node, ast.alias) and node.name.endswith("RunConfig")]
    assert naming == []


def test_nothing_below_the_engine_loads_a_higher_layer_by_name():
    """No module of the lower layers names a module of a higher one in a string (``importlib`` or a ``module:Class``
    spec would load it all the same): the algorithms fedray ships as plugins are found through their entry points.
    An entry-point group's name (``ENTRY_POINTS = "fedray.postprocessors"``) may be a package's: reading the group
    imports nothing."""
    higher = {layer: [key for key, of in LAYER_OF.items() if LAYERS.index(of) > LAYERS.index(layer) and key != "fedray"]
              for layer in BELOW_ENGINE}
    naming = [f"{module}:{node.lineno} {node.value!r}" for module, path in MODULES.items() if layer_of(module) in BELOW_ENGINE
              for tree in [ast.parse(path.read_text())] for groups in [entry_point_groups(tree)]
              for node in ast.walk(tree)
              if isinstance(node, ast.Constant) and isinstance(node.value, str) and node not in groups
              and any(node.value.partition(":")[0] in (name, *MODULES) and
                      (node.value == name or node.value.startswith((f"{name}.", f"{name}:")))
                      for name in higher[layer_of(module)])]
    assert naming == []


def entry_point_groups(tree: ast.Module) -> list[ast.AST]:
    """The string constants a module assigns to ``ENTRY_POINTS``: entry-point group names."""
    return [statement.value for statement in tree.body if isinstance(statement, ast.Assign)
            and any(isinstance(target, ast.Name) and target.id == "ENTRY_POINTS" for target in statement.targets)]
