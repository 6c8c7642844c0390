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

Random numbers come from generators seeded by (seed, block of
:data:`~fedray.data.synthetic.BLOCK` row numbers), so the labels and
features of a client are the same in whichever process generates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import urlencode

import numpy as np
import pyarrow as pa

from fedray.core.errors import FedrayError
from fedray.core.federation import TEST, TRAIN, Federation, split_table
from fedray.data.synthetic import BLOCK, POOLS, SPLITS, Pool, SyntheticFeatures, pool_labels, real_client_sizes


@dataclass(frozen=True)
class ClassLine:
    """Labels of a population's training rows, generated block by block from (seed, block)."""

    seed: int
    tau: float
    edges: np.ndarray
    """Where each class starts on ``[0, 1)`` (C + 1 increasing values, 0 first and 1 last)."""
    num_train: int

    def labels(self, first: int, stop: int) -> np.ndarray:
        """Labels (int32) of training rows ``first .. stop-1``."""
        out = np.empty(stop - first, dtype=np.int32)
        for block in range(first // BLOCK, -(-stop // BLOCK)):
            start = block * BLOCK
            rng = np.random.default_rng([self.seed, 31, block])
            jitter, noise = rng.random(BLOCK), rng.standard_normal(BLOCK)
            lo, hi = max(first, start), min(stop, start + BLOCK)
            rows = np.arange(lo, hi)
            position = (rows + jitter[rows - start]) / self.num_train + self.tau * noise[rows - start]
            position = np.abs(position)  # reflected at 0 ...
            position = np.where(position >= 1, 2 - position, position)  # ... and at 1
            position = np.clip(position, 0.0, np.nextafter(1.0, 0.0))
            out[lo - first:hi - first] = np.searchsorted(self.edges, position, side="right") - 1
        return out

    def labels_at(self, rows: np.ndarray) -> np.ndarray:
        """Labels of any training rows (row numbers, in any order)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return np.empty(0, dtype=np.int32)
        first, stop = int(rows.min()), int(rows.max()) + 1
        if stop - first <= 4 * len(rows) + BLOCK:
            return self.labels(first, stop)[rows - first]
        out = np.empty(len(rows), dtype=np.int32)
        for block in np.unique(rows // BLOCK):
            mine = rows // BLOCK == block
            out[mine] = self.labels(int(block) * BLOCK, min(int(block + 1) * BLOCK, self.num_train))[rows[mine] - block * BLOCK]
        return out


@dataclass
class PopulationFeatures(SyntheticFeatures):
    """The stand-ins' feature model over a population: train labels come from its :class:`ClassLine`."""

    line: ClassLine | None = None

    def labels_of(self, split: str, sample_ids: np.ndarray) -> np.ndarray:
        if split == TRAIN:
            return self.line.labels_at(sample_ids)
        return super().labels_of(split, sample_ids)


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

    @cached_property
    def client_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

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


def check(split: str, clients: int, scale: float, feature_shift: float) -> None:
    """What :func:`build` refuses besides :func:`fedray.data.synthetic.check`'s."""
    if split not in SPLITS:
        raise FedrayError(f"synthetic:{split}: clients=K applies to the client splits ({', '.join(SPLITS)}); "
                          f"re-split a labelled dataset with ?split=…&clients=K")
    if clients < 1:
        raise FedrayError(f"synthetic:{split}: clients must be ≥ 1, got {clients}")
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
    source = PopulationFeatures(pool=pool, dim=dim, seed=seed, train_labels=np.zeros(0, np.int32),
                                test_labels=test_labels, line=line)
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
