"""Named scalars a plugin reports from the server's side of a round: extra columns of metrics.parquet.

A server-side hook (a training algorithm's ``server_update``, a server
optimizer's ``step``, a postprocessor's ``aggregate``, a closed-form method's
``solve``) calls ``fedray.report(name=value, ...)``: FedExP's step size, a DP
run's ε, the fraction of clipped updates. Each name becomes a column; a row
holds the last value reported at or before its round (None before the first),
so a per-round quantity is its value in the row's round and a cumulative one
(ε) its total. A client's quantity is aggregated as the server aggregates
anything: upload it as a tensor (summed with the upload's weight) and report
the mean in ``server_update``; client-side hooks run in the shards, where
``fedray.report`` is refused. A value is any number but NaN: ±inf is one (a DP
run's ε without noise), kept in the rows and in checkpoints; or a string of one
line, at most :data:`MAX_STRING` characters (the RDP orders a DP run's ε was
minimized over). A name holds one kind, number or string, in every row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from numbers import Real

from fedray.core.errors import FedrayError, shown

MAX_STRING = 200
"""The most characters a string column holds (one line: a label, not a log), a reported string's or a callback's."""

_reports: ContextVar[tuple[dict[str, float | str], frozenset[str]] | None] = ContextVar("fedray_reports", default=None)


def report(**scalars: float | str) -> None:
    """Record named numbers (or short strings) for the round the server is processing (see the module docstring)."""
    collecting = _reports.get()
    if collecting is None:
        raise FedrayError("fedray.report(...) is for the server's hooks (server_update, a server optimizer's step, a "
                          "postprocessor's aggregate, solve); a client's quantity goes up in its upload")
    into, reserved = collecting
    for name, value in scalars.items():
        if name in reserved:
            raise FedrayError(f"fedray.report({name}=...): {name} is a column of metrics.parquet already; "
                              "report under another name")
        kept = column_value(value, f"fedray.report({name}=...): got")
        if name in into and isinstance(into[name], str) != isinstance(kept, str):
            raise FedrayError(f"fedray.report({name}=...): got {value!r}, where {name} was {into[name]!r} before: a "
                              f"column holds numbers or strings, not both")
        into[name] = kept


def column_value(value: object, refusal: str) -> float | str:
    """``value`` as a metrics column holds it: a float (±inf included, not NaN) or a one-line string of at most
    :data:`MAX_STRING` characters; else a one-line error that starts with ``refusal`` (what gave it)."""
    if isinstance(value, str):
        if len(value) > MAX_STRING or "\n" in value:
            lines = " of several lines" if "\n" in value else ""
            raise FedrayError(f"{refusal} a {len(value)}-character string{lines}; a string column holds one line of "
                              f"at most {MAX_STRING} characters")
        return value
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value):
        raise FedrayError(f"{refusal} {shown(value)}; expected a number (not NaN; ±inf is one, as a DP run's ε = ∞ "
                          f"without noise) or a one-line string")
    return float(value)


@contextmanager
def reporting(into: dict[str, float | str], reserved: frozenset[str] = frozenset()) -> Iterator[None]:
    """Collect what ``report`` records, while inside, into ``into`` (names in ``reserved`` are refused)."""
    token = _reports.set((into, reserved))
    try:
        yield
    finally:
        _reports.reset(token)
