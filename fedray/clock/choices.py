"""The clock's own choices: which availability model, which selector, and evaluation in virtual seconds.

A component like :class:`~fedray.clock.devices.Devices` and
:class:`~fedray.clock.rounds.SynchronousRounds`: its fields are run options
(``--availability``, ``--selector``, ``--eval-every-s``), and each None means
the option is not given. A run that gives none of the clock's options has no
clock; any of them turns it on, the others taking what their ``Unset`` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np

from fedray.clock.availability import AlwaysAvailable, Availability
from fedray.clock.availability_specs import FORMS, availability_from_spec
from fedray.clock.selector import SELECTORS, Selector
from fedray.core.errors import FedrayError
from fedray.core.options import Metavar, Unset
from fedray.core.plugins import is_plugin, load_class


def selector_class(spec: str) -> type[Selector]:
    """The selector ``spec`` names: a built-in (``uniform``, ``poisson``) or ``FILE.py:Class`` / ``module:Class``."""
    return load_class(spec, Selector, SELECTORS, "selector")


@dataclass(frozen=True)
class ClockChoices:
    """``--availability``, ``--selector`` and ``--eval-every-s``, checked when built (the trace file read, the
    selector's class loaded): one line naming what is wrong, before any work."""

    availability: Annotated[str | None, "when clients are online: always, markov:ON_S,OFF_S (mean online and "
                                        "offline periods), diurnal:PERIOD_S,DUTY or trace:FILE (a Parquet file of "
                                        "trace_id, start_s, end_s intervals)", Unset("always"),
                            Metavar("|".join(FORMS.values()))] = None
    selector: Annotated[str | None, "who a round asks, among the clients online at its start: uniform (the "
                                    "schedule's draw), poisson, or your own fedray.Selector as FILE.py:Class (its "
                                    "options with --option key=value)", Unset("uniform"),
                        Metavar("uniform|poisson|FILE.py:Class")] = None
    eval_every_s: Annotated[float | None, "evaluate after the first round ending at or after each multiple of S "
                                          "virtual seconds (and the last), instead of every --eval-every rounds",
                            Unset("every --eval-every rounds"), Metavar("S")] = None

    def __post_init__(self) -> None:
        if self.eval_every_s is not None and not (self.eval_every_s > 0 and np.isfinite(self.eval_every_s)):
            raise FedrayError(f"--eval-every-s must be a finite number of seconds > 0, got {self.eval_every_s}")
        if self.availability is not None:
            self.availability_model(0)
        if self.selector is not None:
            selector_class(self.selector)

    def availability_model(self, seed: int) -> Availability:
        """The availability model for the run's ``seed`` (``always`` when none is given)."""
        return AlwaysAvailable() if self.availability is None else availability_from_spec(self.availability, seed)

    def plugin(self) -> str | None:
        """The selector's spec when it is a researcher's class (its options are plugin options), else None."""
        return self.selector if self.selector is not None and is_plugin(self.selector) else None

    def selector_spec(self, poisson_sampling: bool) -> str:
        """The selector's spec: when none is given, ``poisson`` for a run of Poisson sampling, else ``uniform``."""
        return self.selector or ("poisson" if poisson_sampling else "uniform")

    @property
    def every_s(self) -> float | None:
        """``--eval-every-s`` (None: evaluation by rounds)."""
        return self.eval_every_s
