"""The fixed tree every sum over clients follows: leaves fixed by the federation, added pairwise by index, so that any
shard layout gives the same bits."""

import numpy as np
import pytest

from fedray.runtime.fixed_tree import LeafOwners, LeafRange, TreeSum, leaf_bounds


def written(a, b):
    """An addition that writes out what it added, in order."""
    return f"({a}+{b})"


def test_leaves_are_added_pairwise_by_index_nothing_standing_for_absent_leaves():
    assert TreeSum.of(0, "abcde", written).root(5, written) == "(((a+b)+(c+d))+e)"
    assert TreeSum.of(0, ["a", "b", None, "d", "e", None, "g"], written).root(7, written) == "(((a+b)+d)+(e+g))"
    assert TreeSum.of(0, ["a"], written).root(1, written) == "a"
    assert TreeSum.of(0, [None, None], written).root(2, written) is None


@pytest.mark.parametrize("cuts", [[], [1], [3], [2, 5], [1, 2, 3, 4, 5, 6], [3, 4]])
def test_any_cut_into_adjacent_ranges_merged_in_any_grouping_gives_the_same_additions(cuts):
    values = list("abcdefg")
    whole = TreeSum.of(0, values, written).root(7, written)
    assert whole == "(((a+b)+(c+d))+((e+f)+g))"
    bounds = [0, *cuts, 7]
    ranges = [TreeSum.of(first, values[first:end], written) for first, end in zip(bounds[:-1], bounds[1:])]
    left_first = ranges[0]
    for other in ranges[1:]:
        left_first = left_first.merged(other, written)
    right_first = ranges[-1]
    for other in reversed(ranges[:-1]):
        right_first = other.merged(right_first, written)
    assert left_first.root(7, written) == right_first.root(7, written) == whole


@pytest.mark.parametrize("cuts", [[], [1], [5], [37], [13, 64], [1, 2, 3, 63, 64, 99]])
def test_a_few_terms_among_many_leaves_add_as_if_every_leaf_were_given(cuts):
    """One client a leaf: a shard's few participants among its range's clients, the others skipped in O(log) nodes."""
    terms = {3: "a", 17: "b", 18: "c", 40: "d", 64: "e", 99: "f"}
    dense = [terms.get(leaf) for leaf in range(100)]
    assert TreeSum.of(0, dense, written).root(100, written) == "(((a+(b+c))+d)+(e+f))"
    bounds = [0, *cuts, 100]
    ranges = [TreeSum.of_terms(first, end, [(leaf, value) for leaf, value in terms.items() if first <= leaf < end],
                               written) for first, end in zip(bounds[:-1], bounds[1:])]
    for first, end, sparse in zip(bounds[:-1], bounds[1:], ranges):
        assert sparse.nodes == TreeSum.of(first, dense[first:end], written).nodes
        assert len(sparse.nodes) <= 2 * 7, "a range's nodes: at most two a level"
    merged = ranges[0]
    for other in ranges[1:]:
        merged = merged.merged(other, written)
    assert merged.root(100, written) == "(((a+(b+c))+d)+(e+f))"
    assert TreeSum.of_terms(0, 10**6, [], written).root(10**6, written) is None


def test_only_adjacent_ranges_merge():
    with pytest.raises(ValueError, match="not adjacent"):
        TreeSum.of(0, "ab", written).merged(TreeSum.of(3, "d", written), written)


def test_a_leaf_takes_its_clients_in_id_order_with_their_rounds():
    leaves = LeafRange(2, np.array([10, 13, 13, 17]))
    split = list(leaves.split(np.array([16, 11, 10, 14]), np.array([1, 2, 3, 4])))
    assert [leaf for leaf, _, _ in split] == [2, 3, 4]
    assert [clients.tolist() for _, clients, _ in split] == [[10, 11], [], [14, 16]]
    assert [rounds.tolist() for _, _, rounds in split] == [[3, 2], [], [4, 1]]


def test_leaves_follow_the_federation_and_each_is_computed_by_the_shard_holding_its_first_client():
    sizes = np.array([3, 40, 5, 5, 9, 1, 1, 30, 2, 7, 11, 6])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    leaves = leaf_bounds(offsets)
    assert leaves.tolist() == [0, 2, 5, 8, 12], \
        "4 leaves: the first clients whose rows start at 30, 60, 90 of 120 or later"
    owners = LeafOwners.of(leaves, np.array([0, 3, 5, 6, 12]))  # shards of clients 0-2, 3-4, 5, 6-11
    assert owners.first_leaves.tolist() == [0, 2, 2, 3, 4]
    assert owners.owners(np.arange(12)).tolist() == [0, 0, 0, 0, 0, 2, 2, 2, 3, 3, 3, 3]
    assert [owners.held_end(shard, end) for shard, end in enumerate([3, 5, 6, 12])] == [5, 5, 8, 12], \
        "shard 0 holds clients 3-4 for leaf 1, shard 2 clients 6-7 for leaf 2; shard 1 computes no leaf"
    assert [(leaves.first, leaves.bounds.tolist()) for leaves in map(owners.range_of, range(4))] == \
        [(0, [0, 2, 5]), (2, []), (2, [5, 8]), (3, [8, 12])]
    nothing = TreeSum.of(2, (clients for _, clients, _ in owners.range_of(1).split(np.arange(12))), written)
    assert (nothing.first, nothing.end, nothing.nodes) == (2, 2, [])
