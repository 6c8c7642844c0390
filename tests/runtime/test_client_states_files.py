"""A file of clients' states read back (a resumed run, a replay) is checked: a damaged one is refused in one line
naming the file and what is wrong with it, before any state is replaced."""

import re

import pytest
import torch

from fedray.core.errors import FedrayError
from fedray.runtime.client_states import ClientStates, check_saved

from tests.full_disk import fill, hashes, small_disk  # noqa: F401 (a fixture)

START_OVER = "delete it and run without --resume to start over"


def saved(tmp_path):
    states = ClientStates()
    states.begin_round(1)
    states.put(3, {"h": torch.tensor([1.0, 2.0, 3.0])})
    path = tmp_path / "checkpoint-clients-r1-0.pt"
    states.save(path)
    return path


def refusal(path) -> str:
    states = ClientStates()
    states.committed = {7: {"h": torch.zeros(3)}}
    with pytest.raises(FedrayError) as error:
        states.restore([path], lambda client: True)
    assert list(states.committed) == [7], "a refused file replaces no state"
    return str(error.value)


def test_a_saved_file_gives_the_states_back(tmp_path):
    states = ClientStates()
    states.restore([saved(tmp_path)], lambda client: True)
    assert list(states.committed) == [3]
    assert torch.equal(states.get(3)["h"], torch.tensor([1.0, 2.0, 3.0]))


def test_an_empty_file_is_refused_in_one_line(tmp_path):
    path = saved(tmp_path)
    path.write_bytes(b"")
    assert refusal(path) == f"{path}: empty file of clients' states; {START_OVER}"


def test_a_truncated_file_is_refused_in_one_line(tmp_path):
    path = saved(tmp_path)
    path.write_bytes(path.read_bytes()[:200])
    message = refusal(path)
    assert message.startswith(f"{path}: damaged file of clients' states (") and message.endswith(START_OVER)
    assert "\n" not in message


def test_a_file_of_strings_is_refused_in_one_line(tmp_path):
    path = tmp_path / "checkpoint-clients-r1-0.pt"
    torch.save({3: {"h": "not a tensor"}}, path)
    assert refusal(path) == f"{path}: the state of client 3 is not a mapping of names to tensors; {START_OVER}"


def test_a_re_shaped_state_is_refused_in_one_line(tmp_path):
    path = tmp_path / "checkpoint-clients-r1-0.pt"
    torch.save({3: {"h": torch.zeros(3)}, 4: {"h": torch.zeros(3, 1)}}, path)
    assert refusal(path) == (f"{path}: the state of client 4 has (dimensions, dtype) {{'h': (2, torch.float32)}}, "
                             f"another client's {{'h': (1, torch.float32)}}; {START_OVER}")


def test_nan_in_a_state_is_refused_in_one_line_before_a_run_resumes(tmp_path):
    """As a checkpoint's parameters are (a run replayed it, ended "diverged" and deleted the checkpoint it resumed
    from)."""
    path = tmp_path / "checkpoint-clients-r1-0.pt"
    state = {"h": torch.tensor([1.0, float("nan"), 3.0]), "n": torch.tensor([7])}
    torch.save({"kept": {3: state}, "spilled": []}, path)
    expected = f"{path}: 'h' of the state of client 3 holds 1 of 3 values that are NaN or infinite; {START_OVER}"
    assert refusal(path) == expected
    with pytest.raises(FedrayError) as error:
        check_saved(path)  # the driver's check, before any work
    assert str(error.value) == expected


def test_states_whose_sizes_depend_on_their_client_are_read(tmp_path):
    """SCAFFOLD's dual-form state is one gradient row per sample of its client."""
    path = tmp_path / "checkpoint-clients-r1-0.pt"
    torch.save({3: {"control.rows": torch.ones(5, 4)}, 4: {"control.rows": torch.ones(1, 4)}}, path)
    states = ClientStates()
    states.restore([path], lambda client: True)
    assert states.get(3)["control.rows"].shape == (5, 4) and states.get(4)["control.rows"].shape == (1, 4)


def test_states_onto_a_full_disk_stop_in_one_line_and_leave_the_previous_file(small_disk):
    path = saved(small_disk)
    fill(small_disk)
    previous = hashes(small_disk)
    states = ClientStates()
    states.begin_round(2)
    states.put(5, {"h": torch.zeros(1000)})
    with pytest.raises(FedrayError) as error:
        states.save(path)
    assert re.fullmatch(rf"disk full: writing {re.escape(str(path))} needed [0-9.]+ kB, 0 kB free", str(error.value))
    assert hashes(small_disk) == previous
