"""A heavy module (torch, pyarrow, polars) imported where it is first used, not where it is named.

The command line's parser and ``fedray methods`` are made from the built-in classes (their options), whose modules
compute with torch; importing torch takes seconds, reading an option's declaration none. A module that names torch at
its top as ``torch = lazy_module("torch", globals())`` defines its classes without importing it; the first attribute
read (``torch.zeros``, in a function that runs) imports torch and puts the module itself in the importing module's
globals, so later reads cost what a plain ``import torch`` costs.

Python's own :class:`importlib.util.LazyLoader` does not serve here: it puts a placeholder in :data:`sys.modules`,
which the next ``import torch`` anywhere, or any scan of :data:`sys.modules` (:func:`inspect.getmodule`), loads.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from fedray.core.interrupts import import_whole


class _LazyModule:
    """Stands for the module ``name`` in ``namespace`` until an attribute is read."""

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        self._name = name
        self._namespace = namespace

    def _load(self) -> ModuleType:
        module = import_whole(self._name)  # a signal in torch's C initialisation would leave it unimportable
        for key, value in list(self._namespace.items()):  # every name bound to this placeholder now names the module
            if value is self:
                self._namespace[key] = module
        return module

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute.endswith("__"):  # copy, pickle and inspect probe dunders
            raise AttributeError(attribute)
        return getattr(self._load(), attribute)

    def __reduce__(self) -> tuple:
        """Pickled (a plugin's globals travel by value to Ray's workers) as the module it stands for."""
        return importlib.import_module, (self._name,)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy_module(name: str, namespace: dict[str, Any]) -> ModuleType:
    """The module ``name`` for the module whose ``globals()`` are ``namespace``, imported when first used there."""
    return _LazyModule(name, namespace)  # type: ignore[return-value]  # it stands for the module until loaded
