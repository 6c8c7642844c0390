"""A folder of spilled clients' states whose actor is gone is removed when another actor starts on the node; a living
actor's folder, even of another run on the same machine, stays."""

import subprocess
import sys
import textwrap

import torch

from fedray.runtime.client_states import ClientStates
from fedray.runtime.spill_owners import claim, remove_orphans

KILLED = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import torch
    from fedray.runtime.client_states import ClientStates

    states = ClientStates(budget=0, spill_root=Path(sys.argv[1]), owner=sys.argv[2])
    states.begin_round(1)
    states.put(1, {"h": torch.ones(4)})
    states.begin_round(2)  # client 1's state spills
    assert (states.spill_folder / "client-1.safetensors").is_file()
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs, as when a driver is killed and its actors with it
""")


def spill_and_get_killed(root, owner: str) -> None:
    finished = subprocess.run([sys.executable, "-c", KILLED, str(root), owner], capture_output=True, text=True)
    assert finished.returncode == -9, finished.stderr


def spilled(root, owner: str) -> ClientStates:
    states = ClientStates(budget=0, spill_root=root, owner=owner)
    states.begin_round(1)
    states.put(1, {"h": torch.zeros(4)})
    states.begin_round(2)
    return states


def folders(root) -> list[str]:
    return sorted(path.name for path in (root / "fedray-client-states").iterdir())


def test_the_next_actor_on_the_node_removes_the_states_a_killed_actor_spilled(tmp_path):
    """A SIGKILL of the driver left its shards' folders behind (29 and 31 files, tens of GB at iNat scale)."""
    living = spilled(tmp_path, "living-run-shard")  # another run's, on the same machine
    spill_and_get_killed(tmp_path, "killed-run-shard")
    earlier = tmp_path / "fedray-client-states" / "earlier-fedray-shard"  # an earlier fedray's: no owner's lock to tell
    earlier.mkdir()
    (earlier / "client-3.safetensors").write_bytes(b"")
    assert folders(tmp_path) == ["earlier-fedray-shard", "killed-run-shard", "living-run-shard"]

    ClientStates(spill_root=tmp_path, owner="new-run-shard")
    assert folders(tmp_path) == ["earlier-fedray-shard", "living-run-shard"]
    assert torch.equal(living.get(1)["h"], torch.zeros(4)), "the living run keeps its states"


def test_a_folder_stays_while_its_owner_holds_it_and_goes_once_it_let_go(tmp_path):
    folder = tmp_path / "owner-1"
    ownership = claim(folder)
    (folder / "client-1.safetensors").write_bytes(b"state")
    remove_orphans(tmp_path)
    assert (folder / "client-1.safetensors").is_file()
    ownership.close()  # as the kernel does when its process ends
    remove_orphans(tmp_path)
    assert not folder.exists()


def test_an_actor_that_cleared_its_states_and_spills_again_owns_its_new_folder(tmp_path):
    states = spilled(tmp_path, "shard-0")
    states.clear()
    states.begin_round(1)
    states.put(2, {"h": torch.ones(4)})
    states.begin_round(2)
    remove_orphans(tmp_path / "fedray-client-states")
    assert torch.equal(states.get(2)["h"], torch.ones(4))
