"""The one order in which a run's sums over clients are added, whatever the shard layout: a fixed tree over fixed
leaves.

Float addition is not associative: a sum's bits follow the order of its terms. So that any ``--num-shards``,
``--cpus-per-shard``, node count or Ray scheduling order gives the same float64 sums, every sum over clients that the
shards compute follows one order fixed by the federation alone:

- the clients are cut into *leaves* (:func:`leaf_bounds`): contiguous ranges of client numbers balanced by sample
  count, as many as the federation's size asks, never as many as the layout has shards;
- the clients of a leaf that take part are taken together, in id order (one statistics call over their rows);
- the leaves are added pairwise in a perfect binary tree over their indices: node (level ``l``, index ``i``) covers
  leaves ``i·2^l .. (i+1)·2^l − 1`` and is its left child plus its right child, None standing for nothing (a leaf none
  of whose clients take part, or one past the last).

The leaves do not follow the shards: a shard computes the leaves that start among its clients (a contiguous range of
them, none where no leaf starts there), holding the rows of its last leaf's clients beyond its own range too
(:class:`LeafOwners`), and returns the nodes of the tree that lie wholly inside its range (:class:`TreeSum`); two
adjacent ranges merge into the nodes of their union (:meth:`TreeSum.merged`) and the whole range into the root
(:meth:`TreeSum.root`): the same additions of the same values on any number of shards.

Actors that work client after client (fine-tuning's trainers, TCT's stage-2 shards) use the same tree with one client
a leaf (:meth:`TreeSum.of_terms`): their ranges need not follow any leaves, and a range's few participants cost
O(log K) nodes each, however many clients it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedray.runtime.actor_group import balanced_bounds, combine_partials

LEAF_SAMPLES = 2**15
"""A leaf holds about this many samples (a federation of N samples has ⌈N / LEAF_SAMPLES⌉ leaves, at least
:data:`MIN_LEAVES`). A leaf's statistics are an object of their own each block (Fed3R: a d×d Gram written and added
once more than one call over a shard's clients would): large leaves keep that small beside their GEMMs; the leaves bound
how many shards share a closed form's statistics (not how many shards a run has)."""
MIN_LEAVES = 4
"""The leaves of a small federation (fewer where it has fewer clients)."""

Add = Callable[[Any, Any], Any]


def leaf_bounds(client_offsets: np.ndarray) -> np.ndarray:
    """Client numbers where the leaves start, plus K at the end, from the clients' row offsets alone."""
    leaves = max(MIN_LEAVES, -(-int(client_offsets[-1]) // LEAF_SAMPLES))
    return balanced_bounds(client_offsets, leaves)


@dataclass(frozen=True)
class LeafOwners:
    """Which shard computes each leaf: the one holding the leaf's first client (``shard_bounds``: the clients' ranges
    of the shards, plus K), which holds the rows of the leaf's other clients too."""

    leaves: np.ndarray
    """Client numbers where the leaves start, plus K (:func:`leaf_bounds`)."""
    first_leaves: np.ndarray
    """The first leaf of each shard's range, plus the number of leaves: shard ``s`` computes leaves
    ``first_leaves[s] .. first_leaves[s + 1] - 1``."""

    @classmethod
    def of(cls, leaves: np.ndarray, shard_bounds: np.ndarray) -> "LeafOwners":
        return cls(leaves, np.searchsorted(leaves[:-1], shard_bounds, side="left"))

    def range_of(self, shard: int) -> "LeafRange":
        """The leaves shard ``shard`` computes."""
        first, end = self.first_leaves[shard], self.first_leaves[shard + 1]
        return LeafRange(int(first), self.leaves[first:end + 1] if end > first else self.leaves[first:first])

    def held_end(self, shard: int, end_client: int) -> int:
        """The client after the last whose rows shard ``shard`` (its own clients ending before ``end_client``) holds:
        the end of its last leaf where that leaf reaches beyond its own clients."""
        end_leaf = self.first_leaves[shard + 1]
        return end_client if end_leaf == self.first_leaves[shard] else max(end_client, int(self.leaves[end_leaf]))

    def owners(self, clients: np.ndarray) -> np.ndarray:
        """The shard computing each of ``clients``' statistics (global numbers)."""
        leaf = np.searchsorted(self.leaves, clients, side="right") - 1
        return np.searchsorted(self.first_leaves, leaf, side="right") - 1


@dataclass(frozen=True)
class LeafRange:
    """The leaves a shard computes: leaf ``first`` starts at client ``bounds[0]``, leaf ``first + j`` at ``bounds[j]``,
    and the last ends before client ``bounds[-1]`` (``bounds`` empty: none)."""

    first: int
    bounds: np.ndarray

    @property
    def count(self) -> int:
        return max(len(self.bounds) - 1, 0)

    def split(self, clients: np.ndarray, rounds: np.ndarray | None = None
              ) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """Each leaf's index, the ``clients`` it holds in increasing order and their ``rounds`` (None if not given):
        every leaf of the range, those without clients too."""
        order = np.argsort(clients, kind="stable")
        ordered = clients[order]
        cuts = np.searchsorted(ordered, self.bounds)
        for position in range(self.count):
            taken = order[cuts[position]:cuts[position + 1]]
            yield self.first + position, clients[taken], None if rounds is None else rounds[taken]


@dataclass
class TreeSum:
    """A sum over leaves ``first .. end − 1`` as the nodes of the fixed tree that lie wholly inside that range, in
    order, none two siblings: (level, index, value), the value None where none of its leaves has a term."""

    first: int
    end: int
    nodes: list[tuple[int, int, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, first: int, values: Iterable[Any], add: Add) -> "TreeSum":
        """The sum of the values of leaves ``first``, ``first + 1``, ... (None: nothing), added by ``add`` as soon as
        both children of a node are in: a leaf's value is dropped once added, so at most one value per level is held."""
        total = cls(first, first)
        for value in values:
            total._append((0, total.end, value), add)
            total.end += 1
        return total

    @classmethod
    def of_terms(cls, first: int, end: int, terms: Iterable[tuple[int, Any]], add: Add) -> "TreeSum":
        """The sum over leaves ``first .. end − 1`` of ``terms``, (leaf, value) in increasing leaf order, every other
        leaf None: O(log) nodes a term, however many leaves the range has (a tree with one client a leaf)."""
        total = cls(first, first)
        for leaf, value in terms:
            total._skip_to(leaf, add)
            total._append((0, leaf, value), add)
            total.end = leaf + 1
        total._skip_to(end, add)
        return total

    def merged(self, other: "TreeSum", add: Add) -> "TreeSum":
        """This range's sum and the next one's (``other`` starts where this one ends), as the nodes of their union."""
        if other.first != self.end:
            raise ValueError(f"leaves {self.first}..{self.end - 1} and {other.first}..{other.end - 1} are not adjacent")
        total = TreeSum(self.first, self.first, list(self.nodes))
        for node in other.nodes:
            total._append(node, add)
        total.end = other.end
        return total

    def mapped(self, function: Callable[[Any], Any]) -> "TreeSum":
        """This sum with ``function`` applied to each node's value (None stays None)."""
        return TreeSum(self.first, self.end, [(level, index, None if value is None else function(value))
                                              for level, index, value in self.nodes])

    def root(self, num_leaves: int, add: Add) -> Any:
        """The sum over all ``num_leaves`` leaves (this must cover them): the value of the tree's root."""
        if (self.first, self.end) != (0, num_leaves):
            raise ValueError(f"leaves {self.first}..{self.end - 1} are not all {num_leaves}")
        total = TreeSum(0, num_leaves, list(self.nodes))
        total._skip_to(1 << max(num_leaves - 1, 0).bit_length(), add)  # leaves past the last, None
        return total.nodes[0][2] if total.nodes else None

    def _skip_to(self, end: int, add: Add) -> None:
        """Leaves ``self.end .. end − 1``, None, in the largest nodes that fit: O(log) nodes however many leaves."""
        position = self.end
        while position < end:
            aligned = (position & -position).bit_length() - 1 if position else end.bit_length()
            level = min(aligned, (end - position).bit_length() - 1)
            self._append((level, position >> level, None), add)
            position += 1 << level
        self.end = max(self.end, end)

    def _append(self, node: tuple[int, int, Any], add: Add) -> None:
        """Add ``node`` after the last, then each node and its left sibling, last before it, into their parent."""
        self.nodes.append(node)
        while len(self.nodes) > 1:
            (left_level, left_index, left), (level, index, right) = self.nodes[-2:]
            if left_level != level or index % 2 == 0 or left_index != index - 1:
                return
            self.nodes[-2:] = [(level + 1, index >> 1, combine_partials(left, right, add))]


def merge_with(add: Add) -> Add:
    """Two adjacent ranges' :class:`TreeSum` merged, their values added by ``add``."""
    return lambda left, right: left.merged(right, add)


def root_of(num_leaves: int, add: Add) -> Callable[[TreeSum], Any]:
    """The sum a :class:`TreeSum` over all ``num_leaves`` leaves stands for, its values added by ``add``."""
    return lambda total: total.root(num_leaves, add)
