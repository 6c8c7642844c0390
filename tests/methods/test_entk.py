import math

import pytest
import torch
import torchvision
from torch import nn

from fedray.methods.finetune_model import build_model
from fedray.data.images.backbones import get_backbone
from fedray.methods.entk import (
    coordinate_index,
    entk_features,
    entk_features_loop,
    entk_num_parameters,
    head_coordinates,
    num_parameters,
    reinitialize_last_layer,
    sample_coordinates,
)

ONE_OUTPUT_PARAMETERS = (6 * 3 * 3 * 3 + 6) + 2 * 6 + (8 * 6 * 3 * 3 + 8) + 2 * 8 + (72 * 12 + 12) + (12 + 1)
"""``conv_bn_model`` with TCT's one-output head: conv, BN (γ, β), conv, BN, linear 72 → 12, head 12 → 1."""


def conv_bn_model() -> nn.Module:
    """Conv + BatchNorm + linear layers, with non-trivial BatchNorm running statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2), nn.BatchNorm2d(8), nn.Tanh(),
        nn.Flatten(), nn.Linear(8 * 3 * 3, 12), nn.Tanh(), nn.Linear(12, 5),
    )
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(module.weight, 0.5, 1.5)
            nn.init.uniform_(module.bias, -0.2, 0.2)
    return model


@pytest.fixture()
def model() -> nn.Module:
    return reinitialize_last_layer(conv_bn_model(), seed=7)


@pytest.fixture()
def inputs() -> torch.Tensor:
    return torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def autograd_reference(model: nn.Module, inputs: torch.Tensor, index: torch.Tensor, logit: int) -> torch.Tensor:
    """Independent of fedray.methods.entk: the full flattened gradient of each sample, then ``[index]``."""
    model.eval()
    params = list(model.parameters())
    rows = []
    for x in inputs:
        grads = torch.autograd.grad(model(x.unsqueeze(0))[0, logit], params)
        rows.append(torch.cat([g.flatten() for g in grads])[index])
    model.train()
    return torch.stack(rows)


@pytest.mark.parametrize("p", [100_000, 300])
@pytest.mark.parametrize("linearized, logit", [(True, 0), (False, 3)])
def test_batched_equals_per_sample_autograd(inputs: torch.Tensor, p: int, linearized: bool, logit: int) -> None:
    """On TCT's one-output model, and on any logit of a several-output one."""
    model = reinitialize_last_layer(conv_bn_model(), seed=7) if linearized else conv_bn_model()
    index = coordinate_index(num_parameters(model), p, seed=0)
    expected = autograd_reference(model, inputs, index, logit)
    batched = entk_features(model, inputs, index, logit=logit, chunk_size=4)
    assert batched.shape == (len(inputs), min(p, num_parameters(model)))
    assert batched.abs().max() > 0.1
    assert (batched - expected).abs().max() <= 1e-5
    assert (entk_features_loop(model, inputs, index, logit=logit) - expected).abs().max() <= 1e-5


def test_frozen_parameters_are_included(model: nn.Module, inputs: torch.Tensor) -> None:
    index = coordinate_index(num_parameters(model), 10**6, seed=0)
    expected = autograd_reference(model, inputs, index, logit=0)
    model[0].weight.requires_grad_(False)
    assert (entk_features(model, inputs, index) - expected).abs().max() <= 1e-5
    assert (entk_features_loop(model, inputs, index) - expected).abs().max() <= 1e-5
    assert not model[0].weight.requires_grad


def test_eval_mode_leaves_model_state_alone(model: nn.Module, inputs: torch.Tensor) -> None:
    index = coordinate_index(num_parameters(model), 200, seed=0)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.train()
    single = entk_features(model, inputs[:1], index)
    assert torch.allclose(single[0], entk_features(model, inputs, index)[0], atol=1e-6)
    assert model.training and all(m.training for m in model.modules())
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name


def test_fp16_storage_close_to_fp32(model: nn.Module, inputs: torch.Tensor) -> None:
    index = coordinate_index(num_parameters(model), 400, seed=0)
    full = entk_features(model, inputs, index)
    half = entk_features(model, inputs, index, dtype=torch.float16)
    assert half.dtype == torch.float16
    assert torch.allclose(half.float(), full, rtol=2e-3, atol=1e-4)


def test_chunk_size_does_not_change_the_result(model: nn.Module, inputs: torch.Tensor) -> None:
    index = coordinate_index(num_parameters(model), 500, seed=3)
    reference = entk_features(model, inputs, index, chunk_size=64)
    for chunk_size in (1, 3, 10):
        assert (entk_features(model, inputs, index, chunk_size=chunk_size) - reference).abs().max() <= 1e-6


def test_coordinate_index_is_seeded_sorted_and_complete_when_small() -> None:
    first = coordinate_index(10_000, 500, seed=4)
    assert torch.equal(first, coordinate_index(10_000, 500, seed=4))
    assert not torch.equal(first, coordinate_index(10_000, 500, seed=5))
    assert first.dtype == torch.int64 and len(first) == 500 and len(first.unique()) == 500
    assert bool((first[1:] > first[:-1]).all()) and 0 <= int(first[0]) and int(first[-1]) < 10_000
    assert torch.equal(coordinate_index(300, 300, seed=4), torch.arange(300))
    assert torch.equal(coordinate_index(300, 10**5, seed=9), torch.arange(300))


def test_unsorted_index_is_rejected(model: nn.Module, inputs: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        entk_features(model, inputs, torch.tensor([5, 2]))
    with pytest.raises(ValueError):
        entk_features(model, inputs, torch.tensor([num_parameters(model)]))


def test_reinitialize_last_layer() -> None:
    original = conv_bn_model()
    before = {name: t.clone() for name, t in original.state_dict().items()}
    rng = torch.random.get_rng_state()
    first = reinitialize_last_layer(original, seed=11)
    assert torch.equal(torch.random.get_rng_state(), rng), "the global RNG is left alone"
    again = reinitialize_last_layer(original, seed=11)
    other = reinitialize_last_layer(original, seed=12)
    head = first[9]
    assert isinstance(head, nn.Linear) and (head.in_features, head.out_features) == (12, 1)
    assert head.weight.shape == (1, 12) and head.bias.shape == (1,)
    assert original[9].weight.shape == (5, 12), "the original is modified"
    # nn.Linear(12, 1).reset_parameters() from a CPU generator seeded 11: weight then bias, both U(±1/√12).
    generator = torch.Generator().manual_seed(11)
    bound = 1 / math.sqrt(12)
    weight = torch.empty(1, 12).uniform_(-bound, bound, generator=generator)
    bias = torch.empty(1).uniform_(-bound, bound, generator=generator)
    assert torch.allclose(head.weight, weight, rtol=0, atol=1e-7) and torch.allclose(head.bias, bias, rtol=0, atol=1e-7)
    for name, tensor in first.state_dict().items():
        assert torch.equal(original.state_dict()[name], before[name]), "the original is modified"
        assert torch.equal(tensor, again.state_dict()[name])
        if name.startswith("9."):
            assert not torch.equal(tensor, other.state_dict()[name])
        else:
            assert torch.equal(tensor, before[name])
    widened = reinitialize_last_layer(conv_bn_model().double(), seed=11)[9]
    assert widened.weight.dtype == torch.float64 and torch.equal(widened.weight, head.weight.double())
    assert torch.equal(widened.bias, head.bias.double())


def test_entk_head_has_one_output_and_no_coordinate_is_zero(inputs: torch.Tensor) -> None:
    """Every eNTK coordinate of the one-output network, the head's being its penultimate features h and 1."""
    model = reinitialize_last_layer(conv_bn_model(), seed=7).eval()
    assert model(inputs).shape == (len(inputs), 1)
    assert entk_num_parameters(conv_bn_model()) == ONE_OUTPUT_PARAMETERS == num_parameters(model)
    index = coordinate_index(ONE_OUTPUT_PARAMETERS, 10**6, seed=0)
    features = entk_features(model, inputs, index)
    assert features.shape == (len(inputs), ONE_OUTPUT_PARAMETERS)
    # The head's coordinates come last (parameter order): ∂(wᵀh + b)/∂w = h, the output of layers 0–8, and ∂/∂b = 1.
    with torch.no_grad():
        penultimate = torch.cat([model[:9](x.unsqueeze(0)) for x in inputs])
    assert torch.allclose(features[:, -13:-1], penultimate, rtol=0, atol=1e-6)
    assert torch.equal(features[:, -1], torch.ones(len(inputs)))
    assert bool((features.abs().amax(dim=0) > 0).all()), "a coordinate is zero for every sample"


def test_entk_parameter_count_of_a_torchvision_backbone() -> None:
    """The fine-tuned network's P: torchvision's squeezenet1_1 less its 1000-class classifier conv, plus TCT's 512 → 1 head."""
    reference = torchvision.models.squeezenet1_1()
    expected = sum(p.numel() for p in reference.parameters()) - (512 * 1000 + 1000) + (512 + 1)
    model = build_model(get_backbone("squeezenet1_1"), num_classes=4)
    assert entk_num_parameters(model) == expected
    assert num_parameters(reinitialize_last_layer(model, seed=0)) == expected


@pytest.mark.parametrize("p", [100_000, 5])
def test_last_layer_features_are_the_heads_weight_gradient_by_plain_autograd(inputs: torch.Tensor, p: int) -> None:
    """TCT-last-layer: the coordinates of the one-output head's weight; per sample, by plain autograd w.r.t. that
    weight alone (in float64), they are the penultimate features h (∂(wᵀh + b)/∂w = h)."""
    trained = conv_bn_model().double()
    model = reinitialize_last_layer(trained, seed=7)
    inputs = inputs.double()
    coordinates = head_coordinates(trained)
    assert coordinates == range(ONE_OUTPUT_PARAMETERS - 13, ONE_OUTPUT_PARAMETERS - 1), "its 12 weights, before its bias"
    index = sample_coordinates(coordinates, p, seed=3)
    assert len(index) == min(p, 12) and bool((index >= coordinates.start).all() and (index < coordinates.stop).all())
    model.eval()
    head = model[-1]
    plain = torch.stack([torch.autograd.grad(model(x.unsqueeze(0))[0, 0], head.weight)[0][0] for x in inputs])
    chosen = index - coordinates.start
    batched = entk_features(model, inputs, index, chunk_size=4, dtype=torch.float64)
    assert torch.allclose(batched, plain[:, chosen], rtol=0, atol=1e-14), "float64 round-off (batched vs one at a time)"
    with torch.no_grad():
        penultimate = model[:-1](inputs)
    assert torch.allclose(plain, penultimate, rtol=0, atol=1e-14)
    assert torch.allclose(autograd_reference(model, inputs, index, logit=0), plain[:, chosen], rtol=0, atol=1e-14)


def test_all_coordinates_are_sampled_as_before() -> None:
    assert torch.equal(sample_coordinates(range(1000), 30, seed=2), coordinate_index(1000, 30, seed=2))
