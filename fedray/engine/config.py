"""A run's configuration: defaults ← YAML file ← command line, validated and resolved in one place (files and keywords
are read by :mod:`fedray.engine.config_files`)."""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Collection, Sequence
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, make_dataclass, replace
from typing import Any, TypeVar

from fedray.data.registry import OPTION_TYPES as DATASET_OPTIONS
from fedray.core.errors import FedrayError
from fedray.methods.sphere import SphereHead
from fedray.methods.tct_stage2 import TctStage2Options
from fedray.methods.training.client_optimizer import ClientOptimizer
from fedray.methods.training.modes import FINETUNE_MODES, INITS, FineTuning
from fedray.methods.training.server import SERVER_OPTIMIZERS, ServerOptimizer
from fedray.methods import METHODS, method_class
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.postprocessor import BUILT_IN as POSTPROCESSORS, postprocessor_class
from fedray.methods.training_algorithms import (BUILT_IN as ALGORITHMS, DEFAULT_PROX_MU, algorithm_class,
                                               own_server_optimizer)
from fedray.core.numeric_options import check_numeric_options, check_positive, command_line
from fedray.core.options import Option, build, option_from_hint, options_of
from fedray.core.plugins import canonical, display_name, is_plugin, load_class, names_subclass
from fedray.engine.plugin_options import Owner, checked_options, declarers, split_key, values_for
from fedray.engine.plugin_options import defaults as plugin_defaults
from fedray.core.results import EvalPoint


TCT = "tct"
SECAGG = "secagg"
"""The postprocessor --secure-aggregation adds."""
DP, DP_FEDAVG = "dp", "dp-fedavg"
"""The postprocessors the DP flags add: sample-level DP on a closed-form method's statistics, DP-FedAvg on a training
method's updates."""
DP_OPTIONS = ("clip_norm", "dp_unit", "dp_epsilon", "dp_delta", "dp_noise", "dp_placement")
"""The DP flags (``--clip-norm``, ``--dp-*``): run options that are the options of the run's DP postprocessor, by the
names its constructor declares."""
DP_REPORTED = ("dp_epsilon", "dp_delta")
"""What a DP postprocessor reports in every row (the ε spent, at most the ε asked, and δ): in metrics.parquet these
columns hold the report, not the budget asked (config.yaml keeps that)."""
DP_UNITS = ("sample", "client")
DP_PLACEMENTS = ("central", "distributed")


GENERAL, SAMPLING, UPLOADS, TRAINING, SPHERE, IMAGES, TCT_GROUP, RESOURCES = (
    None, "sampling", "uploads", "training", "spherefed", "fine-tuning", "tct", "resources")
GROUPS = {
    SAMPLING: "client sampling",
    UPLOADS: "every client's upload, on its way to the server",
    TRAINING: f"gradient methods ({', '.join(ALGORITHMS)})",
    SPHERE: "SphereFed (--head sphere): a projection onto the sphere before a fixed classifier, FFC after",
    IMAGES: "fine-tuning on images (a dataset with images: hsu:CSV?images=ROOT, imagefolder:ROOT)",
    TCT_GROUP: "TCT (--method tct): fine-tune on images, then a linear model on eNTK features",
    RESOURCES: "resources (Ray)",
}
"""The run's own options' groups in ``fedray run --help``, by the stage they belong to (``None``: every run's); the
options of the built-in methods, algorithms and server optimizers are grouped by their owners (:func:`owned`)."""
APPLIES_TO = {UPLOADS: "--postprocessor", TRAINING: "gradient methods", SPHERE: "SphereFed (--head sphere)",
              IMAGES: "fine-tuning on images (--finetune, or --method tct)", TCT_GROUP: "--method tct"}
"""What the options of a group that not every run has apply to, for the refusal of one given to another run."""

SAMPLINGS = ("without", "with", "poisson")
HEADS = ("linear", "sphere")
PLAIN_AVERAGING = "fedavg"
"""The server optimizer of fedavg, fedprox and scaffold: the one ``--server-optimizer`` may replace."""
DEFAULT_PER_ROUND = 10
"""κ when neither --clients-per-round nor --participation is given."""
Component = TypeVar("Component")


def option(default: object, help: str, group: str | None, *, unset: str | None = None,
           choices: Sequence[str] | None = None, metavar: str | None = None) -> Any:
    """A run option: its default, its help and group in ``fedray run --help`` (``unset``: what a ``None`` default means).

    The command line is generated from these (:mod:`fedray.app.cli`), so each default is written here only.
    """
    return field(default=default, metadata={"help": help, "group": group, "unset": unset, "choices": choices,
                                            "metavar": metavar})


BUILT_IN_OWNERS: tuple[tuple[str, dict[str, type]], ...] = (
    ("closed-form methods", dict(METHODS)),
    ("training algorithms", {name: cls for name, cls in ALGORITHMS.items() if isinstance(cls, type)}),
    ("server optimizers", dict(SERVER_OPTIMIZERS)),
)
"""The built-in classes that own run options, by kind and name: an option one of them declares is theirs."""
BUILT_IN_OPTIONS = tuple((kind, {name: options_of(cls) for name, cls in classes.items()}) for kind, classes in BUILT_IN_OWNERS)
"""Each built-in class's options (:func:`~fedray.core.options.options_of`), read once."""
COMPONENTS: tuple[tuple[str, str, type], ...] = (
    (TRAINING, "local SGD", ClientOptimizer),
    (SPHERE, "SphereFed's head", SphereHead),
    (IMAGES, "fine-tuning on images", FineTuning),
    (TCT_GROUP, "TCT's stage 2", TctStage2Options),
)
"""The built-in components a run has when their option group applies to it (one class each: the clients' local SGD
when it trains, ...), with their names: their options are run options in that group (:func:`owned`)."""


def owners_of(name: str) -> tuple[str, list[str], list[Option]]:
    """The kind and names of the built-in classes that declare the option ``name``, and their declarations."""
    for kind, declarations in BUILT_IN_OPTIONS:
        declared = {owner: options[name] for owner, options in declarations.items() if name in options}
        if declared:
            return kind, list(declared), list(declared.values())
    raise KeyError(f"no built-in class declares the option {name!r}")


@functools.cache
def shipped_options() -> dict[str, tuple[tuple[str, ...], Option]]:
    """The options of the built-in training algorithms shipped as plugins (FedDyn's ``alpha``), with their owners' names.

    Like a plugin's, they live in ``options`` (and are metrics columns by that name), and like the other built-ins'
    they are also flags (``--alpha``), YAML keys and sweep keys of their own. Read from the classes when first asked
    for, as :func:`~fedray.methods.training_algorithms.algorithm_class` loads them.
    """
    found: dict[str, tuple[tuple[str, ...], Option]] = {}
    for name, spec in ALGORITHMS.items():
        if isinstance(spec, str):
            for key, declared in options_of(algorithm_class(name)).items():
                found[key] = ((*found.get(key, ((), declared))[0], name), declared)
    return found


def owned(name: str, *, unset: str | None = None, help: str | None = None) -> Any:
    """A run option that belongs to the built-in classes declaring ``name``: their default (``None`` when ``unset``
    says what the owner does without it; a ``None`` default needs it), their help (unless ``help``), and their names as
    its group in ``fedray run --help``; or to a built-in component (:data:`COMPONENTS`): its declaration, in its group.

    So an owner's option is declared once, in its class; ``--option name=value`` sets a class's too (:func:`resolve`).
    """
    component = next(((group, label, cls) for group, label, cls in COMPONENTS if name in options_of(cls)), None)
    if component is not None:
        group, label, cls = component
        declared = options_of(cls)[name]
        if declared.default is None and declared.unset is None:
            raise TypeError(f"{cls.__name__}.{name}: say what its None default means (Unset)")
        return field(default=declared.default, metadata={
            "help": help or declared.help, "group": group, "unset": declared.unset, "choices": declared.choices,
            "metavar": declared.metavar, "owners": (label,), "component": cls})
    kind, names, declarations = owners_of(name)
    defaults = {declaration.default for declaration in declarations}
    if unset is None and (len(defaults) != 1 or None in defaults):
        raise TypeError(f"the owners of {name} ({', '.join(names)}): say what its unset value means")
    group = f"{', '.join(names)} ({kind if len(names) > 1 else kind[:-1]})"
    metadata = {"help": help or declarations[0].help, "group": group, "unset": unset,
                "choices": declarations[0].choices, "metavar": declarations[0].metavar, "owners": tuple(names)}
    return field(default=None if unset is not None else declarations[0].default, metadata=metadata)


@dataclass
class RunLevel:
    """The run's own options, as declared: data, sampling, seed, evaluation, resources, output, which classes run.

    :class:`RunConfig` holds them with the built-in classes' and components' options placed among them
    (:data:`PLACED_AFTER`), and :class:`RunConfigBehaviour`'s methods.
    """

    method: str = option("fed3r", f"{', '.join(sorted([*METHODS, *ALGORITHMS, TCT]))}, or your own closed-form "
                         "method or training algorithm as module:Class or path/to/file.py:Class (see fedray methods)",
                         GENERAL, metavar="METHOD")
    dataset: str = option("synthetic:inat-user-120k",
                          "synthetic:NAME, parquet:PATH, features:CACHE, hsu:CSV, imagefolder:ROOT or your own "
                          "FILE.py:FUNCTION, with ?options", GENERAL)
    out: str = option("results/run", "output folder", GENERAL)
    clients_per_round: int | None = option(None, "κ clients per round", SAMPLING, unset=str(DEFAULT_PER_ROUND))
    participation: float | None = option(None, "fraction of clients per round, instead of κ", SAMPLING,
                                         unset="κ clients per round")
    sampling: str | None = option(None, "client sampling across rounds", SAMPLING, choices=SAMPLINGS,
                                  unset="without for closed-form, with for gradient methods")
    rounds: int | None = option(None, "stop after this many rounds; gradient methods run exactly this many", SAMPLING,
                                unset="until every client was seen")
    eval_every: int = option(100, "evaluate every R rounds and at the end", GENERAL)
    seed: int = option(0, "seed of every random choice of the run", GENERAL)
    init: str = option("random", "head initialization: random, or a closed-form stage first", TRAINING, choices=INITS)
    init_rounds: int | None = option(None, "round budget of the closed-form stage", TRAINING,
                                     unset="until every client was seen")
    probe_ridge: bool = option(False, "after training, report Fed3R's accuracy on the features", TRAINING)
    calibrate: str | None = option(None, "after training, a closed-form method (a built-in or your own) on the features "
                                   "at the trained parameters, every client once: its classifier becomes the run's "
                                   "(--init the other way round; SphereFed's FFC is --head sphere's own)", TRAINING,
                                   unset="none", metavar="METHOD")
    checkpoint_every: int | None = option(500, "write OUT/checkpoint.pt every N rounds", TRAINING)
    head: str = option("linear", "what the gradient methods train on the features: a softmax head, or SphereFed's "
                       "projection before a fixed classifier", TRAINING, choices=HEADS)
    finetune: str | None = option(None, "ft: backbone and head, ftlp: head only, ftfeat: backbone only", IMAGES,
                                  choices=FINETUNE_MODES, unset="linear probing on features (ft with --method tct)")
    base: str = option("fedavg", "stage-1 algorithm, run for --rounds rounds", TCT_GROUP, choices=tuple(sorted(ALGORITHMS)))
    backbone_macs: float | None = option(None, "the backbone's forward multiply-adds per sample, F_φ, for "
                                         "macs_client_avg_fed3r (the papers' accounting)", GENERAL,
                                         unset="from the feature cache's manifest; MobileNetV2: 332.9e6 in Fed3R's Table 5")
    num_trainers: int | None = option(None, "trainer actors", RESOURCES, unset="one per GPU, else CPUs / --cpus-per-trainer")
    cpus_per_trainer: float = option(1.0, "CPUs each trainer requests", RESOURCES)
    num_shards: int | None = option(None, "shard actors", RESOURCES, unset="cluster CPUs / --cpus-per-shard")
    cpus_per_shard: float = option(1.0, "CPUs each shard actor requests", RESOURCES)
    client_state_memory: float | None = option(None, "GB of clients' states (SCAFFOLD's, FedDyn's) each shard or "
                                               "trainer keeps in memory; the least recently used beyond it spill to "
                                               "its node's disk",
                                               TRAINING, unset="1/8 of the node's memory, shared by the "
                                               "actors that fill its CPUs", metavar="GB")
    quiet: bool = option(False, "no progress bar", GENERAL)
    server_optimizer: str | None = option(None, f"{', '.join(SERVER_OPTIMIZERS)}, or your own as module:Class or "
                                          "path/to/file.py:Class", TRAINING, unset="the method's own", metavar="OPTIMIZER")
    postprocessor: str | None = option(None, "each upload through these in order (clipping, noise, quantization...): "
                                       f"{', '.join(POSTPROCESSORS) or 'no built-in yet'}, or your own fedray.Postprocessor "
                                       "subclasses as FILE.py:Class or module:Class, several separated by commas",
                                       UPLOADS, unset="none", metavar="NAME[,NAME...]")
    clip_norm: float | None = option(None, "differential privacy (docs/privacy.md): each sample's features clipped to "
                                     "norm ≤ R (a training method: each client's update). Any --clip-norm or --dp-* adds "
                                     f"--postprocessor {DP} ({DP_FEDAVG} for a training method) after yours and before "
                                     f"{SECAGG}, with these as its options", UPLOADS, unset="no DP", metavar="R")
    dp_unit: str | None = option(None, "what DP protects: one sample, or all of one client's data", UPLOADS,
                                 choices=DP_UNITS, unset="the DP postprocessor's own, sample for dp")
    dp_epsilon: float | None = option(None, "DP budget ε at --dp-delta: the noise is calibrated to it (or give "
                                      "--dp-noise); the rows' dp_epsilon is the ε spent", UPLOADS,
                                      unset="none: give --dp-noise", metavar="EPSILON")
    dp_delta: float | None = option(None, "δ of the (ε, δ) guarantee, below 1/samples (e.g. 1e-5); required with DP",
                                    UPLOADS, unset="none", metavar="DELTA")
    dp_noise: float | None = option(None, "DP noise multiplier σ (the noise's std is σ × the sensitivity), ε computed "
                                    "(with --dp-epsilon: σ is used, and must meet it); 0: no noise, ε = ∞", UPLOADS,
                                    unset="calibrated to --dp-epsilon (config.yaml and the rows record it)",
                                    metavar="SIGMA")
    dp_placement: str | None = option(None, "who adds the DP noise: the server, to each aggregate, or each client its "
                                      "share σ/√κ", UPLOADS, choices=DP_PLACEMENTS,
                                      unset="the DP postprocessor's own, central for dp")
    secure_aggregation: bool = option(False, f"uploads summed by secure aggregation (SecAgg, SecAgg+ with --option "
                                      f"secagg_neighbours=k), simulated exactly: --postprocessor {SECAGG} added last; "
                                      f"its options secagg_clip (required), secagg_bits, secagg_value_bits, "
                                      f"secagg_dropout, secagg_threshold as --option key=value", UPLOADS)
    options: dict = field(default_factory=dict)
    """A plugin's own options by name (``--option key=value``); built-in options are :class:`RunConfig`'s fields."""


class RunConfigBehaviour:
    """What a run's configuration does: validate and resolve itself, say which of its options apply and are columns.
    The fields are :class:`RunConfig`'s."""

    @property
    def trains(self) -> bool:
        """A training algorithm (or TCT, whose stage 1 is one) rather than a closed-form method."""
        return self.method in ALGORITHMS or self.method == TCT or (is_plugin(self.method) and _is_algorithm(self.method))

    @property
    def training_algorithm(self) -> str:
        """The training algorithm that trains: ``--method``, or TCT's stage-1 ``--base``."""
        return self.base if self.method == TCT else self.method

    def algorithm_class(self) -> type[FederatedAlgorithm]:
        return algorithm_class(self.training_algorithm)

    @property
    def own_server_optimizer(self) -> str:
        """The training algorithm's own server optimizer (fedadam's FedAdam, ...), which --server-optimizer replaces."""
        return own_server_optimizer(self.training_algorithm)

    def plugins(self) -> list[Owner]:
        """The run's classes named by ``module:Class`` or ``file.py:Class`` (and the built-in training algorithms
        written as plugins), each once, with the flag that names it: their options go in ``options``."""
        named = [(self.method, "--method", algorithm_class if self.trains and self.method != TCT else method_class)]
        if self.server_optimizer is not None:
            named.append((self.server_optimizer, "--server-optimizer", server_optimizer_class))
        if self.calibrate is not None:
            named.append((self.calibrate, "--calibrate", method_class))
        plugins = [Owner(load(spec), flag) for spec, flag, load in named if is_plugin(spec)]
        plugins += [Owner(postprocessor_class(spec), "--postprocessor") for spec in self.postprocessor_specs()]
        if isinstance(ALGORITHMS.get(self.training_algorithm), str) and self.trains:
            plugins.append(Owner(self.algorithm_class(), "--base" if self.method == TCT else "--method",
                                 self.training_algorithm))
        unique: dict[type, Owner] = {}
        for owner in plugins:  # a postprocessor given twice has its options once
            unique.setdefault(owner.cls, owner)
        return list(unique.values())

    def postprocessor_specs(self) -> list[str]:
        """``--postprocessor``'s classes, in order; with a DP flag (:meth:`dp_options`) the DP postprocessor
        (:meth:`dp_postprocessor`) after them and before ``secagg``, unless one of them takes DP options already (``dp``
        given by name, or your own); and ``secagg`` last with ``--secure-aggregation`` (once)."""
        specs = [] if self.postprocessor is None else [spec.strip() for spec in self.postprocessor.split(",") if spec.strip()]
        if self.dp_options() and not any(set(DP_OPTIONS) & options_of(postprocessor_class(spec)).keys() for spec in specs):
            specs.insert(specs.index(SECAGG) if SECAGG in specs else len(specs), self.dp_postprocessor())
        return specs + [SECAGG] if self.secure_aggregation and SECAGG not in specs else specs

    def dp_options(self) -> dict[str, object]:
        """The DP flags set (:data:`DP_OPTIONS` that are not None)."""
        return {name: getattr(self, name) for name in DP_OPTIONS if getattr(self, name) is not None}

    def dp_postprocessor(self) -> str:
        """The postprocessor a DP flag adds: ``dp-fedavg`` when the run trains, else ``dp``."""
        return DP_FEDAVG if self.trains else DP

    def _dp_defaults(self) -> dict[str, object]:
        """The DP options left unset, at the default of the run's postprocessor that declares them (dp's central and
        sample), so that config.yaml and the metrics columns say what ran."""
        unset = {name for name in DP_OPTIONS if getattr(self, name) is None}
        found: dict[str, object] = {}
        for spec in self.postprocessor_specs():
            for name, declared in options_of(postprocessor_class(spec)).items():
                if name in unset:
                    found.setdefault(name, declared.default)
        return found

    def server_optimizer_class(self) -> type[ServerOptimizer]:
        """``--server-optimizer``, else the method's own (FedAdam for fedadam, ...)."""
        return server_optimizer_class(self.server_optimizer or self.own_server_optimizer)

    def _validate_poisson(self) -> None:
        """Poisson sampling is for training on features: a closed form uploads each client's statistics once (its
        sampling only orders them); TCT's stage 2 and fine-tuning on images are not checked with its empty rounds."""
        if not self.trains or self.init != "random":
            stage = f"--init {self.init}" if self.trains else f"--method {self.method}"
            raise FedrayError(f"--sampling poisson applies to training rounds, not to {stage}'s closed form (each "
                              f"client uploads once there): use --sampling without or with")
        if self.method == TCT or self.finetune is not None:
            raise FedrayError(f"--sampling poisson is not supported with "
                              f"{'--method tct' if self.method == TCT else '--finetune'} yet: use --sampling with")

    def _default_sampling(self) -> str:
        """``--sampling`` when none is given: without for a closed form; with for training, or a postprocessor's
        :attr:`~fedray.Postprocessor.default_sampling` (DP-FedAvg's poisson) where Poisson sampling applies."""
        if not self.trains:
            return "without"
        wanted = {postprocessor_class(spec).default_sampling for spec in self.postprocessor_specs()}
        try:
            self._validate_poisson()
        except FedrayError:
            return "with"
        return "poisson" if "poisson" in wanted else "with"

    def validate(self, given: Collection[str] = (), drop_unused: bool = False) -> "RunConfig":
        """This configuration, checked: a bad or contradictory value is refused in one line, and so is an option that
        does not apply to the run, set to other than its default or named in ``given`` (the command line's flags: a
        config.yaml holds every option). ``drop_unused`` (a sweep's trials, whose options are the sweep's) resets the
        options that do not apply to this run to their defaults instead of refusing them."""
        check_numeric_options({f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}, command_line)
        if not is_plugin(self.method) and self.method not in METHODS and not self.trains:
            raise FedrayError(f"unknown method {self.method!r}; known: {', '.join([*METHODS, *ALGORITHMS, TCT])}, "
                              f"or your own closed-form method as module:Class or path/to/file.py:Class")
        if self.server_optimizer is not None and not self.trains:
            raise FedrayError(f"--server-optimizer applies to gradient methods, not {self.method}")
        self._validate_server_optimizer()
        self._validate_options()
        if self.sampling not in (None, *SAMPLINGS):
            raise FedrayError(f"--sampling must be 'without', 'with' or 'poisson', got {self.sampling!r}")
        if self.sampling == "poisson":
            self._validate_poisson()
        if self.clients_per_round is not None and self.participation is not None:
            raise FedrayError("give --clients-per-round or --participation, not both")
        if self.participation is not None and not 0 < self.participation <= 1:
            raise FedrayError(f"--participation must be in (0, 1], got {self.participation}")
        if self.eval_every < 1:
            raise FedrayError(f"--eval-every must be ≥ 1, got {self.eval_every}")
        if self.rounds is not None and self.rounds < 1:
            raise FedrayError(f"--rounds must be ≥ 1, got {self.rounds}")
        if self.num_shards is not None and self.num_shards < 1:  # the shard pool says so too, once Ray is up
            raise FedrayError(f"--num-shards must be ≥ 1, got {self.num_shards}")
        if self.cpus_per_shard <= 0:
            raise FedrayError(f"--cpus-per-shard must be > 0, got {self.cpus_per_shard}")
        if self.client_state_memory is not None and not self.client_state_memory >= 0:
            raise FedrayError(f"--client-state-memory must be ≥ 0 (GB), got {self.client_state_memory}")
        if self.init not in INITS:
            raise FedrayError(f"--init must be one of {', '.join(INITS)}, got {self.init!r}")
        check_positive({"server_lr": self.server_lr, "init_rounds": self.init_rounds,
                        "checkpoint_every": self.checkpoint_every, "num_trainers": self.num_trainers,
                        "cpus_per_trainer": self.cpus_per_trainer, "rf_sigma": self.rf_sigma,
                        "backbone_macs": self.backbone_macs})
        for _, _, cls in COMPONENTS:  # each checks its own values, whether or not the run has it (refused below then)
            self.component(cls)
        if self.trains:
            self.component(ClientOptimizer).schedule(self.rounds)
        if self.finetune is not None and (self.finetune not in FINETUNE_MODES or not self.trains):
            raise FedrayError(f"--finetune takes {', '.join(FINETUNE_MODES)} with a gradient method, got {self.finetune!r} with {self.method}")
        self._validate_images()
        if self.head not in HEADS:
            raise FedrayError(f"--head must be linear or sphere, got {self.head!r}")
        if self.head == "sphere":
            self._validate_sphere()
        self._validate_dp()
        if self.method == TCT:
            self._validate_tct()
        if self.calibrate is not None:
            self._validate_calibrate()
        unused = self.unused_options(given)
        if unused and not drop_unused:
            raise FedrayError(self.not_used(unused[0]))
        return replace(self, **{name: RUN_DEFAULTS[name] for name in unused}) if unused else self

    def unused_options(self, given: Collection[str] = ()) -> list[str]:
        """The options set to other than their defaults, or named in ``given``, that do not apply to this run."""
        groups, taken = self.applicable_groups(), self._taken()
        return [spec.name for spec in fields(self) if spec.name != "options" and
                (spec.name in given or getattr(self, spec.name) != spec.default) and
                not self._applies(spec, groups, taken)]

    def applies(self, name: str) -> bool:
        """Whether the run option ``name`` applies to this run."""
        spec = next(spec for spec in fields(self) if spec.name == name)
        return self._applies(spec, self.applicable_groups(), self._taken())

    def not_used(self, name: str) -> str:
        """The one line refusing the run option ``name``, which does not apply to this run."""
        spec = next(spec for spec in fields(self) if spec.name == name)
        owned_by_class = "owners" in spec.metadata and "component" not in spec.metadata
        where = spec.metadata["group"] if owned_by_class else APPLIES_TO[spec.metadata["group"]]
        run = f"--method {self.method}"
        if self.trains and "owners" in spec.metadata and spec.metadata["owners"][0] in SERVER_OPTIMIZERS:
            run += f" with server optimizer {self.server_optimizer or self.own_server_optimizer}"
        return f"{command_line(name)} applies to {where}, not to this run ({run})"

    def _taken(self) -> set[str]:
        """The options the run's built-in and plugin classes take."""
        return {name for cls in self.classes() for name in options_of(cls)}

    @staticmethod
    def _applies(spec: Field, groups: set[str | None], taken: set[str]) -> bool:
        """Whether the option ``spec`` applies to a run of these option ``groups`` whose classes take ``taken``."""
        return spec.name in taken if "owners" in spec.metadata else spec.metadata.get("group") in groups

    def _validate_server_optimizer(self) -> None:
        """A method whose server is not plain averaging (fedavgm, fedadam...) is its server: another one contradicts it.

        fedavg, fedprox and scaffold average on the server, so ``--server-optimizer`` replaces their averaging.
        """
        if self.server_optimizer is None or not self.trains:
            return
        own = self.own_server_optimizer
        if own != PLAIN_AVERAGING and canonical(self.server_optimizer) != own:
            flag = f"--base {self.base}" if self.method == TCT else f"--method {self.method}"
            raise FedrayError(f"{flag} is its own server optimizer ({own}): --server-optimizer {self.server_optimizer} "
                              f"contradicts it; give --method fedavg (or fedprox, scaffold) with --server-optimizer "
                              f"{self.server_optimizer}")

    def _validate_dp(self) -> None:
        """Each DP flag given is an option of one of the run's postprocessors: none is dropped unseen. (Its value is
        the postprocessor's to check, when it is built.)"""
        given = self.dp_options()
        if not given:
            return
        specs = self.postprocessor_specs()
        declared = {name for spec in specs for name in options_of(postprocessor_class(spec))}
        missing = [name for name in given if name not in declared]
        if missing:
            raise FedrayError(f"{command_line(missing[0])}: no postprocessor of this run takes {missing[0]} "
                              f"(--postprocessor {','.join(specs)})")

    def _validate_options(self) -> None:
        """Every ``options`` key is an option of one of the run's plugins, and of its type; a per-owner key
        (``Owner.x``) is its owner's, and an option several plugins declare must be given per owner
        (:func:`~fedray.engine.plugin_options.checked_options`)."""
        if not isinstance(self.options, dict):
            raise FedrayError(f"options must be a mapping of option: value, got {self.options!r}")
        plain = {key for key in self.options if split_key(key)[0] is None}
        clashing = sorted({split_key(key)[1] for key in self.options} & (FIELDS | RESERVED))
        if clashing:
            key = clashing[0]
            raise FedrayError(f"--option {key}: {key} is a run option: use {command_line(key)}" if key in FIELDS
                              else f"--option {key}: {key} is a metrics column, not an option name")
        plugins = self.plugins()
        declared = declarers(plugins)
        unknown = sorted(plain - set(declared))
        if unknown:
            elsewhere = [f"; {key} is an option of {', '.join(shipped_options()[key][0])}, not of {self.training_algorithm}"
                         + (f" (the dataset's {key} is given in its spec: ?{key}=...)" if key in DATASET_OPTIONS else "")
                         for key in unknown if key in shipped_options()][:1]
            known = (f"; this run's plugins take: {', '.join(declared)}" if declared else
                     "; this run has no plugin options (its built-in classes' options: fedray run --help)")
            raise FedrayError(f"unknown option(s) {', '.join(unknown)} (--option){''.join(elsewhere)}{known}")
        self.options = checked_options(self.options, plugins)

    def _validate_images(self) -> None:
        """The options of a run on images apply to fine-tuning (and TCT) only; its backbone is one fedray knows."""
        if self.finetune is None and self.method != TCT:
            given = [name for name in IMAGE_OPTIONS if getattr(self, name) != RUN_DEFAULTS[name]]
            if given:
                raise FedrayError(f"{command_line(given[0])} applies to fine-tuning on images (--finetune, or --method "
                                  f"tct), not to {self.method} on the dataset's features")
            return
        self.component(FineTuning).check_backbone()

    def _validate_sphere(self) -> None:
        if not self.trains or self.method == TCT or self.init != "random":
            raise FedrayError("--head sphere (SphereFed) trains with a gradient method from --init random")
        if self.finetune not in (None, "ftfeat"):
            raise FedrayError("SphereFed's classifier is fixed: on images it fine-tunes the backbone only (--finetune ftfeat)")

    def _validate_calibrate(self) -> None:
        if self.head == "sphere":
            raise FedrayError("--calibrate with --head sphere: SphereFed calibrates with its own FFC after training")
        if self.method == TCT:
            raise FedrayError("--calibrate with --method tct: TCT's stage 2 replaces the head after training")
        if self.trains:
            method_class(self.calibrate)  # a closed-form method: a built-in, or a plugin that loads as one

    def _validate_tct(self) -> None:
        if self.base not in ALGORITHMS and not (is_plugin(self.base) and _is_algorithm(self.base)):
            raise FedrayError(f"--base (TCT's stage 1) must be a training algorithm ({', '.join(ALGORITHMS)} or your own "
                              f"as module:Class or path/to/file.py:Class), got {self.base!r}")
        if self.head != "linear":
            raise FedrayError("TCT fine-tunes a linear head on images (stage 1); --head sphere does not apply")
        self.component(TctStage2Options).check_fits(self.component(FineTuning).backbone)

    def resolved(self) -> "RunConfig":
        """Method-dependent defaults filled in: sampling (with replacement for training), server lr, FedProx μ."""
        values = {"sampling": self.sampling or self._default_sampling(), "method": canonical(self.method)}
        if self.postprocessor_specs():
            values["postprocessor"] = ",".join(canonical(spec) for spec in self.postprocessor_specs())
            values.update(self._dp_defaults())
        if self.method == TCT:
            values["finetune"] = self.finetune or "ft"
        if self.trains:
            values["server_optimizer"] = canonical(self.server_optimizer or self.own_server_optimizer)
            values["server_lr"] = self.server_lr or self.server_optimizer_class().default_lr
            if self.calibrate is not None:
                values["calibrate"] = canonical(self.calibrate)
            own = options_of(self.algorithm_class()).get("prox_mu")
            if own is not None:
                values["prox_mu"] = own.default if self.prox_mu is None else self.prox_mu
        defaults = {key: value for key, value in plugin_defaults(self.plugins()).items() if split_key(key)[1] not in FIELDS}
        values["options"] = {**defaults, **self.options}
        return replace(self, **values)

    def recording(self, resolved: dict[str, object]) -> "RunConfig":
        """This configuration with the options the postprocessors resolved before the run
        (:meth:`~fedray.Postprocessor.recorded`: a calibrated σ as ``dp_noise``, the accountant chosen), in its fields
        or ``options``: what config.yaml and every row record, and what re-running the record uses."""
        options = {name: value for name, value in resolved.items() if name not in FIELDS}
        return replace(self, **{name: value for name, value in resolved.items() if name in FIELDS},
                       options={**self.options, **options})

    def per_round(self, num_clients: int) -> int:
        """κ from --clients-per-round, --participation, or :data:`DEFAULT_PER_ROUND` by default."""
        if self.participation is not None:
            return max(1, math.ceil(self.participation * num_clients))
        return DEFAULT_PER_ROUND if self.clients_per_round is None else self.clients_per_round

    def to_dict(self) -> dict:
        return asdict(self)

    def option_values(self, cls: type) -> dict[str, object]:
        """What ``cls``'s options are set from: the run's fields (built-in options such as ``lam``) and its ``options``
        (a plugin's: the plain ones and its own per-owner ones); :func:`~fedray.core.options.build` takes from it the
        options the class declares."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"},
                **values_for(cls, self.options)}

    def closed_form_methods(self) -> list[str]:
        """The closed-form methods the run solves: its method, or a training run's ``--init`` stage, the ridge probe's
        fed3r (``--probe-ridge``) and SphereFed's FFC calibration (``--head sphere``)."""
        if not self.trains:
            return [self.method]
        names = [] if self.init == "random" else [self.init]
        if self.calibrate is not None:
            names.append(self.calibrate)
        if self.probe_ridge:
            names.append("fed3r")
        if self.head == "sphere":
            names.append("ffc")
        return names

    def applicable_groups(self) -> set[str | None]:
        """The option groups (the fields' ``group``) that apply to this run.

        Every run's options, its sampling and its resources always; ``--postprocessor`` when given; the training
        options when it trains; SphereFed's with ``--head sphere``; the image options when it fine-tunes
        (``--finetune``, TCT); TCT's with ``--method tct``. (The options of the run's classes are theirs:
        :meth:`classes`.)
        """
        groups = {GENERAL, SAMPLING, RESOURCES}
        if self.postprocessor_specs():
            groups.add(UPLOADS)
        if self.trains:
            groups.add(TRAINING)
        if self.head == "sphere":
            groups.add(SPHERE)
        if self.finetune is not None or self.method == TCT:
            groups.add(IMAGES)
        if self.method == TCT:
            groups.add(TCT_GROUP)
        return groups

    def classes(self) -> list[type]:
        """The classes the run builds whose options it sets: its closed-form methods, when it trains its training
        algorithm and server optimizer, and its :meth:`components`."""
        classes = [method_class(name) for name in self.closed_form_methods()]
        if self.trains:
            classes += [self.algorithm_class(), self.server_optimizer_class()]
        return classes + self.components()

    def components(self) -> list[type]:
        """The built-in components of this run: those of its option groups (:data:`COMPONENTS`)."""
        groups = self.applicable_groups()
        return [cls for group, _, cls in COMPONENTS if group in groups]

    def component(self, cls: type[Component]) -> Component:
        """The built-in component ``cls`` with this run's options (its constructor checks them)."""
        return build(cls, self.option_values(cls), cls.__name__)

    def metrics_columns(self) -> dict[str, object]:
        """The configuration's columns in metrics.parquet: the options that apply to the run, then the plugins' own.

        An option applies when its group does (:meth:`applicable_groups`); an option owned by the built-in classes
        (``lam``, ``gamma``, ``prox_mu``, ``server_momentum``, ...: :func:`owned`) when one of the run's
        :meth:`classes` takes it. A plugin is named by its class name (``method``: ``MyNCM``) with its spec beside it
        (``method_spec``: ``/home/me/my_ncm.py:MyNCM``), likewise ``server_optimizer``.
        config.yaml keeps every option, to re-run the run.
        """
        groups, taken, private = self.applicable_groups(), self._taken(), bool(self.dp_options())
        columns: dict[str, object] = {}
        for spec in fields(self):
            if spec.name in NOT_COLUMNS or not self._applies(spec, groups, taken) or \
                    spec.name in STAGE_COLUMNS and getattr(self, spec.name) is None or \
                    spec.name in DP_OPTIONS and not private:
                continue
            value = getattr(self, spec.name)
            if spec.name in PLUGIN_FIELDS and isinstance(value, str) and is_plugin(value):
                columns[spec.name], columns[f"{spec.name}_spec"] = display_name(value), value
            else:
                columns[spec.name] = value
        return {**columns, **self.options}


RUN_DEFAULT_NONE = {
    "rf_sigma": ("√d, about the distance between samples of unit-spread features; the Fed3R paper used 1000 on "
                 "MobileNetV2 features", None),
    "server_lr": ("the server optimizer's own: " +
                  ", ".join(f"{name} {cls.default_lr:g}" for name, cls in SERVER_OPTIMIZERS.items()),
                  "server learning rate η"),
    "prox_mu": (f"{DEFAULT_PROX_MU} with fedprox", None),
}
"""The built-in classes' options that a run leaves None until :meth:`RunConfigBehaviour.resolved` fills them for its
classes (their defaults differ by class, or the option is one class's), with what None means and the run's help where
it is not the owners'."""


PLACED_AFTER: dict[str, tuple[type, ...]] = {
    "seed": (*METHODS.values(), ClientOptimizer, *SERVER_OPTIMIZERS.values(),
             *(cls for cls in ALGORITHMS.values() if isinstance(cls, type))),
    "head": (SphereHead,),
    "base": (TctStage2Options, FineTuning),
}
"""The built-in classes and components whose options are run options, after the run option each group follows in
config.yaml, the metrics columns and ``fedray run --help``."""


def _owned_fields(classes: Sequence[type]) -> list[tuple[str, object, Any]]:
    """``(name, type, field)`` of every option of ``classes`` (:func:`owned`), each once."""
    made: dict[str, tuple[str, object, Any]] = {}
    for cls in classes:
        for name, declared in options_of(cls).items():
            if name not in made:
                unset, run_help = RUN_DEFAULT_NONE.get(name, (None, None))
                kind = declared.type | None if declared.optional or unset is not None else declared.type
                made[name] = (name, kind, owned(name, unset=unset, help=run_help))
    return list(made.values())


def _run_config_fields() -> list[tuple[str, object, Any]]:
    """:class:`RunLevel`'s fields with the built-in classes' and components' options placed among them."""
    hints = typing.get_type_hints(RunLevel)
    placed: list[tuple[str, object, Any]] = []
    for spec in fields(RunLevel):
        copied = field(default=spec.default, metadata=spec.metadata) if spec.default_factory is MISSING else \
            field(default_factory=spec.default_factory, metadata=spec.metadata)
        placed += [(spec.name, hints[spec.name], copied), *_owned_fields(PLACED_AFTER.get(spec.name, ()))]
    return placed


RunConfig = make_dataclass("RunConfig", _run_config_fields(), bases=(RunConfigBehaviour,),
                           namespace={"__module__": __name__, "__doc__": """A run's configuration: the run's own
    options (:class:`RunLevel`) and, made from their declarations, every option of the built-in classes and
    components (:data:`PLACED_AFTER`), with :class:`RunConfigBehaviour`'s methods: a new option of one of them is a
    flag, a YAML and sweep key, a line of ``fedray run --help`` and a metrics column with no other edit."""})


def _is_algorithm(spec: str) -> bool:
    """Whether the plugin ``spec`` names a training algorithm (else it must be a closed-form method): by its class
    alone, so that loading it as one reports what is wrong with it (not a dataclass, abstract)."""
    try:
        return names_subclass(spec, FederatedAlgorithm)
    except FedrayError:
        return False  # a module that cannot load: loading it as a closed-form method says so in the same line


def server_optimizer_class(spec: str) -> type[ServerOptimizer]:
    return load_class(spec, ServerOptimizer, SERVER_OPTIMIZERS, "server optimizer")


PLUGIN_FIELDS = ("method", "server_optimizer", "calibrate")
"""The options that may name a plugin: its column holds the class name, ``NAME_spec`` the spec."""
NOT_COLUMNS = ("out", "quiet", "options")
STAGE_COLUMNS = ("calibrate",)
"""Options that add a stage to a run: a column only of the runs that have it."""
FIELDS = {f.name for f in fields(RunConfig)}
RUN_DEFAULTS = {f.name: f.default for f in fields(RunConfig)}
IMAGE_OPTIONS = tuple(options_of(FineTuning))
"""Options of the network a run fine-tunes on images: a run on features has none (its features were extracted)."""
RESERVED = {f.name for f in fields(EvalPoint)} | {f"{name}_spec" for name in PLUGIN_FIELDS} | \
    {"ridge_probe_accuracy", "trial_id", "sweep"}
"""Metrics columns: no option may take their names, since options become columns too."""
COLUMNS = frozenset(FIELDS | RESERVED) - set(DP_REPORTED)
"""Names no plugin may report a number under (:func:`fedray.report`): the run's columns, but what a DP postprocessor
reports (:data:`DP_REPORTED`)."""
PER_ROUND = ("clients_per_round", "participation")
REMOVED = {
    "client_algorithm": "write your client's loss or gradient correction as a fedray.FederatedAlgorithm subclass and "
                        "give it as --method FILE.py:Class (see examples/proximal_client.py)",
}
"""Run options fedray no longer has, with what replaced each: the command line, config files, sweeps and
``fedray.run`` refuse them in one line (:func:`without_removed`)."""


def without_removed(values: dict, where: str | None = None) -> dict:
    """``values`` less the :data:`REMOVED` options: one that is None is dropped (every config.yaml an earlier run wrote
    holds every option, unset ones as null), one with a value is refused in one line saying what replaced it.

    ``where`` names a file, section or function (``config.yaml``, ``fedray.run``), which spell options as keys;
    None is the command line, which spells them as flags.
    """
    for key in sorted(REMOVED.keys() & values.keys()):
        if values[key] is not None:
            spelt = command_line(key) if where is None else f"{where}: {key}"
            raise FedrayError(f"{spelt} was removed: {REMOVED[key]}")
    return {key: value for key, value in values.items() if key not in REMOVED}


def _run_options() -> dict[str, Option]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: option_from_hint(f"RunConfig.{f.name}", f.name, hints[f.name], f.default, f.metadata["help"])
            for f in fields(RunConfig) if f.name != "options"}


RUN_OPTIONS = _run_options()
"""Every run option (the fields of :class:`RunConfig` but ``options``) as an :class:`~fedray.core.options.Option`:
file, sweep and plugin values are all typed and checked by :meth:`~fedray.core.options.Option.coerce`."""


def resolve(file_values: dict, cli_values: dict, drop_unused: bool = False, named: Collection[str] = ()) -> RunConfig:
    """Defaults, overridden by the file, overridden by options given on the command line.

    An option that does not apply to the run is refused when it is given on the command line or ``named`` (a
    keyword of ``fedray.run``), or set to other than its default, or with ``drop_unused`` (a sweep's trial) left at
    its default (:meth:`RunConfig.validate`).

    κ and the participation rate are one choice: either on the command line replaces both from the file. An option
    of a built-in class given among ``options`` (``--option prox_mu=0.1``) is that class's run option (``--prox-mu``).
    """
    file_values, cli_values = _owned_options_moved(file_values), _owned_options_moved(without_removed(cli_values))
    given = {k: v for k, v in cli_values.items() if v is not None}
    if given.keys() & set(PER_ROUND):
        file_values = {k: v for k, v in file_values.items() if k not in PER_ROUND}
    merged = {**file_values, **given, "options": {**file_values.get("options", {}), **given.get("options", {})}}
    try:
        return RunConfig(**merged).validate({*given, *named}, drop_unused).resolved()
    except TypeError as error:
        raise FedrayError(str(error)) from None


OWNED = {f.name for f in fields(RunConfig) if "owners" in f.metadata and "component" not in f.metadata}
"""The run options that belong to the built-in classes (:func:`owned`) that ``--option`` may set too (not those of
the components every run of a kind has: they are the run's own)."""


def _owned_key(key: str) -> str | None:
    """The owned run option an ``options`` key sets (``prox_mu``, ``fedprox.prox_mu``, ``FedProx.prox_mu``: a per-owner
    key names an owner by its built-in name or class name; a DP flag's plain key, ``clip_norm``), else None; a one-line
    error for one given to a class that does not own it."""
    owner, name = split_key(key)
    if owner is None and name in DP_OPTIONS:  # a DP postprocessor's option, as given before the DP flags
        return name
    if name not in OWNED:
        return None
    kind, owners, _ = owners_of(name)
    classes = dict(BUILT_IN_OWNERS)[kind]
    if owner is not None and owner not in {*owners, *(classes[each].__name__ for each in owners)}:
        raise FedrayError(f"--option {key}: {name} is an option of the {kind if len(owners) > 1 else kind[:-1]} "
                          f"{', '.join(owners)}, not of {owner}")
    return name


def _owned_options_moved(values: dict, where: str = "--option") -> dict:
    """One source's ``values`` with the owned options among its ``options`` moved out, as the run options they are
    (``--option fedprox.prox_mu=0.1`` too, and the DP postprocessor's ``--option clip_norm=1``, which is ``--clip-norm
    1``); ``where``: the source, for an error."""
    options = values.get("options") or {}
    owned = {key: _owned_key(key) for key in options}
    named = [name for name in owned.values() if name is not None]
    if len(set(named)) < len(named):
        name = next(name for name in named if named.count(name) > 1)
        raise FedrayError(f"--option {name} is given twice: as " +
                          " and as ".join(key for key, owned_name in owned.items() if owned_name == name))
    moved = {name: RUN_OPTIONS[name].coerce(options[key], f"{where} {key}" if where == "--option" else where)
             for key, name in owned.items() if name is not None}
    twice = sorted(key for key in moved if values.get(key) is not None)
    if twice:
        raise FedrayError(f"{'' if where == '--option' else where + ': '}{twice[0]} is given twice: as "
                          f"{command_line(twice[0])} and as --option {twice[0]} (or options: {{{twice[0]}: ...}})")
    if not moved:
        return values
    return {**values, **moved, "options": {key: value for key, value in options.items() if owned[key] is None}}
