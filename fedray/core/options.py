"""Options that live with their class: the typed keyword arguments, with defaults, of a method's constructor.

A closed-form method, a server optimizer or any other pluggable class declares
its options once, in its ``__init__``::

    def __init__(self, dim: int, num_classes: int, lam: Annotated[float, "ridge λ (> 0)"] = 0.01, bias: bool = False)

Each keyword argument with a default is an option: its type (``int``,
``float``, ``bool`` or ``str``, optionally ``| None``; a ``Literal`` of strings
gives its choices), its default and, with ``typing.Annotated``, its help text
(and, for ``--help``, what a ``None`` default means, :class:`Unset`, and the
value's name, :class:`Metavar`); a training algorithm, a dataclass, declares
them as fields with defaults. Arguments the engine supplies (:data:`SUPPLIED`)
are not options. ``fedray methods`` lists these, the
command line and YAML files set them, and :func:`build` checks and coerces the
values before anything runs.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, is_dataclass

from fedray.core.errors import FedrayError, shown
from fedray.core.numeric_options import check_numeric_option

SUPPLIED = ("dim", "num_classes", "seed")
"""Constructor arguments the engine fills in: the feature dimension, the class count, the run's seed."""

TYPES = (int, float, bool, str)
TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
TRUE, FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


@dataclass(frozen=True)
class Unset:
    """What an option's ``None`` default means, for ``--help``:
    ``Annotated[int | None, "help", Unset("the feature dim")]``; for an option of several built-in classes, or of
    one that not every run builds, what the run's ``None`` means until its class fills in its own default."""

    meaning: str
    shared_help: str | None = None
    """The run's help of an option that several classes declare each with its own help (each saying its default)."""


@dataclass(frozen=True)
class Metavar:
    """How ``--help`` names an option's value: ``Annotated[str | None, "help", Metavar("R1,R2,...")]``."""

    text: str


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: object
    help: str = ""
    optional: bool = False
    """Whether ``None`` is a valid value (the type was ``X | None``)."""
    choices: tuple[str, ...] | None = None
    """The values it takes (the type was a ``Literal``); the class or the run checks them, with its own message."""
    unset: str | None = None
    """What a ``None`` default means (:class:`Unset`)."""
    metavar: str | None = None
    shared_help: str | None = None
    """:attr:`Unset.shared_help`."""

    def describe(self) -> str:
        kind = self.type.__name__ + (" | None" if self.optional else "")
        return f"{self.name}: {kind} = {self.default!r}" + (f"  ({self.help})" if self.help else "")

    def coerce(self, value: object, where: str) -> object:
        """``value`` as this option's type, or a one-line error naming ``where`` it came from.

        One typing for every source: a config file, a sweep, ``--option key=value``, ``fedray.run``'s keywords. A
        string is parsed as the command line parses it (``"1e-3"``, ``"no"``); an integer is a number (numpy's too) and
        a number of any type is the plain Python one; but a bool is not a number, nor a number a bool, nor a float an
        integer, even an integral one (``--rounds 2.0`` is refused too).
        """
        if value is None and self.optional:
            return None
        if isinstance(value, str) and self.type is not str:
            value = _parse(value, self.type)
        value = _plain_number(value, self.type)
        if type(value) is not self.type:
            raise FedrayError(f"{where}: option {self.name} must be {TYPE_NAMES[self.type]}, got {shown(value)}")
        check_numeric_option(f"{where}: option {self.name}", self.name, value)
        return value


def _plain_number(value: object, kind: type) -> object:
    """A number of another type (numpy's, an int for a float) as the plain ``kind``, else ``value`` unchanged; an int
    too large for a float is infinite, as ``float("1e400")`` is."""
    if isinstance(value, bool):
        return value
    if kind is int and isinstance(value, numbers.Integral):
        return int(value)
    if kind is float and isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    return value


def _parse(text: str, kind: type) -> object:
    """``text`` parsed as ``kind``, or returned unchanged when it does not parse (the caller names the error)."""
    if kind is bool:
        lowered = text.strip().lower()
        return True if lowered in TRUE else False if lowered in FALSE else text
    try:
        return kind(text)
    except ValueError:
        return text


def options_of(cls: type) -> dict[str, Option]:
    """The options ``cls`` declares (see the module docstring), in constructor order."""
    return dict(_declared_options(cls))


@functools.cache
def _declared_options(cls: type) -> dict[str, Option]:
    """:func:`options_of`, read from the signature once per class: the catalogue asks each built-in class about each
    option name (reading annotations compiles each of them)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    # a dataclass's fields are resolved each in its own class's module (a subclass's file need not import the base's types)
    hints = typing.get_type_hints(cls if is_dataclass(cls) else cls.__init__, include_extras=True)
    return _declared(cls.__qualname__, "constructor argument", parameters, hints, SUPPLIED)


def function_options(function: Callable) -> dict[str, Option]:
    """The options of a function (a dataset plugin's): its keyword arguments with defaults, typed as a class's are."""
    parameters = inspect.signature(function).parameters.values()
    return _declared(function.__qualname__, "argument", parameters, typing.get_type_hints(function, include_extras=True), ())


def _declared(owner: str, what: str, parameters: Iterable[inspect.Parameter], hints: dict, supplied: Sequence[str]) -> dict[str, Option]:
    found: dict[str, Option] = {}
    for parameter in parameters:
        name = parameter.name
        if name in supplied or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.default is parameter.empty:
            raise TypeError(f"{owner}: {what} {name!r} needs a default to be an option")
        found[name] = option_from_hint(f"{owner}: option {name!r}", name, hints.get(name, type(parameter.default)),
                                       parameter.default)
    return found


def option_from_hint(owner: str, name: str, hint: object, default: object, help_text: str = "") -> Option:
    """The option ``name`` of type ``hint`` (``Annotated[X | None, "help", Unset(...), Metavar(...)]`` or plain)
    declared by ``owner``."""
    kind, extras, optional = _unwrap(hint)
    choices = None
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        kind = str
        if not all(isinstance(choice, str) for choice in choices):
            raise TypeError(f"{owner}: a Literal option takes strings, got {choices!r}")
    if kind not in TYPES:
        raise TypeError(f"{owner} must be int, float, bool or str, got {kind!r}")
    annotated_help = next((extra for extra in extras if isinstance(extra, str)), "")
    unset = next((extra for extra in extras if isinstance(extra, Unset)), None)
    metavar = next((extra.text for extra in extras if isinstance(extra, Metavar)), None)
    return Option(name, kind, default, help_text or annotated_help, optional, choices,
                  None if unset is None else unset.meaning, metavar, None if unset is None else unset.shared_help)


def _unwrap(hint: object) -> tuple[object, tuple, bool]:
    """(type, ``Annotated``'s extras, optional) of an annotation such as ``Annotated[float | None, "help"]``."""
    extras: tuple = ()
    if typing.get_origin(hint) is typing.Annotated:
        hint, *listed = typing.get_args(hint)
        extras = tuple(listed)
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(hint) if member is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        hint = members[0] if len(members) == 1 else hint
    return hint, extras, optional


def supplied_arguments(cls: type, **available: object) -> dict[str, object]:
    """The engine-supplied arguments (:data:`SUPPLIED`) that ``cls``'s constructor takes, from ``available``."""
    parameters = inspect.signature(cls.__init__).parameters
    return {name: value for name, value in available.items() if name in parameters}


def build(cls: type, values: dict[str, object], where: str, **supplied: object) -> object:
    """``cls`` constructed with ``values`` for its options (others keep their defaults) and the ``supplied`` arguments it takes.

    ``values`` may hold options of other classes of the same run; only this
    class's are taken. A constructor's own check (``ValueError`` or
    :class:`FedrayError`) becomes a one-line error naming ``where``.
    """
    declared = options_of(cls)
    chosen = {name: declared[name].coerce(value, where) for name, value in values.items() if name in declared}
    try:
        return cls(**supplied_arguments(cls, **supplied), **chosen)
    except ValueError as error:
        raise FedrayError(f"{where}: {error}") from None
