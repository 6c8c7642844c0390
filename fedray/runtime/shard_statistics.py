"""A shard's closed-form job: the statistics of its uploading clients, summed in the shard, and a method's second pass.

Per block of rounds the driver sends the numbers of the clients that upload in
that block; the shard gathers their rows and computes the block's statistics in
one call per leaf of clients it owns (for Fed3R: one GEMM each), summed in
the fixed tree over the leaves (:mod:`fedray.runtime.fixed_tree`), so that
any shard layout gives the same bits; Ray's overhead scales with shards ×
evaluation points, not with clients or rounds. What a method keeps in the
shards for its second pass (FedCOF's received means) stays here
(:mod:`fedray.runtime.kept`), or, where the server knows every evaluation's
request before the pass (``ClosedFormMethod.label_statistics``), is read once:
each part's second pass is computed with the block's statistics for every
evaluation still to come, and goes back with them (:class:`WithSecondPasses`),
nothing kept.

A second pass is summed block by block: a block's second pass is its leaves'
in the fixed tree, and the blocks' are added in block order on the driver, by
either path. So a shard never holds a sum per leaf and evaluation (FedCOF at
10⁶ clients: 395 leaves × 10 evaluations × a d×d Gram), only the tree's partial
sums of the block it computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch

from fedray.core.errors import FedrayError
from fedray.methods.base import ClientBatch, ClosedFormMethod, floats_in, offers_compact_statistics
from fedray.methods.checks import combine_checked
from fedray.methods.postprocessor import Postprocessing, flatten
from fedray.runtime.actor_group import combine_partials
from fedray.runtime.compact_sum import compact_sum
from fedray.runtime.fixed_tree import LeafRange, TreeSum
from fedray.runtime.kept import KeptParts
from fedray.runtime.shard_rows import HeldRows


@dataclass
class WithSecondPasses:
    """A block's statistics and, for each evaluation ahead (:meth:`ShardStatistics.statistics`' ``ahead``, in its
    order), the second pass over the parts the method would have kept of them (None: nothing)."""

    statistics: Any
    second_passes: list[Any]




class ShardStatistics:
    """The closed-form statistics of the clients of ``rows``, and what methods keep of them within ``kept``'s budget.

    Every sum follows the fixed tree over ``leaves`` (:mod:`fedray.runtime.fixed_tree`; default: all of ``rows``'s
    clients in one leaf): the clients of a leaf in id order, the leaves' sums pairwise by index."""

    def __init__(self, rows: HeldRows, kept: KeptParts, leaves: LeafRange | None = None) -> None:
        self.rows = rows
        self.kept = kept
        self.leaves = leaves or LeafRange(0, np.array([rows.first_client, rows.first_client + len(rows.offsets) - 1]))

    def label_statistics(self, method: ClosedFormMethod, blocks: list[np.ndarray]) -> list[Any]:
        """``method``'s :meth:`~fedray.ClosedFormMethod.label_statistics` of each block of clients (None: none here)."""
        return [method.label_statistics(self.rows.label_batch(clients)) if len(clients) else None for clients in blocks]

    def statistics(self, method: ClosedFormMethod, clients: np.ndarray, postprocessing: Postprocessing | None = None,
                   rounds: np.ndarray | None = None, keep: tuple[str, int] | None = None,
                   ahead: list[tuple[int, Any]] | None = None) -> TreeSum:
        """Statistics summed over ``clients`` (global numbers; ``rounds``: when each uploads) in the fixed tree over
        this shard's leaves: its nodes (:class:`TreeSum`). With a postprocessor that sees each client's upload, a
        leaf's clients one by one through it, summed in id order if it changed any (else the leaf's batched
        statistics, bit for bit those of a run without it).

        ``keep`` (run token, block tag): what the method keeps in the shards (``kept_in_shards``) stays here for
        :meth:`second_pass`, and only the rest is returned. With ``ahead`` ((evaluation, request) of each evaluation
        from this block on), nothing is kept: a leaf's value is :class:`WithSecondPasses`, its statistics and each
        kept part's second pass for each evaluation, summed in the leaf as :meth:`second_pass` would sum them.
        """
        per_client = postprocessing is not None and postprocessing.per_client
        leaves = self.leaves.split(clients, rounds if per_client else None)
        values = (self._leaf_statistics(method, leaf, leaf_clients, postprocessing if per_client else None,
                                        leaf_rounds, keep, ahead) for leaf, leaf_clients, leaf_rounds in leaves)
        return TreeSum.of(self.leaves.first, values, partial(add_block, method))

    def _leaf_statistics(self, method: ClosedFormMethod, leaf: int, clients: np.ndarray,
                         postprocessing: Postprocessing | None, rounds: np.ndarray | None,
                         keep: tuple[str, int] | None, ahead: list[tuple[int, Any]] | None) -> Any:
        """The statistics of one leaf's ``clients`` (in id order), None if there are none (see :meth:`statistics`)."""
        if not len(clients):
            return None
        total, kept, size = None, [] if ahead is None else None, 0
        passes = None if ahead is None or keep is None else [None] * len(ahead)
        for stats in self._uploads(method, clients, postprocessing, rounds):
            if keep is not None:
                stats, part = method.kept_in_shards(stats)
                if passes is not None:
                    passes = [combine_partials(total, method.second_pass(request, part), method.combine_second)
                              for total, (_, request) in zip(passes, ahead)]
                if kept is not None:
                    kept.append(part)
                    size += 8 * floats_in([part])
                    if postprocessing is None and not self.kept.fits(size):
                        kept = None  # dropped run by run, never held whole: the second pass computes this leaf again
            total = stats if total is None else combine_checked(method, total, stats)
        if keep is not None and kept is not None and any(part is not None for part in kept):
            token, tag = keep
            self.kept.add(token, (tag, leaf), kept, must_keep=postprocessing is not None)
        return total if passes is None else WithSecondPasses(total, passes)

    def _uploads(self, method: ClosedFormMethod, clients: np.ndarray, postprocessing: Postprocessing | None,
                 rounds: np.ndarray | None) -> Iterator[Any]:
        """The statistics of ``clients``, as one sum (through ``postprocessing``'s client hooks, if given), or as
        one per run of clients where the shard streams its features (their sum is the clients'); each client's rows
        through ``postprocessing``'s selection and feature hooks either way (a selection of every row and a feature map
        that changes no row change no bit)."""
        round_of = {} if rounds is None else dict(zip(clients.tolist(), rounds.tolist()))

        def batch(rows: np.ndarray) -> ClientBatch:
            batch = self.rows.batch(rows, method.features_dtype)
            if postprocessing is None:
                return batch
            batch = postprocessing.selected(batch, [round_of[client] for client in rows.tolist()])
            return replace(batch, features=postprocessing.features(batch.features))

        if postprocessing is not None:
            if postprocessing.entrywise and offers_compact_statistics(method):
                total = compact_sum(method, self.rows, clients, rounds, postprocessing)
            else:
                uploads = ((client, number, method.client_statistics(batch(np.array([client]))))
                           for client, number in zip(clients.tolist(), rounds.tolist()))
                total = postprocessing.client_sum(uploads, partial(combine_checked, method), method.upload_parts())
            if total is not None:
                yield total
                return
        for run in self.rows.runs(clients):
            yield method.client_statistics(batch(run))

    def second_pass(self, method: ClosedFormMethod, request: Any, token: str, tag: int, clients: np.ndarray,
                    per_client: bool) -> TreeSum:
        """``method``'s second pass over what its run (``token``) kept here from block ``tag`` (this shard's
        ``clients`` that uploaded in it), in the fixed tree over this shard's leaves: a leaf's value is one
        ``second_pass`` per part it kept, added in order. A part not kept (over the budget, or lost when Ray restarted
        this shard) is computed again from its clients' rows."""
        values = (self._leaf_second_pass(method, request, token, leaf, tag, leaf_clients, per_client)
                  for leaf, leaf_clients, _ in self.leaves.split(clients))
        return TreeSum.of(self.leaves.first, values, method.combine_second)

    def _leaf_second_pass(self, method: ClosedFormMethod, request: Any, token: str, leaf: int, tag: int,
                          clients: np.ndarray, per_client: bool) -> Any:
        """One leaf's second pass (see :meth:`second_pass`) over its ``clients`` of block ``tag`` (None: none)."""
        parts = self.kept.parts(token, (tag, leaf))
        if parts is None and len(clients):
            if per_client:
                raise FedrayError(f"a restarted shard lost the uploads {method.name or type(method).__name__} kept "
                                  f"in it, which a per-client postprocessor changed: run it again")
            parts = (method.kept_in_shards(stats)[1] for stats in self._uploads(method, clients, None, None))
        total = None
        for part in parts or ():
            total = combine_partials(total, method.second_pass(request, part), method.combine_second)
        return total

    def forget(self, token: str) -> None:
        """Drop what run ``token`` kept here."""
        self.kept.forget(token)


def same_request(a: Any, b: Any) -> bool:
    """Whether two second-pass requests are the same, bit for bit: their tensors by path (as :func:`flatten` finds
    them), or, holding none, by ``==``."""
    left, right = flatten(a), flatten(b)
    if not left and not right:
        return bool(a == b)
    return left.keys() == right.keys() and all(
        left[path].dtype == right[path].dtype and torch.equal(left[path], right[path]) for path in left)


def add_block(method: ClosedFormMethod, a: Any, b: Any) -> Any:
    """Two sums of a block's statistics added as ``method`` adds them, their shapes checked; with second passes
    (:class:`WithSecondPasses`), each evaluation's too."""
    if not isinstance(a, WithSecondPasses):
        return combine_checked(method, a, b)
    return WithSecondPasses(combine_partials(a.statistics, b.statistics, partial(combine_checked, method)),
                            [combine_partials(x, y, method.combine_second)
                             for x, y in zip(a.second_passes, b.second_passes)])


def merge_statistics(method: ClosedFormMethod, a: TreeSum, b: TreeSum) -> TreeSum:
    """Two adjacent ranges of leaves' statistics merged (:func:`add_block`)."""
    return a.merged(b, partial(add_block, method))


def merge_second(method: ClosedFormMethod, a: TreeSum, b: TreeSum) -> TreeSum:
    """Two adjacent ranges of leaves' second passes merged, added as ``method`` adds them."""
    return a.merged(b, method.combine_second)
