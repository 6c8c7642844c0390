"""A sweep's trials: each one's run configuration, and every one of them checked before Tune starts.

Tune reports a trial that fails on its options like any other failure: after
the sweep, inside Ray's actor traceback. What a trial's options alone decide is
therefore checked for every trial first, through the same resolution and
checks the trial itself runs (the run's options, the dataset spec and its
re-split options, the closed-form methods and server optimizer it builds),
without loading any data: every combination of the grid with the base, each
random option at both ends of its range (every value of a choice). What depends
on the data (κ against the number of clients, whether a split is feasible) is
still found by the trial.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product

from fedray.engine.config import RUN_DEFAULTS, RunConfig, resolve
from fedray.data.registry import check_spec
from fedray.core.errors import FedrayError
from fedray.engine.settings import server_optimizer, training_algorithm
from fedray.methods import METHODS, method_class
from fedray.engine.plan import postprocessing
from fedray.core.options import build
from fedray.app.sweeps.spec import DATASET_PREFIX, OPTIONS_PREFIX, SweepSpec, plugin_options, with_dataset_options


def trial_config(params: dict, out: str) -> RunConfig:
    """The run configuration of the trial with Tune's ``params``, writing to ``out``.

    An option of the sweep that does not apply to this trial (``lam`` in a sweep over fed3r and fedncm) is left at its
    default here; :func:`check_trials` refuses one that applies to none.
    """
    options = {key: value for key, value in params.items() if not key.startswith((DATASET_PREFIX, OPTIONS_PREFIX))}
    options["dataset"] = with_dataset_options(params.get("dataset", RunConfig.dataset), params)
    options["options"] = plugin_options(params)
    return resolve(options, {"out": out, "quiet": True}, drop_unused=True)


def fixed_params(spec: SweepSpec) -> dict:
    """What every trial's parameters hold besides the swept options."""
    return {**spec.base, "cpus_per_shard": spec.cpus_per_shard}


def _ends(distribution: dict) -> list:
    """The values a random option's checks cover: both ends of its range, every value of a choice."""
    kind, arguments = next(iter(distribution.items()))
    if kind == "randint":  # [low, high)
        return [arguments[0], arguments[1] - 1]
    return list(arguments)


def checked_params(spec: SweepSpec) -> Iterator[dict]:
    """Every grid combination with every combination of the random options' ends, as a trial's parameters."""
    swept = {**spec.grid, **{key: _ends(distribution) for key, distribution in spec.random.items()}}
    for values in product(*swept.values()):
        yield {**fixed_params(spec), **dict(zip(swept, values))}


def _run_options_set(params: dict) -> list[str]:
    """The run options a trial's ``params`` set (as ``name`` or ``options.name``), but the sweep's resources."""
    names = (key.removeprefix(OPTIONS_PREFIX) for key in params if key != "cpus_per_shard")
    return [name for name in names if name in RUN_DEFAULTS]


def check_trial(config: RunConfig) -> None:
    """The checks of a trial's run that need no data.

    Built-in methods are built at a stand-in shape (d = C = 1): their
    constructors check only their options. A plugin method is not built here
    (its constructor may depend on the shape); the trial checks it.
    """
    check_spec(config.dataset)
    for name in (name for name in config.closed_form_methods() if name in METHODS):  # a plugin is built by the trial
        cls = method_class(name)
        build(cls, config.option_values(cls), f"--method {name}", dim=1, num_classes=1, seed=config.seed)
    postprocessing(config)
    if config.trains:
        server_optimizer(config)
        training_algorithm(config)


def check_trials(spec: SweepSpec) -> None:
    """Refuse the sweep in one line, naming a trial's values, when any trial would fail on its options alone."""
    failures, total = [], 0
    unused: dict[str, str] = {}  # each run option the sweep sets that a trial does not use: why the first one does not
    applied: set[str] = set()  # those a trial uses
    for params in checked_params(spec):
        total += 1
        try:
            config = trial_config(params, out=".")
            check_trial(config)
        except FedrayError as error:
            failures.append((params, error))
            continue
        for name in _run_options_set(params):
            if config.applies(name):
                applied.add(name)
            else:
                unused.setdefault(name, config.not_used(name))
    never = [name for name in unused if name not in applied]
    if never and not failures:
        raise FedrayError(f"sweep {spec.name}: none of its trials uses {never[0]}: {unused[never[0]]}")
    if not failures:
        return
    params, error = failures[0]
    if not spec.swept:
        raise FedrayError(f"sweep {spec.name}: its trials would fail: {error}")
    values = ", ".join(f"{key}={params[key]}" for key in spec.swept)
    raise FedrayError(f"sweep {spec.name}: {len(failures)} of {total} option combinations would fail, first {values}: {error}")
