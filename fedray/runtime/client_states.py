"""Each client's own state, kept by the actor that holds the client (a shard or a trainer), never by the driver.

A training algorithm's per-client state (SCAFFOLD's c_i, FedDyn's ∇L_k of the
client's last model, a plugin's) is created at a client's first participation
and replaced after each later one. A round's new states stay *pending* until
the actor's next round begins, so a call that Ray retries recomputes from the
same states, and a round the driver abandons changes nothing.

An actor keeps the states within a memory budget (``--client-state-memory``):
beyond it, the least recently used spill to its node's local disk, one
safetensors file a client, read back when the client is sampled again. A spill
file is never rewritten: a client's new state is a new file, and the old one is
unlinked, so a checkpoint hard-links the spilled files it holds rather than
copying them (``TAG-INDEX.pt`` has the states in memory and the numbers of the
clients spilled, ``TAG-INDEX-spilled/`` the links). A checkpoint's states are
checked before a run resumes from them: every spilled state the file names is
there and no other, every value finite (:func:`check_saved`). An actor's spill
folder is its own while it lives; one whose actor is gone (a killed run's) is
removed when an actor starts on the node (:mod:`fedray.runtime.spill_owners`).

An actor that Ray restarted after a failure has lost its states: its first
stateful call raises :class:`ClientStatesLost`, and the driver restores every
actor's states from the run's last checkpoint (or from nothing) and replays the
rounds since, so the run gives bitwise the result of one that never failed.
Checkpoints write each actor's states to files of their own (by client
number, so a run resumed with another number of actors reads them too).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from fedray.core.errors import FedrayError
from fedray.methods.algorithm import FederatedAlgorithm, Params
from fedray.core.results import torch_size, write_atomically
from fedray.runtime.spill_owners import claim, remove_orphans

START_OVER = "delete it and run without --resume to start over"
SPILLED = "-spilled"
"""A checkpoint file ``NAME.pt``'s folder of spilled states is ``NAME-spilled``."""
Layout = dict[str, tuple[int, ...]]
"""A client's state as its tensors' shapes by name."""


def meta_client_state(algorithm: FederatedAlgorithm, shapes: Layout) -> Params | None:
    """The state ``algorithm`` makes for a client training float32 parameters of ``shapes``, made on PyTorch's meta
    device (shapes and dtypes, no memory), for the memory estimate; None for a stateless algorithm, or one whose state
    cannot be made there."""
    if not algorithm.stateful:
        return None
    params = {name: torch.empty(shape, dtype=torch.float32, device="meta") for name, shape in shapes.items()}
    try:
        state = algorithm.init_client_state(params)
    except Exception:  # a plugin's own code, run for real where it trains: here only the shapes are wanted
        return None
    tensors = isinstance(state, dict) and all(isinstance(value, torch.Tensor) for value in state.values())
    return state if tensors else None  # a wrong state is refused where it trains, in one line


def meta_layout(algorithm: FederatedAlgorithm, shapes: Layout) -> Layout | None:
    """The shapes of the state ``algorithm`` makes for parameters of ``shapes`` (None: stateless, or not known)."""
    state = meta_client_state(algorithm, shapes)
    return None if state is None else {name: tuple(value.shape) for name, value in state.items()}


KEPT, SPILLED_CLIENTS = "kept", "spilled"
"""A file of clients' states holds ``{"kept": {client: state}, "spilled": [client, ...]}``; an earlier fedray's holds
the kept states alone (``{client: state}``), and which were spilled is not known."""


def _save(path: Path, kept: dict[int, Params], spilled: list[int]) -> None:
    with open(path, "wb") as handle:  # through a Python file, so that a full disk raises its OSError
        torch.save({KEPT: kept, SPILLED_CLIENTS: spilled}, handle)


def _load(path: Path, mmap: bool = False) -> tuple[dict[int, Params], list[int] | None]:
    """The states in memory of a file of clients' states and the clients it spilled (None: not known), or a one-line
    error naming the file and what is wrong with it; ``mmap`` maps the file instead of reading it (a check)."""
    try:
        if path.stat().st_size == 0:
            raise FedrayError(f"{path}: empty file of clients' states; {START_OVER}")
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FedrayError:
        raise
    except Exception as error:  # the zip and pickle readers raise RuntimeError, EOFError, OSError, ... on damaged files
        raise FedrayError(f"{path}: damaged file of clients' states ({_first_line(error)}); {START_OVER}") from None
    if not isinstance(saved, dict):
        raise FedrayError(f"{path}: holds a {type(saved).__name__}, not clients' states; {START_OVER}")
    kept, spilled = (saved[KEPT], saved[SPILLED_CLIENTS]) if saved.keys() == {KEPT, SPILLED_CLIENTS} else (saved, None)
    if not isinstance(kept, dict) or spilled is not None and not (
            isinstance(spilled, list) and all(type(client) is int for client in spilled)):
        raise FedrayError(f"{path}: its states in memory or its spilled clients are malformed, not clients' states; "
                          f"{START_OVER}")
    for client, state in kept.items():
        if not isinstance(client, int) or not isinstance(state, dict) or not all(
                isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in state.items()):
            raise FedrayError(f"{path}: the state of client {client!r} is not a mapping of names to tensors; {START_OVER}")
        _check_finite(state, path, client)
    return kept, spilled


def _check_finite(state: Params, file: Path, client: int) -> None:
    """Every floating-point value of ``client``'s ``state``, read from ``file``, is finite (NaN in a state would only
    show as a divergence rounds later)."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and (bad := int((~torch.isfinite(tensor)).sum())):
            raise FedrayError(f"{file}: {name!r} of the state of client {client} holds {bad} of {tensor.numel()} "
                              f"values that are NaN or infinite; {START_OVER}")


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


def spilled_folder(path: Path) -> Path:
    """The folder beside a checkpoint's file of clients' states that holds its spilled states."""
    return path.with_name(path.stem + SPILLED)


def remove_saved(path: Path) -> None:
    """A checkpoint's file of clients' states and its spilled states."""
    path.unlink(missing_ok=True)
    shutil.rmtree(spilled_folder(path), ignore_errors=True)


def _spill_name(client: int) -> str:
    return f"client-{client}.safetensors"


def _spilled_client(name: str) -> int | None:
    stem = name.removeprefix("client-").removesuffix(".safetensors")
    return int(stem) if stem.isdigit() and name == _spill_name(int(stem)) else None


def _read_spilled(path: Path) -> Params:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise FedrayError(f"{path}: damaged spilled client state ({_first_line(error)}); {START_OVER}") from None


def _spilled_layout(path: Path) -> tuple[Layout, dict[str, torch.dtype | str]]:
    """Shapes and dtypes of a spilled state from its header alone (a truncated file is refused here)."""
    try:
        with safe_open(path, "pt") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}
            return ({name: tuple(part.get_shape()) for name, part in slices.items()},
                    {name: _SAFETENSORS_DTYPES.get(part.get_dtype(), part.get_dtype()) for name, part in slices.items()})
    except (SafetensorError, OSError) as error:
        raise FedrayError(f"{path}: damaged spilled client state ({_first_line(error)}); {START_OVER}") from None


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _kinds(state: Params) -> dict[str, tuple[int, torch.dtype | str]]:
    return {name: (tensor.dim(), tensor.dtype) for name, tensor in state.items()}


def _state_bytes(state: Params) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def _link(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` (the same bytes, no copy), or a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _saved_states(path: Path) -> list[tuple[int, Layout, dict[str, tuple[int, torch.dtype | str]], Params | Path]]:
    """Each client's state in a checkpoint's file (the tensors) and its spilled folder (the file, its header read):
    (client, shapes, (dimensions, dtype) by name, state)."""
    kept, spilled = _load(path)
    found: list[tuple[int, Layout, dict[str, tuple[int, torch.dtype | str]], Params | Path]] = [
        (int(client), {name: tuple(t.shape) for name, t in state.items()}, _kinds(state), state)
        for client, state in kept.items()]
    for client, file in _spilled_files(path, spilled):
        shapes, dtypes = _spilled_layout(file)
        found.append((client, shapes, {name: (len(shapes[name]), dtypes[name]) for name in shapes}, file))
    return found


def _spilled_files(path: Path, spilled: list[int] | None) -> list[tuple[int, Path]]:
    """The files of the states ``path`` spilled (by client), each of them there and no other (``spilled`` None: those
    its folder has, all that an earlier fedray's file tells)."""
    folder = spilled_folder(path)
    found = {}
    for file in sorted(folder.iterdir()) if folder.is_dir() else []:
        if (client := _spilled_client(file.name)) is None:
            raise FedrayError(f"{file}: not a spilled client state (client-K.safetensors); {START_OVER}")
        found[client] = file
    if spilled is None:
        return list(found.items())
    if missing := [client for client in spilled if client not in found]:
        if len(missing) == len(spilled):
            what = f"{folder}: missing, with the {len(spilled)} spilled clients' states"
        else:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            what = f"{folder / _spill_name(missing[0])}: missing{more}, a spilled client's state"
        raise FedrayError(f"{what} that {path.name} names; {START_OVER}")
    if foreign := sorted(found.keys() - set(spilled)):
        raise FedrayError(f"{found[foreign[0]]}: a client's state that {path.name} does not name; {START_OVER}")
    return [(client, found[client]) for client in spilled]


def check_saved(path: Path) -> None:
    """The file of clients' states ``path`` and its spilled states can be restored: readable, complete, every value
    finite; a one-line error naming the file that is not. Reads every state once, mapped or one client at a time."""
    _, spilled = _load(path, mmap=True)  # its states in memory are checked as they are read
    for client, file in _spilled_files(path, spilled):
        _check_finite(_read_spilled(file), file, client)


class ClientStatesLost(FedrayError):
    """Raised by a restarted actor whose clients' states are gone until the driver restores them."""


SPILL_FOLDERS = "fedray-client-states"
"""The folder of a node's temporary folder that holds each actor's folder of spilled states."""


def spill_folder(owner: str, spill_root: Path | None = None) -> Path:
    """Where the actor ``owner`` spills its clients' states: ``spill_root`` (default: the node's temporary folder)."""
    return Path(spill_root or tempfile.gettempdir()) / SPILL_FOLDERS / owner


class ClientStates:
    """The states of an actor's clients (client number → named tensors): the most recently used in memory, up to
    ``budget`` bytes (None: no limit), the rest in ``spill_root``'s folder of this actor (default: the node's
    temporary folder), named by ``owner`` (the actor's id, which a restart keeps; default: a new name).

    A restarted actor (``lost``) deletes what its predecessor spilled under the same name: those states are gone from
    the run (the driver restores them from a checkpoint, whose files are links of their own), and nothing else would
    delete them (a killed actor's shutdown never ran; 9.9 GB were left behind by two OOM kills of a FedDyn run).
    """

    def __init__(self, lost: bool = False, budget: int | None = None, spill_root: Path | None = None,
                 owner: str | None = None) -> None:
        self.committed: OrderedDict[int, Params] = OrderedDict()
        """The states in memory, least recently used first."""
        self.held = 0
        """Their bytes."""
        self.spilled: dict[int, Path] = {}
        self.pending: dict[int, Params] = {}
        self.pending_round: int | None = None
        self.lost = lost
        self.budget = budget
        self.spill_folder = spill_folder(owner or uuid.uuid4().hex, spill_root)
        self.ownership: IO[bytes] | None = None
        """The spill folder's lock, held while this actor has the folder (:mod:`fedray.runtime.spill_owners`)."""
        if lost:
            shutil.rmtree(self.spill_folder, ignore_errors=True)
        remove_orphans(self.spill_folder.parent, keep=self.spill_folder)

    def _own_spill_folder(self) -> None:
        """The spill folder, made (and owned) when this actor first needs it."""
        if self.ownership is None or not self.spill_folder.is_dir():
            self._disown()
            self.ownership = claim(self.spill_folder)

    def _disown(self) -> None:
        if self.ownership is not None:
            self.ownership.close()
            self.ownership = None

    def begin_round(self, round_number: int) -> None:
        """Start round ``round_number``: the previous round's states become the clients' states (a retried call of
        the same round starts again from the same ones)."""
        if self.lost:
            raise ClientStatesLost("a restarted actor lost its clients' states")
        if round_number != self.pending_round:
            self._commit()
        self.pending, self.pending_round = {}, round_number

    def get(self, client: int) -> Params | None:
        if client in self.committed:
            self.committed.move_to_end(client)
            return self.committed[client]
        return _read_spilled(self.spilled[client]) if client in self.spilled else None

    def put(self, client: int, state: Params | None) -> None:
        if state is not None:
            self.pending[client] = state

    def _commit(self) -> None:
        for client, state in self.pending.items():
            self._forget(client)
            self._hold(client, state)
        self.pending = {}
        self._spill_beyond_budget()

    def _hold(self, client: int, state: Params) -> None:
        self.committed[client] = state
        self.held += _state_bytes(state)

    def _forget(self, client: int) -> None:
        """Drop ``client``'s state (a checkpoint's link to its spilled file keeps that file's bytes)."""
        if client in self.committed:
            self.held -= _state_bytes(self.committed.pop(client))
        if client in self.spilled:
            self.spilled.pop(client).unlink()

    def _spill_beyond_budget(self) -> None:
        """Write the least recently used states to disk until those in memory fit the budget."""
        while self.budget is not None and self.held > self.budget and self.committed:
            client, state = next(iter(self.committed.items()))
            path = self.spill_folder / _spill_name(client)
            try:
                self._own_spill_folder()
                save_file({name: tensor.contiguous() for name, tensor in state.items()}, path)
            except (SafetensorError, OSError) as error:
                path.unlink(missing_ok=True)
                raise FedrayError(f"cannot spill clients' states to {self.spill_folder} ({_first_line(error)}): free "
                                  "space there, or keep more in memory with --client-state-memory") from None
            self.spilled[client] = path
            self.held -= _state_bytes(self.committed.pop(client))

    def save(self, path: Path) -> None:
        """Write every state, the last round's included (the driver checkpoints only after a round is complete): those
        in memory to ``path``, the spilled ones as hard links in its :func:`spilled_folder`."""
        self._commit()
        folder = spilled_folder(path)
        shutil.rmtree(folder, ignore_errors=True)
        if self.spilled:
            linking = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                linking.mkdir(parents=True)
                for client, spilled in self.spilled.items():
                    _link(spilled, linking / _spill_name(client))
                os.replace(linking, folder)
            except OSError as error:
                shutil.rmtree(linking, ignore_errors=True)
                raise FedrayError(f"cannot write {folder} ({_first_line(error)})") from None
        write_atomically(path, lambda temporary: _save(temporary, dict(self.committed), sorted(self.spilled)),
                         lambda: torch_size(self.committed))

    def restore(self, paths: Iterable[Path], holds: Callable[[int], bool],
                expected: Callable[[int], Layout | None] = lambda client: None) -> None:
        """Replace every state by those of ``paths`` (and their spilled folders) for the clients this actor ``holds``
        (no paths: no states), each checked against the ``expected`` shapes of a client's state (None: not known).
        Every file is checked before any state is replaced."""
        restored: dict[int, Params | Path] = {}
        kinds: dict[str, tuple[int, torch.dtype | str]] | None = None
        for path in paths:
            for client, shapes, kind, state in _saved_states(path):
                kinds = kinds or kind
                file = state if isinstance(state, Path) else path  # the file that holds it
                if kind != kinds:
                    raise FedrayError(f"{file}: the state of client {client} has (dimensions, dtype) {kind}, another "
                                      f"client's {kinds}; {START_OVER}")
                if not holds(client):
                    continue
                if (wanted := expected(client)) is not None and shapes != wanted:
                    raise FedrayError(f"{file}: the state of client {client} has shapes {shapes}, where this run's "
                                      f"algorithm makes {wanted}; {START_OVER}")
                restored[client] = state
        self.clear()
        for client, state in restored.items():
            if isinstance(state, Path):
                self._own_spill_folder()
                self.spilled[client] = self.spill_folder / _spill_name(client)
                _link(state, self.spilled[client])
            else:
                self._hold(client, state)
        self._spill_beyond_budget()

    def sizes(self) -> tuple[int, int]:
        """Bytes of the committed states in memory, and on disk."""
        return self.held, sum(path.stat().st_size for path in self.spilled.values())

    def clear(self) -> None:
        """No states (those spilled deleted), as a new actor has."""
        shutil.rmtree(self.spill_folder, ignore_errors=True)
        self._disown()
        self.committed, self.held, self.spilled = OrderedDict(), 0, {}
        self.pending, self.pending_round, self.lost = {}, None, False
