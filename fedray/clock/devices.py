"""The clients' devices: a device table, each client's device drawn once from it, and a task's durations on it.

A device table is a CSV or Parquet file, one row a device, the units in the column names:

- ``macs_per_s`` (multiply-adds per second), ``down_bps`` and ``up_bps`` (bits per second): finite rates > 0;
- optional ``macs_jitter``, ``down_jitter``, ``up_jitter`` (default 0): the σ ≥ 0 of a lognormal factor of median 1
  that multiplies the device's compute, download and upload time, drawn anew each round;
- ``share``: the device's share of the population (> 0, summing to 1 within 1e-9), each client's device drawn by the
  inverse CDF of the shares from the stream (seed, 40, client); or instead ``client_id``: one row per client of the
  population (ids 0 .. K − 1, each once), for a trace that knows each client's device;
- optional ``name``: a label of the device, which nothing reads.

Rows are numbered from 1, the header not counted. A task of ``macs`` multiply-adds, ``down_bytes`` and ``up_bytes``
takes ``macs / macs_per_s``, ``down_bytes · 8 / down_bps`` and ``up_bytes · 8 / up_bps`` seconds, each times its
jitter factor from the stream (seed, 41, client, round), draws 0, 1 and 2: a pure function of the table, the seed,
the client, the round and the task, never a measurement of this machine.

Built-in tables by name (``fedray/clock/tables/``, their provenance in its README): ``uniform``, every client the
same nominal phone (the ``phones`` table's median rates, no jitter: the default; the engine runs a ``uniform`` clock
as no clock unless a deadline or an evaluation in seconds asks for time, and its durations still give time to
accuracy a scale), and ``phones``, FLASH's 19 measured network-speed distributions crossed with ten compute tiers
of AI-Benchmark's phones, anchored to FLASH's measured on-device training time of a Pixel 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, NamedTuple

import numpy as np

from fedray.clock.costs import TaskCost
from fedray.clock.streams import lognormal_factors, uniforms
from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.options import Metavar, Unset

pa = lazy_module("pyarrow", globals())
pc = lazy_module("pyarrow.compute", globals())
pa_csv = lazy_module("pyarrow.csv", globals())
pq = lazy_module("pyarrow.parquet", globals())

ASSIGNMENT_STREAM = 40
"""The stream of each client's device: (seed, 40, client)."""
JITTER_STREAM = 41
"""The stream of the per-round jitter factors: (seed, 41, client, round), draws 0 (compute), 1 (down), 2 (up)."""

RATES = {"macs_per_s": "multiply-adds per second", "down_bps": "bits per second", "up_bps": "bits per second"}
JITTERS = ("macs_jitter", "down_jitter", "up_jitter")
COLUMNS = (*RATES, *JITTERS, "share", "client_id", "name")
SHARE_TOLERANCE = 1e-9
BUILT_INS = {"uniform": "uniform.csv", "phones": "phones.csv"}
DEFAULT_TABLE = "uniform"
"""The table of a run that gives no ``--devices`` (None) but another option of the clock."""
"""The tables fedray ships, by name: files of ``fedray/clock/tables/``."""


class Durations(NamedTuple):
    """Seconds of a task's three parts for each client (float64 arrays in the clients' order)."""

    compute_s: np.ndarray
    down_s: np.ndarray
    up_s: np.ndarray

    @property
    def total_s(self) -> np.ndarray:
        """The whole task: download, compute, upload, one after the other."""
        return self.down_s + self.compute_s + self.up_s


@dataclass(frozen=True, eq=False)
class DeviceTable:
    """A validated device table (see the module docstring): one float64 array per rate and jitter, one entry a row,
    and either the rows' population shares or their client ids."""

    source: str
    """The file, or the built-in table's name, that error messages name."""
    macs_per_s: np.ndarray
    down_bps: np.ndarray
    up_bps: np.ndarray
    macs_jitter: np.ndarray
    down_jitter: np.ndarray
    up_jitter: np.ndarray
    share: np.ndarray | None = None
    client_id: np.ndarray | None = None
    name: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.macs_per_s)


def load_table(devices: str) -> DeviceTable:
    """The device table ``devices`` names (a built-in's name or a .csv / .parquet file), validated: any problem is a
    one-line error naming the file, the column and the row."""
    if devices in BUILT_INS:
        with resources.as_file(resources.files("fedray.clock") / "tables" / BUILT_INS[devices]) as path:
            return _validated(devices, _read(path, devices))
    path = Path(devices)
    if path.suffix.lower() not in (".csv", ".parquet"):
        names = ", ".join(BUILT_INS)
        raise FedrayError(f"--devices takes {names} or a .csv or .parquet device table, got {devices!r}")
    if not path.is_file():
        raise FedrayError(f"devices table {devices}: no such file")
    return _validated(devices, _read(path, devices))


def _read(path: Path, source: str) -> pa.Table:
    try:
        if path.suffix.lower() == ".parquet":
            return pq.read_table(path)
        return pa_csv.read_csv(path, convert_options=pa_csv.ConvertOptions(null_values=[""]))
    except (pa.ArrowException, OSError) as error:
        raise FedrayError(f"devices table {source}: unreadable ({str(error).splitlines()[0]})") from None


def _validated(source: str, table: pa.Table) -> DeviceTable:
    where = f"devices table {source}"
    for column in table.column_names:
        if column not in COLUMNS:
            raise FedrayError(f"{where}: {_unknown(column)}")
    if len(set(table.column_names)) < len(table.column_names):
        raise FedrayError(f"{where}: a column appears twice ({', '.join(table.column_names)})")
    for column in RATES:
        if column not in table.column_names:
            raise FedrayError(f"{where}: no column {column} ({RATES[column]}); a device table has macs_per_s, "
                              "down_bps, up_bps and share or client_id")
    if ("share" in table.column_names) == ("client_id" in table.column_names):
        raise FedrayError(f"{where}: give a column share (of the population) or a column client_id (one row per "
                          "client), exactly one of them")
    if table.num_rows == 0:
        raise FedrayError(f"{where}: no rows")
    numbers = {column: _floats(where, table, column) for column in (*RATES, *JITTERS, "share")
               if column in table.column_names}
    for column in RATES:
        _check_rows(where, column, numbers[column], numbers[column] > 0, "a rate must be a finite number > 0")
    for column in JITTERS:
        if column in numbers:
            _check_rows(where, column, numbers[column], numbers[column] >= 0,
                        "a jitter σ must be a finite number ≥ 0")
    share = numbers.get("share")
    if share is not None:
        _check_rows(where, "share", share, share > 0, "a share must be a finite number > 0")
        if abs(share.sum() - 1.0) > SHARE_TOLERANCE:
            raise FedrayError(f"{where}: column share sums to {float(share.sum())!r}, not 1 (within {SHARE_TOLERANCE})")
    client_id = _client_ids(where, table) if "client_id" in table.column_names else None
    name = None
    if "name" in table.column_names:
        name = tuple("" if value is None else str(value) for value in table.column("name").to_pylist())
    zeros = np.zeros(table.num_rows)
    return DeviceTable(source, *(numbers[column] for column in RATES),
                       *(numbers.get(column, zeros) for column in JITTERS), share=share, client_id=client_id, name=name)


def _unknown(column: str) -> str:
    """Why ``column`` is refused: units fedray does not read (``down_mbps``), or no column of a device table at all."""
    known = {"macs": "macs_per_s, macs_jitter", "down": "down_bps, down_jitter", "up": "up_bps, up_jitter"}
    quantity = column.split("_")[0].lower()
    if quantity in known:
        return f"column {column!r} has units fedray does not read: it reads {known[quantity]} (rates in " \
               "multiply-adds per second and bits per second; a jitter is a lognormal σ)"
    return f"unknown column {column!r} (a device table has {', '.join(COLUMNS)})"


def _floats(where: str, table: pa.Table, column: str) -> np.ndarray:
    """``column`` as float64, or a one-line error naming the first row that is empty or not a number."""
    values = table.column(column)
    if values.null_count:
        first = pc.indices_nonzero(values.is_null())[0].as_py()
        raise FedrayError(f"{where}: column {column}, row {first + 1} is empty")
    if pa.types.is_integer(values.type) or pa.types.is_floating(values.type):
        return _float64_array(pc.cast(values, pa.float64()))
    numbers = []
    for row, value in enumerate(values.to_pylist()):  # text that Python reads as a number ("NaN", "1e9") is one
        try:
            numbers.append(float(value))
        except (TypeError, ValueError):
            raise FedrayError(f"{where}: column {column}, row {row + 1}: {value!r} is not a number") from None
    return np.array(numbers, dtype=np.float64)


def _float64_array(values: pa.ChunkedArray) -> np.ndarray:
    """A float64 column without nulls as a numpy array, copied from its Arrow buffer: pyarrow's own ``to_numpy`` imports
    pandas (a second), which a run that reads the default device table would pay before any work."""
    array = values.combine_chunks()
    return np.frombuffer(array.buffers()[1], dtype=np.float64, count=len(array), offset=array.offset * 8).copy()


def _check_rows(where: str, column: str, values: np.ndarray, valid: np.ndarray, rule: str) -> None:
    """A one-line error naming the first row of ``column`` where ``valid`` fails or the value is not finite."""
    bad = np.flatnonzero(~(valid & np.isfinite(values)))
    if len(bad):
        raise FedrayError(f"{where}: column {column}, row {bad[0] + 1}: {rule}, got {float(values[bad[0]])!r}")


def _client_ids(where: str, table: pa.Table) -> np.ndarray:
    """The ``client_id`` column as int64: integers ≥ 0, none twice."""
    ids = _floats(where, table, "client_id")
    _check_rows(where, "client_id", ids, (ids >= 0) & (ids == np.round(ids)) & (ids < 2.0**62),
                "a client id must be an integer ≥ 0")
    ids = ids.astype(np.int64)
    order = np.argsort(ids, kind="stable")
    repeated = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if len(repeated):
        first, again = sorted(order[repeated[0]:repeated[0] + 2])
        raise FedrayError(f"{where}: column client_id, row {again + 1}: client {ids[again]} is listed again "
                          f"(first at row {first + 1})")
    return ids


@dataclass(frozen=True)
class Devices:
    """The devices component: the clients' device table (``--devices``), each client's device and its durations."""

    devices: Annotated[str | None, "the clients' devices: uniform (every client one nominal phone), phones (FLASH's "
                                   "measured networks × AI-Benchmark compute tiers) or a device table FILE (.csv or "
                                   ".parquet: macs_per_s, down_bps, up_bps, optional *_jitter, and share or "
                                   "client_id)", Unset("no clock; uniform when another clock option is given"),
                       Metavar("uniform|phones|FILE")] = None
    table: DeviceTable = field(init=False, repr=False, compare=False)
    _row_of_client: np.ndarray | None = field(init=False, repr=False, compare=False)
    """For a table of client ids: each client id's row (−1 where it has none); None for a table of shares."""
    _edges: np.ndarray | None = field(init=False, repr=False, compare=False)
    """For a table of shares: the shares' cumulative sums, normalised so that the last is exactly 1."""
    _jittered: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """The draws (0 compute, 1 download, 2 upload) of the table's parts with a jitter σ other than 0."""
    _assigned: tuple[int, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)
    """The seed and every client's row that :meth:`assign` last drew (None: not asked yet)."""

    def __post_init__(self) -> None:
        table = load_table(self.devices or DEFAULT_TABLE)
        object.__setattr__(self, "table", table)
        row_of_client = edges = None
        if table.client_id is not None:
            row_of_client = np.full(int(table.client_id.max()) + 1, -1, dtype=np.int64)
            row_of_client[table.client_id] = np.arange(len(table))
        else:
            cumulative = np.cumsum(table.share)
            edges = cumulative / cumulative[-1]
        object.__setattr__(self, "_row_of_client", row_of_client)
        object.__setattr__(self, "_edges", edges)
        sigmas = (table.macs_jitter, table.down_jitter, table.up_jitter)
        object.__setattr__(self, "_jittered", tuple(draw for draw, sigma in enumerate(sigmas) if np.any(sigma)))

    def assign(self, num_clients: int, seed: int) -> np.ndarray:
        """Each of the population's clients' device (its table row, int64), O(K); a table of client ids must list
        exactly the clients 0 .. ``num_clients`` − 1. The rows are kept for ``seed`` (in the smallest integer type
        that holds them: a byte a client for a table of up to 256 devices), so that :meth:`device_of` then reads
        them instead of drawing them again each round."""
        if self.table.client_id is not None:
            self._check_population(num_clients)
        rows = self.device_of(np.arange(num_clients, dtype=np.int64), seed)
        object.__setattr__(self, "_assigned", (seed, rows.astype(np.min_scalar_type(max(len(self.table) - 1, 0)))))
        return rows

    def device_of(self, clients: np.ndarray, seed: int) -> np.ndarray:
        """The device (table row, int64) of each of ``clients`` (ids, any order): from the stream (seed, 40, client)
        by the shares' inverse CDF, or the client's own row (the rows :meth:`assign` kept for ``seed``, where it did).
        O(len(clients))."""
        clients = np.asarray(clients, dtype=np.int64)
        if self._assigned is not None and self._assigned[0] == seed and clients.size:
            rows = self._assigned[1]
            if 0 <= clients.min() and clients.max() < len(rows):
                return rows[clients].astype(np.int64)
        if self._edges is not None:
            if len(self._edges) == 1:  # one device: every client's, no draw needed
                return np.zeros(clients.shape, dtype=np.int64)
            return np.searchsorted(self._edges, uniforms(seed, ASSIGNMENT_STREAM, clients), side="right")
        known = (clients >= 0) & (clients < len(self._row_of_client))
        rows = np.where(known, self._row_of_client[np.where(known, clients, 0)], -1)
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            raise FedrayError(f"devices table {self.table.source}: column client_id has no row for client "
                              f"{clients[missing[0]]}")
        return rows

    def _check_population(self, num_clients: int) -> None:
        ids = self.table.client_id
        outside = np.flatnonzero(ids >= num_clients)
        if len(outside):
            raise FedrayError(f"devices table {self.table.source}: column client_id, row {outside[0] + 1}: client "
                              f"{ids[outside[0]]} is not in the population of {num_clients} clients")
        if len(ids) < num_clients:  # distinct ids, all below num_clients: some client has no row
            absent = np.flatnonzero(self._row_of_client < 0)
            first = absent[0] if len(absent) else len(self._row_of_client)
            raise FedrayError(f"devices table {self.table.source}: column client_id has no row for client {first} "
                              f"(the population has {num_clients} clients, the table {len(ids)} rows)")

    def durations(self, clients: np.ndarray, round: int, cost: TaskCost, seed: int) -> Durations:
        """Seconds of ``cost`` (amounts for all or one per client) for each of ``clients`` in round ``round``: its
        multiply-adds at its device's ``macs_per_s``, its bytes · 8 at ``down_bps`` and ``up_bps``, each times the
        jitter factor of (seed, 41, client, round) where the device has a jitter σ. O(len(clients))."""
        clients = np.asarray(clients, dtype=np.int64)
        for name in ("macs", "down_bytes", "up_bytes"):
            try:
                np.broadcast_shapes(clients.shape, np.shape(getattr(cost, name)))
            except ValueError:
                raise FedrayError(f"durations: the cost's {name} has shape {np.shape(getattr(cost, name))}, the "
                                  f"clients {clients.shape}") from None
        device = self.device_of(clients, seed)
        table = self.table
        parts = [cost.macs / table.macs_per_s[device], cost.down_bytes * 8.0 / table.down_bps[device],
                 cost.up_bytes * 8.0 / table.up_bps[device]]
        draws = self._jittered  # a σ of 0 everywhere changes no bit: no factor is drawn
        if draws:
            sigmas = np.stack([(table.macs_jitter, table.down_jitter, table.up_jitter)[draw][device] for draw in draws])
            factors = lognormal_factors(sigmas, seed, JITTER_STREAM, clients, round, draws)
            for factor, draw in zip(factors, draws):
                parts[draw] = parts[draw] * factor
        return Durations(*(np.broadcast_to(seconds, clients.shape).astype(np.float64) for seconds in parts))

