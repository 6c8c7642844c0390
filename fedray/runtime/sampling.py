"""Which clients take part in which round, deterministically from the run's seed.

Without replacement every client takes part exactly once: ⌈K/κ⌉ rounds over a
seeded permutation. With replacement (the FedAvg convention) every round draws
κ distinct clients uniformly at random, independently of earlier rounds, so a
closed-form run needs a coupon-collector number of rounds to see every client.
"""

from __future__ import annotations

import os

import numpy as np

from fedray.core.errors import FedrayError

CHUNK_ROUNDS = 1024


def check_per_round(num_clients: int, per_round: int, option: str = "--clients-per-round", default: bool = False) -> None:
    """κ is 1..K; ``option`` is how the user gave κ, ``default`` says they did not (κ = 10 on a smaller federation)."""
    if not 1 <= per_round <= num_clients:
        got = f"its default {per_round} (give {option} or --participation)" if default else str(per_round)
        raise FedrayError(f"{option} must be between 1 and the {num_clients} clients, got {got}")


ROUND_OVERHEAD = 120
"""Bytes a round of a schedule takes besides its clients' numbers: the array's Python object (112) and the list's slot."""


def check_schedule(rounds: int, per_round: int, option: str = "--rounds") -> None:
    """Refuse ``rounds`` rounds of ``per_round`` clients whose schedule (the driver builds every round's clients
    before the first round) would not fit this machine's memory; a bound that depends on the machine, not its load."""
    needed = rounds * (per_round * np.dtype(np.int64).itemsize + ROUND_OVERHEAD)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > memory:
        raise FedrayError(f"{option} {rounds}: the driver would hold every round's clients, about {needed / 1e9:.3g} GB "
                          f"({rounds:,} rounds of {per_round}), more than this machine's {memory / 1e9:.1f} GB of "
                          f"memory; give fewer rounds")


def distinct_draws(rng: np.random.Generator, num_clients: int, per_round: int, num_rounds: int) -> np.ndarray:
    """``num_rounds`` rows of ``per_round`` distinct clients each, uniform over such rows.

    When κ² ≤ K a row rarely repeats a client, so all rows are drawn at once and
    the few with a repeat are redrawn; otherwise each row is drawn without
    replacement on its own.
    """
    if per_round * per_round > num_clients:
        return np.stack([rng.choice(num_clients, per_round, replace=False) for _ in range(num_rounds)])
    rounds = rng.integers(num_clients, size=(num_rounds, per_round))
    while True:
        ordered = np.sort(rounds, axis=1)
        clash = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
        if len(clash) == 0:
            return rounds
        rounds[clash] = rng.integers(num_clients, size=(len(clash), per_round))


def first_seen_rounds(num_clients: int, per_round: int, rng: np.random.Generator) -> np.ndarray:
    """Round (0-based) in which each client is first drawn, sampling with replacement until all are seen."""
    first = np.full(num_clients, -1, dtype=np.int64)
    start = 0
    while (first < 0).any():
        rounds = distinct_draws(rng, num_clients, per_round, CHUNK_ROUNDS)
        clients, position = np.unique(rounds.ravel(), return_index=True)
        new = first[clients] < 0
        first[clients[new]] = start + position[new] // per_round
        start += CHUNK_ROUNDS
    return first


def schedule(
    num_clients: int, per_round: int, replacement: bool, seed: int, max_rounds: int | None = None,
    past_coverage: bool = False,
) -> list[np.ndarray]:
    """Clients of each round, until every client was seen (or ``max_rounds``).

    With ``past_coverage`` (training) the schedule goes on to exactly
    ``max_rounds`` rounds: without replacement in passes over fresh
    permutations. Either way a shorter schedule is a prefix of a longer one.
    """
    check_per_round(num_clients, per_round)
    rng = np.random.default_rng([seed, 21])
    more = past_coverage and max_rounds is not None
    if not replacement:
        passes = -(-max_rounds // -(-num_clients // per_round)) if more else 1
        orders = [rng.permutation(num_clients) for _ in range(passes)]
        rounds = [order[i : i + per_round] for order in orders for i in range(0, num_clients, per_round)]
        return rounds[:max_rounds]
    rounds: list[np.ndarray] = []
    seen = np.zeros(num_clients, dtype=bool)
    while (more or not seen.all()) and (max_rounds is None or len(rounds) < max_rounds):
        for row in distinct_draws(rng, num_clients, per_round, CHUNK_ROUNDS):
            rounds.append(row)
            seen[row] = True
            if (seen.all() and not more) or len(rounds) == max_rounds:
                break
    return rounds


def coverage(
    num_clients: int, per_round: int, replacement: bool, trials: int, seed: int, fractions=(0.25, 0.5, 0.75, 1.0)
) -> dict[float, tuple[float, float]]:
    """Mean and std over ``trials`` of the rounds needed to have seen each fraction of the clients."""
    check_per_round(num_clients, per_round)
    if trials < 1:
        raise FedrayError(f"--trials must be ≥ 1, got {trials}")
    needed = np.ceil(np.asarray(fractions) * num_clients).astype(np.int64)
    results = np.empty((trials, len(fractions)))
    for trial in range(trials):
        rng = np.random.default_rng([seed, 22, trial])
        if replacement:
            rounds_seen = np.sort(first_seen_rounds(num_clients, per_round, rng)) + 1
            results[trial] = rounds_seen[needed - 1]
        else:
            results[trial] = np.ceil(needed / per_round)
    return {f: (float(results[:, i].mean()), float(results[:, i].std(ddof=1) if trials > 1 else 0.0)) for i, f in enumerate(fractions)}
