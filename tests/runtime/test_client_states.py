"""The shapes of a client's state, for the memory estimate, are made by the runtime from the algorithm's public
``init_client_state`` on PyTorch's meta device (no memory), not by a method of the public interface."""

from dataclasses import dataclass

import torch

import fedray
from fedray.methods.training_algorithms import FedAvg, Scaffold
from fedray.runtime.client_states import meta_client_state, meta_layout

SHAPES = {"weight": (32, 10), "bias": (10,)}


@dataclass(frozen=True)
class Broken(fedray.FederatedAlgorithm):
    def init_client_state(self, start):
        raise RuntimeError("needs real tensors")


@dataclass(frozen=True)
class Counts(fedray.FederatedAlgorithm):
    def init_client_state(self, start):
        return {"seen": 3}  # not a tensor: refused where it trains


def test_the_public_algorithm_has_no_memory_estimate_hook():
    assert not hasattr(fedray.FederatedAlgorithm, "meta_client_state")


def test_a_stateful_algorithms_state_is_made_on_the_meta_device_with_its_shapes():
    state = meta_client_state(Scaffold(), SHAPES)
    assert {name: (tuple(value.shape), value.device.type, value.dtype) for name, value in state.items()} == {
        "control.weight": ((32, 10), "meta", torch.float32), "control.bias": ((10,), "meta", torch.float32)}
    assert meta_layout(Scaffold(), SHAPES) == {"control.weight": (32, 10), "control.bias": (10,)}


def test_no_layout_for_a_stateless_algorithm_nor_one_whose_state_cannot_be_made_there():
    assert meta_layout(FedAvg(), SHAPES) is None
    assert meta_layout(Broken(), SHAPES) is None
    assert meta_layout(Counts(), SHAPES) is None
