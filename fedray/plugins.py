"""Built-in classes by name, a researcher's own as ``module:Class`` or ``path/to/file.py:Class``.

A plugin's module is registered with Ray's cloudpickle to travel by value, so
shard actors, Tune trials and other nodes use the same class without having
its file or being able to import its module.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from fedray.errors import FedrayError


def is_plugin(spec: str) -> bool:
    """Whether ``spec`` names a class by module or file rather than a built-in by name."""
    return ":" in spec


def display_name(spec: str) -> str:
    """What a table or a summary calls ``spec``: a plugin's class name (``MyNCM`` for ``my_ncm.py:MyNCM``), a built-in's name."""
    return spec.rpartition(":")[2] if is_plugin(spec) else spec


def canonical(spec: str) -> str:
    """``spec`` with a file path made absolute, so a Tune trial (run in another folder) finds the same file."""
    target, colon, name = spec.rpartition(":")
    if colon and target.endswith(".py"):
        return f"{Path(target).expanduser().resolve()}:{name}"
    return spec


def spec_of(cls: type) -> str:
    """The ``module:Class`` text naming ``cls`` (a class defined in a notebook is ``__main__:Class``)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def load_class(spec: str, base: type, builtins: dict[str, type], what: str) -> type:
    """The class ``spec`` names: a key of ``builtins``, ``module:Class`` or ``file.py:Class``; it must subclass ``base``."""
    if not is_plugin(spec):
        if spec not in builtins:
            raise FedrayError(f"unknown {what} {spec!r}; built-in: {', '.join(builtins)}; "
                              f"or your own as module:Class or path/to/file.py:Class")
        return builtins[spec]
    target, _, name = spec.rpartition(":")
    module = _module_from_file(Path(target)) if target.endswith(".py") else _imported(target, spec)
    cls = module
    for part in name.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            raise FedrayError(f"{spec}: no class {name!r} in {target}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise FedrayError(f"{spec}: {name} is not a subclass of fedray.{base.__name__}")
    _travel_by_value(module)
    return cls


def _imported(name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise FedrayError(f"{spec}: cannot import {name} ({error})") from None


def _module_from_file(path: Path) -> ModuleType:
    """The module in ``path``, loaded once per process under a name derived from its absolute path."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise FedrayError(f"{path}: no such plugin file")
    name = "fedray_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise FedrayError(f"{path}: the plugin failed to load ({type(error).__name__}: {error})") from None
    return module


def _travel_by_value(module: ModuleType) -> None:
    """Pickle the plugin's classes by value (not by reference to a module the receiving process may lack)."""
    if module.__name__ == "__main__" or module.__name__.split(".")[0] == "fedray":
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
