"""A run's configuration: defaults ← YAML file ← command line, validated in one place."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from fedray.errors import FedrayError
from fedray.gradient.algorithms import ALGORITHMS, DEFAULT_PROX_MU, FINETUNE_MODES, INITS, Algorithm
from fedray.gradient.server import SERVER_OPTIMIZERS, ServerOptimizer
from fedray.methods import METHODS, method_class
from fedray.numeric_options import check_numeric_option, check_numeric_options, command_line
from fedray.options import options_of
from fedray.plugins import canonical, is_plugin, load_class
from fedray.results import EvalPoint


TCT = "tct"
TCT_SOLVERS = ("scaffold", "closed_form", "both")
CLOSED_FORM_MAX_DIM = 10_000
"""Widest stage-2 problem the closed form solves: a 10k × 10k float64 system is 0.8 GB."""


@dataclass
class RunConfig:
    method: str = "fed3r"
    dataset: str = "synthetic:inat-user-120k"
    out: str = "results/run"
    clients_per_round: int | None = None
    participation: float | None = None
    sampling: str | None = None
    rounds: int | None = None
    eval_every: int = 100
    seed: int = 0
    lam: float = 0.01
    bias: bool = False
    rf_dim: int = 5000
    rf_sigma: float | None = None
    gamma: float = 0.1
    means_per_class: int = 1
    client_lr: float = 0.1
    weight_decay: float = 4e-5
    batch_size: int = 50
    local_epochs: int = 5
    server_lr: float | None = None
    server_momentum: float = 0.9
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_tau: float = 1e-3
    prox_mu: float | None = None
    temperature: float = 1.0
    init: str = "random"
    init_rounds: int | None = None
    probe_ridge: bool = False
    checkpoint_every: int | None = 500
    head: str = "linear"
    sphere_dim: int | None = None
    sphere_loss: str = "mse"
    finetune: str | None = None
    base: str = "fedavg"
    entk_dim: int = 100_000
    entk_fp16: bool = False
    entk_chunk: int = 32
    tct_rounds: int = 100
    tct_local_steps: int = 500
    tct_lr: float = 5e-5
    tct_solver: str = "scaffold"
    tct_projection: int | None = None
    tct_lam: float = 0.0
    backbone: str = "mobilenet_v2"
    weights: str = "imagenet"
    image_size: int = 224
    backbone_macs: float | None = None
    """F_φ, the backbone's forward multiply-adds per sample (papers' accounting); None: from the feature cache if recorded."""
    num_trainers: int | None = None
    cpus_per_trainer: float = 1.0
    num_shards: int | None = None
    cpus_per_shard: float = 1.0
    quiet: bool = False
    server_optimizer: str | None = None
    options: dict = field(default_factory=dict)
    """A plugin's own options by name (``--option key=value``); built-in options are the fields above."""

    @property
    def trains(self) -> bool:
        """A gradient-based method (or TCT, whose stage 1 is one) rather than a closed-form one."""
        return self.method in ALGORITHMS or self.method == TCT

    @property
    def algorithm(self) -> Algorithm:
        """The gradient algorithm that trains: ``--method``, or TCT's stage-1 ``--base``."""
        return ALGORITHMS[self.base if self.method == TCT else self.method]

    def plugins(self) -> list[type]:
        """The run's classes named by ``module:Class`` or ``file.py:Class``: their options go in ``options``."""
        named = [(self.method, method_class)]
        if self.server_optimizer is not None:
            named.append((self.server_optimizer, server_optimizer_class))
        return [load(spec) for spec, load in named if is_plugin(spec)]

    def server_optimizer_class(self) -> type[ServerOptimizer]:
        """``--server-optimizer``, else the method's own (FedAdam for fedadam, ...)."""
        return server_optimizer_class(self.server_optimizer or self.algorithm.server)

    def validate(self) -> "RunConfig":
        check_numeric_options({f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}, command_line)
        if not is_plugin(self.method) and self.method not in METHODS and not self.trains:
            raise FedrayError(f"unknown method {self.method!r}; known: {', '.join([*METHODS, *ALGORITHMS, TCT])}, "
                              f"or your own closed-form method as module:Class or path/to/file.py:Class")
        if self.server_optimizer is not None and not self.trains:
            raise FedrayError(f"--server-optimizer applies to gradient methods, not {self.method}")
        self._validate_options()
        if self.sampling not in (None, "without", "with"):
            raise FedrayError(f"--sampling must be 'without' or 'with', got {self.sampling!r}")
        if self.clients_per_round is not None and self.participation is not None:
            raise FedrayError("give --clients-per-round or --participation, not both")
        if self.participation is not None and not 0 < self.participation <= 1:
            raise FedrayError(f"--participation must be in (0, 1], got {self.participation}")
        if self.eval_every < 1:
            raise FedrayError(f"--eval-every must be ≥ 1, got {self.eval_every}")
        if self.rounds is not None and self.rounds < 1:
            raise FedrayError(f"--rounds must be ≥ 1, got {self.rounds}")
        if self.cpus_per_shard <= 0:
            raise FedrayError(f"--cpus-per-shard must be > 0, got {self.cpus_per_shard}")
        if self.init not in INITS:
            raise FedrayError(f"--init must be one of {', '.join(INITS)}, got {self.init!r}")
        positive = {"client_lr": self.client_lr, "batch_size": self.batch_size, "local_epochs": self.local_epochs,
                    "temperature": self.temperature, "server_lr": self.server_lr, "init_rounds": self.init_rounds,
                    "checkpoint_every": self.checkpoint_every, "image_size": self.image_size,
                    "num_trainers": self.num_trainers, "cpus_per_trainer": self.cpus_per_trainer,
                    "sphere_dim": self.sphere_dim, "entk_dim": self.entk_dim, "entk_chunk": self.entk_chunk,
                    "tct_rounds": self.tct_rounds, "tct_local_steps": self.tct_local_steps, "tct_lr": self.tct_lr,
                    "tct_projection": self.tct_projection, "rf_sigma": self.rf_sigma,
                    "backbone_macs": self.backbone_macs}
        for name, value in positive.items():
            if value is not None and value <= 0:
                raise FedrayError(f"{command_line(name)} must be > 0, got {value}")
        if self.finetune is not None and (self.finetune not in FINETUNE_MODES or not self.trains):
            raise FedrayError(f"--finetune takes {', '.join(FINETUNE_MODES)} with a gradient method, got {self.finetune!r} with {self.method}")
        if self.head not in ("linear", "sphere"):
            raise FedrayError(f"--head must be linear or sphere, got {self.head!r}")
        if self.head == "sphere":
            self._validate_sphere()
        if self.sphere_loss not in ("mse", "ce"):
            raise FedrayError(f"--sphere-loss must be mse or ce, got {self.sphere_loss!r}")
        if self.prox_mu is not None and not self.algorithm.proximal:
            raise FedrayError(f"--prox-mu applies to fedprox only, not {self.method}")
        if self.method == TCT:
            self._validate_tct()
        return self

    def _validate_options(self) -> None:
        """Every ``options`` key is an option of one of the run's plugins, and of its type."""
        if not isinstance(self.options, dict):
            raise FedrayError(f"options must be a mapping of option: value, got {self.options!r}")
        clashing = sorted(set(self.options) & (FIELDS | RESERVED))
        if clashing:
            key = clashing[0]
            raise FedrayError(f"--option {key}: {key} is a run option: use {command_line(key)}" if key in FIELDS
                              else f"--option {key}: {key} is a metrics column, not an option name")
        plugins = self.plugins()
        declared = {name: option for cls in plugins for name, option in options_of(cls).items()}
        unknown = sorted(set(self.options) - set(declared))
        if unknown:
            known = ", ".join(declared) or "none"
            raise FedrayError(f"unknown option(s) {', '.join(unknown)} (--option); this run's plugins take: {known}")
        self.options = {key: declared[key].coerce(value, "--option") for key, value in self.options.items()}

    def _validate_sphere(self) -> None:
        if self.method not in ALGORITHMS or self.init != "random":
            raise FedrayError("--head sphere (SphereFed) trains with a gradient method from --init random")
        if self.finetune not in (None, "ftfeat"):
            raise FedrayError("SphereFed's classifier is fixed: on images it fine-tunes the backbone only (--finetune ftfeat)")

    def _validate_tct(self) -> None:
        if self.base not in ALGORITHMS:
            raise FedrayError(f"--base (TCT's stage 1) must be one of {', '.join(ALGORITHMS)}, got {self.base!r}")
        if self.head != "linear":
            raise FedrayError("TCT fine-tunes a linear head on images (stage 1); --head sphere does not apply")
        if self.tct_solver not in TCT_SOLVERS:
            raise FedrayError(f"--tct-solver must be one of {', '.join(TCT_SOLVERS)}, got {self.tct_solver!r}")
        if self.tct_lam < 0:
            raise FedrayError(f"--tct-lam must be ≥ 0, got {self.tct_lam}")
        width = self.tct_projection or self.entk_dim
        if self.tct_solver != "scaffold" and width > CLOSED_FORM_MAX_DIM:
            raise FedrayError(f"the closed-form stage 2 solves a {width} × {width} system: give --tct-projection D "
                              f"≤ {CLOSED_FORM_MAX_DIM} (or --entk-dim ≤ {CLOSED_FORM_MAX_DIM})")

    def resolved(self) -> "RunConfig":
        """Method-dependent defaults filled in: sampling (with replacement for training), server lr, FedProx μ."""
        values = {"sampling": self.sampling or ("with" if self.trains else "without"), "method": canonical(self.method)}
        if self.method == TCT:
            values["finetune"] = self.finetune or "ft"
        if self.trains:
            algorithm = self.algorithm
            values["server_optimizer"] = canonical(self.server_optimizer or algorithm.server)
            values["server_lr"] = self.server_lr or self.server_optimizer_class().default_lr
            if algorithm.proximal:
                values["prox_mu"] = DEFAULT_PROX_MU if self.prox_mu is None else self.prox_mu
        defaults = {name: option.default for cls in self.plugins() for name, option in options_of(cls).items()
                    if name not in FIELDS}
        values["options"] = {**defaults, **self.options}
        return replace(self, **values)

    def per_round(self, num_clients: int) -> int:
        """κ from --clients-per-round, --participation, or 10 by default."""
        if self.participation is not None:
            return max(1, math.ceil(self.participation * num_clients))
        return 10 if self.clients_per_round is None else self.clients_per_round

    def to_dict(self) -> dict:
        return asdict(self)


def server_optimizer_class(spec: str) -> type[ServerOptimizer]:
    return load_class(spec, ServerOptimizer, SERVER_OPTIMIZERS, "server optimizer")


FIELDS = {f.name for f in fields(RunConfig)}
FIELD_TYPES = {f.name: str(f.type) for f in fields(RunConfig)}
RESERVED = {f.name for f in fields(EvalPoint)} | {"ridge_probe_accuracy", "trial_id", "sweep"}
"""Metrics columns: no option may take their names, since options become columns too."""
PER_ROUND = ("clients_per_round", "participation")
TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def typed_value(path: Path, key: str, value: object) -> object:
    """A file value as its option's type (YAML reads ``1e-3`` as a string), finite, a seed ≥ 0; null only where the option allows it."""
    typed = _as_option_type(path, key, value)
    check_numeric_option(f"{path}: option {key}", key, typed)
    return typed


def _as_option_type(path: Path, key: str, value: object) -> object:
    kind, _, optional = FIELD_TYPES[key].partition(" | ")
    if value is None:
        if optional:
            return None
    elif kind == "float" and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    elif kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif kind == "bool" and isinstance(value, bool) or kind == "str" and isinstance(value, str):
        return value
    raise FedrayError(f"{path}: option {key} must be {TYPE_NAMES[kind]}, got {value!r}")


def read_yaml_mapping(path: Path, kind: str, shape: str) -> dict:
    """The mapping in the YAML file ``path``, or a one-line error naming the file (``kind``: what it should be)."""
    if not path.is_file():
        raise FedrayError(f"{path}: no such {kind}")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise FedrayError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise FedrayError(f"{path}: a {kind} is a mapping of {shape}")
    return values


def load_config_file(path: str | Path) -> dict:
    path = Path(path)
    values = read_yaml_mapping(path, "config file", "option: value")
    values = {str(key).replace("-", "_"): value for key, value in values.items()}
    unknown = sorted(set(values) - FIELDS)
    if unknown:
        raise FedrayError(f"{path}: unknown option(s) {', '.join(unknown)}")
    return {key: options_mapping(path, value) if key == "options" else typed_value(path, key, value)
            for key, value in values.items()}


def options_mapping(path: Path, value: object) -> dict:
    """A file's ``options:`` (a plugin's options), a mapping of names to values; their types are checked with the run."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise FedrayError(f"{path}: options must be a mapping of option: value, got {value!r}")
    return dict(value)


def resolve(file_values: dict, cli_values: dict) -> RunConfig:
    """Defaults, overridden by the file, overridden by options given on the command line.

    κ and the participation rate are one choice: either on the command line replaces both from the file.
    """
    given = {k: v for k, v in cli_values.items() if v is not None}
    if given.keys() & set(PER_ROUND):
        file_values = {k: v for k, v in file_values.items() if k not in PER_ROUND}
    merged = {**file_values, **given, "options": {**file_values.get("options", {}), **given.get("options", {})}}
    try:
        return RunConfig(**merged).validate().resolved()
    except TypeError as error:
        raise FedrayError(str(error)) from None
