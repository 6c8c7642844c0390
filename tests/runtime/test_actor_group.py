"""The actor group under every pool: client ranges, the fixed-order tree reduction, and no placement group left behind."""

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from ray.util import placement_group_table

from fedray.core.errors import FedrayError
from fedray.runtime import parked
from fedray.runtime.actor_group import ActorGroup, balanced_bounds, tree_reduce
from fedray.runtime.client_states import spill_folder


@ray.remote(num_cpus=0)
class Holder:
    """Holds the clients first..end and answers with their numbers."""

    def __init__(self, first: int, end: int) -> None:
        self.first, self.end = first, end

    def clients(self, chosen: np.ndarray) -> list[int]:
        assert all(self.first <= client < self.end for client in chosen)
        return chosen.tolist()

    def combine(self, _method, a: list[int], b: list[int]) -> list[int]:
        return a + b


def live_groups() -> int:
    return sum(1 for entry in placement_group_table().values() if entry["state"] != "REMOVED")


def test_balanced_bounds_cut_at_equal_sample_counts():
    offsets = np.array([0, 10, 20, 30, 40, 50, 60])  # six clients of 10 samples
    assert balanced_bounds(offsets, 2).tolist() == [0, 3, 6]
    assert balanced_bounds(offsets, 4).tolist() == [0, 2, 3, 5, 6]  # targets 15, 30, 45: each range ends at or past its target
    assert balanced_bounds(offsets, 9).tolist() == [0, 1, 2, 3, 4, 5, 6]  # at most one range per client


def test_clients_go_to_their_range_and_sums_reduce_in_client_order(ray_session):
    bounds = np.array([0, 3, 5, 9])
    arguments = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    group = ActorGroup.launch(Holder, {"CPU": 0.01}, arguments, bounds, what="3 holders", hint="none")
    try:
        chosen = np.array([7, 0, 4, 2, 8])
        assert [part.tolist() for part in group.split_clients(chosen)] == [[0, 2], [4], [7, 8]]
        partials = [(actor.clients.remote(part), actor) for actor, part in zip(group.actors, group.split_clients(chosen))]
        reduction = tree_reduce(None, partials)
        assert len(reduction.partials) == 2  # holder 0 adds holders 0 and 1's; the caller adds that and holder 2's
        assert reduction.result() == [0, 2, 4, 7, 8]
    finally:
        group.shutdown()


def test_a_failed_check_releases_the_group_before_any_actor_starts(ray_session):
    parked.release()  # as the reservation would: shards an earlier test's run parked are not counted
    before = live_groups()

    def refuse() -> None:
        raise FedrayError("does not fit")

    with pytest.raises(FedrayError, match="does not fit"):
        ActorGroup.launch(Holder, {"CPU": 0.01}, [(0, 1)], np.array([0, 1]), what="1 holder", hint="none",
                          before_start=refuse)
    assert live_groups() == before


@ray.remote(num_cpus=0)
class Spiller:
    """Has spilled a client's state into its folder (named by its actor id, as a shard's), deleted at shutdown."""

    def __init__(self) -> None:
        self.folder = spill_folder(ray.get_runtime_context().get_actor_id())
        self.folder.mkdir(parents=True)
        (self.folder / "client-1.safetensors").write_bytes(b"state")

    def spilled_into(self) -> str:
        return str(self.folder)

    def clear_client_states(self) -> None:
        shutil.rmtree(self.folder)


class SpillingGroup(ActorGroup):
    keeps_client_states = True


def test_shutdown_deletes_the_spilled_states_of_an_actor_killed_for_good_too(ray_session):
    group = SpillingGroup.launch(Spiller, {"CPU": 0.01}, [(), ()], np.array([0, 1, 2]), what="2 spillers", hint="none")
    folders = [Path(path) for path in ray.get([actor.spilled_into.remote() for actor in group.actors])]
    assert all(folder.is_dir() for folder in folders)
    ray.kill(group.actors[0], no_restart=True)  # its shutdown never runs: the run ended on it
    while True:
        try:
            ray.get(group.actors[0].spilled_into.remote())
            time.sleep(0.1)
        except ray.exceptions.RayActorError:
            break
    group.shutdown()
    assert not folders[0].exists() and not folders[1].exists()
