"""Availability models by name, and the spec strings that build them: ``always``, ``markov:ON_S,OFF_S``,
``diurnal:PERIOD_S,DUTY``, ``trace:FILE``."""

from __future__ import annotations

from fedray.core.errors import FedrayError
from fedray.core.options import build
from fedray.clock.availability import AlwaysAvailable, Availability
from fedray.clock.diurnal import DiurnalAvailability
from fedray.clock.markov import MarkovAvailability
from fedray.clock.traces import TraceAvailability

AVAILABILITY_MODELS: dict[str, type[Availability]] = {
    "always": AlwaysAvailable,
    "markov": MarkovAvailability,
    "diurnal": DiurnalAvailability,
    "trace": TraceAvailability,
}
SPEC_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "always": (),
    "markov": ("markov_on_s", "markov_off_s"),
    "diurnal": ("diurnal_period_s", "diurnal_duty"),
    "trace": ("trace_file",),
}
"""The options a model's spec string sets, in the order it lists them after the colon."""
FORMS = {"always": "always", "markov": "markov:ON_S,OFF_S", "diurnal": "diurnal:PERIOD_S,DUTY", "trace": "trace:FILE"}


def availability_from_spec(spec: str, seed: int) -> Availability:
    """The model a spec string names (``markov:600,1800``), for the run's ``seed``, checked, or a one-line error."""
    name, _, listed = spec.partition(":")
    if name not in AVAILABILITY_MODELS:
        raise FedrayError(f"--availability: unknown model {spec!r} (one of {', '.join(FORMS.values())})")
    names = SPEC_ARGUMENTS[name]
    # a file's path may hold commas: the trace model's one argument is all that follows the colon
    values = [listed] if name == "trace" else listed.split(",") if listed else []
    if len(values) != len(names) or any(not value for value in values):
        raise FedrayError(f"--availability: {name} is spelled {FORMS[name]}, got {spec!r}")
    where = f"--availability {spec}"
    return build(AVAILABILITY_MODELS[name], dict(zip(names, values)), where, seed=seed)
