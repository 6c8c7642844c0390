"""A run's clock: one object for the whole run, its virtual time carried from stage to stage, that turns each
scheduled round into who trains, when the round ends and what it cost.

Each round, in round order (:meth:`RunClock.round`): the selector picks among
the clients online at the round's start (the schedule's row is today's draw),
each selected client's task (a :class:`~fedray.clock.costs.TaskCost`) becomes
durations on its device, and the round scheduler
(:class:`~fedray.clock.rounds.SynchronousRounds` today, an asynchronous one
next) decides who finishes, who straggles and who drops out, and when the
round ends; the next round starts then. Everything is a pure function of the
run's seed, the devices, the costs and the availability: the order in which
Ray's tasks return never reaches it, and the rounds of a closed form are known
before any of them runs.

The finishers keep the order the selector gave them (with everyone online and
no over-commitment, the schedule's row: the clients of today's round in
today's order, so a clock that changes nothing changes no bit).

A round's duration is split into compute and communication along its critical
path, the kept client whose upload arrived last: ``compute_s`` is that client's
computing time (its partial steps' under ``--stragglers partial``), and
``comm_s`` the rest of the round (that client's download and upload, and any
wait beyond it: for a deadline or a dropout when no upload ends the round).
A round with no upload counts all of its duration as ``comm_s``. A round that finds nobody online at its start waits
for the first client to come online and starts then: that idle time is in neither part (it is in ``clock_s``).
A closed form's round is told the clients the stage still has to hear
(:class:`~fedray.clock.hearing.StillToHear`): it draws only among them, and waits for the first of them to come
online when none is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from fedray.clock.asynchronous import AsyncPlan, AsynchronousRounds, plan_async
from fedray.clock.availability import Availability
from fedray.clock.costs import TaskCost
from fedray.clock.devices import Devices
from fedray.clock.hearing import StillToHear
from fedray.clock.round_log import NOTHING_LOST, ClockedRound, RoundLog
from fedray.clock.rounds import SynchronousRounds
from fedray.clock.selector import ClientHistory, RoundContext, Selector, check_selection
from fedray.core.errors import FedrayError

Costs = Callable[[np.ndarray], TaskCost]
"""The task of each of the given clients (ids) in a round: one amount for all, or one per client in their order."""
Steps = Callable[[np.ndarray], np.ndarray]
"""The local steps each of the given clients takes in a round (all of them: its whole task)."""


class RunClock:
    """The clock of a run (see the module's note): ``round`` advances it, ``columns`` says where it stood after a
    round, ``table`` is rounds.parquet."""

    def __init__(self, devices: Devices, availability: Availability | None, scheduler: SynchronousRounds,
                 selector: Selector, selector_name: str, num_clients: int, per_round: int, seed: int,
                 sized_by_draw: bool = False, every_s: float | None = None,
                 asynchronous: AsynchronousRounds = AsynchronousRounds()) -> None:
        """``availability`` None: every client always online; ``sized_by_draw``: a round keeps every upload of its
        selection (Poisson sampling, whose rounds' size is random by design), not the scheduled row's count;
        ``every_s``: evaluate every that many virtual seconds (None: by rounds); ``asynchronous``: training's
        scheduler when it is not synchronous rounds (:mod:`fedray.clock.asynchronous`)."""
        self.devices, self.availability, self.scheduler = devices, availability, scheduler
        self.asynchronous = asynchronous
        self.selector, self.selector_name = selector, selector_name
        self.num_clients, self.per_round, self.seed, self.sized_by_draw = num_clients, per_round, seed, sized_by_draw
        self.every_s = every_s
        self.history = ClientHistory(num_clients, kept=selector.reads_history or selector.uses_utility)
        self.now = 0.0
        self.log = RoundLog()
        """Its rounds' rows and running totals (what :meth:`columns` reads in O(log rounds)); a round's clients are
        its stage's to keep (:mod:`fedray.clock.round_log`)."""

    def check(self, cost: TaskCost) -> None:
        """Refuse, in one line before any work, a deadline that no client's ``cost`` (one per client of the
        population, or one for all) can meet on the fastest device of the table (its rates without jitter), and
        availability where no round can ever fill."""
        if self.availability is not None:
            self.availability.check_rounds_can_fill(self.per_round, self.num_clients)
        deadline = self.scheduler.deadline
        if deadline is None:
            return
        table = self.devices.table
        quickest = float(np.min(cost.macs / table.macs_per_s.max() + np.asarray(cost.down_bytes) * 8.0 /
                                table.down_bps.max() + np.asarray(cost.up_bytes) * 8.0 / table.up_bps.max()))
        if quickest > deadline:
            raise FedrayError(f"--deadline {deadline:g}: no device can meet it: the quickest client's task takes "
                              f"{quickest:.6g} s on the fastest device of {table.source}")

    def round(self, number: int, stage: str, scheduled: np.ndarray, costs: Costs, local_steps: Steps | None = None,
              places: int | None = None, hearing: StillToHear | None = None) -> ClockedRound:
        """Round ``number`` of ``stage`` from the schedule's row ``scheduled``, starting when the last one ended.

        ``places``: the clients the round keeps (None: the row's; a closed form's row less the clients it heard
        through another round has fewer, a round after its schedule's none). ``hearing``: the clients a closed form
        still has to hear (None: a training round), the only ones it draws beyond the row; a round that finds none of
        them online at its start starts when the first comes online
        (:meth:`~fedray.clock.hearing.StillToHear.next_online`), its selector asked then only. Without ``hearing``, a
        round that finds nobody online starts when the first client comes online (O(K), only then)."""
        scheduled = np.asarray(scheduled, dtype=np.int64)
        places = len(scheduled) if places is None else places
        start, devices, seed = self.now, self.devices, self.seed
        waited = False
        if hearing is not None and places and self.availability is not None:
            start, waited = self._heard_start(start, hearing)
        context = self._context(number, start, scheduled, places, costs, hearing)
        selected = self._selected(context)
        if not waited and places and self.availability is not None and self._waits(context, selected):
            online = float(self.availability.next_available(np.arange(self.num_clients), start).min()) \
                if hearing is None else hearing.next_online(start)
            if np.isfinite(online):
                start = online
                context = self._context(number, start, scheduled, places, costs, hearing)
                selected = self._selected(context)
        cost = costs(selected)
        durations = devices.durations(selected, number, cost, seed)
        comm_s = durations.down_s + durations.up_s
        steps = None
        if self.scheduler.partial:
            steps = np.ones(len(selected), dtype=np.int64) if local_steps is None else local_steps(selected)
        keep = len(selected) if self.sized_by_draw else places
        outcome = self.scheduler.run(selected, durations.compute_s, comm_s, start, keep, steps, self.availability)
        at = outcome.kept  # each finisher's place among the selected, in arrival order
        kept = np.zeros(len(selected), dtype=bool)
        kept[at] = True
        clients = selected if len(at) == len(selected) else selected[kept]  # everyone kept: the same array, once
        self.history.record(outcome.finished, number, outcome.finish_s - start)
        compute = 0.0
        if len(outcome.finished):
            last = at[-1]  # finished is in arrival order: the last kept upload ends the critical path
            share = 1.0 if steps is None or outcome.steps is None else outcome.steps[-1] / steps[last]
            compute = min(float(durations.compute_s[last] * share), outcome.end_s - start)
        clients_steps = None
        if outcome.steps is not None and self.scheduler.partial:
            clients_steps = outcome.steps[np.argsort(at)].astype(np.int64)  # in the selector's order, as ``clients``
        lost = NOTHING_LOST
        if len(outcome.stragglers) or len(outcome.dropped):
            lost = np.union1d(outcome.stragglers, outcome.dropped)
            lost = lost[~np.isin(lost, clients)]  # a partial straggler's steps arrived
        up = np.broadcast_to(np.asarray(cost.up_bytes, dtype=np.float64), selected.shape)
        down = np.broadcast_to(np.asarray(cost.down_bytes, dtype=np.float64), selected.shape)
        record = ClockedRound(number, stage, start, outcome.end_s, selected, clients, clients_steps,
                              len(outcome.stragglers), len(outcome.dropped), float(up[kept].sum()),
                              float(down.sum()), compute, outcome.end_s - start - compute, lost)
        self.append(record)
        self.now = outcome.end_s
        return record

    def asynchronous_steps(self, steps: int, schedule: list[np.ndarray], costs: Costs, first_round: int,
                           stage: str) -> tuple[AsyncPlan, list[ClockedRound]]:
        """``steps`` server steps of the run's asynchronous scheduler (:mod:`fedray.clock.asynchronous`) from the
        clock's present, which they advance, each appended as one of the clock's rounds (rounds.parquet's rows: its
        dispatched clients as ``selected``, its updates as ``finished``, the updates dropped as too stale as
        ``stragglers``).

        Dispatch wave w asks first for the idle online clients of the schedule's row w (where it has one: with a
        buffer equal to the concurrency on equal devices, the synchronous rounds' draw), then fills uniformly among
        the idle online clients (the uniform selector's stream). Returns the plan and its steps' records."""
        concurrency, buffer = self.asynchronous.sizes(self.per_round)
        if concurrency > self.num_clients:
            raise FedrayError(f"--concurrency {concurrency} is more than the federation's {self.num_clients} clients")

        def pick(wave: int, t: float, count: int, busy: np.ndarray) -> np.ndarray:
            row = schedule[wave - 1] if wave <= len(schedule) else np.empty(0, dtype=np.int64)
            context = RoundContext(first_round + wave, t, self.per_round, count, self.num_clients, self.seed,
                                   np.asarray(row, dtype=np.int64), self.history, self.availability)
            scheduled = context.scheduled  # after the schedule's rows: empty, with no lookup
            kept = scheduled[context.online(scheduled) & ~busy[scheduled]][:count] if len(scheduled) else scheduled
            if len(kept) == count:
                return kept
            return np.concatenate((kept, context.draw_online(count - len(kept), kept, lambda clients: ~busy[clients])))

        plan = plan_async(steps, concurrency, buffer, self.asynchronous.max_staleness, pick, costs, self.devices,
                          self.availability, self.num_clients, self.seed, self.now)
        records = []
        for step in plan.aggregations:
            record = ClockedRound(first_round + step.number, stage, step.start_s, step.end_s, step.dispatched,
                                  step.clients, None, step.stale, step.dropped, step.bytes_up, step.bytes_down,
                                  step.compute_s, step.end_s - step.start_s - step.compute_s,
                                  staleness=np.bincount(step.staleness))
            self.append(record)
            self.history.record(step.clients, record.number, step.end_s - step.start_s)
            self.now = step.end_s
            records.append(record)
        return plan, records

    @property
    def measures_losses(self) -> bool:
        """Whether training's rounds measure their clients' losses: its selector reads their utility and picks the
        clients of synchronous rounds (the asynchronous schedulers' dispatch does not ask it)."""
        return self.selector.uses_utility and not self.asynchronous.asynchronous

    @property
    def partial(self) -> bool:
        """Whether a late client sends the local steps it finished by the deadline (``--stragglers partial``)."""
        return self.scheduler.partial

    def population_kept(self) -> AbstractContextManager[None]:
        """Inside, the availability model keeps what it may of every client for lookups over many of them, round after
        round (:meth:`Availability.population_kept`)."""
        return nullcontext() if self.availability is None else self.availability.population_kept(self.num_clients)

    def still_to_hear(self, schedule: Sequence[np.ndarray], num_clients: int) -> StillToHear:
        """Who a closed form's stage has to hear, from its schedule, on this clock's availability."""
        return StillToHear.of(schedule, num_clients, self.availability)

    def append(self, record: ClockedRound) -> None:
        """``record`` after the others (its number after theirs, or the last one's in another stage: TCT's closed form
        and SCAFFOLD's first round), and the totals after it (a round another scheduler ran: asynchronous server
        steps)."""
        last = self.log.last()
        if last is not None and (record.number < last[0] or record.number == last[0] and record.stage == last[1]):
            raise FedrayError(f"the clock's round {record.number} comes after its round {last[0]}: "
                              f"rounds are clocked in the run's order")
        self.log.append(record)

    def _context(self, number: int, start: float, scheduled: np.ndarray, places: int, costs: Costs,
                 hearing: StillToHear | None) -> RoundContext:
        """What the selector knows of round ``number`` starting at ``start``."""
        devices, seed = self.devices, self.seed
        wanted = len(scheduled) if self.sized_by_draw else self.scheduler.wanted(places, self.num_clients)
        return RoundContext(number, start, self.per_round, wanted, self.num_clients, seed, scheduled, self.history,
                            self.availability,
                            lambda clients: devices.durations(clients, number, costs(clients), seed).total_s,
                            None if hearing is None else hearing.eligible,
                            None if hearing is None else lambda: hearing.online(start),
                            None if hearing is None else hearing.found)

    def _selected(self, context: RoundContext) -> np.ndarray:
        """The selector's clients for the round of ``context``, checked."""
        return check_selection(context, self.selector.select(context), self.selector_name)

    @staticmethod
    def _heard_start(start: float, hearing: StillToHear) -> tuple[float, bool]:
        """When a round of a closed form that could start at ``start`` does, and whether it waited: at ``start`` if a
        client it still has to hear is online then, else when the first comes online, found in the hearing's calendar
        without asking the selector at ``start`` (whose choice such a round drops: :meth:`_waits`). Leaves the
        hearing's count of the clients found online as it was where the round does not wait, so that its selector
        sees what it saw before."""
        if hearing.surely_online(start):
            return start, False
        found = hearing.found
        online = hearing.next_online(start)
        if start < online < np.inf:
            return online, True
        hearing.found = found
        return start, False

    @staticmethod
    def _waits(context: RoundContext, selected: np.ndarray) -> bool:
        """Whether the round waits for a client to come online: it asks nobody, or (with an eligible set) none of the
        clients it still has to hear while none of them is online at its start (one draw: O(κ) while they are a fair
        share of the online clients, else a pass over them)."""
        if context.eligible is None:
            return not len(selected)
        return not context.eligible[selected].any() and not len(context.draw_online(1))

    def columns(self, number: int, after: int | None = None) -> dict[str, float | int]:
        """The clock's columns of the row after the run's round ``number``: virtual seconds at its end and their
        split, and the stragglers and dropouts so far (a row before any round: the clock's start). Running totals
        kept round by round, added in the rounds' order: O(log rounds) a row.

        Under an asynchronous scheduler also ``aggregations``, the server steps so far, and, where the row's
        window (the rounds after round ``after``, the row before's, up to ``number``; None: from the start) holds
        server steps, the staleness of the updates they aggregated (:meth:`staleness_columns`)."""
        done = self.log.done_by(number)
        values = self.log.totals(done)
        if self.asynchronous.asynchronous:
            values["aggregations"] = self.log.aggregations(done)
            values |= self.staleness_columns(0 if after is None else self.log.done_by(after), done)
        return values

    def staleness_columns(self, first: int, stop: int) -> dict[str, float | int]:
        """``staleness_mean`` and ``staleness_max`` of the updates the server steps among the rounds ``first`` ..
        ``stop`` - 1 (in the clock's order) aggregated (none when they hold no server step): O(the window's steps)."""
        counts = self.log.staleness(first, stop)
        if not counts:
            return {}
        histogram = np.zeros(max(len(count) for count in counts), dtype=np.int64)
        for count in counts:
            histogram[:len(count)] += count
        total = int(histogram @ np.arange(len(histogram)))
        return {"staleness_mean": total / int(histogram.sum()), "staleness_max": int(np.flatnonzero(histogram)[-1])}

    def evaluate_at(self, ends: Sequence[float], start_s: float) -> set[int] | None:
        """The rounds (numbered from 1) that end at ``ends`` and started at ``start_s``, evaluated every ``every_s``
        virtual seconds (:func:`evaluated_rounds`); None when the run evaluates by rounds."""
        if self.every_s is None:
            return None
        return evaluated_rounds(np.asarray(ends, dtype=np.float64), start_s, self.every_s)

    def table(self) -> pa.Table:
        """rounds.parquet: one row a round, in order (an asynchronous step's with its ``staleness_counts``)."""
        return self.log.table()


def evaluated_rounds(ends: np.ndarray, start_s: float, every_s: float) -> set[int]:
    """The rounds (numbered from 1 in ``ends``' order) evaluated every ``every_s`` virtual seconds: the first round
    ending at or after each multiple of ``every_s`` (since the run's start), and the last; ``start_s``: when the first
    round started."""
    ends = np.asarray(ends, dtype=np.float64)
    passed = np.floor(np.concatenate(([start_s], ends)) / every_s)
    chosen = {int(number) for number in np.flatnonzero(passed[1:] > passed[:-1]) + 1}
    return chosen | ({len(ends)} if len(ends) else set())
