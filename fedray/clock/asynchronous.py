"""Asynchronous rounds on the clock (FedBuff, FedAsync): who trains from which model version, and which updates each
server step aggregates — a pure function of the devices, the availability, the selection and the options.

``--scheduler fedbuff`` (Nguyen et al. 2022) keeps ``--concurrency`` M clients
training at once and steps the server every ``--buffer`` K arrived updates;
``--scheduler fedasync`` (Xie et al. 2019) steps on every update (K = 1),
mixing the client's model in with rate α. The events, in virtual time:

* At time 0 the scheduler dispatches M clients picked among those online; each
  downloads the model version current at its dispatch and finishes after its
  download, its local training and its upload (its device's durations, the
  jitter of its dispatch's wave).
* A client online for the whole of its task arrives at its finish, with
  staleness s = (server version now) − (version it downloaded). An update
  staler than ``--max-staleness`` is dropped; the others join the buffer, and
  when the buffer holds K updates the server steps once (the version grows by
  one). A client that goes offline before it finishes is lost when it goes
  offline (its compute spent, nothing sent).
* Each freed slot is refilled at once: the new client downloads the version
  current then. Events at the same virtual time: first every arrival and loss,
  in client-id order (the server stepping each time the buffer fills), then the
  refills, as one wave. When fewer clients are online (and not training) than
  slots are free, the rest are refilled when the first of them comes online.
* ``--rounds`` counts server steps; the run ends at the last one, and clients
  still training then are not needed.

Every update an aggregation takes was dispatched at a version before it, so a
run trains the clients dispatched at version v from the model of version v,
together, as one batch (:meth:`AsyncPlan.trained_from`): the shards still train
many clients at once. With a buffer equal to the concurrency and devices that
all take the same time, every update arrives at staleness 0 and each step
aggregates the clients dispatched at the version before: synchronous rounds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np

from fedray.clock.availability import Availability
from fedray.clock.costs import TaskCost
from fedray.clock.devices import Devices
from fedray.core.errors import FedrayError
from fedray.core.options import Metavar, Unset

SCHEDULERS = ("sync", "fedbuff", "fedasync")
STALENESS_FORMS = "constant|sqrt|poly:A|hinge:A,B"
FEDASYNC_MIXING = 0.6
"""FedAsync's mixing rate α when none is given (the value of the paper's main experiments)."""

Pick = Callable[[int, float, int, np.ndarray], np.ndarray]
"""``pick(wave, t, count, busy)``: up to ``count`` distinct clients online at ``t`` and not ``busy`` (a read-only bool
array over the clients: training now), in the order chosen; fewer only when fewer are such."""
Costs = Callable[[np.ndarray], TaskCost]
"""The task of each of the given clients."""


def staleness_weights(form: str) -> Callable[[np.ndarray], np.ndarray]:
    """The staleness function a spec names, as a map of staleness arrays to weights in (0, 1], non-increasing:
    ``constant`` 1; ``sqrt`` 1/√(1+s) (FedBuff's); ``poly:A`` (1+s)^−A; ``hinge:A,B`` 1 up to B, then 1/(A·(s−B)+1)
    (FedAsync's)."""
    name, _, arguments = form.partition(":")
    try:
        values = [float(value) for value in arguments.split(",")] if arguments else []
    except ValueError:
        values = None
    expected = {"constant": 0, "sqrt": 0, "poly": 1, "hinge": 2}.get(name)
    if expected is None or values is None or len(values) != expected:
        raise FedrayError(f"--staleness must be {STALENESS_FORMS}, got {form!r}")
    if any(not (math.isfinite(value) and value >= 0) for value in values):
        raise FedrayError(f"--staleness {form}: its parameters must be finite numbers ≥ 0 (a staleness function "
                          f"must not grow with staleness)")
    if name == "constant":
        return lambda s: np.ones(np.shape(s))
    if name == "sqrt":
        return lambda s: 1.0 / np.sqrt(1.0 + np.asarray(s, dtype=np.float64))
    if name == "poly":
        return lambda s: (1.0 + np.asarray(s, dtype=np.float64)) ** -values[0]
    a, b = values
    return lambda s: np.where(np.asarray(s) <= b, 1.0, 1.0 / (a * (np.asarray(s, dtype=np.float64) - b) + 1.0))


@dataclass(frozen=True)
class AsynchronousRounds:
    """``--scheduler`` and its options (see the module's note); the default, ``sync``, is the synchronous round."""

    scheduler: Annotated[Literal["sync", "fedbuff", "fedasync"] | None, "sync: rounds that wait for their clients; "
                         "fedbuff: --concurrency clients training at once, the server stepping every --buffer "
                         "updates; fedasync: stepping on every update, mixing it in at rate --mixing",
                         Unset("sync")] = None
    concurrency: Annotated[int | None, "clients training at once (fedbuff, fedasync)",
                           Unset("κ, the clients a round"), Metavar("M")] = None
    buffer: Annotated[int | None, "updates a server step aggregates (fedbuff)",
                      Unset("⌈M / 2⌉; 1 for fedasync"), Metavar("K")] = None
    staleness: Annotated[str | None, "the weight of an update s versions old: constant, sqrt (1/√(1+s)), poly:A "
                         "((1+s)^−A) or hinge:A,B (1 up to B, then 1/(A·(s−B)+1))", Unset("sqrt"),
                         Metavar(STALENESS_FORMS)] = None
    max_staleness: Annotated[int | None, "drop updates more than this many versions old", Unset("none"),
                             Metavar("S")] = None
    mixing: Annotated[float | None, "fedasync's mixing rate α: θ ← (1 − α·w(s))·θ + α·w(s)·θ_k",
                      Unset("0.6"), Metavar("ALPHA")] = None
    staleness_divide: Annotated[Literal["weighted", "plain"] | None, "a fedbuff step divides the staleness-weighted "
                                "sum of updates by their weighted total (weighted, FedScale's) or by their plain "
                                "total (plain, the FedBuff paper's)", Unset("weighted")] = None

    def __post_init__(self) -> None:
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise FedrayError(f"--scheduler must be {'|'.join(SCHEDULERS)}, got {self.scheduler!r}")
        for name in ("concurrency", "buffer"):
            value = getattr(self, name)
            if value is not None and not value >= 1:
                raise FedrayError(f"--{name} must be ≥ 1, got {value}")
        if self.concurrency is not None and self.buffer is not None and self.buffer > self.concurrency:
            raise FedrayError(f"--buffer {self.buffer} is more than --concurrency {self.concurrency}: no server step "
                              f"could ever fill its buffer")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise FedrayError(f"--max-staleness must be ≥ 0, got {self.max_staleness}")
        if self.mixing is not None and not 0 < self.mixing <= 1:
            raise FedrayError(f"--mixing must be in (0, 1], got {self.mixing}")
        if self.staleness is not None:
            staleness_weights(self.staleness)
        if self.scheduler == "fedasync" and self.buffer not in (None, 1):
            raise FedrayError(f"--scheduler fedasync steps on every update: --buffer {self.buffer} is fedbuff's")

    @property
    def asynchronous(self) -> bool:
        return self.scheduler in ("fedbuff", "fedasync")

    @property
    def flag(self) -> str:
        """The option as a user gave it, for messages: ``--scheduler fedbuff``."""
        return f"--scheduler {self.scheduler or 'sync'}"

    @property
    def mixing_rate(self) -> float | None:
        """fedasync's α (its default when not given); None for a scheduler that does not mix."""
        return (self.mixing or FEDASYNC_MIXING) if self.scheduler == "fedasync" else None

    @property
    def divides_plainly(self) -> bool:
        """Whether a fedbuff step divides by the updates' plain total (the FedBuff paper's), not their weighted one."""
        return self.staleness_divide == "plain"

    def sizes(self, per_round: int) -> tuple[int, int]:
        """The concurrency M and the buffer K of a run of ``per_round`` clients a round."""
        concurrency = self.concurrency or per_round
        buffer = 1 if self.scheduler == "fedasync" else self.buffer or -(-concurrency // 2)
        if buffer > concurrency:
            raise FedrayError(f"--buffer {buffer} is more than the concurrency {concurrency}: no server step could "
                              f"ever fill its buffer")
        return concurrency, buffer

    def staleness_function(self) -> Callable[[np.ndarray], np.ndarray]:
        """The weight w(s) of an update s versions old (``--staleness``, 1/√(1+s) when not given)."""
        return staleness_weights(self.staleness or "sqrt")


@dataclass(frozen=True)
class Aggregation:
    """One server step of an asynchronous run, as rounds.parquet holds it."""

    number: int
    start_s: float
    """When the step before it happened (0 for the first)."""
    end_s: float
    """When this step happened: its buffer's last arrival."""
    clients: np.ndarray
    """The updates it aggregates, in arrival order (time, then client id)."""
    versions: np.ndarray
    """The version each of them downloaded (staleness = number − 1 − version)."""
    dispatches: np.ndarray
    """Each one's place in the run's order of dispatches (the order a version's clients train in)."""
    dispatched: np.ndarray
    """The clients dispatched since the step before (their downloads), in dispatch order."""
    stale: int
    """Updates dropped since the step before, staler than ``--max-staleness``."""
    dropped: int
    """Clients lost since the step before: offline before they finished."""
    bytes_up: float
    """The uploads that arrived since the step before (stale ones too)."""
    bytes_down: float
    """The downloads of the clients dispatched since the step before."""
    compute_s: float
    """The computing time of the update that filled the buffer (the rest of the step's time is communication and
    waiting)."""

    @property
    def staleness(self) -> np.ndarray:
        return self.number - 1 - self.versions


@dataclass(frozen=True)
class AsyncPlan:
    """A run's asynchronous events: its server steps and, for each model version, the updates trained from it."""

    aggregations: list[Aggregation]

    def trained_from(self) -> list[dict[int, np.ndarray]]:
        """For each version 0 .. steps − 1, the clients trained from it whose updates a step takes, by that step's
        number (ascending), each in the order they were dispatched (with a buffer equal to the concurrency on equal
        devices: the synchronous round's order). O(updates log updates)."""
        groups: list[dict[int, np.ndarray]] = [{} for _ in self.aggregations]
        for aggregation in self.aggregations:
            for version in np.unique(aggregation.versions).tolist():
                mine = aggregation.versions == version
                order = np.argsort(aggregation.dispatches[mine], kind="stable")
                groups[version][aggregation.number] = aggregation.clients[mine][order]
        return [dict(sorted(group.items())) for group in groups]


@dataclass
class _Tally:
    """What happened since the last server step."""

    dispatched: list[np.ndarray] = field(default_factory=list)
    stale: int = 0
    dropped: int = 0
    up: float = 0.0
    down: float = 0.0
    sequence: int = 0
    """Dispatches since the run's start (carried from step to step)."""


def plan_async(steps: int, concurrency: int, buffer: int, max_staleness: int | None, pick: Pick, costs: Costs,
               devices: Devices, availability: Availability | None, num_clients: int, seed: int,
               start_s: float = 0.0) -> AsyncPlan:
    """The events of ``steps`` server steps (see the module's note), from ``start_s``."""
    if buffer > concurrency:
        raise FedrayError(f"--buffer {buffer} is more than the concurrency {concurrency}")
    events: list[tuple[float, int, int, bool]] = []  # (time, client, version, arrives)
    training: dict[int, tuple[int, float, float, int]] = {}  # client -> (version, up bytes, compute s, dispatch)
    busy = np.zeros(num_clients, dtype=bool)  # training's clients, for O(1) lookups (no pass over them per event)
    seen_busy = busy.view()
    seen_busy.flags.writeable = False
    aggregations: list[Aggregation] = []
    buffered: list[tuple[int, int, int]] = []
    version, wave, now, last_step = 0, 0, start_s, start_s
    tally = _Tally()

    def dispatch(t: float) -> float:
        """Fill the free slots at ``t``; when some stay free, the time the first idle client comes online."""
        nonlocal wave
        free = concurrency - len(training)
        if free <= 0:
            return math.inf
        wave += 1
        clients = np.asarray(pick(wave, t, free, seen_busy), dtype=np.int64)
        if len(clients):
            busy[clients] = True
            cost = costs(clients)
            durations = devices.durations(clients, wave, cost, seed)
            finish = t + durations.total_s
            lost_at = finish if availability is None else np.minimum(availability.online_until(clients, t), finish)
            arrives = lost_at >= finish
            up = np.broadcast_to(np.asarray(cost.up_bytes, dtype=np.float64), clients.shape)
            down = np.broadcast_to(np.asarray(cost.down_bytes, dtype=np.float64), clients.shape)
            for client, end, ok, sent, computing in zip(clients.tolist(), np.where(arrives, finish, lost_at).tolist(),
                                                        arrives.tolist(), up.tolist(), durations.compute_s.tolist()):
                training[client] = (version, sent, computing, tally.sequence)
                tally.sequence += 1
                heapq.heappush(events, (end, client, version, ok))
            tally.dispatched.append(clients)
            tally.down += float(down.sum())
        if len(clients) == free or availability is None:
            return math.inf
        idle = np.flatnonzero(~busy)
        later = availability.next_available(idle, np.nextafter(t, math.inf)) if len(idle) else np.array([math.inf])
        return float(later.min())

    retry = dispatch(now)
    while len(aggregations) < steps:
        if not events and not math.isfinite(retry):
            raise FedrayError(f"the asynchronous run stopped after {len(aggregations)} of {steps} server steps: "
                              f"no client will ever come online to train")
        now = min(events[0][0] if events else math.inf, retry)
        while events and events[0][0] == now and len(aggregations) < steps:
            _, client, downloaded, arrives = heapq.heappop(events)
            _, sent, computing, sequence = training.pop(client)
            busy[client] = False
            if not arrives:
                tally.dropped += 1
                continue
            tally.up += sent
            if max_staleness is not None and version - downloaded > max_staleness:
                tally.stale += 1
                continue
            buffered.append((client, downloaded, sequence))
            if len(buffered) == buffer:
                version += 1
                clients, versions, dispatches = (np.array(column, dtype=np.int64) for column in zip(*buffered))
                asked = np.concatenate(tally.dispatched or [np.empty(0)]).astype(np.int64)
                aggregations.append(Aggregation(version, last_step, now, clients, versions, dispatches, asked,
                                                tally.stale, tally.dropped, tally.up, tally.down,
                                                min(computing, now - last_step)))
                buffered, last_step, tally = [], now, _Tally(sequence=tally.sequence)
        if len(aggregations) < steps:
            retry = dispatch(now)
    return AsyncPlan(aggregations)
