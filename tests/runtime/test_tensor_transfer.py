"""Tensors through Ray's object store as numpy buffers: the same tensor comes back, the receiver's own; tensors the
numpy path cannot carry go by torch's own pickling, as before."""

import pytest
import ray
import torch

from fedray.runtime import tensor_transfer


@pytest.fixture(scope="module")
def registered(ray_session):
    tensor_transfer.register()


@ray.remote(num_cpus=0)
def describe(tensor):
    """What a task that receives ``tensor`` sees."""
    return tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.requires_grad, tensor.clone()


PLAIN = {
    "float64 matrix": torch.arange(12, dtype=torch.float64).reshape(3, 4) / 7,
    "float32 vector": torch.linspace(-1, 1, 5),
    "int64": torch.tensor([3, -1, 2**40]),
    "bool": torch.tensor([True, False, True]),
    "float16": torch.tensor([0.5, 1e-3], dtype=torch.float16),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
    "empty": torch.zeros(0, 3),
}


@pytest.mark.parametrize("name", PLAIN)
def test_a_plain_tensor_comes_back_equal_and_writable(registered, name):
    sent = PLAIN[name]
    stored = ray.put(sent)
    back = ray.get(stored)
    assert back.dtype == sent.dtype and back.shape == sent.shape and back.stride() == sent.stride()
    assert torch.equal(back, sent)
    back.fill_(1)  # the receiver's own memory, writable (the store's is read-only)
    assert torch.equal(ray.get(stored), sent)


def test_a_tensor_in_a_task_argument_and_result_is_the_same(registered):
    sent = torch.randn(50, 40, dtype=torch.float64)
    dtype, shape, stride, grad, copy = ray.get(describe.remote(sent))
    assert (dtype, shape, stride, grad) == (torch.float64, (50, 40), (40, 1), False)
    assert torch.equal(copy, sent)


OTHERS = {
    "transposed view": torch.arange(6.0).reshape(2, 3).T,
    "requires grad": torch.ones(3, requires_grad=True),
    "bfloat16": torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", OTHERS)
def test_other_tensors_go_by_torchs_pickling_unchanged(registered, name):
    sent = OTHERS[name]
    dtype, shape, stride, grad, copy = ray.get(describe.remote(sent))
    assert (dtype, shape, stride, grad) == (sent.dtype, tuple(sent.shape), sent.stride(), sent.requires_grad)
    assert torch.equal(copy.detach(), sent.detach())
