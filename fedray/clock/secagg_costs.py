"""What secure aggregation adds to a group's tasks, counted rather than paid: the clock turns the counts into time.

SecAgg (Bonawitz et al. 2017) with the semi-honest server, or SecAgg+ (Bell et al. 2020) on a k-regular graph: each of
the n participants of an aggregate has d neighbours (n − 1, or k) and sends a vector of m values in the ring Z_2^b.
Its rounds, and what each participant sends (up) and receives (down) in them:

- *AdvertiseKeys*: up its two public keys (2 · :data:`KEY_BYTES`); down its d neighbours' (2 · 32 · d).
- *ShareKeys*: up a Shamir share of each of its two secrets (its self-mask seed and its mask key) for each neighbour,
  encrypted (2 · :data:`SHARE_BYTES` · d); down the d ciphertexts addressed to it (2 · 32 · d).
- *MaskedInputCollection*: up the masked vector, ⌈m · b / 8⌉ bytes, in place of its plain upload; before it, it
  expands d + 1 masks of m words (a self-mask and one per neighbour) and adds each into its vector.
- *Unmasking*: up one share per neighbour (the self-mask seed's of a survivor, the mask key's of a dropped client:
  32 · d). The list of survivors it is sent (a bit per neighbour) is not counted.

Three of the four are round trips a plain upload does not make (*AdvertiseKeys*, *ShareKeys*, *Unmasking*): the
masked vector travels where the plain upload would. A participant that drops does so after *ShareKeys* and before
its masked upload: it has paid the first two rounds, expands no mask and sends no vector. The server reconstructs
one secret per participant and expands m words per survivor (its self-mask) and per surviving neighbour of each
dropped client (their pairwise masks).

A mask word's compute is counted in multiply-adds (the unit of the devices' ``macs_per_s``):
:data:`MACS_PER_MASK_WORD`. The key agreements' elliptic-curve work and the Shamir sharing (2 · d points of a
polynomial of degree t − 1) are small beside the masks for any upload of more than a few values, and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedray.core.errors import FedrayError

KEY_BYTES = 32
"""A public key (X25519), of the two each participant advertises."""
SHARE_BYTES = 32
"""A Shamir share of a 256-bit secret."""
MACS_PER_MASK_WORD = 6
"""Multiply-adds to expand one 64-bit mask word and add it into the vector: Philox4x64-10 (the generator
``secagg_masks=generate`` runs) makes 4 words with 10 rounds of two 64 × 64-bit multiplications (5 a word), and the
word's addition mod 2^b is one more."""
ROUND_TRIPS = 3
"""The round trips a surviving participant makes beyond a plain upload: AdvertiseKeys, ShareKeys, Unmasking."""
ROUND_TRIPS_DROPPED = 2
"""A dropped participant's: AdvertiseKeys and ShareKeys, before it drops."""


@dataclass(frozen=True)
class SecAggCosts:
    """What one aggregate's secure sum costs: per participant (arrays of n, in the participants' order) and on the
    server. A participant's ``up_bytes`` include the masked vector (``masked_bytes``), which it sends in place of its
    plain upload; everything else is overhead a plain round does not have."""

    mask_words: np.ndarray
    """int64: the mask words a participant expands, (d + 1) · m for a survivor, 0 for a dropped one."""
    macs: np.ndarray
    """int64: their multiply-adds, ``mask_words`` · :data:`MACS_PER_MASK_WORD`."""
    up_bytes: np.ndarray
    """int64: keys, shares and (a survivor's) masked vector."""
    down_bytes: np.ndarray
    """int64: its neighbours' keys and the shares addressed to it."""
    round_trips: np.ndarray
    """int64: its round trips beyond a plain upload (:data:`ROUND_TRIPS`, or :data:`ROUND_TRIPS_DROPPED`)."""
    masked_bytes: int
    """The masked vector, ⌈m · b / 8⌉ bytes."""
    server_mask_words: int
    """The mask words the server expands to unmask the sum."""
    server_reconstructions: int
    """The secrets the server reconstructs from shares: one per participant."""


def secagg_costs(values: int, ring_bits: int, degree: int, survived: np.ndarray,
                 surviving_neighbours: np.ndarray) -> SecAggCosts:
    """The costs of one aggregate of ``values`` (m) values a participant in the ring Z_2^``ring_bits``, each of its
    participants with ``degree`` (d) neighbours; ``survived`` (bool, one per participant): who sent its masked vector;
    ``surviving_neighbours`` (int, one per participant): how many of its neighbours survived (the server expands the
    pairwise masks of each dropped participant with those). O(n), no loop over participants."""
    survived = np.asarray(survived, dtype=bool)
    surviving_neighbours = np.asarray(surviving_neighbours, dtype=np.int64)
    if values < 0 or not 1 <= ring_bits <= 64 or degree < 1 or survived.shape != surviving_neighbours.shape:
        raise FedrayError(f"secagg_costs: expected m ≥ 0 values, 1 ≤ b ≤ 64 ring bits, d ≥ 1 neighbours and one "
                          f"surviving-neighbour count per participant, got m={values}, b={ring_bits}, d={degree}, "
                          f"{survived.shape} and {surviving_neighbours.shape}")
    masked_bytes = -(-values * ring_bits // 8)
    keys_and_shares = 2 * KEY_BYTES + 2 * SHARE_BYTES * degree
    mask_words = np.where(survived, (degree + 1) * values, 0).astype(np.int64)
    up_bytes = keys_and_shares + np.where(survived, masked_bytes + SHARE_BYTES * degree, 0).astype(np.int64)
    return SecAggCosts(mask_words=mask_words, macs=mask_words * MACS_PER_MASK_WORD, up_bytes=up_bytes,
                       down_bytes=np.full(len(survived), 2 * KEY_BYTES * degree + 2 * SHARE_BYTES * degree,
                                          dtype=np.int64),
                       round_trips=np.where(survived, ROUND_TRIPS, ROUND_TRIPS_DROPPED).astype(np.int64),
                       masked_bytes=masked_bytes,
                       server_mask_words=values * int(survived.sum() + surviving_neighbours[~survived].sum()),
                       server_reconstructions=len(survived))
