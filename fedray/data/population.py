"""Synthetic populations of any size: ``synthetic:<split>?clients=K``.

The real splits' stand-ins (:mod:`fedray.data.synthetic`) cut one sample pool
into the real clients, which needs the whole pool, sorted, in one process. A
population of K clients is generated client by client instead, so that any
process can produce any range of clients alone and no process ever holds a
per-sample array of the whole federation:

- client sizes are drawn (seeded) from the real split's client-size table;
  the pool has their sum of samples;
- the clients are laid end to end on the class line of the stand-in (classes
  in taxonomy order, each occupying a width in proportion to its long-tailed
  share of the pool); a sample at position ``u`` in ``[0, 1)`` (its row
  number plus a uniform jitter, over N) takes the class found at
  ``u + tau * noise``, reflected into ``[0, 1)``. This is the stand-ins'
  model (class position plus ``tau`` noise, sorted and cut into clients) read
  the other way round, with the same ``tau``, so a client holds a few related
  classes and M/K is about the real split's;
- features follow the stand-ins' feature model (:class:`SyntheticFeatures`),
  and the test set is the stand-in's (the real split's test rows).

A row's label is a pure function of (seed, row number) (a counter-based
generator), and a client's feature noise comes from a generator seeded by
(seed, client), so any client's rows are the same in whichever process
generates them, alone or among others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import urlencode

import numpy as np
import pyarrow as pa

from fedray.core.lazy_modules import lazy_module
from fedray.core.errors import FedrayError
from fedray.core.threads import single_threaded
from fedray.core.federation import TEST, TRAIN, Federation, split_table
from fedray.data.synthetic import LOW_RANK, POOLS, SPLITS, Pool, SyntheticFeatures, pool_labels, real_client_sizes

torch = lazy_module("torch", globals())


def _mixed(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: uint64 values to well-mixed uint64 values (a counter-based generator's core)."""
    with np.errstate(over="ignore"):
        x = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _uniform(seed: int, stream: int, rows: np.ndarray) -> np.ndarray:
    """Uniform numbers in [0, 1), one per row number, a pure function of (seed, stream, row)."""
    key = _mixed(np.array([seed * 64 + stream], dtype=np.uint64))[0]
    return (_mixed(rows.astype(np.uint64) ^ key) >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass(frozen=True)
class ClassLine:
    """Labels of a population's training rows, each a pure function of (seed, row number): any rows, any process."""

    seed: int
    tau: float
    edges: np.ndarray
    """Where each class starts on ``[0, 1)`` (C + 1 increasing values, 0 first and 1 last)."""
    num_train: int

    def labels(self, first: int, stop: int) -> np.ndarray:
        """Labels (int32) of training rows ``first .. stop-1``."""
        return self.labels_at(np.arange(first, stop, dtype=np.int64))

    def labels_at(self, rows: np.ndarray) -> np.ndarray:
        """Labels of any training rows (row numbers, in any order): the class at ``(row + U)/N + tau·ε``, reflected
        into [0, 1) (ε standard normal by Box-Muller)."""
        rows = np.asarray(rows, dtype=np.int64)
        jitter, radius, angle = (_uniform(self.seed, stream, rows) for stream in (1, 2, 3))
        noise = np.sqrt(-2.0 * np.log1p(-radius)) * np.cos(2.0 * np.pi * angle)
        position = np.abs((rows + jitter) / self.num_train + self.tau * noise)  # reflected at 0 ...
        position = np.where(position >= 1, 2 - position, position)  # ... and at 1
        position = np.clip(position, 0.0, np.nextafter(1.0, 0.0))
        return (np.searchsorted(self.edges, position, side="right") - 1).astype(np.int32)


@dataclass
class PopulationFeatures(SyntheticFeatures):
    """The stand-ins' feature model over a population, each client's noise drawn from a generator of its own (seeded
    by (seed, client)): a shard's runs of scattered clients generate just their rows. Test rows are the stand-in's."""

    line: ClassLine | None = None
    offsets: np.ndarray | None = None

    def labels_of(self, split: str, sample_ids: np.ndarray) -> np.ndarray:
        if split == TRAIN:
            return self.line.labels_at(sample_ids)
        return super().labels_of(split, sample_ids)

    def features(self, split: str, sample_ids: np.ndarray) -> torch.Tensor:
        if split != TRAIN:
            return super().features(split, sample_ids)
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        labels = torch.from_numpy(self.line.labels_at(sample_ids).astype(np.int64))
        clients = np.searchsorted(self.offsets, sample_ids, side="right") - 1
        order = np.argsort(clients, kind="stable")
        present, starts = np.unique(clients[order], return_index=True)
        seeds = _mixed(present.astype(np.uint64) ^ _mixed(np.array([self.seed * 64 + 5], dtype=np.uint64))[0])
        out = torch.empty(len(sample_ids), self.dim)
        with single_threaded():  # a client's few rows: on a busy machine, two threads' handovers cost 50× the work
            self._fill(out, sample_ids, labels, order, present, starts, seeds)
        return out

    def _fill(self, out: torch.Tensor, sample_ids: np.ndarray, labels: torch.Tensor, order: np.ndarray,
              present: np.ndarray, starts: np.ndarray, seeds: np.ndarray) -> None:
        """``out``'s rows, client after client (``present``, whose rows are ``order[starts[i]:starts[i+1]]``)."""
        model = self._model
        for client, seed, start, stop in zip(present.tolist(), seeds.tolist(), starts.tolist(),
                                             [*starts[1:].tolist(), len(order)]):
            g = torch.Generator().manual_seed(seed >> 1)  # a non-negative 63-bit seed
            size = int(self.offsets[client + 1] - self.offsets[client])
            noise = torch.randn(size, self.dim, generator=g) * model["scales"]
            noise += torch.randn(size, LOW_RANK, generator=g) @ model["low_rank"]
            rows = torch.from_numpy(order[start:stop])
            within = torch.from_numpy(sample_ids[order[start:stop]] - self.offsets[client])
            out[rows] = (noise[within] + model["base"] + model["means"][labels[rows]]).clamp_(0.0, 6.0)


@dataclass(frozen=True)
class Population(Federation):
    """A federation of clients generated on demand: the driver holds their sizes (O(K) numbers), never their rows.

    ``table`` holds the test rows only; a training row's sample id is its row number, clients' rows are consecutive
    (client k's are ``client_offsets[k] .. client_offsets[k+1]-1``).
    """

    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), compare=False)
    line: ClassLine | None = field(default=None, compare=False)

    streams_features = True

    def __post_init__(self) -> None:
        if len(self.sizes) == 0 or self.sizes.min() < 1:
            raise FedrayError(f"{self.name}: a population needs clients of at least one sample")

    @property
    def train(self) -> pa.Table:
        raise FedrayError(f"{self.name}: a population of {self.num_clients:,} clients has no per-sample table "
                          f"(its shards generate their own clients' rows)")

    @property
    def client_offsets(self) -> np.ndarray:
        """Its source's: the features of a row are drawn from its offset within its client."""
        return self.source.offsets

    @cached_property
    def client_sizes(self) -> np.ndarray:
        return self.sizes

    @cached_property
    def client_ids(self) -> list[str]:
        return [str(client) for client in range(self.num_clients)]

    def train_arrays(self, first_client: int, end_client: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        start, stop = int(self.client_offsets[first_client]), int(self.client_offsets[end_client])
        offsets = self.client_offsets[first_client:end_client + 1] - start
        return np.arange(start, stop, dtype=np.int64), self.line.labels(start, stop), offsets


DRIVER_BYTES_PER_CLIENT = 48
"""The driver's peak memory per client of a population, its sizes and offsets and their temporaries while it is built
and summarized (45.5 bytes measured at K = 10⁷)."""


def machine_memory() -> int:
    """This machine's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check(split: str, clients: int, scale: float, feature_shift: float) -> None:
    """What :func:`build` refuses besides :func:`fedray.data.synthetic.check`'s: also a population whose clients' sizes
    alone would not fit this machine's memory, before anything is allocated."""
    if split not in SPLITS:
        raise FedrayError(f"synthetic:{split}: clients=K applies to the client splits ({', '.join(SPLITS)}); "
                          f"re-split a labelled dataset with ?split=…&clients=K")
    if clients < 1:
        raise FedrayError(f"synthetic:{split}: clients must be ≥ 1, got {clients}")
    needed, memory = clients * DRIVER_BYTES_PER_CLIENT, machine_memory()
    if needed > memory:
        raise FedrayError(f"synthetic:{split}: clients={clients} needs {needed / 2**30:,.1f} GiB on the driver for the "
                          f"clients' sizes alone ({DRIVER_BYTES_PER_CLIENT} bytes a client), more than this machine's "
                          f"{memory / 2**30:,.1f} GiB: lower clients (at most "
                          f"{memory // DRIVER_BYTES_PER_CLIENT:,} here)")
    if scale != 1:
        raise FedrayError(f"synthetic:{split}: give clients=K or scale, not both")
    if feature_shift != 0:
        raise FedrayError(f"synthetic:{split}: feature_shift applies to the real splits' stand-ins, not with clients=K")


def build(split: str, clients: int, dim: int = 1280, seed: int = 0, classes: int | None = None) -> Population:
    """``clients`` clients shaped like ``split``'s (see the module's docstring)."""
    shape = SPLITS[split]
    real = real_client_sizes(shape.sizes_file)
    sizes = real[np.random.default_rng([seed, 30, clients]).integers(len(real), size=clients)].astype(np.int64)
    reference = POOLS[shape.pool]
    num_classes = classes or reference.num_classes
    pool = Pool(num_classes=num_classes, num_train=int(sizes.sum()), num_test=reference.num_test,
                num_superclasses=min(reference.num_superclasses, num_classes))
    labels_by_class, test_labels = pool_labels(_test_pool(shape.pool, num_classes), seed)
    counts = np.bincount(labels_by_class, minlength=num_classes)
    line = ClassLine(seed, shape.tau, np.concatenate([[0.0], np.cumsum(counts) / counts.sum()]), pool.num_train)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    source = PopulationFeatures(pool=pool, dim=dim, seed=seed, train_labels=np.zeros(0, np.int32),
                                test_labels=test_labels, line=line, offsets=offsets)
    n_test = len(test_labels)
    table = split_table(pa.nulls(n_test, pa.string()), np.arange(n_test), test_labels, np.repeat(TEST, n_test))
    options = {"classes": classes, "clients": clients, "dim": dim, "seed": seed}
    spec = f"synthetic:{split}?" + urlencode([(k, v) for k, v in sorted(options.items()) if v is not None])
    return Population(name=f"synthetic:{split}", num_classes=num_classes, table=table, source=source, spec=spec,
                      sizes=sizes, line=line)


def _test_pool(pool_name: str, num_classes: int) -> Pool:
    """The pool whose class counts and test rows the population takes: the real split's (with ``classes`` fewer
    classes, the stand-in's pool of that many classes and the real number of samples)."""
    real = POOLS[pool_name]
    if num_classes == real.num_classes:
        return real
    return Pool(num_classes, real.num_train, real.num_test, min(real.num_superclasses, num_classes))
