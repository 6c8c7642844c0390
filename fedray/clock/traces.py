"""``--availability trace:FILE``: clients online as recorded traces say (see :mod:`fedray.clock.trace_file`), each
client following trace ⌊u · T⌋ of the file's T traces (sorted by id), u uniform from (seed, 44, client), the traces
repeated over their span S.

Repetition m of a trace holds its intervals moved by C_m = m · S, with edges computed by one rule wherever they are
used: [min(C_m + start, C_m+1), min(C_m + end, C_m+1)), and an interval that ends at S ends exactly at C_m+1 (so that it
joins the next repetition's interval starting at 0 without a rounding's gap). A lookup finds its repetition, then
the last interval starting at or before t by a vectorised binary search: O(κ log L) for κ clients and traces of at
most L intervals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import numpy as np

from fedray.core.errors import FedrayError
from fedray.core.options import Metavar, Unset
from fedray.clock.availability import Availability
from fedray.clock.trace_file import TraceSet, load_traces
from fedray.clock.streams import uniforms

STREAM = 44


@dataclass(frozen=True)
class TraceAvailability(Availability):
    """Availability from recorded traces, one drawn per client, repeated over the file's span."""

    trace_file: Annotated[str | None, "availability traces: a Parquet or CSV file of trace_id, start_s, end_s",
                          Unset("none: --availability trace:FILE names it"), Metavar("FILE")] = None
    seed: int = 0
    traces: TraceSet = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.trace_file is None:
            raise FedrayError("--availability trace needs a trace file: trace:FILE")
        object.__setattr__(self, "traces", load_traces(self.trace_file))

    def trace_of(self, clients: np.ndarray) -> np.ndarray:
        """The index (into the sorted trace ids) of each client's trace."""
        count = self.traces.num_traces
        return np.minimum((uniforms(self.seed, STREAM, clients) * count).astype(np.int64), count - 1)

    def check_rounds_can_fill(self, clients_per_round: int, num_clients: int) -> None:
        """Refuse when at no moment κ clients are online: the most clients online at once, over the span (and so
        over all time), of this seed's assignment of the K clients to traces (O(K) once, then a sweep over the
        intervals' edges)."""
        super().check_rounds_can_fill(clients_per_round, num_clients)
        traces = self.traces
        followers = np.bincount(self.trace_of(np.arange(num_clients)), minlength=traces.num_traces)
        per_interval = np.repeat(followers, np.diff(traces.offsets))
        moments = np.concatenate([traces.starts, traces.ends])
        changes = np.concatenate([per_interval, -per_interval])
        order = np.lexsort((changes, moments))  # at one moment, intervals that end go before those that start
        most = int(np.cumsum(changes[order]).max())
        if most < clients_per_round:
            raise FedrayError(f"--availability trace:{self.trace_file} has at most {most} of the {num_clients} "
                              f"clients online at once: a round of {clients_per_round} never fills")

    def _available(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        trace = self.trace_of(clients)
        cycle = self._cycle(t)
        interval = self._last_starting(trace, cycle, t)
        started = interval >= self.traces.offsets[trace]
        online = np.zeros(clients.shape, dtype=bool)
        online[started] = t[started] < self._end(cycle[started], interval[started])
        return online

    def _next_online(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        trace = self.trace_of(clients)
        moment = self._following_start(trace, t)
        late = np.flatnonzero(~self._available(clients, moment))  # only where a rounding joined or split edges
        while late.size:
            moment[late] = self._following_start(trace[late], moment[late])
            late = late[~self._available(clients[late], moment[late])]
        return moment

    def _online_end(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        trace = self.trace_of(clients)
        starts, ends, offsets = self.traces.starts, self.traces.ends, self.traces.offsets
        first = offsets[trace]
        forever = (offsets[trace + 1] - first == 1) & (starts[first] == 0) & (ends[first] == self.traces.span_s)
        moment = np.full(clients.shape, np.inf)
        going = np.flatnonzero(~forever)
        moment[going] = self._current_end(trace[going], t[going])
        going = going[self._available(clients[going], moment[going])]  # the interval joins the next repetition's
        while going.size:
            moment[going] = self._current_end(trace[going], moment[going])
            going = going[self._available(clients[going], moment[going])]
        return moment

    def _cycle(self, t: np.ndarray) -> np.ndarray:
        """The repetition m (a float) with m · S ≤ t < (m + 1) · S, as those products round."""
        span = self.traces.span_s
        cycle = np.floor(t / span)
        cycle = np.where((cycle + 1) * span <= t, cycle + 1, cycle)
        return np.where(cycle * span > t, cycle - 1, cycle)

    def _start(self, cycle: np.ndarray, interval: np.ndarray) -> np.ndarray:
        span = self.traces.span_s
        return np.minimum(cycle * span + self.traces.starts[interval], (cycle + 1) * span)

    def _end(self, cycle: np.ndarray, interval: np.ndarray) -> np.ndarray:
        span, end = self.traces.span_s, self.traces.ends[interval]
        return np.where(end == span, (cycle + 1) * span, np.minimum(cycle * span + end, (cycle + 1) * span))

    def _last_starting(self, trace: np.ndarray, cycle: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The last interval of each trace's repetition ``cycle`` that starts at or before t (its first − 1: none)."""
        low, high = self.traces.offsets[trace], self.traces.offsets[trace + 1]
        last = self.traces.starts.size - 1
        while np.any(open_ := low < high):
            middle = np.minimum((low + high) // 2, last)
            before = self._start(cycle, middle) <= t
            low = np.where(open_ & before, middle + 1, low)
            high = np.where(open_ & ~before, middle, high)
        return low - 1

    def _following_start(self, trace: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The first interval start after t, for clients offline at t."""
        cycle = self._cycle(t)
        following = self._last_starting(trace, cycle, t) + 1
        within = following < self.traces.offsets[trace + 1]
        return np.where(within, self._start(cycle, np.where(within, following, self.traces.offsets[trace])),
                        self._start(cycle + 1, self.traces.offsets[trace]))

    def _current_end(self, trace: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The end of the interval holding t, for clients online at t."""
        cycle = self._cycle(t)
        return self._end(cycle, self._last_starting(trace, cycle, t))
