"""A shard keeps its clients' states within a memory budget: the least recently used spill to disk (one safetensors
file a client) and come back bitwise; a checkpoint hard-links the spilled files instead of copying them; what is
read back is checked in one line."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedray.core.errors import FedrayError
from fedray.runtime.client_states import ClientStates, check_saved, spilled_folder

from tests.full_disk import small_disk  # noqa: F401 (a fixture)

START_OVER = "delete it and run without --resume to start over"
STATE_BYTES = 4 * 6  # one client's state below: six float32


def state(value: float) -> dict[str, torch.Tensor]:
    return {"h": torch.full((2, 2), value), "b": torch.arange(2, dtype=torch.float32) + value}


def spilled_files(folder) -> list[str]:
    """The spilled states in ``folder`` (beside its owner's lock, :mod:`fedray.runtime.spill_owners`)."""
    return sorted(path.name for path in folder.iterdir() if path.name != ".owner")


def states_after(rounds: list[dict[int, float]], budget: int | None, root) -> ClientStates:
    """States after each round's clients put their new states (round r's committed when round r + 1 begins)."""
    states = ClientStates(budget=budget, spill_root=root)
    for number, puts in enumerate(rounds, start=1):
        states.begin_round(number)
        for client, value in puts.items():
            states.put(client, state(value))
    states.begin_round(len(rounds) + 1)
    return states


def test_states_beyond_the_budget_spill_least_recently_used_first_and_come_back_bitwise(tmp_path):
    states = states_after([{1: 1.0, 2: 2.0}, {3: 3.0}], budget=2 * STATE_BYTES, root=tmp_path)
    assert list(states.committed) == [2, 3] and list(states.spilled) == [1]  # client 1 was used least recently
    assert states.held == 2 * STATE_BYTES
    assert spilled_files(states.spill_folder) == ["client-1.safetensors"]
    for client, value in ((1, 1.0), (2, 2.0), (3, 3.0)):
        got = states.get(client)
        assert got.keys() == {"h", "b"} and all(torch.equal(got[name], state(value)[name]) for name in got)
    assert states.get(4) is None


def test_reading_a_state_makes_it_the_most_recently_used(tmp_path):
    states = states_after([{1: 1.0, 2: 2.0}], budget=2 * STATE_BYTES, root=tmp_path)
    states.get(1)  # client 1 is sampled again: client 2 is now the least recently used
    states.begin_round(3)
    states.put(3, state(3.0))
    states.begin_round(4)
    assert list(states.spilled) == [2] and list(states.committed) == [1, 3]


def test_a_client_s_new_state_replaces_its_spilled_file(tmp_path):
    states = states_after([{1: 1.0}, {2: 2.0}, {1: 10.0}], budget=0, root=tmp_path)
    assert not states.committed and sorted(states.spilled) == [1, 2]
    assert torch.equal(states.get(1)["h"], torch.full((2, 2), 10.0))
    assert spilled_files(states.spill_folder) == ["client-1.safetensors", "client-2.safetensors"]


def test_a_retried_round_starts_again_from_the_spilled_states(tmp_path):
    states = states_after([{1: 1.0}], budget=0, root=tmp_path)
    states.begin_round(2)
    states.put(1, state(5.0))
    states.begin_round(2)  # Ray retried round 2: its pending state is dropped
    assert torch.equal(states.get(1)["h"], torch.full((2, 2), 1.0))


def test_a_checkpoint_links_the_spilled_files_and_keeps_them_when_the_states_move_on(tmp_path):
    states = states_after([{1: 1.0, 2: 2.0}, {3: 3.0}], budget=2 * STATE_BYTES, root=tmp_path / "spill")
    path = tmp_path / "out" / "checkpoint-clients-r2-0.pt"
    states.save(path)
    linked = spilled_folder(path) / "client-1.safetensors"
    assert sorted(p.name for p in spilled_folder(path).iterdir()) == ["client-1.safetensors"]
    assert os.stat(linked).st_ino == os.stat(states.spilled[1]).st_ino, "a hard link, not a copy"
    saved = torch.load(path, weights_only=True)
    assert set(saved["kept"]) == {2, 3}, "the states in memory are in the file"
    assert saved["spilled"] == [1], "and the clients whose states are spilled (the folder beside it holds them)"

    states.begin_round(3)
    states.put(1, state(7.0))  # client 1 moves on after the checkpoint
    states.begin_round(4)
    assert torch.equal(load_file(linked)["h"], torch.full((2, 2), 1.0)), "the checkpoint still holds round 2's state"

    for budget in (None, 0, STATE_BYTES):  # any budget reads the same states back
        restored = ClientStates(budget=budget, spill_root=tmp_path / f"spill-{budget}")
        restored.restore([path], lambda client: True)
        for client, value in ((1, 1.0), (2, 2.0), (3, 3.0)):
            assert torch.equal(restored.get(client)["b"], state(value)["b"])
        assert len(restored.committed) == {None: 2, 0: 0, STATE_BYTES: 1}[budget], "spilled files stay spilled"


def test_a_restarted_actor_deletes_what_its_predecessor_spilled_and_no_checkpoint_s_link(tmp_path):
    """A restarted actor keeps its id: its ClientStates (lost) deletes the folder the killed one spilled into, which no
    shutdown would ever delete (two OOM kills of a FedDyn run left 9.9 GB in the node's temporary folder)."""
    killed = ClientStates(budget=0, spill_root=tmp_path / "spill", owner="actor-7")
    killed.begin_round(1)
    killed.put(1, state(1.0))
    killed.put(2, state(2.0))
    killed.begin_round(2)
    checkpoint = tmp_path / "out" / "checkpoint-clients-r1-0.pt"
    killed.save(checkpoint)
    other = ClientStates(budget=0, spill_root=tmp_path / "spill", owner="actor-8")
    other.begin_round(1)
    other.put(5, state(5.0))
    other.begin_round(2)

    restarted = ClientStates(lost=True, budget=0, spill_root=tmp_path / "spill", owner="actor-7")
    assert restarted.spill_folder == killed.spill_folder and not killed.spill_folder.exists()
    assert sorted(p.name for p in (tmp_path / "spill" / "fedray-client-states").iterdir()) == ["actor-8"]
    restarted.restore([checkpoint], lambda client: True)  # the checkpoint's links survive: the run replays from it
    assert torch.equal(restarted.get(2)["h"], torch.full((2, 2), 2.0))


def test_a_damaged_spilled_file_of_a_checkpoint_is_refused_in_one_line_replacing_no_state(tmp_path):
    states = states_after([{1: 1.0, 2: 2.0}], budget=0, root=tmp_path / "spill")
    path = tmp_path / "checkpoint-clients-r1-0.pt"
    states.save(path)
    damaged = spilled_folder(path) / "client-2.safetensors"
    data = damaged.read_bytes()
    os.unlink(damaged)  # a link: write a new file, not through the spill folder's
    damaged.write_bytes(data[:-3])
    other = ClientStates()
    other.committed[7] = state(0.0)
    with pytest.raises(FedrayError) as error:
        other.restore([path], lambda client: True)
    message = str(error.value)
    assert message.startswith(f"{damaged}: damaged spilled client state (") and message.endswith(START_OVER), message
    assert "\n" not in message and list(other.committed) == [7]


def saved_with_spilled(tmp_path):
    """A checkpoint's file of clients' states: client 1's in memory, clients 2, 3 and 12's spilled."""
    states = states_after([{2: 2.0, 3: 3.0, 12: 12.0}, {1: 1.0}], budget=STATE_BYTES, root=tmp_path / "spill")
    path = tmp_path / "out" / "checkpoint-clients-r2-0.pt"
    states.save(path)
    assert list(states.committed) == [1] and sorted(states.spilled) == [2, 3, 12]
    return path


def replaced(file, tensors) -> None:
    """``file`` (a link to a spilled state) replaced by a new file of ``tensors``, the spilled one left as it was."""
    file.unlink()
    save_file(tensors, file)


def refusals(path) -> list[str]:
    """The driver's check of ``path`` (before a resumed run starts) and an actor's restore, each a one-line error; the
    actor's states stay as they were."""
    messages = []
    with pytest.raises(FedrayError) as error:
        check_saved(path)
    messages.append(str(error.value))
    other = ClientStates()
    other.committed[7] = state(0.0)
    with pytest.raises(FedrayError) as error:
        other.restore([path], lambda client: True)
    assert list(other.committed) == [7]
    return messages + [str(error.value)]


def test_a_checkpoint_missing_one_spilled_state_is_refused_naming_it(tmp_path):
    """It resumed to a different result (weights off by 1.1e-3 after a resumed FedDyn run), as if client 12 had none."""
    path = saved_with_spilled(tmp_path)
    (spilled_folder(path) / "client-12.safetensors").unlink()
    missing = spilled_folder(path) / "client-12.safetensors"
    assert refusals(path) == [f"{missing}: missing, a spilled client's state that {path.name} names; {START_OVER}"] * 2


def test_a_checkpoint_missing_spilled_states_says_how_many(tmp_path):
    path = saved_with_spilled(tmp_path)
    for client in (2, 12):
        (spilled_folder(path) / f"client-{client}.safetensors").unlink()
    missing = spilled_folder(path) / "client-2.safetensors"
    assert refusals(path) == [f"{missing}: missing (and 1 more), a spilled client's state that {path.name} names; "
                              f"{START_OVER}"] * 2


def test_a_checkpoint_missing_its_spilled_folder_is_refused_naming_it(tmp_path):
    """``rm -r OUT/checkpoint-clients-r3-*-spilled``: the resumed run ended with exit 0, its weights off by 1.2e-2."""
    path = saved_with_spilled(tmp_path)
    shutil.rmtree(spilled_folder(path))
    assert refusals(path) == [f"{spilled_folder(path)}: missing, with the 3 spilled clients' states that {path.name} "
                              f"names; {START_OVER}"] * 2


def test_a_spilled_state_the_checkpoint_does_not_name_is_refused(tmp_path):
    path = saved_with_spilled(tmp_path)
    foreign = spilled_folder(path) / "client-5.safetensors"
    save_file(state(5.0), foreign)
    assert refusals(path) == [f"{foreign}: a client's state that {path.name} does not name; {START_OVER}"] * 2


def test_nan_in_a_spilled_state_is_refused_before_a_run_resumes_naming_its_file(tmp_path):
    """It used to be replayed: the run ended "diverged", and deleted the checkpoint it had resumed from."""
    path = saved_with_spilled(tmp_path)
    file = spilled_folder(path) / "client-12.safetensors"
    replaced(file, {"h": torch.tensor([[1.0, float("nan")], [float("inf"), 4.0]]), "b": torch.zeros(2)})
    with pytest.raises(FedrayError) as error:
        check_saved(path)
    assert str(error.value) == (f"{file}: 'h' of the state of client 12 holds 2 of 4 values that are NaN or infinite; "
                                f"{START_OVER}")


def test_a_re_shaped_spilled_state_is_refused_naming_its_file(tmp_path):
    """It was reported as the checkpoint's file of the states in memory (checkpoint-clients-r2-0.pt)."""
    path = saved_with_spilled(tmp_path)
    file = spilled_folder(path) / "client-12.safetensors"
    replaced(file, {"h": torch.zeros(1, 4), "b": torch.zeros(2)})
    states = ClientStates()
    with pytest.raises(FedrayError) as error:
        states.restore([path], lambda client: True, lambda client: {"b": (2,), "h": (2, 2)})
    assert str(error.value) == (f"{file}: the state of client 12 has shapes {{'b': (2,), 'h': (1, 4)}}, where this "
                                f"run's algorithm makes {{'b': (2,), 'h': (2, 2)}}; {START_OVER}")
    replaced(file, {"h": torch.zeros(4), "b": torch.zeros(2)})
    with pytest.raises(FedrayError) as error:
        states.restore([path], lambda client: True)
    assert str(error.value).startswith(f"{file}: the state of client 12 has (dimensions, dtype) ")


def test_a_state_of_other_shapes_than_the_run_s_is_refused_in_one_line(tmp_path):
    """Every client's state re-shaped alike: only the algorithm's expected shapes can tell."""
    path = tmp_path / "checkpoint-clients-r1-0.pt"
    torch.save({3: {"h": torch.zeros(4, 1)}, 4: {"h": torch.zeros(4, 1)}}, path)
    with pytest.raises(FedrayError) as error:
        ClientStates().restore([path], lambda client: True, lambda client: {"h": (2, 2)})
    assert str(error.value) == (f"{path}: the state of client 3 has shapes {{'h': (4, 1)}}, where this run's algorithm "
                                f"makes {{'h': (2, 2)}}; {START_OVER}")


def test_a_spill_onto_a_full_disk_stops_in_one_line_and_keeps_the_state(small_disk):  # noqa: F811
    states = ClientStates(budget=0, spill_root=small_disk)
    states.begin_round(1)
    states.put(1, {"h": torch.zeros(1_000_000)})  # 4 MB onto a 1 MiB disk
    with pytest.raises(FedrayError) as error:
        states.begin_round(2)
    folder = states.spill_folder
    message = str(error.value)
    assert message.startswith(f"cannot spill clients' states to {folder} (") and "No space left on device" in message
    assert message.endswith("): free space there, or keep more in memory with --client-state-memory")
    assert list(states.committed) == [1] and not spilled_files(folder)
