"""A sweep file: which ``fedray run`` options to vary, and what each trial may use.

    name: participation            # the sweep's folder under --out
    base:                          # options every trial shares
      dataset: synthetic:inat-user-120k
      eval_every: 100
    grid:                          # every combination is a trial
      clients_per_round: [10, 20, 50, 100]
      method: [fedncm, fed3r, fedcof]
      dataset.alpha: [0.1, 0.5]    # dataset.X: option X of the dataset spec (here ?alpha=...)
    random:                        # drawn per trial (uniform, loguniform: [low, high]; randint: [low, high); choice: [...])
      lam: {loguniform: [0.0001, 0.1]}
    num_samples: 1                 # repeats of the grid, each with its own random draws
    shards_per_trial: 1            # shard actors (fine-tuning: trainers) of each trial ...
    cpus_per_shard: 1              # ... and their CPUs; the trial's driver gets driver_cpus
    gpus_per_shard: 0              # ... and their GPUs (fine-tuning's trainers and TCT's stage 2 use them)
    driver_cpus: 1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

from fedray.engine.config import FIELDS, shipped_options, without_removed
from fedray.engine.config_files import did_you_mean, options_mapping, read_yaml_mapping, typed_value
from fedray.data.registry import OPTION_TYPES, canonical_spec
from fedray.core.errors import FedrayError
from fedray.core.plugins import canonical
from fedray.core.numeric_options import check_numeric_option

RESOURCE_OPTIONS = ("num_shards", "cpus_per_shard", "num_trainers", "cpus_per_trainer")
"""Run options the sweep sets for every trial, from the trial's placement group (``shards_per_trial``, ``cpus_per_shard``)."""
COMMAND_OPTIONS = ("out", "quiet")
"""Run options ``fedray sweep`` sets for every trial from its own ``--out`` and ``--quiet``."""
DATASET_PREFIX = "dataset."
OPTIONS_PREFIX = "options."
"""``options.KEY``: option KEY of a plugin (``--option KEY=...``), typed and checked with each trial's run."""
DISTRIBUTIONS = ("uniform", "loguniform", "randint", "choice")
SWEEP_KEYS = ("name", "base", "grid", "random", "num_samples", "shards_per_trial", "cpus_per_shard", "gpus_per_shard",
              "driver_cpus")


@dataclass(frozen=True)
class SweepSpec:
    name: str
    base: dict = field(default_factory=dict)
    grid: dict[str, list] = field(default_factory=dict)
    random: dict[str, dict] = field(default_factory=dict)
    num_samples: int = 1
    shards_per_trial: int = 1
    cpus_per_shard: float = 1.0
    gpus_per_shard: float = 0.0
    driver_cpus: float = 1.0

    @property
    def shard_bundle(self) -> dict[str, float]:
        """What each shard (or fine-tuning trainer) of a trial holds."""
        return {"CPU": self.cpus_per_shard, **({"GPU": self.gpus_per_shard} if self.gpus_per_shard else {})}

    @property
    def bundles(self) -> list[dict[str, float]]:
        """One trial's placement group: its driver, then one bundle per shard (or fine-tuning trainer)."""
        return [{"CPU": self.driver_cpus}] + [self.shard_bundle] * self.shards_per_trial

    @property
    def swept(self) -> list[str]:
        return [*self.grid, *self.random]


def load_sweep(path: str | Path) -> SweepSpec:
    """The sweep in the YAML file ``path``."""
    path = Path(path)
    return sweep_spec(read_yaml_mapping(path, "sweep file", "name, base, grid, random, ..."), path)


def sweep_spec(values: dict, path: Path) -> SweepSpec:
    """The sweep a mapping describes (a sweep file's content), checked; errors begin with ``path``."""
    if not isinstance(values, dict):
        raise FedrayError(f"{path}: a sweep is a mapping of name, base, grid, random, ...")
    unknown = sorted(set(values) - set(SWEEP_KEYS))
    if unknown:
        key = unknown[0]
        where = f"; {key} is a run option: give it under base: (or grid:, random:)" if key in FIELDS \
            else did_you_mean(key, SWEEP_KEYS)
        raise FedrayError(f"{path}: unknown key(s) {', '.join(unknown)}; a sweep has {', '.join(SWEEP_KEYS)}{where}")
    if not isinstance(values.get("name"), str) or not values["name"].replace("-", "").replace("_", "").isalnum():
        raise FedrayError(f"{path}: name must be a word (letters, digits, - and _), got {values.get('name')!r}")
    base = {key: _typed(path, key, value) for key, value in _options(path, values, "base").items()}
    grid = {}
    for key, choices in _options(path, values, "grid").items():
        if not isinstance(choices, list) or not choices:
            raise FedrayError(f"{path}: grid.{key} must be a non-empty list")
        grid[key] = [_typed(path, key, choice) for choice in choices]
    random = {key: _distribution(path, key, value) for key, value in _options(path, values, "random").items()}
    overlap = sorted((set(base) & set(grid)) | (set(base) & set(random)) | (set(grid) & set(random)))
    if overlap:
        raise FedrayError(f"{path}: option(s) {', '.join(overlap)} given in more than one of base, grid, random")
    for key, canonical_form in (("dataset", canonical_spec), ("method", canonical), ("server_optimizer", canonical)):
        if base.get(key) is not None:
            base[key] = canonical_form(base[key])
        if key in grid:
            grid[key] = [canonical_form(value) for value in grid[key]]
    spec = SweepSpec(values["name"], base, grid, random, **{k: values[k] for k in SWEEP_KEYS[4:] if k in values})
    for key, value in (("num_samples", spec.num_samples), ("shards_per_trial", spec.shards_per_trial)):
        if not isinstance(value, int) or value < 1:
            raise FedrayError(f"{path}: {key} must be an integer ≥ 1, got {value!r}")
    for key, value in (("cpus_per_shard", spec.cpus_per_shard), ("driver_cpus", spec.driver_cpus)):
        if not isinstance(value, (int, float)) or value <= 0:
            raise FedrayError(f"{path}: {key} must be a number > 0, got {value!r}")
        check_numeric_option(f"{path}: {key}", key, value)
    if not isinstance(spec.gpus_per_shard, (int, float)) or isinstance(spec.gpus_per_shard, bool) or spec.gpus_per_shard < 0:
        raise FedrayError(f"{path}: gpus_per_shard must be a number ≥ 0, got {spec.gpus_per_shard!r}")
    check_numeric_option(f"{path}: gpus_per_shard", "gpus_per_shard", spec.gpus_per_shard)
    return spec


def _typed(path: Path, key: str, value: object) -> object:
    """A run option's value as its type; a dataset option's value as the type the dataset spec parses it to."""
    if key.startswith(OPTIONS_PREFIX):
        if isinstance(value, (dict, list)):
            raise FedrayError(f"{path}: {key} must be a single value, got {value!r}")
        return value
    if not key.startswith(DATASET_PREFIX):
        return typed_value(path, key, value)
    kind = OPTION_TYPES[key[len(DATASET_PREFIX):]]
    try:
        if isinstance(value, bool) or isinstance(value, (dict, list)):
            raise ValueError
        typed = kind(value)
    except ValueError:
        raise FedrayError(f"{path}: {key} must be {'a string' if kind is str else 'a number'}, got {value!r}") from None
    check_numeric_option(f"{path}: {key}", key[len(DATASET_PREFIX):], typed)
    return typed


def plugin_options(params: dict) -> dict:
    """The ``options.KEY`` entries of a trial's ``params`` as the run's ``options``."""
    return {key[len(OPTIONS_PREFIX):]: value for key, value in params.items() if key.startswith(OPTIONS_PREFIX)}


def with_dataset_options(dataset: str, params: dict) -> str:
    """``dataset`` with the ``dataset.X`` entries of ``params`` set as its ``?X=`` options."""
    options = {key[len(DATASET_PREFIX):]: value for key, value in params.items() if key.startswith(DATASET_PREFIX)}
    if not options:
        return dataset
    target, _, query = dataset.partition("?")
    merged = dict(parse_qsl(query)) | {key: str(value) for key, value in options.items()}
    return canonical_spec(f"{target}?{urlencode(merged, safe='/')}")


def _options(path: Path, values: dict, section: str) -> dict:
    options = values.get(section) or {}
    if not isinstance(options, dict):
        raise FedrayError(f"{path}: {section} must be a mapping of option: value")
    options = without_removed({str(key).replace("-", "_"): value for key, value in options.items()}, f"{path}: {section}")
    if "options" in options:
        options = _plugin_options_spelt_out(path, options, section)
    # the options of the built-in algorithms shipped as plugins (FedDyn's alpha) live among a run's plugin options
    renamed = {OPTIONS_PREFIX + key if key not in FIELDS and key in shipped_options() else key: value
               for key, value in options.items()}
    if len(renamed) < len(options):
        twice = sorted(key for key in options if OPTIONS_PREFIX + key in options)[0]
        raise FedrayError(f"{path}: {section}.{twice} is given twice: as {twice} and as {OPTIONS_PREFIX}{twice}")
    options = renamed
    for key in options:
        if key.startswith(OPTIONS_PREFIX) and len(key) > len(OPTIONS_PREFIX):
            continue
        if key.startswith(DATASET_PREFIX) and section != "base":
            if key[len(DATASET_PREFIX):] not in OPTION_TYPES:
                raise FedrayError(f"{path}: {section}.{key}: unknown dataset option {key[len(DATASET_PREFIX):]!r}")
            continue
        if key in RESOURCE_OPTIONS:
            raise FedrayError(f"{path}: {section}.{key} is the sweep's to set: shards_per_trial (a trial's shards, or its "
                              f"trainers when it fine-tunes) and cpus_per_shard (the CPUs of each)")
        if key in COMMAND_OPTIONS:
            raise FedrayError(f"{path}: {section}.{key} is set for every trial by fedray sweep --{key}")
        if key not in FIELDS:
            raise FedrayError(f"{path}: {section}.{key} is not a run option{_where_it_went(key, section)}")
    return options


def _plugin_options_spelt_out(path: Path, options: dict, section: str) -> dict:
    """``base: {options: {x: 1}}``, as a config file writes a plugin's options, as ``base: {options.x: 1}``; in a grid or
    random section each swept plugin option is its own key (``options.x: [...]``)."""
    if section != "base":
        raise FedrayError(f"{path}: {section}.options: sweep each plugin option as its own key, "
                          f"{section}.{OPTIONS_PREFIX}NAME")
    plugin = options_mapping(f"{path}: base", options.pop("options"))
    twice = sorted(key for key in plugin if OPTIONS_PREFIX + key in options)
    if twice:
        raise FedrayError(f"{path}: base.{OPTIONS_PREFIX}{twice[0]} is given twice: in base.options and as "
                          f"base.{OPTIONS_PREFIX}{twice[0]}")
    return {**options, **{OPTIONS_PREFIX + key: value for key, value in plugin.items()}}


def _where_it_went(key: str, section: str) -> str:
    """Where a key that is not a run option belongs in a sweep file, or the nearest run option."""
    if key in OPTION_TYPES:
        return f" ({key} is an option of the dataset: write {section}.{DATASET_PREFIX}{key})" if section != "base" \
            else f" ({key} is an option of the dataset: give it in base.dataset as ?{key}=...)"
    return did_you_mean(key, sorted(set(FIELDS) - set(RESOURCE_OPTIONS) - set(COMMAND_OPTIONS))) or \
        f" (a plugin's option is written {section}.{OPTIONS_PREFIX}{key})"


def _distribution(path: Path, key: str, value: object) -> dict:
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in DISTRIBUTIONS:
        raise FedrayError(f"{path}: random.{key} must be one of {{{' | '.join(DISTRIBUTIONS)}: ...}}")
    kind, arguments = next(iter(value.items()))
    if not isinstance(arguments, list) or not arguments or (kind != "choice" and len(arguments) != 2):
        raise FedrayError(f"{path}: random.{key}.{kind} needs " + ("a list of choices" if kind == "choice" else "[low, high]"))
    if kind in ("uniform", "loguniform"):
        arguments = [float(_typed(path, key, a)) for a in arguments]
    elif kind == "randint" or kind == "choice":
        arguments = [_typed(path, key, a) for a in arguments]
    if kind != "choice" and not arguments[0] < arguments[1] or kind == "loguniform" and arguments[0] <= 0:
        raise FedrayError(f"{path}: random.{key}.{kind} needs 0 < low < high" if kind == "loguniform" else f"{path}: random.{key}.{kind} needs low < high")
    return {kind: arguments}
