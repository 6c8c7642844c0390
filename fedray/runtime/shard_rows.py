"""The rows a shard holds, loaded once per shard process and shared by its jobs (statistics, training, evaluation).

A shard is a contiguous range of client numbers, balanced by sample count. Its
features are produced once, inside the actor, by the federation's feature
source: the actor rebuilds the federation from its dataset spec (a line of
text) and reads or generates only its own clients' rows. :class:`HeldRows`
gathers the rows of any clients it holds into one :class:`ClientBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedray.core.federation import STREAMED_ROWS, TEST, TRAIN, FeatureSource, Federation
from fedray.methods.base import ClientBatch
from fedray.runtime.named_objects import fetch

STAGING_BYTES = 2**28
"""The largest buffer a shard keeps for rows converted to a method's ``features_dtype`` (256 MiB)."""


def gather_rows(offsets: np.ndarray, local_clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of the given clients' samples, concatenated, and their new offsets."""
    starts, stops = offsets[local_clients], offsets[local_clients + 1]
    lengths = stops - starts
    new_offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = np.arange(new_offsets[-1]) + np.repeat(starts - new_offsets[:-1], lengths)
    return rows, new_offsets


GATHER_BYTES = 2**22
"""The most bytes of rows gathered before they are converted to another dtype: 4 MiB, which stay in the caches."""


def gather_features(features: torch.Tensor, rows: np.ndarray, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The features at ``rows`` (row indices) in ``dtype``: one indexing in the stored dtype; in another, gathered and
    converted a few MiB of rows at a time, into ``out`` when given (``len(rows)`` rows of ``dtype``). A conversion
    changes no bit a row has in its client's own batch (float32 to float64 is exact)."""
    index = torch.from_numpy(rows)
    if dtype == features.dtype:
        return features[index]
    out = torch.empty(len(rows), features.shape[1], dtype=dtype) if out is None else out
    step = max(1, GATHER_BYTES // max(1, features.shape[1] * features.element_size()))
    for start in range(0, len(rows), step):
        out[start:start + step].copy_(features.index_select(0, index[start:start + step]))
    return out


@dataclass(frozen=True)
class ShardRows:
    """Which rows a shard holds, small enough to travel inline with the actor's creation task.

    Clients ``first_client .. end_client-1`` and test rows ``first_test ..
    end_test-1`` (positions in the federation's test split; the clients reach past the shard's own to the end of the
    last leaf of the fixed tree it computes, :mod:`fedray.runtime.fixed_tree`) of the federation
    that ``spec`` rebuilds (the shard reads only these rows' features), or, for
    a federation that exists only in memory (``spec`` None), the name of the
    :class:`~fedray.runtime.named_objects.NamedObjects` holding their
    :class:`Rows` under ``first_client``: either way a restarted shard loads
    the same rows again.
    """

    first_client: int
    end_client: int
    first_test: int
    end_test: int
    spec: str | None = None
    stored: str | None = None

    def load(self) -> "Rows":
        if self.spec is None:
            return fetch(self.stored, self.first_client)
        from fedray.data.registry import load_federation  # the dataset kinds' loaders, needed by this kind only

        federation = load_federation(self.spec)
        return Rows.of(federation, (self.first_client, self.end_client), (self.first_test, self.end_test))


@dataclass(frozen=True)
class Rows:
    """A shard's rows: its clients' features, labels and row offsets, and its test rows' features and labels.

    For a federation that streams its features (``Federation.streams_features``), ``features`` is None and
    ``source`` gives the rows of ``sample_ids`` when a batch needs them.
    """

    features: torch.Tensor | None
    labels: np.ndarray
    offsets: np.ndarray
    test_features: torch.Tensor
    test_labels: np.ndarray
    source: FeatureSource | None = None
    sample_ids: np.ndarray | None = None

    @classmethod
    def of(cls, federation: Federation, clients: tuple[int, int], tests: tuple[int, int]) -> "Rows":
        """Clients ``clients[0] .. clients[1]-1`` and test rows ``tests[0] .. tests[1]-1`` of ``federation``."""
        source = federation.require_features()
        sample_ids, labels, offsets = federation.train_arrays(*clients)
        test_ids, test_labels = (column[slice(*tests)] for column in federation.test_arrays())
        test = source.features(TEST, test_ids)
        if federation.streams_features:
            return cls(None, labels, offsets, test, test_labels, source, sample_ids)
        return cls(source.features(TRAIN, sample_ids), labels, offsets, test, test_labels)


class HeldRows:
    """The training rows of clients ``first_client ..`` as one shard holds them, and batches of any of its clients."""

    def __init__(self, rows: Rows, first_client: int) -> None:
        self.first_client = first_client
        self.features, self.offsets = rows.features, rows.offsets
        self.source, self.sample_ids = rows.source, rows.sample_ids
        self.labels = torch.from_numpy(rows.labels.astype(np.int64))
        self._staging = torch.empty(0)

    @property
    def streams(self) -> bool:
        """Whether the features are read from their source batch by batch, not held."""
        return self.features is None

    def samples(self, client: int) -> int:
        """The number of samples of ``client`` (a global number)."""
        local = client - self.first_client
        return int(self.offsets[local + 1] - self.offsets[local])

    def batch(self, clients: np.ndarray, dtype: torch.dtype | None = None) -> ClientBatch:
        """The samples of ``clients`` (global numbers), client after client in the given order, features in ``dtype``
        (None: as stored)."""
        local = clients - self.first_client
        rows, offsets = gather_rows(self.offsets, local)
        if self.features is None:
            features = self.source.features(TRAIN, self.sample_ids[rows])
            labels = self.labels[torch.from_numpy(rows)]
            return ClientBatch(features.to(dtype or features.dtype), labels, offsets, clients)
        dtype = dtype or self.features.dtype
        staging = self._staging_for(len(rows), dtype) if dtype != self.features.dtype else None
        features = gather_features(self.features, rows, dtype, staging)
        return ClientBatch(features, self.labels[torch.from_numpy(rows)], offsets, clients)

    def label_batch(self, clients: np.ndarray) -> ClientBatch:
        """The labels of ``clients`` (global numbers) as :meth:`batch` gives them, with features of width 0: nothing
        read or generated."""
        rows, offsets = gather_rows(self.offsets, clients - self.first_client)
        return ClientBatch(torch.zeros(len(rows), 0, dtype=torch.float64), self.labels[torch.from_numpy(rows)], offsets,
                           clients)

    def _staging_for(self, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where ``rows`` rows are converted to ``dtype``: a buffer kept from call to call (converting each block into
        fresh memory faults in every page of it: 0.07 s of Fed3R's 1.7 s over the iNat stand-in), unless it would
        exceed :data:`STAGING_BYTES` (e.g. a two-stage run's one block of every client, whose buffer would then be held
        through the training)."""
        width = self.features.shape[1]
        if rows * width * dtype.itemsize > STAGING_BYTES:
            return None
        if self._staging.dtype != dtype or len(self._staging) < rows:
            kept_rows = min(rows * 5 // 4, STAGING_BYTES // (width * dtype.itemsize))
            self._staging = torch.empty(kept_rows, width, dtype=dtype)
        return self._staging[:rows]

    def runs(self, clients: np.ndarray) -> list[np.ndarray]:
        """``clients`` cut into runs of about :data:`STREAMED_ROWS` samples (a client's rows stay in one run) where the
        features stream, so that a block of many clients is never in memory whole; ``[clients]`` where they are held."""
        if not self.streams:
            return [clients]
        return split_every(clients, self.sample_counts(clients), STREAMED_ROWS)

    def sample_counts(self, clients: np.ndarray) -> np.ndarray:
        """The number of samples of each of ``clients`` (global numbers)."""
        local = clients - self.first_client
        return self.offsets[local + 1] - self.offsets[local]


def split_every(items: np.ndarray, sizes: np.ndarray, limit: int) -> list[np.ndarray]:
    """``items`` (of ``sizes``) cut, in order, where their running total passes each multiple of ``limit``: pieces of
    about ``limit`` each (one item of more alone)."""
    ends = np.cumsum(sizes)
    cuts = np.searchsorted(ends, np.arange(limit, ends[-1], limit), side="left") + 1
    return np.split(items, np.unique(cuts[cuts < len(items)]))
