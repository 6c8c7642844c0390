"""Built-in classes by name, a researcher's own as ``module:Class`` or ``path/to/file.py:Class``; a dataset function as
``module:function`` or ``path/to/file.py:function``.

A plugin's module is registered with Ray's cloudpickle to travel by value, so
shard actors, Tune trials and other nodes use the same class without having
its file or being able to import its module.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import os
import re
import site
import sys
import sysconfig
import traceback
import typing
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from fedray.core.errors import FedrayError

FILE_MODULE = "fedray_plugin_"
"""The prefix of the name under which a plugin file's module is loaded (then its path's hash)."""
_SPECS_OF_FILE: dict[str, set[str]] = {}
"""The loaded plugins' files (absolute paths) and the specs of the classes loaded from each: a traceback frame in one
of these files is the researcher's code."""
_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\S+)')


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
    """The spec naming ``cls`` for a run started in this working directory, as its ``config.yaml`` records it.

    ``module:Class`` when such a run (``fedray run --config``, a fresh process) imports the same module from the same
    file: a module in the working directory, on ``PYTHONPATH`` or installed; else ``/abs/path/file.py:Class``, since
    a module imported from elsewhere (``ccvr`` beside the script that ran, or a folder put on ``sys.path``) would
    not be found there. A class defined in a notebook or the running script is ``__main__:Class``.
    """
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    if cls.__module__ != "__main__" and file and not _importable_here(cls.__module__, Path(file).resolve()):
        return f"{Path(file).resolve()}:{cls.__qualname__}"
    return f"{cls.__module__}:{cls.__qualname__}"


def _importable_here(name: str, file: Path) -> bool:
    """Whether a fresh Python process in this working directory imports module ``name`` from ``file``: its top-level
    package is found in the working directory, on ``PYTHONPATH``, among the standard and installed packages (also by
    an editable install's finder), at the place ``file`` is in."""
    top = name.partition(".")[0]
    paths = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep), *sysconfig.get_paths().values(),
             *site.getsitepackages(), site.getusersitepackages()]
    found = importlib.machinery.PathFinder.find_spec(top, [path for path in paths if path])
    for finder in sys.meta_path:  # an editable install's finder (a fresh process has it too)
        if found is not None:
            break
        if finder not in (importlib.machinery.PathFinder, importlib.machinery.BuiltinImporter,
                          importlib.machinery.FrozenImporter) and hasattr(finder, "find_spec"):
            try:
                found = finder.find_spec(top, None)
            except Exception:  # a third-party finder that cannot answer does not find it
                found = None
    if found is None:
        return False
    places = [Path(place).resolve() for place in found.submodule_search_locations or []]
    return file == Path(found.origin).resolve() if not places else any(file.is_relative_to(place) for place in places)


def registered(group: str) -> dict[str, str]:
    """The classes installed packages register by name under the entry-point group ``group`` (their pyproject's
    ``[project.entry-points."GROUP"]``), as ``module:Class``, sorted by name: a registry the layers above fill, read
    without importing them."""
    return {point.name: point.value for point in sorted(_entry_points().select(group=group), key=lambda p: p.name)}


@functools.cache
def _entry_points() -> importlib.metadata.EntryPoints:
    """Every installed package's entry points, read once (each read scans every package's metadata)."""
    return importlib.metadata.entry_points()


def load_class(spec: str, base: type, builtins: dict[str, type], what: str) -> type:
    """The class ``spec`` names: a key of ``builtins``, ``module:Class`` or ``file.py:Class``; it must subclass ``base``."""
    if not is_plugin(spec):
        if spec not in builtins:
            raise FedrayError(f"unknown {what} {spec!r}; built-in: {', '.join(builtins)}; "
                              f"or your own as module:Class or path/to/file.py:Class")
        return builtins[spec]
    module, cls = _attribute(spec, "class")
    name = spec.rpartition(":")[2]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise FedrayError(f"{spec}: {name} is not a subclass of fedray.{base.__name__}")
    if inspect.isabstract(cls):
        raise FedrayError(f"{spec}: {name} is abstract: it does not define {', '.join(sorted(cls.__abstractmethods__))}, "
                          f"which a subclass of fedray.{base.__name__} must")
    undecorated = _undecorated(cls, base)
    if undecorated is not None:
        raise FedrayError(f"{spec}: {undecorated.__qualname__} is not a dataclass: decorate it with "
                          f"@dataclass(frozen=True), as fedray.{base.__name__} is (its fields with defaults are its options)")
    _travel_by_value(module)
    if getattr(module, "__file__", None):
        _SPECS_OF_FILE.setdefault(str(Path(module.__file__).resolve()), set()).add(canonical(spec))
    return cls


def names_subclass(spec: str, base: type) -> bool:
    """Whether the plugin ``spec`` names a subclass of ``base``, whatever else is wrong with it (abstract, not a
    dataclass: :func:`load_class` says so); a module that cannot load raises its one-line error."""
    _, found = _attribute(spec, "class")
    return isinstance(found, type) and issubclass(found, base)


def _undecorated(cls: type, base: type) -> type | None:
    """The class between ``cls`` and a dataclass ``base`` that declares fields or a constructor without being a dataclass
    itself (its fields would not be the constructor's, its constructor not the one fedray calls), or None."""
    if not dataclasses.is_dataclass(base):
        return None
    for klass in cls.__mro__:
        if klass is base or not issubclass(klass, base):
            return None
        own = vars(klass)
        fields = [hint for hint in own.get("__annotations__", {}).values() if not _is_class_variable(hint)]
        if "__dataclass_fields__" not in own and (fields or "__init__" in own):
            return klass
    return None


def _is_class_variable(hint: object) -> bool:
    """Whether an annotation (an object, or its text under ``from __future__ import annotations``) is a ``ClassVar``."""
    if isinstance(hint, str):
        return hint.startswith(("ClassVar", "typing.ClassVar"))
    return hint is typing.ClassVar or typing.get_origin(hint) is typing.ClassVar


def plugin_spec(cls: type) -> str | None:
    """The spec of a plugin class as a run names it (``/home/me/my_ncm.py:MyNCM``, ``my_package.methods:MyNCM``), also
    in a process that received it by value (a shard); None for fedray's own classes."""
    module = cls.__module__
    if module.split(".")[0] == "fedray":
        return None
    if not module.startswith(FILE_MODULE):
        return f"{module}:{cls.__qualname__}"
    loaded = getattr(sys.modules.get(module), "__file__", None)
    # received by value, the module is not there: the file is where the methods written in the class bodies come from
    files = {loaded} if loaded else {function.__code__.co_filename for klass in cls.__mro__ if klass.__module__ == module
                                     for function in vars(klass).values() if inspect.isfunction(function)
                                     and function.__code__.co_qualname.startswith(f"{klass.__qualname__}.")}
    return f"{files.pop()}:{cls.__qualname__}" if len(files) == 1 else cls.__qualname__


def load_function(spec: str) -> Callable:
    """The function ``spec`` names, as ``module:function`` or ``file.py:function`` (a dataset plugin's)."""
    module, function = _attribute(spec, "function")
    if not inspect.isfunction(function):
        raise FedrayError(f"{spec}: {spec.rpartition(':')[2]} is not a function")
    _travel_by_value(module)
    return function


def _attribute(spec: str, kind: str) -> tuple[ModuleType, object]:
    """The module of ``spec`` (``module:name`` or ``file.py:name``) and the object ``name`` in it (dotted: an attribute
    of an attribute); ``kind`` names what was looked for in the error."""
    target, _, name = spec.rpartition(":")
    module = _module_from_file(Path(target)) if target.endswith(".py") else _imported(target, spec)
    found = module
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise FedrayError(f"{spec}: no {kind} {name!r} in {target}")
    return module, found


def plugin_failure(error: BaseException) -> str | None:
    """One line naming the plugin whose code raised ``error`` and the call into it (``MyNCM.solve``'s file:Class and
    ``solve``), or None when no loaded plugin's code is in its traceback.

    The traceback is read as text, so an error raised in a shard actor (a Ray task error, whose text holds the
    actor's traceback) is found as one raised on the driver. The call is the outermost frame in the plugin's file:
    the method fedray called, not the line deep inside it that failed.
    """
    text = "".join(traceback.format_exception(error))
    for path, function in _FRAME.findall(text):
        specs = _SPECS_OF_FILE.get(path)
        if specs:
            cause = getattr(error, "cause", None)  # a Ray task error carries the actor's exception
            raised = cause if isinstance(cause, BaseException) else error
            message = str(raised).strip().splitlines()
            what = f"{type(raised).__name__}: {message[0]}" if message else type(raised).__name__
            plugin = next(iter(specs)) if len(specs) == 1 else path
            return f"the plugin {plugin} failed in {function} ({what})"
    return None


def _imported(name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as error:
        shadowed = shadowing_fedray()
        raise FedrayError(f"{spec}: cannot import {name} ({_load_failure(error, located=not shadowed)})"
                          + (f": {shadowed}" if shadowed else "")) from None


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
    except (Exception, SystemExit) as error:
        del sys.modules[name]
        shadowed = shadowing_fedray()
        raise FedrayError(f"{path}: the plugin failed to load ({_load_failure(error, located=not shadowed)})"
                          + (f": {shadowed}" if shadowed else "")) from None
    return module


def _load_failure(error: BaseException, located: bool = True) -> str:
    """What went wrong while a plugin's module ran, in one line: the error and, when ``located``, where it was raised
    (a syntax error names its line itself), or the ``sys.exit`` it called."""
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r}) while loading"
    message = (str(error).strip().splitlines() or [""])[0]
    what = f"{type(error).__name__}: {message}" if message else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    if isinstance(error, SyntaxError) or not (frames and located):
        return what
    return f"{what}, at {frames[-1].filename}:{frames[-1].lineno}"


def shadowing_fedray() -> str | None:
    """What ``import fedray`` gives when it is not this package, or None.

    A folder named ``fedray/`` in the working directory (Ray's workers put the
    driver's on ``sys.path``) is imported as a namespace package ahead of an
    editable install, while ``fedray.core.plugins`` and the other submodules still
    come from the install: a plugin's ``fedray.ClosedFormMethod`` then fails
    with a bare "module 'fedray' has no attribute".
    """
    ours = Path(__file__).resolve().parents[1]  # fedray/, above fedray/core/
    imported = sys.modules.get("fedray")
    file = getattr(imported, "__file__", None)
    if imported is None or (file is not None and Path(file).resolve().parent == ours):
        return None
    folders = dict.fromkeys(str(Path(folder).resolve()) for folder in getattr(imported, "__path__", []))
    where = file or " and ".join(folders) or repr(imported)
    kind = "" if file else " (a folder without __init__.py, imported as a namespace package)"
    return (f"'import fedray' gave {where}{kind}, not fedray's package {ours}: a folder named fedray in the working "
            f"directory or on sys.path hides it; rename or move that folder")


def _travel_by_value(module: ModuleType) -> None:
    """Pickle the plugin's classes by value (not by reference to a module the receiving process may lack)."""
    if module.__name__ == "__main__" or module.__name__.split(".")[0] == "fedray":
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
