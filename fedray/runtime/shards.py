"""Shard actors: each holds the rows of many clients and runs the jobs of a run on them, and their pool.

A shard loads its rows once (:mod:`fedray.runtime.shard_rows`) and its jobs
share them: the closed-form statistics and second passes
(:mod:`fedray.runtime.shard_statistics`), local training with the clients'
states (:mod:`fedray.runtime.shard_training`) and the count of correct
predictions on its test rows (:mod:`fedray.runtime.shard_evaluation`). Each
job adds its partial sums as its method (or trainer) defines in the tree
reduction of :class:`ShardPool`: the closed-form sums and training's as the
nodes of the fixed tree over leaves of clients (:mod:`fedray.runtime.fixed_tree`),
the same bits on any number of shards.
"""

from __future__ import annotations

import resource
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial, reduce
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup

from fedray.core.federation import Federation
from fedray.core.errors import FedrayError
from fedray.methods.evaluation import eval_bounds
from fedray.methods.base import Classifier, ClosedFormMethod
from fedray.methods.checks import combine_checked
from fedray.methods.postprocessor import Postprocessing
from fedray.methods.training.backend import RoundUpdate
from fedray.methods.training.held_updates import Arrival
from fedray.runtime.cluster import check_memory
from fedray.runtime.client_states import ClientStates, Layout
from fedray.runtime.kept import KeptParts, default_budget
from fedray.runtime.footprint import Footprint
from fedray.runtime import actor_group, parked
from fedray.runtime.named_objects import NamedObjects, read
from fedray.runtime.placement import default_count
from fedray.runtime.restarts import this_actor_was_restarted
from fedray.runtime.actor_group import (CLEAR_TIMEOUT_S, ActorGroup, Reduction, balanced_bounds, combine_partials,
                                       tree_reduce)
from fedray.runtime.fixed_tree import LeafOwners, LeafRange, TreeSum, leaf_bounds, merge_with, root_of
from fedray.runtime.shard_evaluation import ShardEvaluation
from fedray.runtime.shard_rows import HeldRows, Rows, ShardRows
from fedray.runtime.shard_statistics import ShardStatistics, add_block, merge_statistics, merge_second
from fedray.runtime.shard_training import ShardTraining
from fedray.runtime.update_holder import UpdateHolder
from fedray.runtime import tensor_transfer


def shard_threads(cpus_per_shard: float) -> int:
    """The torch threads a shard computes with: its whole CPUs, at least one."""
    return max(1, int(cpus_per_shard))


def peak_memory_bytes() -> int:
    """Peak resident memory of the calling process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_seconds() -> float:
    """CPU time the calling process has used so far, user and system, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class ShardAssignment:
    """What a shard holds and how it runs: its rows, its threads, the bytes it keeps for second passes
    (``kept_budget``) and of clients' states in memory (``state_budget``), and the leaves whose statistics it
    computes."""

    rows: ShardRows
    threads: int
    kept_budget: int
    state_budget: int | None = None
    leaves: LeafRange | None = None
    """The leaves of the fixed tree whose statistics it computes (:mod:`fedray.runtime.fixed_tree`); None: its rows as
    one leaf."""


@ray.remote(max_restarts=3, max_task_retries=3)
class ShardActor:
    """Holds the clients of its :class:`ShardAssignment` and runs its jobs' calls on them.

    Its state is a pure function of its assignment, which it fetches by the
    name of its pool's :class:`~fedray.runtime.named_objects.NamedObjects`
    (entry ``("shard", index)``) as often as it starts, and its calls are pure
    functions of their arguments, so Ray can restart a failed shard and retry
    its calls with bitwise the same results, also in a pool a later run took
    over (:meth:`ShardPool.start`), which gives it a new assignment. The one
    exception, its clients' states of a stateful training algorithm, is
    restored by the driver (see :mod:`fedray.runtime.client_states`). A bad
    row in its part of the data (e.g. NaN in a Parquet file) is kept as the
    shard's error, for :meth:`ShardPool.wait` to raise in the driver as one
    line.
    """

    def __init__(self, assignments: str, index: int) -> None:
        tensor_transfer.register()
        self.assignments, self.index = assignments, index
        self.load(lost=this_actor_was_restarted())

    def load(self, lost: bool = False) -> str | None:
        """Take this shard's assignment (as a new actor would; ``lost``: a restart lost the clients' states); None
        once its rows are held, else why they could not be."""
        assignment: ShardAssignment = read(self.assignments, ("shard", self.index))
        torch.set_num_threads(assignment.threads)
        self.client_states = ClientStates(lost, assignment.state_budget, owner=ray.get_runtime_context().get_actor_id())
        self.error: str | None = None
        try:
            loaded = assignment.rows.load()
        except FedrayError as error:
            self.error = str(error)
            return self.error
        held = HeldRows(loaded, assignment.rows.first_client)
        self.statistics_job = ShardStatistics(held, KeptParts(assignment.kept_budget), assignment.leaves)
        self.training = ShardTraining(held, self.client_states, self.statistics_job.leaves)
        self.evaluation = ShardEvaluation(loaded.test_features, loaded.test_labels)
        return None

    def park(self) -> bool:
        """Drop the rows, what was kept for second passes and the clients' states (those spilled deleted); whether
        this shard may be parked: never restarted (a restart spends one of its restarts, which the next run needs)."""
        self.client_states.clear()
        self.statistics_job = self.training = self.evaluation = None
        return not this_actor_was_restarted()

    def loaded(self) -> str | None:
        """None once the rows are held, else why they could not be."""
        return self.error

    def peak_memory_bytes(self) -> int:
        """Peak resident memory of this actor's process."""
        return peak_memory_bytes()

    def cpu_seconds(self) -> float:
        """CPU time this actor's process has used since it started (its start-up and imports included)."""
        return cpu_seconds()

    # --- closed-form statistics (ShardStatistics)

    def label_statistics(self, method: ClosedFormMethod, blocks: list[np.ndarray]) -> list[Any]:
        return self.statistics_job.label_statistics(method, blocks)

    def statistics(self, method: ClosedFormMethod, clients: np.ndarray, postprocessing: Postprocessing | None = None,
                   rounds: np.ndarray | None = None, keep: tuple[str, int] | None = None,
                   ahead: list[tuple[int, Any]] | None = None) -> Any:
        return self.statistics_job.statistics(method, clients, postprocessing, rounds, keep, ahead)

    def second_pass(self, method: ClosedFormMethod, request: Any, token: str, tag: int, clients: np.ndarray,
                    per_client: bool) -> Any:
        return self.statistics_job.second_pass(method, request, token, tag, clients, per_client)

    def forget(self, token: str) -> None:
        self.statistics_job.forget(token)

    def combine_statistics(self, method: ClosedFormMethod, a: TreeSum, b: TreeSum) -> TreeSum:
        return merge_statistics(method, a, b)

    def combine_second(self, method: ClosedFormMethod, a: TreeSum, b: TreeSum) -> TreeSum:
        return merge_second(method, a, b)

    def root_statistics(self, method: ClosedFormMethod, total: TreeSum, num_leaves: int) -> Any:
        """The sum a block's :class:`TreeSum` over all ``num_leaves`` leaves stands for (see :meth:`ShardPool.statistics`)."""
        return total.root(num_leaves, partial(add_block, method))

    # --- local training with the clients' states (ShardTraining)

    def local_train(self, trainer: Any, received: Any, clients: np.ndarray, round_number: int,
                    steps: np.ndarray | None = None) -> Any:
        return self.training.local_train(trainer, received, clients, round_number, steps)

    def combine_updates(self, trainer: Any, a: TreeSum, b: TreeSum) -> TreeSum:
        return a.merged(b, trainer.combine)

    def client_state_sizes(self) -> tuple[int, int]:
        """Bytes of its clients' states in memory, and spilled to disk."""
        return self.client_states.sizes()

    def save_client_states(self, path: str) -> None:
        self.client_states.save(Path(path))

    def restore_client_states(self, paths: list[str], first: int, end: int, layout: Layout | None = None) -> None:
        self.training.restore(paths, first, end, layout)

    def clear_client_states(self) -> None:
        self.client_states.clear()

    # --- evaluation (ShardEvaluation)

    def correct(self, feature_map: list[ray.ObjectRef], classifier: Classifier) -> int:
        return self.evaluation.correct(feature_map, classifier)


def _parking_key(shards: int, cpus_per_shard: float, trial_group: PlacementGroup | None) -> tuple:
    """What makes parked shards fit a run: as many, of the same resources (and so the same threads), in the same Tune
    trial's placement group (None: in one of their own)."""
    return "shards", shards, cpus_per_shard, None if trial_group is None else trial_group.id.hex()


@dataclass(kw_only=True)
class ShardPool(ActorGroup):
    """The shard actors of one federation, reusable across runs of different methods.

    The shards' CPUs are reserved at once in a placement group (one bundle per
    shard, spread over the nodes), so a run either gets all its shards or fails
    with a clear message instead of waiting forever for a partial set. Shards
    load their rows while the driver goes on (e.g. reading the test set);
    :meth:`wait`, called by every method that needs them, waits for them.
    A pool started ``reusable`` is parked at :meth:`shutdown` (see
    :mod:`fedray.runtime.parked`) for the next run's :meth:`start` to take.
    """

    keeps_client_states = True

    federation: Federation
    """The federation whose rows the shards hold (None while parked)."""
    stored: NamedObjects
    """The shards' assignments (under ``("shard", index)``) and the rows of a federation held in memory (see
    :class:`ShardRows`), kept for a shard that restarts."""
    leaves: LeafOwners
    """The leaves of the fixed tree (:func:`~fedray.runtime.fixed_tree.leaf_bounds`) and the shard computing each:
    every closed-form sum over clients follows that tree, whatever the shards."""
    loading: list | None = None
    reusable: bool = False
    holder: ray.actor.ActorHandle | None = None
    """A run's asynchronous updates waiting for their steps (:meth:`hold_from_now`)."""

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
        reusable: bool = False,
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
        :mod:`fedray.runtime.client_states`). ``reusable``: on a Ray this process started, or in the bundles of a Tune
        trial whose process the sweep reuses, take the shards a run parked with as many shards of the same resources,
        reloaded with these rows (bitwise what new shards give), and park them at :meth:`shutdown`.
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
        leaves = LeafOwners.of(leaf_bounds(federation.client_offsets), bounds)
        held = [leaves.held_end(index, int(end)) for index, end in enumerate(bounds[1:])]

        def check_fit() -> None:
            for footprint in footprints:
                check_memory(footprint, federation.client_offsets[held] - federation.client_offsets[bounds[:-1]],
                             np.diff(tests))

        threads = shard_threads(cpus_per_shard)
        kept_budget = default_budget(cpus_per_shard) if kept_budget is None else kept_budget
        state_budget = default_budget(cpus_per_shard) if state_budget is None else state_budget
        ranges = [((int(a), int(b)), (int(t), int(u))) for a, b, t, u in zip(bounds[:-1], held, tests[:-1], tests[1:])]
        reusable = reusable and (trial_group is not None or parked.allowed())

        def assigned(name: str) -> tuple[dict, dict]:
            """Each shard's assignment, and the rows of a federation held in memory, as the named objects ``name``
            keep them (the small objects, the large)."""
            where = {"spec": federation.spec} if federation.spec is not None else {"stored": name}
            rows = {} if federation.spec is not None else {
                clients[0]: Rows.of(federation, clients, test_rows) for clients, test_rows in ranges}
            return {("shard", index): ShardAssignment(ShardRows(*clients, *test_rows, **where), threads, kept_budget,
                                                      state_budget, leaves.range_of(index))
                    for index, (clients, test_rows) in enumerate(ranges)}, rows

        taken = parked.take(_parking_key(shards, cpus_per_shard, trial_group)) if reusable else None
        if taken is not None:
            try:
                check_fit()
                taken = replace(taken, stored=taken.stored.replace(*assigned(taken.stored.name)))  # what end() releases
                pool = replace(taken, bounds=bounds, leaves=leaves, federation=federation, reusable=True)
                pool.loading = [actor.load.remote() for actor in pool.actors]
                return pool
            except BaseException:
                taken.end()
                raise
        name = NamedObjects.new_name()
        stored = NamedObjects.put(*assigned(name), name)
        try:
            pool = cls.launch(ShardActor, bundle, [(name, index) for index in range(shards)], bounds,
                              what=f"{shards} shard{'s' if shards > 1 else ''}{cut} × {cpus_per_shard:g} CPU",
                              hint="lower --num-shards or --cpus-per-shard", trial_group=trial_group,
                              before_start=check_fit, federation=federation, stored=stored, leaves=leaves,
                              reusable=reusable)
        except BaseException:
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
        """Park the shards if the pool is ``reusable`` and every shard has done all it was asked (none failed, none
        is still busy with a call an interrupted run left) and none was ever restarted, else end them."""
        try:
            if self.reusable and self._parked():
                return
        except BaseException:
            self.end()
            raise
        self.end()

    def _parked(self) -> bool:
        try:
            if not all(ray.get([actor.park.remote() for actor in self.actors], timeout=CLEAR_TIMEOUT_S)):
                return False
        except ray.exceptions.RayError:  # a shard failed, or is still busy with an interrupted run's call
            return False
        parked.park(_parking_key(self.num_shards, self.bundle["CPU"], self.trial_group),
                    replace(self, federation=None, holder=None, stored=self.stored.replace({}, {})))  # none held

        return True

    def end(self) -> None:
        """Kill the shards (deleting the clients' states they spilled) and free their resources."""
        super().shutdown()
        self.stored.release()

    @property
    def num_shards(self) -> int:
        return len(self.actors)

    def owned_bounds(self) -> np.ndarray:
        """Where the clients each shard trains start, plus K: those of the leaves it computes (a shard where no leaf
        starts trains none), so that a round's sum follows the fixed tree."""
        return self.leaves.leaves[self.leaves.first_leaves]

    def statistics(self, method: ClosedFormMethod, clients: np.ndarray, method_ref: ray.ObjectRef | None = None,
                   postprocessing: Postprocessing | None = None, rounds: np.ndarray | None = None,
                   keep: tuple[str, int] | None = None, ahead: list[tuple[int, Any]] | None = None) -> Reduction:
        """Submit the statistics of ``clients`` to their shards and join their sums in the fixed tree (``.result()``:
        the sum, the same bits on any number of shards). The shards make the last step and the root too, so that the
        driver fetches the sum alone, not the tree's nodes (O(log leaves) statistics objects from each side: Fed3R's
        driver at 10⁵ clients peaked 350 MB higher that way; with FedCOF's second passes ahead, a d × d per evaluation
        in each node).

        ``method_ref`` is ``method`` put in the object store (once per run, by a caller that submits many blocks);
        ``postprocessing``'s client hooks see each upload, made in round ``rounds[i]`` by ``clients[i]``; ``keep``
        (run token, block tag): what the method keeps in the shards stays there, for :meth:`second_pass`, or, with
        ``ahead`` ((evaluation, request) of each evaluation from this block on), goes into each evaluation's second
        pass over this block as it is computed: the sum is then a
        :class:`~fedray.runtime.shard_statistics.WithSecondPasses`.
        """
        self.wait()
        method_ref = ray.put(method) if method_ref is None else method_ref
        owners = self.leaves.owners(clients)
        per_client = postprocessing is not None and postprocessing.per_client
        partials = [(actor.statistics.remote(method_ref, clients[owners == index], postprocessing if per_client else None,
                                             rounds[owners == index] if per_client else None, keep, ahead), actor)
                    for index, actor in enumerate(self.actors)]
        return tree_reduce(method_ref, partials, merge_with(partial(add_block, method)), combine="combine_statistics",
                           finish_in=("root_statistics", (len(self.leaves.leaves) - 1,)))

    def label_statistics(self, method: ClosedFormMethod, method_ref: ray.ObjectRef,
                         blocks: list[np.ndarray]) -> list[Any]:
        """``method``'s :meth:`~fedray.ClosedFormMethod.label_statistics` of each block of clients, each summed over
        the shards in their order (None for a block without clients), waited for: the labels only, no features."""
        self.wait()
        owned = [self.leaves.owners(clients) for clients in blocks]
        shards = ray.get([actor.label_statistics.remote(method_ref, [clients[owners == index]
                                                                      for clients, owners in zip(blocks, owned)])
                          for index, actor in enumerate(self.actors)])
        return [reduce(partial(combine_partials, add=partial(combine_checked, method)), parts, None)
                for parts in zip(*shards)]

    def second_pass(self, method: ClosedFormMethod, method_ref: ray.ObjectRef, request: Any, token: str,
                    uploads: list[tuple[int, np.ndarray]], per_client: bool = False) -> Any:
        """``method``'s second pass over what run ``token`` kept in the shards from the blocks ``uploads`` ((tag, the
        clients that uploaded in it)): each block's summed in the fixed tree (one reduction a block, all submitted at
        once), the blocks' added in their order here, as :class:`~fedray.engine.closed_form.ClosedFormRounds` adds the
        second passes the shards computed with the statistics."""
        self.wait()
        request_ref, add, num_leaves = ray.put(request), method.combine_second, len(self.leaves.leaves) - 1
        reductions = []
        for tag, clients in uploads:
            owners = self.leaves.owners(clients)
            partials = [(actor.second_pass.remote(method_ref, request_ref, token, tag, clients[owners == index],
                                                  per_client), actor)
                        for index, actor in enumerate(self.actors)]
            reductions.append(tree_reduce(method_ref, partials, merge_with(add), combine="combine_second",
                                          finish=root_of(num_leaves, add)))
        return reduce(partial(combine_partials, add=add), (reduction.result() for reduction in reductions), None)

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
                    round_number: int, steps: np.ndarray | None = None, hold: Arrival | None = None) -> Reduction:
        """Submit one round of local training of ``clients`` to their shards and tree-reduce the shards' sums.

        ``trainer_ref`` is ``trainer`` put in the object store, ``received`` what the server sends the clients,
        ``steps`` each client's step budget (None: none). ``hold``: the sum is held for the server step of that
        :class:`Arrival` by the run's :class:`UpdateHolder` (:meth:`take_held`), the reduction left unread.
        """
        self.wait()
        owners = self.owners(clients)
        partials = [(actor.local_train.remote(trainer_ref, received, clients[owners == index], round_number,
                                              None if steps is None else steps[owners == index]), actor)
                    for index, actor in enumerate(self.actors)]
        num_leaves = len(self.leaves.leaves) - 1
        reduction = tree_reduce(trainer_ref, partials, merge_with(trainer.combine), combine="combine_updates",
                                finish=root_of(num_leaves, trainer.combine))
        if hold is not None:
            self.holder.hold.remote(trainer_ref, num_leaves, hold, *reduction.partials)
        return reduction

    def hold_from_now(self) -> None:
        """Start holding a run's asynchronous updates (:meth:`local_train`'s ``hold``) in an :class:`UpdateHolder` of
        its own: whatever an earlier run left held ends with the holder before."""
        self.holder = UpdateHolder.remote()

    def take_held(self, step: int) -> RoundUpdate | None:
        """The sum of the updates held for server step ``step`` (None: none), once every update submitted before is
        held."""
        return actor_group.fetch([self.holder.take.remote(step)])[0]

    def peak_memory_bytes(self) -> list[int]:
        self.wait()
        return ray.get([actor.peak_memory_bytes.remote() for actor in self.actors])

    def cpu_seconds(self) -> list[float]:
        self.wait()
        return ray.get([actor.cpu_seconds.remote() for actor in self.actors])

    def client_state_sizes(self) -> list[tuple[int, int]]:
        """Each shard's bytes of clients' states in memory and on disk."""
        return ray.get([actor.client_state_sizes.remote() for actor in self.actors])

