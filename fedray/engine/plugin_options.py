"""The options of a run's plugins (``--option key=value``), each given to the class that declares it.

A run's plugins (its ``--method``, ``--server-optimizer`` and ``--postprocessor``
classes given as ``module:Class`` or ``file.py:Class``, and the built-in
algorithms shipped as plugins, FedDyn, FedNova) declare their options in their
constructors (:mod:`fedray.core.options`). ``--option x=1`` sets the ``x`` of the
one class that declares it; when two of the run's classes declare an ``x``, a
plain ``x`` would set both, so it is refused and each is given per owner:
``--option A.x=1 --option B.x=2``. An owner is named by its class name (``A``),
a built-in also by its ``--method`` name (``feddyn.alpha``).

Checked, the options are kept under one spelling, which is also their metrics
column: the plain name when one class of the run declares it, ``Class.name``
for each owner when several do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedray.core.errors import FedrayError
from fedray.core.options import Option, options_of

SEPARATOR = "."
"""Between an owner's name and its option's in a per-owner key (``Proximal.mu``)."""


@dataclass(frozen=True)
class Owner:
    """One of a run's classes whose options are set through ``--option``, and the flag that names it."""

    cls: type
    flag: str
    """Where the run names it: ``--method``, ``--server-optimizer``, ``--postprocessor``."""
    builtin: str | None = None
    """A built-in's ``--method`` name (``feddyn``), which per-owner keys may give it too."""

    @property
    def name(self) -> str:
        """The name per-owner keys and metrics columns spell it by: the class name."""
        return self.cls.__name__

    @property
    def aliases(self) -> tuple[str, ...]:
        """The names a per-owner key may give it: the class name, and a built-in's ``--method`` name."""
        return (self.name,) if self.builtin is None else (self.name, self.builtin)

    def __str__(self) -> str:
        return f"{self.name} ({self.flag})"

    def options(self) -> dict[str, Option]:
        return options_of(self.cls)


def split_key(key: str) -> tuple[str | None, str]:
    """(owner, option) of ``Owner.option``; (None, key) of a plain key."""
    owner, separator, name = key.rpartition(SEPARATOR)
    return (owner, name) if separator else (None, key)


def declarers(owners: list[Owner]) -> dict[str, list[Owner]]:
    """Each option name the run's classes declare, with the classes that declare it."""
    found: dict[str, list[Owner]] = {}
    for owner in owners:
        for name in owner.options():
            found.setdefault(name, []).append(owner)
    return found


def column(owner: Owner, name: str, declared: Mapping[str, list[Owner]]) -> str:
    """The key (and metrics column) of ``owner``'s option ``name``: plain unless another class of the run declares it."""
    return name if len(declared[name]) == 1 else f"{owner.name}{SEPARATOR}{name}"


def checked_options(options: dict[str, object], owners: list[Owner], where: str = "--option") -> dict[str, object]:
    """``options`` (plain keys declared by the run's classes, checked by the caller, and per-owner keys) typed by
    their owners and keyed as :func:`column` says; a one-line error for a plain key two owners declare, a per-owner
    key naming no class of the run or an option its owner lacks, and an option given twice."""
    declared = declarers(owners)
    for name, holders in declared.items():  # their per-owner keys and columns would be one
        named = [owner.name for owner in holders]
        twice = next((owner for owner in named if named.count(owner) > 1), None)
        if twice is not None:
            raise FedrayError(f"{where}: two of this run's classes named {twice} declare an option {name}; give them "
                              f"different class names")
    checked: dict[str, object] = {}
    spelt: dict[str, str] = {}
    for key, value in options.items():
        named, name = split_key(key)
        if named is None:
            if len(declared[name]) > 1:
                raise FedrayError(ambiguous(name, declared[name], where))
            owner = declared[name][0]
        else:
            owner = owner_named(named, key, owners, where)
            if name not in owner.options():
                raise FedrayError(f"{where} {key}: {owner} has no option {name}; its options: "
                                  f"{', '.join(owner.options()) or 'none'}")
        target = column(owner, name, declared)
        if target in checked:
            raise FedrayError(f"{where} {key}: {owner}'s option {name} is given twice: as {spelt[target]} and as {key}")
        checked[target], spelt[target] = owner.options()[name].coerce(value, where), key
    return checked


def ambiguous(name: str, owners: list[Owner], where: str) -> str:
    """The line refusing a plain ``name`` that several of the run's classes declare."""
    return (f"{where} {name}: {' and '.join(map(str, owners))} declare an option {name}; give it per owner: "
            f"{' and '.join(f'--option {owner.name}{SEPARATOR}{name}=...' for owner in owners)}")


def owner_named(named: str, key: str, owners: list[Owner], where: str) -> Owner:
    """The one class of the run that ``named`` (a per-owner key's owner) names, or a one-line error listing them."""
    matching = list({id(owner.cls): owner for owner in owners if named in owner.aliases}.values())
    if len(matching) == 1:
        return matching[0]
    if matching:
        raise FedrayError(f"{where} {key}: {named} names {len(matching)} of this run's classes "
                          f"({', '.join(map(str, matching))}); give them different class names")
    listed = ", ".join(map(str, owners)) if owners else "none (this run's built-in options are flags: fedray run --help)"
    raise FedrayError(f"{where} {key}: {named} is none of this run's classes whose options --option sets: {listed}")


def values_for(cls: type, options: dict[str, object]) -> dict[str, object]:
    """The checked ``options`` that ``cls`` takes, by its option names: the plain ones, and its own per-owner ones."""
    own = {}
    for key, value in options.items():
        named, name = split_key(key)
        if named is None or named == cls.__name__:
            own[name] = value
    return own


def defaults(owners: list[Owner]) -> dict[str, object]:
    """Every option of the run's classes at its default, keyed as :func:`column` says."""
    declared = declarers(owners)
    return {column(owner, name, declared): option.default for owner in owners for name, option in owner.options().items()}
