"""secagg_costs: the protocol's counts per participant and on the server, written out by hand for small groups."""

import numpy as np
import pytest

from fedray.clock.secagg_costs import secagg_costs
from fedray.core.errors import FedrayError


def test_a_secagg_group_without_dropouts():
    """5 participants, all pairs (d = 4), m = 10 values on 20 bits: the masked vector is 25 bytes; a participant sends
    2 keys (64), 2 shares per neighbour (256), its vector and 1 share per neighbour at unmasking (128); it receives
    its neighbours' keys (256) and the shares addressed to it (256); it expands 5 masks of 10 words."""
    costs = secagg_costs(10, 20, 4, np.ones(5, dtype=bool), np.full(5, 4))
    assert costs.masked_bytes == 25
    assert costs.up_bytes.tolist() == [64 + 256 + 25 + 128] * 5
    assert costs.down_bytes.tolist() == [256 + 256] * 5
    assert costs.mask_words.tolist() == [50] * 5 and costs.macs.tolist() == [300] * 5
    assert costs.round_trips.tolist() == [3] * 5
    assert costs.server_mask_words == 50 and costs.server_reconstructions == 5


def test_a_secagg_plus_group_with_dropouts():
    """6 participants on a ring, k = 2 neighbours, m = 3 values on 9 bits (⌈27 / 8⌉ = 4 bytes); participants 1 and 4
    drop after ShareKeys: they sent keys and shares (64 + 128), received as much as the others, expand nothing. The
    server expands each survivor's self-mask (4 · 3 words) and each dropped client's masks with its surviving
    neighbours (2 + 1 of them here: 3 · 3 words)."""
    survived = np.array([True, False, True, True, False, True])
    costs = secagg_costs(3, 9, 2, survived, np.array([1, 2, 2, 1, 1, 1]))
    assert costs.up_bytes.tolist() == [64 + 128 + 4 + 64, 64 + 128, 260, 260, 192, 260]
    assert costs.down_bytes.tolist() == [128 + 128] * 6
    assert costs.mask_words.tolist() == [9, 0, 9, 9, 0, 9] and costs.macs.tolist() == [54, 0, 54, 54, 0, 54]
    assert costs.round_trips.tolist() == [3, 2, 3, 3, 2, 3]
    assert costs.server_mask_words == 3 * 4 + 3 * (2 + 1) and costs.server_reconstructions == 6


@pytest.mark.parametrize("arguments", [(-1, 20, 4, np.ones(5, bool), np.full(5, 4)),
                                       (10, 65, 4, np.ones(5, bool), np.full(5, 4)),
                                       (10, 20, 0, np.ones(5, bool), np.full(5, 4)),
                                       (10, 20, 4, np.ones(5, bool), np.full(4, 4))])
def test_bad_counts_are_refused_in_one_line(arguments):
    with pytest.raises(FedrayError, match=r"^secagg_costs: expected m ≥ 0 values, 1 ≤ b ≤ 64 ring bits, d ≥ 1 "
                                          r"neighbours and one surviving-neighbour count per participant, got m="):
        secagg_costs(*arguments)
