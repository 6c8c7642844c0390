"""Postprocessors: what happens to every upload between a client and the server, in one place for every method.

A client's upload (a closed-form method's statistics, a training algorithm's
update) passes through each postprocessor's :meth:`Postprocessor.client` on its
way out, and the server's sum of the uploads through each one's
:meth:`Postprocessor.aggregate` before it is used, in the order given
(``--postprocessor a.py:Clip,b.py:Noise``). This is where clipping, noise,
quantization and secure-aggregation masks go. An upload reaches a
postprocessor as named tensors (:func:`flatten`: a statistics dataclass's
fields, a tuple's items, an update's parameters), whatever the method.

A postprocessor is one subclass with its options as typed keyword arguments of
its constructor (``--option key=value``), like a server optimizer. Each call
gets a ``torch.Generator`` seeded from the run's seed, the round, the client
(or the aggregate) and the postprocessor's place in the list, so its random
draws are the same on any shard layout. What it keeps between rounds goes in
``self.state`` (named tensors), which checkpoints save.

Where the sums are (fedray sums uploads inside the shards): a postprocessor
whose :attr:`~Postprocessor.per_client` is true makes every client's upload
exist on its own before it is added (closed-form statistics are then computed
client by client; linear heads train by autograd, not the dual form); one
that only changes the aggregate keeps every fast path. The aggregate of a
training round is its clients' sum; a closed-form method's aggregates are the
sums of each evaluation block's uploads (the server solves once a block).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedray.methods.algorithm import Params
from fedray.methods.checks import check_like, check_state

AGGREGATE = -1
"""The client number the aggregate's generator is seeded with."""


@dataclass(frozen=True)
class UploadContext:
    """Where an upload is: ``client`` (:data:`AGGREGATE` for the server's sum), the ``round`` it belongs to (a closed-form
    block's last round for its aggregate), how many ``clients`` it sums, and the ``generator`` of its random draws."""

    client: int
    round: int
    clients: int
    generator: torch.Generator


class Postprocessor:
    """The identity: subclass it and override :meth:`client`, :meth:`aggregate` or both."""

    def __init__(self) -> None:
        self.state: Params = {}

    @property
    def per_client(self) -> bool:
        """Whether :meth:`client` changes uploads (by default: whether the subclass overrides it)."""
        return type(self).client is not Postprocessor.client

    def client(self, upload: Params, context: UploadContext) -> Params:
        """One client's upload as it leaves the client; return new tensors (``upload`` is not to be changed)."""
        return upload

    def aggregate(self, total: Params, context: UploadContext) -> Params:
        """The sum of the uploads as the server receives it; return new tensors (``total`` is not to be changed)."""
        return total


def flatten(value: Any, prefix: str = "") -> Params:
    """The tensors in ``value`` (dataclasses, dicts, lists, tuples of tensors) by their path: ``sums``, ``0.weight``."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if dataclasses.is_dataclass(value):
        items = [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        return {}
    out: Params = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def unflatten(template: Any, tensors: Params, prefix: str = "") -> Any:
    """``template`` with each of its tensors replaced by the one of ``tensors`` at its path."""
    if isinstance(template, torch.Tensor):
        return tensors[prefix]
    name = (lambda key: f"{prefix}.{key}" if prefix else str(key))
    if dataclasses.is_dataclass(template):
        return dataclasses.replace(template, **{field.name: unflatten(getattr(template, field.name), tensors, name(field.name))
                                                for field in dataclasses.fields(template) if field.init})
    if isinstance(template, dict):
        return {key: unflatten(item, tensors, name(key)) for key, item in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(unflatten(item, tensors, name(index)) for index, item in enumerate(template))
    return template


@dataclass(frozen=True)
class Postprocessing:
    """A run's postprocessors, applied in order, with the run's ``seed``."""

    postprocessors: Sequence[Postprocessor] = ()
    seed: int = 0

    @property
    def per_client(self) -> bool:
        return any(postprocessor.per_client for postprocessor in self.postprocessors)

    def _generator(self, round_number: int, client: int, index: int) -> torch.Generator:
        seed = np.random.SeedSequence((self.seed, round_number, client + 1, index)).generate_state(2, np.uint64)[0]
        return torch.Generator().manual_seed(int(seed) & (2**63 - 1))

    def client(self, upload: Any, client: int, round_number: int) -> Any:
        """``upload`` (tensors in any nesting) through every postprocessor's client hook; itself when none has one."""
        if not self.per_client:
            return upload
        tensors = flatten(upload)
        for index, postprocessor in enumerate(self.postprocessors):
            if postprocessor.per_client:
                tensors = check_like(postprocessor, "client", postprocessor.client(tensors, UploadContext(
                    client, round_number, 1, self._generator(round_number, client, index))), tensors, "the upload's tensors")
        return unflatten(upload, tensors)

    def aggregate(self, total: Any, round_number: int, clients: int) -> Any:
        """The server's sum through every postprocessor's aggregate hook; itself when there are none."""
        if not self.postprocessors:
            return total
        tensors = flatten(total)
        for index, postprocessor in enumerate(self.postprocessors):
            tensors = check_like(postprocessor, "aggregate", postprocessor.aggregate(tensors, UploadContext(
                AGGREGATE, round_number, clients, self._generator(round_number, AGGREGATE, index))), tensors,
                "the sum's tensors")
            check_state(postprocessor, "aggregate", postprocessor.state, "tensors by name")
        return unflatten(total, tensors)

    def state_dict(self) -> list[Params]:
        return [dict(postprocessor.state) for postprocessor in self.postprocessors]

    def load_state_dict(self, states: list[Params]) -> None:
        for postprocessor, state in zip(self.postprocessors, states):
            postprocessor.state = dict(state)
