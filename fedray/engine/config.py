"""A run's configuration: defaults ← YAML file ← command line, validated and resolved in one place (files and keywords
are read by :mod:`fedray.engine.config_files`).

:class:`RunConfig` holds the run's own options as fields and every component's options in one mapping,
``component_options``; the options of the run and of its components are one catalogue (:func:`catalogue`), from which
the command line, files, sweeps and metrics columns are made. Each component option is also spelt as a field, as
before: ``RunConfig(lam=0.1)``, ``config.lam``, ``replace(config, lam=...)``, and ``to_dict`` (config.yaml) writes
them among the run's own.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Collection
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from fedray.clock.choices import ClockChoices, selector_class
from fedray.core.errors import FedrayError
from fedray.core.numeric_options import check_numeric_options, check_positive, command_line
from fedray.core.options import build, option_from_hint, options_of
from fedray.core.plugins import canonical, display_name, is_plugin, load_class, names_subclass
from fedray.core.results import EvalPoint
from fedray.data.dataset_options import OPTION_TYPES as DATASET_OPTIONS
from fedray.engine.plugin_options import Owner, checked_options, declarers, split_key, values_for
from fedray.engine.plugin_options import defaults as plugin_defaults
from fedray.engine.run_options import (APPLIES_TO, BUILT_IN_OWNERS, CLOCK, CLOCK_COMPONENTS, COMPONENTS, GENERAL,
                                       IMAGES, RESOURCES, SAMPLING, SPHERE, TCT_GROUP, TRAINING, UPLOADS, RunOption,
                                       flagged_postprocessors, option, owners_of, placed, shipped_options)
from fedray.methods import METHODS, method_class
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.postprocessor import BUILT_IN as POSTPROCESSORS, postprocessor_class
from fedray.methods.ridge import PROBE_METHOD, Fed3R
from fedray.methods.sphere import SphereHead
from fedray.methods.tct_stage2 import TCT, TctStage2Options
from fedray.methods.training.client_optimizer import ClientOptimizer
from fedray.methods.training.modes import FINETUNE_MODES, INITS, FineTuning
from fedray.methods.training.server import SERVER_OPTIMIZERS, ServerOptimizer, ServerSGD
from fedray.methods.training_algorithms import BUILT_IN as ALGORITHMS, FedAvg, algorithm_class, own_server_optimizer

SAMPLINGS = ("without", "with", "poisson")
HEADS = ("linear", "sphere")
PLAIN_AVERAGING = ServerSGD.name
"""The server optimizer of fedavg, fedprox and scaffold: the one ``--server-optimizer`` may replace."""
DEFAULT_PER_ROUND = 10
"""κ when neither --clients-per-round nor --participation is given."""
Component = TypeVar("Component")
COMPONENT_OPTIONS = "component_options"


@dataclass
class RunConfig:
    """A run's configuration: the run's own options (data, sampling, seed, evaluation, resources, output, which
    classes run) and its components' options in :attr:`component_options`.

    Every option of a component is also taken and read as a field of its name (:func:`_spelt_as_fields`), so a new
    option of a component is a flag, a YAML and sweep key, a line of ``fedray run --help`` and a metrics column with
    no edit here.
    """

    method: str = option(Fed3R.name, f"{', '.join(sorted([*METHODS, *ALGORITHMS, TCT]))}, or your own closed-form "
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
    base: str = option(FedAvg.name, "stage-1 algorithm, run for --rounds rounds", TCT_GROUP,
                       choices=tuple(sorted(ALGORITHMS)))
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
    component_options: dict = field(default_factory=dict)
    """Every component's options by name (``Owner.name`` where two of the run's plugins declare one): the built-in
    ones' (``lam``, ``prox_mu``, the DP flags, :func:`catalogue`) always, a plugin's when given (``--option
    key=value``); :attr:`options` is its plugins' part."""

    def __post_init__(self) -> None:
        if not isinstance(self.component_options, dict):
            raise FedrayError(f"options must be a mapping of option: value, got {self.component_options!r}")
        declared = component_catalogue()
        given = self.component_options
        self.component_options = {**{name: given.get(name, entry.default) for name, entry in declared.items()},
                                  **{key: value for key, value in given.items() if key not in declared}}

    def __getattr__(self, name: str) -> Any:
        """A component's option, read as a field of its name (``config.lam``)."""
        values = self.__dict__.get(COMPONENT_OPTIONS)
        if values is None or name.startswith("__") or name not in component_catalogue():
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return values[name]

    @property
    def options(self) -> dict[str, object]:
        """The run's plugins' own options (``--option key=value``; built-in options are flags): the part of
        :attr:`component_options` outside the catalogue, as config.yaml writes it."""
        declared = component_catalogue()
        return {key: value for key, value in self.component_options.items() if key not in declared}

    @options.setter
    def options(self, values: dict[str, object]) -> None:
        declared = component_catalogue()
        self.component_options = {**{key: value for key, value in self.component_options.items() if key in declared},
                                  **values}

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
        selector = self.component(ClockChoices).plugin()
        if selector is not None:
            plugins.append(Owner(selector_class(selector), "--selector"))
        if isinstance(ALGORITHMS.get(self.training_algorithm), str) and self.trains:
            plugins.append(Owner(self.algorithm_class(), "--base" if self.method == TCT else "--method",
                                 self.training_algorithm))
        unique: dict[type, Owner] = {}
        for owner in plugins:  # a postprocessor given twice has its options once
            unique.setdefault(owner.cls, owner)
        return list(unique.values())

    def postprocessor_specs(self) -> list[str]:
        """``--postprocessor``'s classes, in order, and those the run's flags add (:attr:`~fedray.Postprocessor.flags`):
        each after them and before those added last (DP's ``--clip-norm``, ``--dp-*``: ``dp``, or its training
        counterpart ``dp-fedavg`` when the run trains), unless one of them takes one of its flags already or is it
        (``dp`` given by name, or your own DP postprocessor), those added last at the end
        (``--secure-aggregation``: ``secagg``)."""
        specs = [] if self.postprocessor is None else [spec.strip() for spec in self.postprocessor.split(",") if spec.strip()]
        for name, cls in self._flagged().items():
            added = cls.training_counterpart or name if self.trains else name
            flags = {flag.name for flag in cls.flags}
            if added in specs or any(flags & options_of(postprocessor_class(spec)).keys() for spec in specs):
                continue
            last = [index for index, spec in enumerate(specs) if _added_last(spec)]
            specs.insert(len(specs) if cls.added_last or not last else last[0], added)
        return specs

    def _flagged(self) -> dict[str, type]:
        """The registered postprocessors with a flag set in this run (other than its default), by name."""
        return {name: cls for name, cls in flagged_postprocessors().items()
                if any(getattr(self, flag.name) != flag.default for flag in cls.flags)}

    def _flag_defaults(self) -> dict[str, object]:
        """The flags left unset (None), at the default of the run's postprocessor that declares them (dp's central and
        sample), so that config.yaml and the metrics columns say what ran."""
        unset = {name for name, entry in catalogue().items() if entry.kind == "flag" and getattr(self, name) is None}
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
                              f"{'--method ' + TCT if self.method == TCT else '--finetune'} yet: use --sampling with")

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

    def validate(self, given: Collection[str] = (), drop_unused: bool = False) -> RunConfig:
        """This configuration, checked: a bad or contradictory value is refused in one line, and so is an option that
        does not apply to the run, set to other than its default or named in ``given`` (the command line's flags: a
        config.yaml holds every option). ``drop_unused`` (a sweep's trials, whose options are the sweep's) resets the
        options that do not apply to this run to their defaults instead of refusing them."""
        check_numeric_options({name: getattr(self, name) for name in catalogue()}, command_line)
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
        check_positive({**{name: getattr(self, name) for name in _chosen_by_owners()},
                        "init_rounds": self.init_rounds, "checkpoint_every": self.checkpoint_every,
                        "num_trainers": self.num_trainers, "cpus_per_trainer": self.cpus_per_trainer,
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
        self._validate_flags()
        if self.method == TCT:
            self._validate_tct()
        if self.calibrate is not None:
            self._validate_calibrate()
        unused = self.unused_options(given)
        if unused and not drop_unused:
            raise FedrayError(self.not_used(unused[0]))
        return replace(self, **{name: catalogue()[name].default for name in unused}) if unused else self

    def unused_options(self, given: Collection[str] = ()) -> list[str]:
        """The options set to other than their defaults, or named in ``given``, that do not apply to this run."""
        groups, taken = self.applicable_groups(), self._taken()
        return [name for name, entry in catalogue().items()
                if (name in given or getattr(self, name) != entry.default) and not _applies(entry, groups, taken)]

    def applies(self, name: str) -> bool:
        """Whether the run option ``name`` applies to this run."""
        return _applies(catalogue()[name], self.applicable_groups(), self._taken())

    def not_used(self, name: str) -> str:
        """The one line refusing the run option ``name``, which does not apply to this run."""
        entry = catalogue()[name]
        where = entry.group if entry.by_class else APPLIES_TO[entry.group]
        run = f"--method {self.method}"
        if self.trains and entry.by_class and entry.owners[0] in SERVER_OPTIMIZERS:
            run += f" with server optimizer {self.server_optimizer or self.own_server_optimizer}"
        return f"{command_line(name)} applies to {where}, not to this run ({run})"

    def _taken(self) -> set[str]:
        """The options the run's built-in and plugin classes take."""
        return {name for cls in self.classes() for name in options_of(cls)}

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

    def _validate_flags(self) -> None:
        """Each flag given that the postprocessor it adds declares is an option of one of the run's postprocessors:
        none is dropped unseen (DP-FedAvg takes no ``--dp-unit``). (Its value is the postprocessor's to check, when it
        is built.)"""
        given = [name for cls in self._flagged().values() for name in options_of(cls)
                 if name in {flag.name for flag in cls.flags} and getattr(self, name) is not None]
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
        options = self.options
        plain = {key for key in options if split_key(key)[0] is None}
        clashing = sorted({split_key(key)[1] for key in options} & (FIELDS | RESERVED))
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
        self.options = checked_options(options, plugins)

    def _validate_images(self) -> None:
        """The options of a run on images apply to fine-tuning (and TCT) only; its backbone is one fedray knows."""
        if self.finetune is None and self.method != TCT:
            given = [name for name in options_of(FineTuning) if getattr(self, name) != catalogue()[name].default]
            if given:
                raise FedrayError(f"{command_line(given[0])} applies to fine-tuning on images (--finetune, or --method "
                                  f"{TCT}), not to {self.method} on the dataset's features")
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
            raise FedrayError(f"--calibrate with --method {TCT}: TCT's stage 2 replaces the head after training")
        if self.trains:
            method_class(self.calibrate)  # a closed-form method: a built-in, or a plugin that loads as one

    def _validate_tct(self) -> None:
        if self.base not in ALGORITHMS and not (is_plugin(self.base) and _is_algorithm(self.base)):
            raise FedrayError(f"--base (TCT's stage 1) must be a training algorithm ({', '.join(ALGORITHMS)} or your own "
                              f"as module:Class or path/to/file.py:Class), got {self.base!r}")
        if self.head != "linear":
            raise FedrayError("TCT fine-tunes a linear head on images (stage 1); --head sphere does not apply")
        self.component(TctStage2Options).check_fits(self.component(FineTuning))

    def resolved(self) -> RunConfig:
        """Class-dependent defaults filled in: sampling (with replacement for training), the method's own server
        optimizer, the options the run leaves None until its classes fill them (:func:`_unset_until_resolved`: what
        the built server optimizer holds, its learning rate; else the default a class of the run declares, FedProx's
        μ), the flags' postprocessors' defaults and the plugins' options."""
        values = {"sampling": self.sampling or self._default_sampling(), "method": canonical(self.method)}
        if self.postprocessor_specs():
            values["postprocessor"] = ",".join(canonical(spec) for spec in self.postprocessor_specs())
            values.update(self._flag_defaults())
        if self.method == TCT:
            values["finetune"] = self.finetune or "ft"
        if self.trains:
            values["server_optimizer"] = canonical(self.server_optimizer or self.own_server_optimizer)
            server = self.server_optimizer_class()  # the class that needs no data to be built: it says its own
            built = build(server, self.option_values(server), f"--server-optimizer {values['server_optimizer']}")
            values.update({name: getattr(built, name) for name in _unset_until_resolved()
                           if getattr(self, name) is None and hasattr(built, name)})
            if self.calibrate is not None:
                values["calibrate"] = canonical(self.calibrate)
        for cls in self.classes():
            values.update({name: declared.default for name, declared in options_of(cls).items()
                           if name in _unset_until_resolved() and getattr(self, name) is None
                           and declared.default is not None and name not in values})
        defaults = {key: value for key, value in plugin_defaults(self.plugins()).items()
                    if split_key(key)[1] not in FIELDS}
        values["options"] = {**defaults, **self.options}
        return replace(self, **values)

    def recording(self, resolved: dict[str, object]) -> RunConfig:
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
        """Every option by name, the run's own and its components' in :func:`catalogue`'s order, then ``options``
        (its plugins'): config.yaml and a checkpoint's configuration."""
        return {**{name: _copied(getattr(self, name)) for name in catalogue()}, "options": _copied(self.options)}

    def option_values(self, cls: type) -> dict[str, object]:
        """What ``cls``'s options are set from: the run's (its own and its built-in components', such as ``lam``) and
        its plugins' ``options`` (the plain ones and ``cls``'s own per-owner ones);
        :func:`~fedray.core.options.build` takes from it the options the class declares."""
        return {**{name: getattr(self, name) for name in catalogue()}, **values_for(cls, self.options)}

    def closed_form_methods(self) -> list[str]:
        """The closed-form methods the run solves: its method, or a training run's ``--init`` stage, its
        ``--calibrate`` method, the ridge probe's (``--probe-ridge``) and SphereFed's calibration (``--head
        sphere``)."""
        if not self.trains:
            return [self.method]
        names = [] if self.init == "random" else [self.init]
        if self.calibrate is not None:
            names.append(self.calibrate)
        if self.probe_ridge:
            names.append(PROBE_METHOD)
        if self.head == "sphere":
            names.append(SphereHead.calibration_method)
        return names

    def applicable_groups(self) -> set[str | None]:
        """The option groups that apply to this run.

        Every run's options, its sampling and its resources always; the uploads' (``--postprocessor``, the
        postprocessors' flags) when it has postprocessors; the training options when it trains; SphereFed's with
        ``--head sphere``; the image options when it fine-tunes (``--finetune``, TCT); TCT's with ``--method tct``; the
        clock's when one of them is given (:attr:`clocked`). (The options of the run's classes are theirs:
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
        if self.clocked:
            groups.add(CLOCK)
        return groups

    @property
    def clocked(self) -> bool:
        """Whether the run is on the clock: it gives one of the clock's options (:data:`CLOCK_COMPONENTS`)."""
        return any(self.component_options[name] is not None for cls in CLOCK_COMPONENTS for name in options_of(cls))

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
        (``lam``, ``gamma``, ``prox_mu``, ``server_momentum``, ...) when one of the run's :meth:`classes` takes it; a
        postprocessor's flag with no default (DP's) only in a run that sets one of its postprocessor's flags. A plugin
        is named by its class name (``method``: ``MyNCM``) with its spec beside it (``method_spec``:
        ``/home/me/my_ncm.py:MyNCM``), likewise ``server_optimizer``. config.yaml keeps every option, to re-run the run.
        """
        groups, taken, flagged = self.applicable_groups(), self._taken(), self._flagged().values()
        columns: dict[str, object] = {}
        for name, entry in catalogue().items():
            if name in NOT_COLUMNS or not _applies(entry, groups, taken) or \
                    name in STAGE_COLUMNS and getattr(self, name) is None or \
                    entry.kind == "flag" and entry.default is None and \
                    not any(entry.option in cls.flags for cls in flagged):
                continue
            value = getattr(self, name)
            if name in PLUGIN_FIELDS and isinstance(value, str) and is_plugin(value):
                columns[name], columns[f"{name}_spec"] = display_name(value), value
            else:
                columns[name] = value
        return {**columns, **self.options}


def _copied(value: object) -> object:
    """A mapping's copy (``to_dict`` hands out no part of the configuration), any other value as it is."""
    return dict(value) if isinstance(value, dict) else value


def _added_last(spec: str) -> bool:
    """Whether the postprocessor ``spec`` names is one the flags add last (secure aggregation), given by name."""
    return not is_plugin(spec) and spec in POSTPROCESSORS and postprocessor_class(spec).added_last


def _applies(entry: RunOption, groups: set[str | None], taken: set[str]) -> bool:
    """Whether the option ``entry`` applies to a run of these option ``groups`` whose classes take ``taken``."""
    return entry.name in taken if entry.by_class else entry.group in groups


def _spelt_as_fields(cls: type[RunConfig]) -> type[RunConfig]:
    """``cls``, whose constructor also takes each component option by name, as a field (``RunConfig(lam=0.1)``,
    ``replace(config, lam=...)``), into ``component_options``, and ``options`` (the plugins' options) as the part of
    it outside the catalogue."""
    made = cls.__init__

    @functools.wraps(made)
    def __init__(self: RunConfig, *args: Any, options: dict | None = None, **values: Any) -> None:
        declared = component_catalogue()
        named = {name: values.pop(name) for name in list(values) if name in declared}
        made(self, *args, **values)
        if options is not None and not isinstance(options, dict):
            raise FedrayError(f"options must be a mapping of option: value, got {options!r}")
        clashing = sorted((options or {}).keys() & declared.keys())
        if clashing:  # a plugin's option may not take a run option's name (RunConfig.validate)
            raise FedrayError(f"--option {clashing[0]}: {clashing[0]} is a run option: use {command_line(clashing[0])}")
        if named or options is not None:
            kept = self.component_options if options is None else \
                {key: value for key, value in self.component_options.items() if key in declared}
            self.component_options = {**kept, **named, **(options or {})}

    cls.__init__ = __init__
    return cls


RunConfig = _spelt_as_fields(RunConfig)


def _is_algorithm(spec: str) -> bool:
    """Whether the plugin ``spec`` names a training algorithm (else it must be a closed-form method): by its class
    alone, so that loading it as one reports what is wrong with it (not a dataclass, abstract)."""
    try:
        return names_subclass(spec, FederatedAlgorithm)
    except FedrayError:
        return False  # a module that cannot load: loading it as a closed-form method says so in the same line


def server_optimizer_class(spec: str) -> type[ServerOptimizer]:
    return load_class(spec, ServerOptimizer, SERVER_OPTIMIZERS, "server optimizer")


@functools.cache
def catalogue() -> dict[str, RunOption]:
    """Every option of a run by name, in config.yaml's order: :class:`RunConfig`'s fields, with its components'
    options placed among them (:func:`~fedray.engine.run_options.placed`); not ``component_options`` itself."""
    hints = typing.get_type_hints(RunConfig)
    run_level = []
    for spec in fields(RunConfig):
        if spec.name != COMPONENT_OPTIONS:
            metadata = spec.metadata
            declared = replace(option_from_hint(f"RunConfig.{spec.name}", spec.name, hints[spec.name], spec.default,
                                                metadata["help"]),
                               choices=metadata["choices"], unset=metadata["unset"], metavar=metadata["metavar"])
            run_level.append(RunOption(declared, metadata["group"]))
    return placed(run_level)


@functools.cache
def component_catalogue() -> dict[str, RunOption]:
    """The components' options of :func:`catalogue`: those ``component_options`` holds always."""
    return {name: entry for name, entry in catalogue().items() if entry.kind != "run"}


@functools.cache
def _unset_until_resolved() -> tuple[str, ...]:
    """The built-in classes' options that a run leaves None until :meth:`RunConfig.resolved` fills them for its
    classes, which say what None means (:class:`~fedray.core.options.Unset`): their defaults differ by class
    (``server_lr``), or the option is one class's and the run says so (FedProx's μ)."""
    return tuple(name for name, entry in catalogue().items()
                 if entry.kind == "class" and entry.default is None and entry.option.unset is not None)


@functools.cache
def _chosen_by_owners() -> tuple[str, ...]:
    """The built-in classes' options whose None each owner replaces by a value of its own choosing (Fed3R-RF's
    bandwidth √d, a server optimizer's learning rate): a quantity > 0, so one given is checked to be before any class
    is built."""
    return tuple(name for name in _unset_until_resolved()
                 if all(declared.optional and declared.default is None for declared in owners_of(name)[2]))


RUN_OPTIONS = {name: entry.option for name, entry in catalogue().items()}
"""Every run option (the run's own and its components') as an :class:`~fedray.core.options.Option`: file, sweep and
plugin values are all typed and checked by :meth:`~fedray.core.options.Option.coerce`."""
FIELDS = frozenset({*catalogue(), "options"})
"""The keys of a run's options in a file or ``fedray.run``'s keywords (``options``: its plugins'), which no plugin
option may take."""
RUN_DEFAULTS = {name: entry.default for name, entry in catalogue().items()}


PLUGIN_FIELDS = ("method", "server_optimizer", "calibrate")
"""The options that may name a plugin: its column holds the class name, ``NAME_spec`` the spec."""
NOT_COLUMNS = ("out", "quiet", "options")
STAGE_COLUMNS = ("calibrate",)
"""Options that add a stage to a run: a column only of the runs that have it."""
RESERVED = {f.name for f in fields(EvalPoint)} | {f"{name}_spec" for name in PLUGIN_FIELDS} | \
    {"ridge_probe_accuracy", "trial_id", "sweep"}
"""Metrics columns: no option may take their names, since options become columns too."""
COLUMNS = frozenset({name for name, entry in catalogue().items() if entry.kind != "flag"} | {"options"} | RESERVED)
"""Names no plugin may report a number under (:func:`fedray.report`): the run's columns, but its postprocessors'
flags, whose columns hold what they report (DP's ε spent, at most the ε asked, and δ)."""
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


def _owned_key(key: str) -> str | None:
    """The built-in run option an ``options`` key sets (``prox_mu``, ``fedprox.prox_mu``, ``FedProx.prox_mu``: a
    per-owner key names an owner by its built-in name or class name; a postprocessor's flag by its plain key,
    ``clip_norm``), else None; a one-line error for one given to a class that does not own it."""
    owner, name = split_key(key)
    entry = catalogue().get(name)
    if entry is not None and entry.kind == "flag" and owner is None and name in options_of(entry.component):
        return name  # an option of the postprocessor the flag adds, as given before the flags were
    if entry is None or not entry.by_class:
        return None
    kind, owners, _ = owners_of(name)
    classes = dict(BUILT_IN_OWNERS)[kind]
    if owner is not None and owner not in {*owners, *(classes[each].__name__ for each in owners)}:
        raise FedrayError(f"--option {key}: {name} is an option of the {kind if len(owners) > 1 else kind[:-1]} "
                          f"{', '.join(owners)}, not of {owner}")
    return name


def _owned_options_moved(values: dict, where: str = "--option") -> dict:
    """One source's ``values`` with the built-in options among its ``options`` moved out, as the run options they
    are (``--option fedprox.prox_mu=0.1`` too, and the DP postprocessor's ``--option clip_norm=1``, which is
    ``--clip-norm 1``); ``where``: the source, for an error."""
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
