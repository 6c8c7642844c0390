"""Shard actors: each holds the features of many clients and sums their statistics.

A shard is a contiguous range of client numbers, balanced by sample count. Its
features are produced once, inside the actor, by the federation's feature
source: the actor rebuilds the federation from its dataset spec (a line of
text) and reads or generates only its own clients' rows. Per block of rounds
the driver sends the numbers of the clients that upload in that block; the
shard gathers their rows and computes the block's
statistics in one call (for Fed3R: one GEMM), so Ray's overhead scales with
shards × evaluation points, not with clients or rounds. Each shard also holds
whole chunks of the test rows and counts a classifier's correct predictions on
them (:mod:`fedray.methods.evaluation`), so the driver never holds features.
"""

from __future__ import annotations

import resource
from pathlib import Path
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup

from fedray.core.federation import STREAMED_ROWS, TEST, TRAIN, FeatureSource, Federation
from fedray.core.errors import FedrayError
from fedray.methods.evaluation import EvalRows, eval_bounds
from fedray.methods.base import Classifier, ClientBatch, ClosedFormMethod, floats_in
from fedray.methods.checks import combine_checked
from fedray.methods.postprocessor import Postprocessing
from fedray.runtime.cluster import check_memory
from fedray.runtime.client_states import ClientStates, Layout
from fedray.runtime.kept import KeptParts, SecondPass, default_budget
from fedray.runtime.footprint import Footprint
from fedray.runtime.named_objects import NamedObjects, fetch
from fedray.runtime.placement import default_count
from fedray.runtime.actor_group import ActorGroup, Reduction, balanced_bounds, combine_partials, tree_reduce
from fedray.runtime import tensor_transfer


def peak_memory_bytes() -> int:
    """Peak resident memory of the calling process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


STAGING_BYTES = 2**28
"""The largest buffer a shard keeps for rows converted to a method's ``features_dtype`` (256 MiB)."""


def gather_rows(offsets: np.ndarray, local_clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of the given clients' samples, concatenated, and their new offsets."""
    starts, stops = offsets[local_clients], offsets[local_clients + 1]
    lengths = stops - starts
    new_offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = np.arange(new_offsets[-1]) + np.repeat(starts - new_offsets[:-1], lengths)
    return rows, new_offsets


def gather_features(features: torch.Tensor, offsets: np.ndarray, local_clients: np.ndarray, rows: np.ndarray,
                    dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The features of the given clients (``rows``: their row indices, concatenated) in ``dtype``.

    In the stored dtype, one indexing; in another, each client's rows are copied and converted in one pass (a loop
    over the clients, cheap beside the copy: a closed-form run gathers every client once), into ``out`` when given
    (``len(rows)`` rows of ``dtype``).
    """
    if dtype == features.dtype:
        return features[torch.from_numpy(rows)]
    starts, stops = offsets[local_clients], offsets[local_clients + 1]
    out = torch.empty(len(rows), features.shape[1], dtype=dtype) if out is None else out
    position = 0
    for start, stop in zip(starts.tolist(), stops.tolist()):
        out[position:position + stop - start].copy_(features[start:stop])
        position += stop - start
    return out


@dataclass(frozen=True)
class ShardRows:
    """Which rows a shard holds, small enough to travel inline with the actor's creation task.

    Clients ``first_client .. end_client-1`` and test rows ``first_test ..
    end_test-1`` (positions in the federation's test split) of the federation
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
        from fedray.data.registry import load_federation  # the dataset kinds' loaders, needed by this kind of shard only

        return Rows.of(load_federation(self.spec), (self.first_client, self.end_client), (self.first_test, self.end_test))


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


@ray.remote(max_restarts=3, max_task_retries=3)
class ShardActor:
    """Holds the clients of :class:`ShardRows`.

    Its state is a pure function of its constructor arguments and its calls are
    pure functions of their arguments, so Ray can restart a failed shard and
    retry its calls with bitwise the same results; the one exception, its
    clients' states of a stateful training algorithm, is restored by the driver
    (see :mod:`fedray.runtime.client_states`). A bad row in its part of
    the data (e.g. NaN in a Parquet file) is kept as the shard's error, for
    :meth:`ShardPool.wait` to raise in the driver as one line.
    """

    def __init__(self, rows: ShardRows, threads: int, kept_budget: int, state_budget: int | None = None) -> None:
        torch.set_num_threads(threads)
        tensor_transfer.register()
        self.first_client = rows.first_client
        context = ray.get_runtime_context()
        self.client_states = ClientStates(context.was_current_actor_reconstructed, state_budget,
                                          owner=context.get_actor_id())
        self.kept = KeptParts(kept_budget)
        self.error: str | None = None
        self._staging = torch.empty(0)
        try:
            held = rows.load()
        except FedrayError as error:
            self.error = str(error)
            return
        self.features, self.offsets = held.features, held.offsets
        self.source, self.sample_ids = held.source, held.sample_ids
        self.labels = torch.from_numpy(held.labels.astype(np.int64))
        self.test = EvalRows(held.test_features, torch.from_numpy(held.test_labels.astype(np.int64)))

    def loaded(self) -> str | None:
        """None once the rows are held, else why they could not be."""
        return self.error

    def peak_memory_bytes(self) -> int:
        """Peak resident memory of this actor's process."""
        return peak_memory_bytes()

    def client_state_sizes(self) -> tuple[int, int]:
        """Bytes of its clients' states in memory, and spilled to disk."""
        return self.client_states.sizes()

    def _batch(self, clients: np.ndarray, dtype: torch.dtype | None = None) -> ClientBatch:
        """The samples of ``clients`` (global numbers), client after client in the given order, features in ``dtype``
        (None: as stored)."""
        local = clients - self.first_client
        rows, offsets = gather_rows(self.offsets, local)
        if self.features is None:
            features = self.source.features(TRAIN, self.sample_ids[rows])
            return ClientBatch(features.to(dtype or features.dtype), self.labels[torch.from_numpy(rows)], offsets, clients)
        dtype = dtype or self.features.dtype
        staging = self._staging_for(len(rows), dtype) if dtype != self.features.dtype else None
        features = gather_features(self.features, self.offsets, local, rows, dtype, staging)
        return ClientBatch(features, self.labels[torch.from_numpy(rows)], offsets, clients)

    def _staging_for(self, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where ``rows`` rows are converted to ``dtype``: a buffer kept from call to call (converting each block into
        fresh memory faults in every page of it: 0.07 s of Fed3R's 1.7 s over the iNat stand-in), unless it would
        exceed :data:`STAGING_BYTES` (e.g. a two-stage run's one block of every client, whose buffer would then be held
        through the training)."""
        width = self.features.shape[1]
        if rows * width * dtype.itemsize > STAGING_BYTES:
            return None
        if self._staging.dtype != dtype or len(self._staging) < rows:
            self._staging = torch.empty(min(rows * 5 // 4, STAGING_BYTES // (width * dtype.itemsize)), width, dtype=dtype)
        return self._staging[:rows]

    def statistics(self, method: ClosedFormMethod, clients: np.ndarray, postprocessing: Postprocessing | None = None,
                   rounds: np.ndarray | None = None, keep: tuple[str, int] | None = None) -> Any:
        """Statistics summed over ``clients`` (global numbers, in upload order; ``rounds``: when each uploads); None if
        there are none. With a postprocessor that sees each client's upload, client by client through it, summed in
        that order if it changed any (else the batched statistics, bit for bit those of a run without it).

        ``keep`` (run token, block tag): what the method keeps in the shards (``kept_in_shards``) stays here for
        :meth:`second_pass`, and only the rest is returned.
        """
        if not len(clients):
            return None
        per_client = postprocessing is not None and postprocessing.per_client
        total, kept, size = None, [], 0
        for stats in self._uploads(method, clients, postprocessing if per_client else None, rounds):
            if keep is not None:
                stats, part = method.kept_in_shards(stats)
                if kept is not None:
                    kept.append(part)
                    size += 8 * floats_in([part])
                    if not per_client and not self.kept.fits(size):
                        kept = None  # dropped run by run, never held whole: the second pass computes this block again
            total = stats if total is None else combine_checked(method, total, stats)
        if keep is not None and kept is not None and any(part is not None for part in kept):
            self.kept.add(*keep, kept, must_keep=per_client)
        return total

    def _uploads(self, method: ClosedFormMethod, clients: np.ndarray, postprocessing: Postprocessing | None,
                 rounds: np.ndarray | None) -> Iterator[Any]:
        """The statistics of ``clients``, as one sum (through ``postprocessing``'s client hooks, if given), or as
        one per run of clients where this shard streams its features (their sum is the clients'); each client's rows
        through ``postprocessing``'s selection and feature hooks either way (a selection of every row and a feature map
        that changes no row change no bit)."""
        round_of = {} if rounds is None else dict(zip(clients.tolist(), rounds.tolist()))

        def batch(rows: np.ndarray) -> ClientBatch:
            batch = self._batch(rows, method.features_dtype)
            if postprocessing is None:
                return batch
            batch = postprocessing.selected(batch, [round_of[client] for client in rows.tolist()])
            return replace(batch, features=postprocessing.features(batch.features))

        if postprocessing is not None:
            uploads = ((client, number, method.client_statistics(batch(np.array([client]))))
                       for client, number in zip(clients.tolist(), rounds.tolist()))
            total = postprocessing.client_sum(uploads, partial(combine_checked, method))
            if total is not None:
                yield total
                return
        for run in self._runs(clients) if self.features is None else [clients]:
            yield method.client_statistics(batch(run))

    def second_pass(self, method: ClosedFormMethod, request: Any, token: str, uploads: list[tuple[int, np.ndarray]],
                    per_client: bool) -> Any:
        """``method``'s second pass over what its run (``token``) kept here from the blocks ``uploads`` ((tag, this
        shard's clients that uploaded in it), in order): one ``second_pass`` per kept part, added in order. A part not
        kept (over the budget, or lost when Ray restarted this shard) is computed again from its clients' rows."""
        total = None
        for tag, clients in uploads:
            parts = self.kept.parts(token, tag)
            if parts is None and len(clients):
                if per_client:
                    raise FedrayError(f"a restarted shard lost the uploads {method.name or type(method).__name__} kept "
                                      f"in it, which a per-client postprocessor changed: run it again")
                parts = (method.kept_in_shards(stats)[1] for stats in self._uploads(method, clients, None, None))
            for part in parts or ():
                total = combine_partials(total, method.second_pass(request, part), method.combine_second)
        return total

    def forget(self, token: str) -> None:
        """Drop what run ``token`` kept here."""
        self.kept.forget(token)

    def _runs(self, clients: np.ndarray) -> list[np.ndarray]:
        """``clients`` cut into runs of about :data:`STREAMED_ROWS` samples (a client's rows stay in one run), for a
        shard that streams its features: a block of many clients is then never in memory whole."""
        local = clients - self.first_client
        ends = np.cumsum(self.offsets[local + 1] - self.offsets[local])
        cuts = np.searchsorted(ends, np.arange(STREAMED_ROWS, ends[-1], STREAMED_ROWS), side="left") + 1
        return np.split(clients, np.unique(cuts[cuts < len(clients)]))

    def local_train(self, trainer: Any, received: Any, clients: np.ndarray, round_number: int) -> Any:
        """Local training of ``clients`` from what the server sent (``received``), summed as ``trainer.train`` defines;
        their states stay here (``trainer.stateful``). None if there are none."""
        if trainer.stateful:
            self.client_states.begin_round(round_number)
        if not len(clients):
            return None
        return trainer.train(self._batch(clients), received, round_number, self.client_states)

    def save_client_states(self, path: str) -> None:
        self.client_states.save(Path(path))

    def restore_client_states(self, paths: list[str], first: int, end: int, layout: Layout | None = None) -> None:
        """The states of ``paths`` for clients ``first`` to ``end`` (this shard's), each of ``layout`` (-1: the
        client's samples) when given."""
        def expected(client: int) -> Layout | None:
            if layout is None:
                return None
            samples = int(self.offsets[client - self.first_client + 1] - self.offsets[client - self.first_client])
            return {name: tuple(samples if size == -1 else size for size in shape) for name, shape in layout.items()}
        self.client_states.restore(map(Path, paths), lambda client: first <= client < end, expected)

    def clear_client_states(self) -> None:
        self.client_states.clear()

    def combine(self, method: Any, a: Any, b: Any) -> Any:
        """``a`` + ``b`` as ``method`` (a closed-form method, or a trainer) adds them."""
        if isinstance(method, ClosedFormMethod):
            return combine_partials(a, b, partial(combine_checked, method))
        return combine_partials(a, b, method.combine)

    def correct(self, feature_map: list[ray.ObjectRef], classifier: Classifier) -> int:
        """Correct predictions of ``classifier`` on this shard's test rows through ``feature_map[0]`` (a reference,
        in a list so that Ray passes it unresolved: it is fetched only when the shard has not transformed through it)."""
        return self.test.correct(feature_map[0].hex(), lambda: ray.get(feature_map[0]), classifier)


@dataclass(kw_only=True)
class ShardPool(ActorGroup):
    """The shard actors of one federation, reusable across runs of different methods.

    The shards' CPUs are reserved at once in a placement group (one bundle per
    shard, spread over the nodes), so a run either gets all its shards or fails
    with a clear message instead of waiting forever for a partial set. Shards
    load their rows while the driver goes on (e.g. reading the test set);
    :meth:`wait`, called by every method that needs them, waits for them.
    """

    keeps_client_states = True

    federation: Federation
    stored: NamedObjects | None = None
    """The rows of a federation held in memory (see :class:`ShardRows`), kept for a shard that restarts."""
    loading: list | None = None

    @classmethod
    def start(
        cls,
        federation: Federation,
        num_shards: int | None = None,
        cpus_per_shard: float = 1,
        trial_group: PlacementGroup | None = None,
        footprints: Sequence[Footprint] = (),
        kept_budget: int | None = None,
        state_budget: int | None = None,
    ) -> "ShardPool":
        """Start the shards in a placement group of their own, or in bundles 1.. of ``trial_group``.

        ``trial_group`` is the placement group a Tune trial runs in (bundle 0
        is the trial's driver), reserved by the sweep with one bundle per
        shard, so trials never compete with each other for shard CPUs.
        ``footprints`` (the run's estimated memory, stage by stage) must fit
        the cluster before any shard starts. ``kept_budget``: bytes each shard keeps for a method's second pass
        (default :func:`~fedray.runtime.kept.default_budget`'s share of the machine's memory split among the shards
        that fill it; what exceeds it is computed again when needed); ``state_budget``: bytes of clients' states each
        shard keeps in memory (default: the same share; the least recently used beyond it spill to the node's disk,
        :mod:`fedray.runtime.client_states`).
        """
        federation.require_features()
        if trial_group is not None:
            num_shards = len(trial_group.bundle_specs) - 1
        elif num_shards is None:
            num_shards = default_count(cpus_per_shard)
        if num_shards < 1:
            raise FedrayError(f"--num-shards must be ≥ 1, got {num_shards}")
        bounds = balanced_bounds(federation.client_offsets, num_shards)
        shards = len(bounds) - 1
        bundle = {"CPU": cpus_per_shard}
        cut = f" (--num-shards {num_shards} cut at equal sample counts over {federation.num_clients} clients)" if shards < num_shards else ""
        tests = eval_bounds(federation.num_test, shards)

        def check_fit() -> None:
            for footprint in footprints:
                check_memory(footprint, np.diff(federation.client_offsets[bounds]), np.diff(tests))

        threads = max(1, int(cpus_per_shard))
        kept_budget = default_budget(cpus_per_shard) if kept_budget is None else kept_budget
        state_budget = default_budget(cpus_per_shard) if state_budget is None else state_budget
        ranges = [((int(a), int(b)), (int(t), int(u))) for a, b, t, u in zip(bounds[:-1], bounds[1:], tests[:-1], tests[1:])]
        stored = None if federation.spec is not None else NamedObjects.put(
            {clients[0]: Rows.of(federation, clients, rows) for clients, rows in ranges})
        where = {"spec": federation.spec} if stored is None else {"stored": stored.name}
        arguments = [(ShardRows(*clients, *rows, **where), threads, kept_budget, state_budget) for clients, rows in ranges]
        try:
            pool = cls.launch(ShardActor, bundle, arguments, bounds, what=f"{shards} shard{'s' if shards > 1 else ''}{cut} "
                              f"× {cpus_per_shard:g} CPU", hint="lower --num-shards or --cpus-per-shard",
                              trial_group=trial_group, before_start=check_fit, federation=federation, stored=stored)
        except BaseException:
            if stored is not None:
                stored.release()
            raise
        pool.loading = [actor.loaded.remote() for actor in pool.actors]
        return pool

    def wait(self) -> "ShardPool":
        """Wait until every shard holds its rows; a shard's bad row is raised here as one :class:`FedrayError`."""
        if self.loading is not None:
            errors, self.loading = ray.get(self.loading), None
            for error in errors:
                if error is not None:
                    raise FedrayError(error)
        return self

    def shutdown(self) -> None:
        super().shutdown()
        if self.stored is not None:
            self.stored.release()

    @property
    def num_shards(self) -> int:
        return len(self.actors)

    def statistics(self, method: ClosedFormMethod, clients: np.ndarray, method_ref: ray.ObjectRef | None = None,
                   postprocessing: Postprocessing | None = None, rounds: np.ndarray | None = None,
                   keep: tuple[str, int] | None = None) -> Reduction:
        """Submit the statistics of ``clients`` to their shards and tree-reduce the partial sums (``.result()``: the sum).

        ``method_ref`` is ``method`` put in the object store (once per run, by a caller that submits many blocks);
        ``postprocessing``'s client hooks see each upload, made in round ``rounds[i]`` by ``clients[i]``; ``keep``
        (run token, block tag): what the method keeps in the shards stays there, for :meth:`second_pass`.
        """
        self.wait()
        method_ref = ray.put(method) if method_ref is None else method_ref
        owners = self.owners(clients)
        per_client = postprocessing is not None and postprocessing.per_client
        partials = [(actor.statistics.remote(method_ref, clients[owners == index], postprocessing if per_client else None,
                                             rounds[owners == index] if per_client else None, keep), actor)
                    for index, actor in enumerate(self.actors)]
        return tree_reduce(method_ref, partials, partial(combine_checked, method))

    def second_pass(self, method: ClosedFormMethod, method_ref: ray.ObjectRef, request: Any, token: str,
                    uploads: list[tuple[int, np.ndarray]], per_client: bool = False) -> Reduction:
        """Submit ``method``'s second pass over what run ``token`` kept in the shards from the blocks ``uploads`` ((tag,
        the clients that uploaded in it)) and tree-reduce the shards' sums (``.result()``: the sum)."""
        self.wait()
        adder = ray.put(SecondPass(method))
        request_ref = ray.put(request)
        owned = [(tag, self.owners(clients), clients) for tag, clients in uploads]
        partials = [(actor.second_pass.remote(method_ref, request_ref, token,
                                              [(tag, clients[owners == index]) for tag, owners, clients in owned],
                                              per_client), actor)
                    for index, actor in enumerate(self.actors)]
        return tree_reduce(adder, partials, method.combine_second)

    def forget(self, token: str) -> None:
        """Drop what run ``token`` kept in the shards, waiting for them: a call still pending when the pool shuts down
        would be killed with its shard, and Ray would print that it retries it."""
        ray.get([actor.forget.remote(token) for actor in self.actors])

    def correct(self, feature_map: ray.ObjectRef, classifier: ray.ObjectRef) -> list[ray.ObjectRef]:
        """Each shard's count of the correct predictions of ``classifier`` on its test rows through ``feature_map``,
        submitted (their sum is the count over every test row)."""
        self.wait()
        return [actor.correct.remote([feature_map], classifier) for actor in self.actors]

    def local_train(self, trainer: Any, trainer_ref: ray.ObjectRef, received: ray.ObjectRef, clients: np.ndarray,
                    round_number: int) -> Reduction:
        """Submit one round of local training of ``clients`` to their shards and tree-reduce the shards' sums.

        ``trainer_ref`` is ``trainer`` put in the object store, ``received`` what the server sends the clients.
        """
        self.wait()
        partials = [(actor.local_train.remote(trainer_ref, received, local, round_number), actor)
                    for actor, local in zip(self.actors, self.split_clients(clients))]
        return tree_reduce(trainer_ref, partials, trainer.combine)

    def peak_memory_bytes(self) -> list[int]:
        self.wait()
        return ray.get([actor.peak_memory_bytes.remote() for actor in self.actors])

    def client_state_sizes(self) -> list[tuple[int, int]]:
        """Each shard's bytes of clients' states in memory and on disk."""
        return ray.get([actor.client_state_sizes.remote() for actor in self.actors])

