"""Every option a run takes, from its declarations: the run's own (:class:`~fedray.engine.config.RunConfig`'s fields)
and its components' (the built-in methods', algorithms' and server optimizers', the components a run of a kind has,
the registered postprocessors' flags), each with its ``--help`` group and owners.

The command line, config files, sweeps, the manual's tables and the metrics columns all iterate this catalogue
(:func:`~fedray.engine.config.catalogue`), so an option is declared once, where its class is.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fedray.clock.choices import ClockChoices
from fedray.clock.devices import Devices
from fedray.clock.asynchronous import AsynchronousRounds
from fedray.clock.rounds import SynchronousRounds
from fedray.core.options import Option, options_of
from fedray.methods import METHODS
from fedray.methods.postprocessor import BUILT_IN as POSTPROCESSORS, Postprocessor, postprocessor_class
from fedray.methods.sphere import SphereHead
from fedray.methods.tct_stage2 import TctStage2Options
from fedray.methods.training.client_optimizer import ClientOptimizer
from fedray.methods.training.modes import FineTuning
from fedray.methods.training.server import SERVER_OPTIMIZERS
from fedray.methods.training_algorithms import BUILT_IN as ALGORITHMS, algorithm_class

GENERAL, SAMPLING, UPLOADS, TRAINING, SPHERE, IMAGES, TCT_GROUP, RESOURCES, CLOCK = (
    None, "sampling", "uploads", "training", "spherefed", "fine-tuning", "tct-stages", "resources", "clock")
GROUPS = {
    SAMPLING: "client sampling",
    UPLOADS: "every client's upload, on its way to the server",
    TRAINING: f"gradient methods ({', '.join(ALGORITHMS)})",
    SPHERE: "SphereFed (--head sphere): a projection onto the sphere before a fixed classifier, FFC after",
    IMAGES: "fine-tuning on images (a dataset with images: hsu:CSV?images=ROOT, imagefolder:ROOT)",
    TCT_GROUP: "TCT (--method tct): fine-tune on images, then a linear model on eNTK features",
    RESOURCES: "resources (Ray)",
    CLOCK: "the clock: devices, availability, deadlines and stragglers in virtual time (none given: no clock; any "
           "turns it on)",
}
"""The run's own options' groups in ``fedray run --help``, by the stage they belong to (``None``: every run's); the
options of the built-in methods, algorithms and server optimizers are grouped by their owners."""
APPLIES_TO = {UPLOADS: "--postprocessor", TRAINING: "gradient methods", SPHERE: "SphereFed (--head sphere)",
              IMAGES: "fine-tuning on images (--finetune, or --method tct)", TCT_GROUP: "--method tct",
              CLOCK: "a run on the clock"}
"""What the options of a group that not every run has apply to, for the refusal of one given to another run."""

Kind = Literal["run", "class", "component", "flag"]


@dataclass(frozen=True)
class RunOption:
    """One option of a run: its declaration (the run's default, help, choices, what None means), its group in
    ``fedray run --help`` and what it belongs to.

    ``kind``: ``run``, a field of :class:`~fedray.engine.config.RunConfig`; ``class``, an option of built-in classes a
    run may build (``lam``: fed3r's...), which applies when one of the run's classes takes it; ``component``, an
    option of a built-in component every run of its group has (local SGD's when it trains...); ``flag``, a registered
    postprocessor's flag (:attr:`~fedray.Postprocessor.flags`), which applies when the run has postprocessors.
    """

    option: Option
    group: str | None
    kind: Kind = "run"
    owners: tuple[str, ...] = ()
    """The names of the classes that declare it (a component's: its label, a flag's: its postprocessors')."""
    component: type | None = None
    """A component's class; a flag's postprocessor."""

    @property
    def name(self) -> str:
        return self.option.name

    @property
    def default(self) -> object:
        return self.option.default

    @property
    def by_class(self) -> bool:
        """Whether it applies when a class of the run takes it (else when its group applies to the run)."""
        return self.kind == "class"


def option(default: object, help: str, group: str | None, *, unset: str | None = None,
           choices: Sequence[str] | None = None, metavar: str | None = None) -> Any:
    """A run option: its default, its help and group in ``fedray run --help`` (``unset``: what a ``None`` default
    means).

    The command line is generated from these (:mod:`fedray.app.cli`), so each default is written here only.
    """
    return field(default=default, metadata={"help": help, "group": group, "unset": unset, "choices": choices,
                                            "metavar": metavar})


CLOCK_COMPONENTS = (Devices, ClockChoices, SynchronousRounds, AsynchronousRounds)
"""The clock's components: a run that sets none of their options has no clock."""
BUILT_IN_OWNERS: tuple[tuple[str, dict[str, type]], ...] = (
    ("closed-form methods", dict(METHODS)),
    ("training algorithms", {name: cls for name, cls in ALGORITHMS.items() if isinstance(cls, type)}),
    ("server optimizers", dict(SERVER_OPTIMIZERS)),
)
"""The built-in classes that own run options, by kind and name: an option one of them declares is theirs."""
COMPONENTS: tuple[tuple[str, str, type], ...] = (
    (TRAINING, "local SGD", ClientOptimizer),
    (SPHERE, "SphereFed's head", SphereHead),
    (IMAGES, "fine-tuning on images", FineTuning),
    (TCT_GROUP, "TCT's stage 2", TctStage2Options),
    (CLOCK, "the clients' devices", Devices),
    (CLOCK, "the clock's choices", ClockChoices),
    (CLOCK, "synchronous rounds", SynchronousRounds),
    (CLOCK, "asynchronous rounds", AsynchronousRounds),
)
"""The built-in components a run has when their option group applies to it (one class each: the clients' local SGD
when it trains, ...), with their names: their options are run options in that group."""
PLACED_AFTER: dict[str, tuple[type, ...]] = {
    "seed": (*METHODS.values(), ClientOptimizer, *SERVER_OPTIMIZERS.values(),
             *(cls for cls in ALGORITHMS.values() if isinstance(cls, type))),
    "head": (SphereHead,),
    "base": (TctStage2Options, FineTuning),
    "eval_every": CLOCK_COMPONENTS,
}
"""The built-in classes and components whose options are run options, after the run option each group follows in
config.yaml, the metrics columns and ``fedray run --help``; the postprocessors' flags follow ``--postprocessor``."""
FLAGS_AFTER = "postprocessor"


def owners_of(name: str) -> tuple[str, list[str], list[Option]]:
    """The kind and names of the built-in classes that declare the option ``name``, and their declarations."""
    for kind, classes in BUILT_IN_OWNERS:
        declared = {owner: options_of(cls)[name] for owner, cls in classes.items() if name in options_of(cls)}
        if declared:
            return kind, list(declared), list(declared.values())
    raise KeyError(f"no built-in class declares the option {name!r}")


def _component_option(name: str, group: str | None, label: str, cls: type) -> RunOption:
    declared = options_of(cls)[name]
    if declared.default is None and declared.unset is None:
        raise TypeError(f"{cls.__name__}.{name}: say what its None default means (Unset)")
    return RunOption(declared, group, "component", (label,), cls)


def _class_option(name: str) -> RunOption:
    """The run option ``name`` of the built-in classes declaring it: their default (``None`` when the owners declare
    what it means, :class:`~fedray.core.options.Unset`, or their defaults differ: the run's class fills it in when the
    run is resolved), their help, and their names as its group in ``fedray run --help``."""
    kind, names, declarations = owners_of(name)
    unset = next((declared.unset for declared in declarations if declared.unset is not None), None)
    defaults = {declared.default for declared in declarations}
    if unset is None and (len(defaults) != 1 or None in defaults):
        raise TypeError(f"the owners of {name} ({', '.join(names)}): say what its unset value means (Unset)")
    first = declarations[0]
    run_help = next((declared.shared_help for declared in declarations if declared.shared_help), first.help)
    declared = Option(name, first.type, None if unset is not None else first.default, run_help,
                      first.optional or unset is not None, first.choices, unset, first.metavar)
    return RunOption(declared, f"{', '.join(names)} ({kind if len(names) > 1 else kind[:-1]})", "class", tuple(names))


def _owned_options(classes: Iterable[type]) -> dict[str, RunOption]:
    """Every option of ``classes`` as a run option, each once, in the classes' order."""
    made: dict[str, RunOption] = {}
    for cls in classes:
        for name in options_of(cls):
            if name not in made:
                component = next(((group, label, owner) for group, label, owner in COMPONENTS if owner is cls), None)
                made[name] = _class_option(name) if component is None else _component_option(name, *component)
    return made


@functools.cache
def flagged_postprocessors() -> dict[str, type[Postprocessor]]:
    """The registered postprocessors that declare flags (:attr:`~fedray.Postprocessor.flags`), by name."""
    classes = {name: postprocessor_class(name) for name in POSTPROCESSORS}
    return {name: cls for name, cls in classes.items() if cls.flags}


def _flags() -> dict[str, RunOption]:
    """The registered postprocessors' flags, in the uploads group: a flag two of them declare is one option."""
    made: dict[str, RunOption] = {}
    for name, cls in flagged_postprocessors().items():
        for flag in cls.flags:
            first = made.get(flag.name)
            if first is None:
                made[flag.name] = RunOption(flag, UPLOADS, "flag", (name,), cls)
            elif first.option == flag:
                made[flag.name] = replace(first, owners=(*first.owners, name))
            else:
                raise TypeError(f"postprocessors {first.owners[0]} and {name} declare the flag {flag.name} differently")
    return made


def placed(run_level: Sequence[RunOption]) -> dict[str, RunOption]:
    """The run's own options (``run_level``) with the components' options placed among them (:data:`PLACED_AFTER`,
    :data:`FLAGS_AFTER`), by name."""
    catalogue: dict[str, RunOption] = {}
    for run_option in run_level:
        catalogue[run_option.name] = run_option
        owned = _owned_options(PLACED_AFTER.get(run_option.name, ()))
        owned.update(_flags() if run_option.name == FLAGS_AFTER else {})
        for name, declared in owned.items():
            if name in catalogue:
                raise TypeError(f"{name}: an option of {', '.join(declared.owners)} takes a run option's name")
            catalogue[name] = declared
    return catalogue


@functools.cache
def shipped_options() -> dict[str, tuple[tuple[str, ...], Option]]:
    """The options of the built-in training algorithms shipped as plugins (FedDyn's ``alpha``), with their owners'
    names.

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
