"""A run's options read from a YAML file or Python keywords: each typed as its option, one line naming the source and
the option on a bad one (and where an unknown one belongs)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from fedray.core.errors import FedrayError, shown
from fedray.core.numeric_options import command_line
from fedray.core.options import options_of
from fedray.core.plugins import is_plugin
from fedray.data.dataset_options import OPTION_TYPES as DATASET_OPTIONS
from fedray.engine.config import (ALGORITHMS, FIELDS, RUN_OPTIONS, _is_algorithm, _owned_options_moved,
                                  server_optimizer_class, shipped_options, without_removed)
from fedray.methods import method_class
from fedray.methods.training_algorithms import algorithm_class


def typed_value(path: Path, key: str, value: object) -> object:
    """A file value as its option's type (YAML reads ``1e-3`` as a string), finite, a seed ≥ 0; null only where the option allows it."""
    return RUN_OPTIONS[key].coerce(value, str(path))


def did_you_mean(key: str, known: Sequence[str]) -> str:
    """``"; did you mean KNOWN?"`` for the nearest of ``known`` to a misspelt ``key``, or ``""``."""
    nearest = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean {nearest[0]}?" if nearest else ""


def read_yaml_mapping(path: Path, kind: str, shape: str) -> dict:
    """The mapping in the YAML file ``path``, or a one-line error naming the file (``kind``: what it should be)."""
    if path.is_dir():
        inside = path / "config.yaml"  # a run's folder: its configuration is this file
        hint = f"; did you mean {inside}?" if inside.is_file() else "; name a YAML file"
        raise FedrayError(f"{path}: is a folder, not a {kind}{hint}")
    if not path.is_file():
        raise FedrayError(f"{path}: no such {kind}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise FedrayError(f"{path}: not a text file (byte 0x{error.object[error.start]:02x} at offset {error.start} "
                          f"is not UTF-8); a {kind} is YAML") from None
    except OSError as error:
        raise FedrayError(f"{path}: cannot be read ({error.strerror})") from None
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise FedrayError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    except RecursionError:  # PyYAML builds nested collections recursively
        raise FedrayError(f"{path}: nested too deeply to read (a {kind} holds options, not thousands of nested "
                          f"lists or mappings)") from None
    if not isinstance(values, dict):
        raise FedrayError(f"{path}: a {kind} is a mapping of {shape}")
    return values


@dataclass(frozen=True)
class Spelling:
    """How a source of run options writes a plugin's option and a dataset option, for the hint after an unknown one."""

    plugin_option: str
    dataset_option: str


FILE_SPELLING = Spelling("under options: {{{key}: ...}}", "in dataset: as ?{key}=...")
"""A config file's: ``options: {normalize: false}``, ``dataset: synthetic:...?alpha=0.5``."""


def load_config_file(path: str | Path) -> dict:
    path = Path(path)
    values = read_yaml_mapping(path, "config file", "option: value")
    return typed_options({str(key).replace("-", "_"): value for key, value in values.items()}, str(path), FILE_SPELLING)


def typed_options(values: dict, where: str, spelling: Spelling) -> dict:
    """Run options (a config file's, ``fedray.run``'s keywords) each as its option's type (:meth:`Option.coerce`), and
    ``options`` as a mapping; a one-line error naming ``where`` on an unknown name (saying where it belongs), a removed
    one (:func:`without_removed`) or a value."""
    values = without_removed(values, where)
    shipped = {key: value for key, value in values.items() if key not in FIELDS and key in shipped_options()}
    unknown = sorted(set(values) - FIELDS - set(shipped))
    if unknown:
        hints = "".join(_where_it_went(key, values, spelling) for key in unknown)
        raise FedrayError(f"{where}: unknown option(s) {', '.join(unknown)}{hints}")
    typed = {key: options_mapping(where, value) if key == "options" else RUN_OPTIONS[key].coerce(value, where)
             for key, value in values.items() if key not in shipped}
    return _owned_options_moved(with_shipped_options(typed, shipped, where), where)


def with_shipped_options(values: dict, shipped: dict, where: str) -> dict:
    """``values`` with the options of the built-in algorithms shipped as plugins given by their own names
    (``alpha: 0.1``, ``--alpha 0.1``: :func:`shipped_options`) put among ``options``, where they live."""
    if not shipped:
        return values
    options = values.get("options") or {}
    twice = sorted(set(shipped) & set(options))
    if twice:
        raise FedrayError(f"{where}: {twice[0]} is given twice: as {command_line(twice[0])} (or {twice[0]}: in YAML) "
                          f"and as --option {twice[0]} (or options: {{{twice[0]}: ...}})")
    return {**values, "options": {**options, **shipped}}


def _where_it_went(key: str, values: dict, spelling: Spelling) -> str:
    """Where an unknown run option ``key`` belongs: a plugin's options, the dataset spec, or the nearest run option."""
    owners = []
    method = values.get("method")
    load_method = algorithm_class if method in ALGORITHMS or (isinstance(method, str) and is_plugin(method) and
                                                                _is_algorithm(method)) else method_class
    for spec, load in ((method, load_method), (values.get("server_optimizer"), server_optimizer_class)):
        if isinstance(spec, str) and (is_plugin(spec) or isinstance(ALGORITHMS.get(spec), str)):  # feddyn's, fednova's too
            try:
                owners += [spec] if key in options_of(load(spec)) else []
            except FedrayError:  # the run names the bad plugin once it is checked
                pass
    if owners:
        return f"; {key} is an option of {owners[0]}: give it {spelling.plugin_option.format(key=key)}"
    if key in DATASET_OPTIONS:
        return f"; {key} is an option of the dataset: give it {spelling.dataset_option.format(key=key)}"
    return did_you_mean(key, sorted(RUN_OPTIONS))


def options_mapping(where: str, value: object) -> dict:
    """``options`` (a plugin's options), a mapping of names to values; their types are checked with the run."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise FedrayError(f"{where}: options must be a mapping of option: value, got {shown(value)}")
    return dict(value)
