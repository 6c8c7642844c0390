"""Federated fine-tuning on generated images with seeded random backbones (not pre-trained), against plain torch.

Most tests use SqueezeNet 1.1 (no BatchNorm); MobileNetV2 covers BN. Training
random networks on batches of 1–2 tiny images is chaotic: round-off (1- vs
2-thread convolution kernels, or the two decoding recipes' 1e-6 pixel
differences) flips ReLU and max-pool decisions, and BN at initialization has
exploding gradients, so updates can differ by 1e-3 to O(1). Plain-torch
references therefore run on the trainers' single thread and decoded inputs,
where the backend must match them to summation round-off.
"""

from types import SimpleNamespace
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
import torchvision
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedray.data import synthetic
from fedray.data.registry import load_federation
from fedray.core.errors import FedrayError
from fedray.runtime.finetune.backend import FineTuneBackend
from fedray.runtime.finetune.pool import TrainerPool
from fedray.methods.training.modes import FineTuning
from fedray.methods.training.local import LocalSGD, client_rng, minibatches, train_heads
from fedray.methods.training.schedule import LrSchedule
from fedray.data.images.backbones import get_backbone, load_weights
from fedray.methods.algorithm import Population
from fedray.methods.base import single_threaded
from fedray.methods.training_algorithms import FedAvg, FedProx, Scaffold
from fedray.data.images.decode import ImageTransform, load_image
from fedray.runtime.shard_rows import gather_rows
from tests.images import write_inat_split

SIZE, SEED, HEAD_SEED, BACKBONE, DIM = 64, 5, 9, "squeezenet1_1", 512
SGD = LocalSGD(lr=0.05, weight_decay=1e-3, batch_size=2, epochs=2, prox_mu=0.5, temperature=2.0)
RANDOM_NETWORK = FineTuning(BACKBONE, "random")
CLIENTS, ROUND = np.array([4, 0, 2, 3]), 3
CPUS = 0.25


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("inat")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FEDRAY_CACHE_DIR", str(root / "fedray-cache"))
        train_csv, image_root = write_inat_split(root, users=6, images_per_user=3, classes=3, test_images=6)
        # a per-class Dirichlet re-split gives clients of 2, 3, 5, 2 and 6 images
        federation = load_federation(f"hsu:{train_csv}?images={image_root}&split=dirichlet_per_class&alpha=1&clients=5&split_seed=2")
    return federation


@pytest.fixture(scope="module")
def bad_images(tmp_path_factory):
    """A split whose first train image is missing, and the same split with that image unreadable instead."""
    root = tmp_path_factory.mktemp("bad")
    train_csv, image_root = write_inat_split(root, users=2, images_per_user=2, classes=2, test_images=1, seed=1)
    spec = f"hsu:{train_csv}?images={image_root}"

    def load(cache: str):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("FEDRAY_CACHE_DIR", str(root / cache))  # the walked image index is cached per cache folder
            return load_federation(spec)

    path = Path(load("before").train.column("image_path")[0].as_py())
    path.unlink()
    missing = load("missing")
    path.write_bytes(b"not a jpeg")
    return missing, load("unreadable"), path


@pytest.fixture(scope="module")
def pools(images, bad_images, ray_session):
    """Trainer pools shared by the tests (starting a trainer takes seconds), a quarter CPU (so one thread) per
    trainer; plus a backend on a pool of its own, over the split with an unreadable image.

    Started one after another: Ray pickling the trainer class while another thread imports can fail.
    """
    started = {}
    try:
        for backbone, trainers in ((BACKBONE, 2), (BACKBONE, 1), ("mobilenet_v2", 1)):
            started[backbone, trainers] = TrainerPool.start(images, backbone, image_size=SIZE, num_trainers=trainers, cpus_per_trainer=CPUS)
        started["unreadable"] = FineTuneBackend.start(bad_images[1], FineTuning(BACKBONE, "random", SIZE), "ft",
                                                      LocalSGD(batch_size=2, epochs=1), SEED, num_trainers=1,
                                                      cpus_per_trainer=CPUS)
        yield started
    finally:
        for pool in started.values():
            pool.shutdown()


def backend(pools, mode="ft", sgd=SGD, backbone=BACKBONE, trainers=1, algorithm=None, **options):
    """A backend whose clients run ``algorithm``: by default FedProx at ``sgd.prox_mu`` (FedAvg when it is 0)."""
    algorithm = algorithm or (FedProx(prox_mu=sgd.prox_mu) if sgd.prox_mu else FedAvg())
    return FineTuneBackend(pools[backbone, trainers], "random", mode, replace(sgd, prox_mu=0.0), SEED, algorithm=algorithm,
                           **options)


def train_round(ft, params, clients, number, broadcast=None):
    """One round; ``delta`` holds the summed updates and BN statistics together, as Σ n_k (θ_k − θ)."""
    update = ft.train_round(params, broadcast or {}, clients, number)
    return SimpleNamespace(delta={**update.sums, **update.statistics}, weight=update.weight, samples=update.samples,
                           loss_sum=update.loss_sum, sums=update.sums, statistics=update.statistics)


def fedavg(params, update):
    return {name: value + update.delta[name] / update.weight if name in update.delta else value for name, value in params.items()}


class Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(x, dim=1)


def reference_net(backbone: str, num_classes: int, params: dict | None = None, sphere: bool = False) -> tuple[nn.Module, str]:
    """torchvision's network with its classifier replaced by a linear head (after an L2 normalization for SphereFed),
    and the head's name prefix."""
    net = getattr(torchvision.models, backbone)()
    normalize = [Normalize()] if sphere else []
    if backbone == "mobilenet_v2":
        net.classifier, head = nn.Sequential(*normalize, nn.Linear(1280, num_classes)), f"classifier.{len(normalize)}."
    else:
        layers = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), *normalize, nn.Linear(DIM, num_classes)]
        net.classifier, head = nn.Sequential(*layers), f"classifier.{len(layers) - 1}."
    if params is not None:
        net.load_state_dict({reference_name(name, head): value for name, value in params.items()})
    return net, head


def reference_name(name: str, head: str) -> str:
    return name.replace("head.", head) if name.startswith("head.") else name.removeprefix("backbone.")


def decode(paths: list[str]) -> torch.Tensor:
    """The images as extraction decodes them (tested against torchvision's recipe in test_images).

    Not an independent decoder on purpose: see the module docstring.
    """
    transform = ImageTransform(SIZE)
    pipeline = transform.pipeline()
    return torch.stack([load_image(path, transform, pipeline) for path in paths])


def plain_round(backbone, federation, params, clients, sgd, seed, round_number, sphere=False, steps=None):
    """FedAvg's client side written plainly: each client trains a copy of the whole network with torch.optim.SGD
    (client ``clients[i]`` on the first ``steps[i]`` of its mini-batches, with ``steps``).

    BN in train mode (batch statistics; running statistics averaged like weights);
    the starting model's loss summed over the client's samples in batch_size chunks, in train mode.
    ``sphere``: SphereFed, the head fixed after an L2 normalization and SphereFed's MSE (1/C)‖Wz − onehot(y)‖².
    """
    with single_threaded():
        return _plain_round(backbone, federation, params, clients, sgd, seed, round_number, sphere, steps)


def plain_loss(logits, labels, sgd, sphere, reduction="mean"):
    if not sphere:
        return nn.functional.cross_entropy(logits / sgd.temperature, labels, reduction=reduction)
    per_sample = (logits - nn.functional.one_hot(labels, logits.shape[1]).float()).square().mean(dim=1)
    return per_sample.sum() if reduction == "sum" else per_sample.mean()


def _plain_round(backbone, federation, params, clients, sgd, seed, round_number, sphere, steps):
    paths = federation.train.column("image_path").to_pylist()
    labels = torch.from_numpy(federation.train.column("label").to_numpy().astype(np.int64))
    offsets = federation.client_offsets
    net, head = reference_net(backbone, federation.num_classes, params, sphere)
    start = {name: value.clone() for name, value in net.state_dict().items()}
    trained = [p for name, p in net.named_parameters() if not (sphere and name.startswith(head))]
    delta = {name: torch.zeros_like(value) for name, value in start.items()
             if value.is_floating_point() and not (sphere and name.startswith(head))}
    loss_sum = 0.0
    for k, client in enumerate(clients):
        rows = np.arange(offsets[client], offsets[client + 1])
        x, y = decode([paths[r] for r in rows]), labels[rows]
        net.load_state_dict(start)
        net.train()
        with torch.no_grad():
            for first in range(0, len(rows), sgd.batch_size):
                batch = slice(first, first + sgd.batch_size)
                loss_sum += float(plain_loss(net(x[batch]), y[batch], sgd, sphere, reduction="sum"))
        net.load_state_dict(start)
        optimizer = torch.optim.SGD(trained, lr=sgd.lr, weight_decay=sgd.weight_decay, momentum=sgd.momentum)
        plan = minibatches(len(rows), sgd.batch_size, sgd.epochs, client_rng(seed, round_number, int(client)))
        for batch in plan if steps is None else plan[:steps[k]]:
            optimizer.zero_grad()
            loss = plain_loss(net(x[batch]), y[batch], sgd, sphere)
            prox = sum(((p - start[name]) ** 2).sum() for name, p in net.named_parameters() if not (sphere and name.startswith(head)))
            (loss + sgd.prox_mu / 2 * prox).backward()
            optimizer.step()
        for name, value in net.state_dict().items():
            if name in delta:
                delta[name] += len(rows) * (value - start[name])
    backend_names = {reference_name(name, head): name for name in params}
    return {backend_names[name]: value for name, value in delta.items()}, loss_sum


def backbone_forward_flops(backbone: str, num_classes: int) -> float:
    """torch's count for the whole network minus the head's 2 d C."""
    net, head = reference_net(backbone, num_classes)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        net.eval()(torch.zeros(1, 3, SIZE, SIZE))
    return counter.get_total_flops() - 2 * net.state_dict()[head + "weight"].numel()


def close(a, b, **tolerance):
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def ft_runs(images, pools):
    """One ft round, the test accuracy and the embeddings, on 2 trainers and on 1."""
    runs = {}
    for trainers in (2, 1):
        ft = backend(pools, trainers=trainers)
        params = ft.initial_params(HEAD_SEED)
        runs[trainers] = {
            "trainers": ft.pool.num_trainers, "params": params, "update": train_round(ft, params, CLIENTS, ROUND),
            "accuracy": ft.accuracy(params), "test": ft.embed(params, "test"), "train": ft.embed(params, "train"),
            "traffic": ft.model_floats(), "flops": ft.client_flops(images.client_sizes),
        }
    return runs


def test_a_fedavg_round_of_full_fine_tuning_equals_plain_torch(images, ft_runs):
    run = ft_runs[2]
    assert run["trainers"] == 2
    params, update = run["params"], run["update"]
    expected_delta, expected_loss = plain_round(BACKBONE, images, params, CLIENTS, SGD, SEED, ROUND)
    close(update.delta, expected_delta, rtol=1e-4, atol=1e-6)
    assert update.weight == update.samples == images.client_sizes[CLIENTS].sum()
    assert update.loss_sum == pytest.approx(expected_loss, rel=1e-5)
    assert all(value.abs().max() > 0 for value in update.delta.values())


def test_results_do_not_depend_on_the_number_of_trainers(ft_runs):
    """The same bits: each client's upload is its own (one thread a trainer in both pools), and the sums follow the
    tree with one client a leaf, not the trainers' ranges (2 trainers split the round's clients 0, 2 | 3, 4)."""
    one, two = ft_runs[1], ft_runs[2]
    assert one["trainers"] == 1
    close(one["update"].delta, two["update"].delta, rtol=0, atol=0)
    assert one["update"].loss_sum == two["update"].loss_sum and one["update"].weight == two["update"].weight
    assert one["accuracy"] == two["accuracy"]
    torch.testing.assert_close(one["test"][0], two["test"][0])
    torch.testing.assert_close(one["train"][0], two["train"][0])


def test_step_budgets_stop_each_trainers_clients_after_their_first_minibatches(pools, images, ft_runs):
    ft, params, whole = backend(pools, trainers=2), ft_runs[2]["params"], ft_runs[2]["update"]
    full = ft.local_steps(CLIENTS)
    assert full.tolist() == [6, 2, 6, 2]  # 2 epochs of ⌈n / 2⌉ mini-batches of 6, 2, 5 and 2 images
    same = ft.train_round(params, {}, CLIENTS, ROUND, full)
    close({**same.sums, **same.statistics}, whole.delta, rtol=0, atol=0)
    budgets = np.array([3, 1, 5, 2])
    partial = ft.train_round(params, {}, CLIENTS, ROUND, budgets)
    expected_delta, expected_loss = plain_round(BACKBONE, images, params, CLIENTS, SGD, SEED, ROUND, steps=budgets)
    close({**partial.sums, **partial.statistics}, expected_delta, rtol=1e-4, atol=1e-6)
    assert partial.weight == images.client_sizes[CLIENTS].sum() and partial.loss_sum == whole.loss_sum
    with pytest.raises(FedrayError, match="step budget must be ≥ 1"):
        ft.train_round(params, {}, CLIENTS, ROUND, np.array([3, 0, 5, 2]))


def test_initial_params_are_the_loaded_backbone_and_a_seeded_linear_head(images, ft_runs):
    params = ft_runs[2]["params"]
    backbone = load_weights(get_backbone(BACKBONE), "random", SEED).state_dict
    for name, value in params.items():
        if not name.startswith("head."):
            assert torch.equal(value, backbone[name.removeprefix("backbone.")]), name
    # nn.Linear's U(±1/√d), drawn d × C as the linear-probing path's random head, then transposed
    generator = torch.Generator().manual_seed(HEAD_SEED)
    weight = torch.empty(DIM, images.num_classes).uniform_(-1 / np.sqrt(DIM), 1 / np.sqrt(DIM), generator=generator)
    bias = torch.empty(images.num_classes).uniform_(-1 / np.sqrt(DIM), 1 / np.sqrt(DIM), generator=generator)
    assert torch.equal(params["head.weight"], weight.T) and torch.equal(params["head.bias"], bias)
    assert torch.equal(ft_runs[1]["params"]["head.weight"], params["head.weight"])


def test_evaluation_and_embedding_use_the_trained_backbone(images, ft_runs):
    run = ft_runs[2]
    features, labels = run["test"]
    net, _ = reference_net(BACKBONE, images.num_classes, run["params"])
    with torch.no_grad():
        x = decode(images.test.column("image_path").to_pylist())
        expected = torch.flatten(nn.functional.adaptive_avg_pool2d(net.eval().features(x), 1), 1)
        logits = net(x)
    assert features.dtype == torch.float32 and features.shape == (images.test.num_rows, DIM)
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(labels, images.test.column("label").to_numpy())
    assert run["accuracy"] == pytest.approx((logits.argmax(1).numpy() == labels).mean())
    train_features, train_labels = run["train"]
    assert train_features.shape == (images.train.num_rows, DIM)
    np.testing.assert_array_equal(train_labels, images.train.column("label").to_numpy())


def test_full_fine_tuning_sends_every_parameter_and_counts_its_flops(images, ft_runs):
    run = ft_runs[2]
    sent = sum(value.numel() for value in run["update"].delta.values())
    net, _ = reference_net(BACKBONE, images.num_classes)
    assert sent == sum(p.numel() for p in net.parameters())
    assert run["traffic"] == sent
    per_sample = 3 * backbone_forward_flops(BACKBONE, images.num_classes) + 6 * DIM * images.num_classes
    np.testing.assert_allclose(run["flops"], images.client_sizes * SGD.epochs * per_sample)


def test_batchnorm_trains_and_averages_its_statistics_like_weights(pools, images):
    ft = backend(pools, backbone="mobilenet_v2")
    params = ft.initial_params(HEAD_SEED)
    update = train_round(ft, params, CLIENTS, ROUND)
    expected_delta, expected_loss = plain_round("mobilenet_v2", images, params, CLIENTS, SGD, SEED, ROUND)
    close(update.delta, expected_delta, rtol=1e-4, atol=1e-6)
    assert update.loss_sum == pytest.approx(expected_loss, rel=1e-5)
    statistics = {name for name in update.delta if "running_" in name}
    assert statistics and all(update.delta[name].abs().max() > 0 for name in statistics)
    assert set(update.statistics) == statistics and ft.trained_names == set(update.sums)
    assert not any("num_batches_tracked" in name for name in update.delta)
    assert ft.model_floats() == sum(value.numel() for value in update.delta.values())


def test_linear_probing_on_images_trains_the_head_only_exactly_like_probing_on_features(pools, images):
    ftlp = backend(pools, "ftlp", backbone="mobilenet_v2")
    params = ftlp.initial_params(HEAD_SEED)
    update = train_round(ftlp, params, CLIENTS, ROUND)
    assert set(update.delta) == {"head.weight", "head.bias"}
    trained = fedavg(params, update)
    assert all(torch.equal(trained[name], params[name]) for name in params if not name.startswith("head."))
    assert not torch.equal(trained["head.weight"], params["head.weight"])
    classes = images.num_classes
    assert ftlp.model_floats() == classes * 1280 + classes

    # eval-mode BN: the head trains on exactly the features embed() gives, as linear probing on a feature cache does
    features, labels = ftlp.embed(params, "train")
    rows, offsets = gather_rows(images.client_offsets, CLIENTS)
    y = torch.from_numpy(labels[rows].astype(np.int64))
    heads = train_heads(features[rows], y, offsets, CLIENTS, params["head.weight"].T.contiguous(), params["head.bias"], SGD, SEED, ROUND)
    delta_w, delta_b, count = heads.weighted_update(params["head.bias"])
    torch.testing.assert_close(update.delta["head.weight"], delta_w.T, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(update.delta["head.bias"], delta_b, rtol=1e-4, atol=1e-6)
    assert update.weight == float(count)
    logits = (features[rows] @ params["head.weight"].T + params["head.bias"]) / SGD.temperature
    assert update.loss_sum == pytest.approx(float(nn.functional.cross_entropy(logits, y, reduction="sum")), rel=1e-5)
    per_sample = backbone_forward_flops("mobilenet_v2", classes) + 6 * 1280 * classes
    np.testing.assert_allclose(ftlp.client_flops(np.array([1, 7])), np.array([1, 7]) * SGD.epochs * per_sample)


def test_each_clients_squared_losses_at_the_model_received_are_measured_when_asked(pools, images):
    """Σ over each client's images of its squared cross-entropy at the round's starting model (what Oort's utility is
    made of), written out here on the features embed() gives (eval-mode BN, as ftlp's loss pass)."""
    ftlp = backend(pools, "ftlp", backbone="mobilenet_v2", client_losses=True)
    params = ftlp.initial_params(HEAD_SEED)
    update = ftlp.train_round(params, {}, CLIENTS, ROUND)
    features, labels = ftlp.embed(params, "train")
    expected = []
    for client in CLIENTS:
        rows = slice(images.client_offsets[client], images.client_offsets[client + 1])
        logits = (features[rows] @ params["head.weight"].T + params["head.bias"]) / SGD.temperature
        losses = nn.functional.cross_entropy(logits, torch.from_numpy(labels[rows].astype(np.int64)), reduction="none")
        expected.append(float((losses.double() ** 2).sum()))
    measured = dict(zip(update.client_losses.clients.tolist(), update.client_losses.squares.tolist()))
    assert sorted(measured) == sorted(CLIENTS.tolist())
    np.testing.assert_allclose([measured[client] for client in CLIENTS.tolist()], expected, rtol=1e-5)
    assert backend(pools, "ftlp", backbone="mobilenet_v2").train_round(params, {}, CLIENTS, ROUND).client_losses is None


def test_ftfeat_trains_the_backbone_and_leaves_the_head_alone(pools):
    ftfeat = backend(pools, "ftfeat")
    params = ftfeat.initial_params(HEAD_SEED)
    update = train_round(ftfeat, params, CLIENTS, ROUND)
    assert not any(name.startswith("head.") for name in update.delta)
    trained = fedavg(params, update)
    assert torch.equal(trained["head.weight"], params["head.weight"]) and torch.equal(trained["head.bias"], params["head.bias"])
    assert all(update.delta[name].abs().max() > 0 for name in update.delta)
    backbone_floats = sum(value.numel() for name, value in params.items() if not name.startswith("head."))
    assert ftfeat.model_floats() == backbone_floats
    assert sum(value.numel() for value in update.delta.values()) == backbone_floats


def test_spherefed_fine_tunes_the_backbone_under_the_fixed_classifier_like_plain_torch(pools, images):
    sphere = backend(pools, "ftfeat", sphere_loss="mse")
    params = sphere.initial_params(HEAD_SEED)
    classifier = params["head.weight"]
    assert torch.allclose(classifier @ classifier.T, torch.eye(images.num_classes), atol=1e-6)
    assert not params["head.bias"].any()
    update = train_round(sphere, params, CLIENTS, ROUND)
    assert not any(name.startswith("head.") for name in update.delta)
    expected_delta, expected_loss = plain_round(BACKBONE, images, params, CLIENTS, SGD, SEED, ROUND, sphere=True)
    close(update.delta, expected_delta, rtol=1e-4, atol=1e-6)
    assert update.loss_sum == pytest.approx(expected_loss, rel=1e-5)
    with pytest.raises(FedrayError, match="ftfeat"):
        backend(pools, "ft", sphere_loss="mse")


def test_client_momentum_and_a_scheduled_learning_rate_train_like_plain_torch(pools, images):
    scheduled = replace(SGD, lr=0.1, momentum=0.9, schedule=LrSchedule("cosine", rounds=4))
    fl = backend(pools, sgd=scheduled)
    params = fl.initial_params(HEAD_SEED)
    update = train_round(fl, params, CLIENTS, ROUND)
    # round 3 of a cosine over 4 rounds: 0.1 · (1 + cos(π · 2/4)) / 2 = 0.05
    expected_delta, _ = plain_round(BACKBONE, images, params, CLIENTS, replace(SGD, lr=0.05, momentum=0.9), SEED, ROUND)
    close(update.delta, expected_delta, rtol=1e-4, atol=1e-6)


def test_a_huge_prox_term_keeps_clients_near_the_global_model(pools):
    steps = {}
    for mu in (0.0, 90.0):  # lr·μ = 0.9: each step pulls 90 % of the way back to the global model
        fedprox = backend(pools, sgd=LocalSGD(lr=0.01, weight_decay=0.0, batch_size=2, epochs=2, prox_mu=mu))
        update = train_round(fedprox, fedprox.initial_params(HEAD_SEED), CLIENTS, ROUND)
        steps[mu] = torch.sqrt(sum((value / update.weight).square().sum() for value in update.delta.values()))
    assert steps[90.0] < 0.4 * steps[0.0]


def run_rounds(fl, params, server, rounds):
    """SCAFFOLD's rounds with plain averaging: the model and the server's c after them, and each round's loss."""
    losses, population = [], Population(len(fl.pool.federation.client_sizes), int(fl.pool.federation.client_sizes.sum()))
    for number, clients in rounds:
        model = {name: params[name] for name in fl.trained_names}
        update = fl.train_round(params, Scaffold().broadcast(model, server), np.array(clients), number)
        delta, server = Scaffold().server_update(model, update.aggregate(), server, population)
        params = {name: value + (delta[name] if name in delta else update.statistics[name] / update.samples
                                 if name in update.statistics else 0) for name, value in params.items()}
        losses.append(update.loss_sum)
    return params, server, losses


def test_scaffold_keeps_option_ii_control_variates_in_the_trainers_and_resumes_bitwise_from_their_files(pools, images,
                                                                                                        tmp_path):
    sgd = LocalSGD(lr=0.05, batch_size=2, epochs=1)
    rounds = [(1, [2]), (2, [0, 1, 3]), (3, [2, 4, 0])]
    first = backend(pools, sgd=sgd, trainers=2, algorithm=Scaffold(variant="II"))
    first.pool.restore_client_states([])
    initial = first.initial_params(HEAD_SEED)
    model = {name: initial[name] for name in first.trained_names}
    server = Scaffold(variant="II").init_server_state(model)

    update = first.train_round(initial, Scaffold(variant="II").broadcast(model, server), np.array([2]), 1)
    size, steps = int(images.client_sizes[2]), 3  # 5 samples in batches of 2
    files = first.pool.save_client_states(tmp_path, "first")
    held = [torch.load(tmp_path / name, weights_only=True)["kept"] for name in files]
    assert [sorted(states) for states in held] == [[2], []]  # client 2 is the first trainer's
    own = held[0][2]
    assert set(own) == {f"control.{name}" for name in model}
    for name in model:  # c_i⁺ = c_i − c + (θ⁰ − θ)/(τη) with c_i = c = 0
        torch.testing.assert_close(own[f"control.{name}"], -update.sums[name] / size / (steps * sgd.lr), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(update.sums[f"control.{name}"], size * own[f"control.{name}"])

    after_one = {name: initial[name] + (update.sums[name] / update.weight if name in update.sums else
                                        update.statistics[name] / update.samples if name in update.statistics else 0)
                 for name in initial}
    server = Scaffold(variant="II").server_update(model, update.aggregate(), server, Population(0, images.train.num_rows))[1]
    after_two, server_two, _ = run_rounds(first, after_one, server, rounds[1:2])
    files = first.pool.save_client_states(tmp_path, "second")
    expected, expected_server, expected_losses = run_rounds(first, after_two, server_two, rounds[2:])

    resumed_backend = backend(pools, sgd=sgd, trainers=2, algorithm=Scaffold(variant="II"))
    resumed_backend.pool.restore_client_states([])  # the trainers forget every state ...
    resumed_backend.pool.restore_client_states([tmp_path / name for name in files])  # ... and take the saved ones back
    resumed, resumed_server, losses = run_rounds(resumed_backend, after_two, server_two, rounds[2:])
    assert losses == expected_losses
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
    assert all(torch.equal(resumed_server[key], expected_server[key]) for key in expected_server)


def test_scaffold_option_i_on_images_keeps_the_gradient_at_the_model_received(pools, images, tmp_path):
    """Option I by autograd: c_i⁺ is the gradient of the client's mean loss at the model it received (train mode,
    in batch-size chunks, as the loss of the model received is taken), whatever its local steps then do."""
    sgd = LocalSGD(lr=0.05, batch_size=2, epochs=1)
    ft = backend(pools, sgd=sgd, trainers=2, algorithm=Scaffold())
    ft.pool.restore_client_states([])
    initial = ft.initial_params(HEAD_SEED)
    model = {name: initial[name] for name in ft.trained_names}
    update = ft.train_round(initial, Scaffold().broadcast(model, Scaffold().init_server_state(model)), np.array([2]), 1)
    own = torch.load(tmp_path / ft.pool.save_client_states(tmp_path, "first")[0], weights_only=True)["kept"][2]

    rows = np.arange(images.client_offsets[2], images.client_offsets[3])
    paths = images.train.column("image_path").to_pylist()
    labels = torch.from_numpy(images.train.column("label").to_numpy().astype(np.int64))
    net, head = reference_net(BACKBONE, images.num_classes, initial)
    net.train()
    with single_threaded():
        x, y = decode([paths[r] for r in rows]), labels[rows]
        for first in range(0, len(rows), sgd.batch_size):
            batch = slice(first, first + sgd.batch_size)
            (plain_loss(net(x[batch]), y[batch], sgd, False, reduction="sum") / len(rows)).backward()
    gradients = {name: parameter.grad for name, parameter in net.named_parameters()}
    assert set(own) == {f"control.{name}" for name in model}
    for name in model:
        torch.testing.assert_close(own[f"control.{name}"], gradients[reference_name(name, head)], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(update.sums[f"control.{name}"], len(rows) * own[f"control.{name}"])


def test_bad_inputs_get_clear_errors(pools, images, bad_images):
    with pytest.raises(FedrayError, match="unknown fine-tuning mode 'lp'; known: ft, ftlp, ftfeat"):
        FineTuneBackend.start(images, RANDOM_NETWORK, "lp", SGD, SEED)
    features_only = synthetic.build("inat-geo-100", dim=8, scale=0.1, seed=0)
    with pytest.raises(FedrayError, match="no images to fine-tune on"):
        FineTuneBackend.start(features_only, RANDOM_NETWORK, "ft", SGD, SEED)
    with pytest.raises(FedrayError, match="bad local SGD settings"):
        FineTuneBackend.start(images, RANDOM_NETWORK, "ft", LocalSGD(batch_size=0), SEED)
    missing, _, path = bad_images
    with pytest.raises(FedrayError, match=f"image '{path.stem}' .* not found under the image root"):
        FineTuneBackend.start(missing, RANDOM_NETWORK, "ft", SGD, SEED)

    ft = pools["unreadable"]
    params = ft.initial_params(HEAD_SEED)
    with pytest.raises(FedrayError, match=f"^{path}: unreadable image"):
        train_round(ft, params, np.array([0]), 1)
    with pytest.raises(FedrayError, match="distinct client numbers"):
        train_round(ft, params, np.array([1, 1]), 1)
    with pytest.raises(FedrayError, match="do not match the squeezenet1_1 model"):
        train_round(ft, {"head.weight": params["head.weight"]}, np.array([1]), 1)
    assert train_round(ft, params, np.array([1]), 1).samples == 2


@pytest.mark.slow  # a restarted actor imports torch and builds its model again
def test_a_restarted_trainer_fetches_its_rows_again_and_gives_the_same_results(pools):
    """A trainer's rows come with every call, so a restarted trainer (its constructor took small things only) serves
    the same images and labels."""
    pool = pools[BACKBONE, 1]
    params = ray.put(backend(pools).initial_params(HEAD_SEED))
    features, labels = pool.embed(params, "test")
    ray.kill(pool.actors[0], no_restart=False)
    again, labels_again = pool.embed(params, "test")
    assert torch.equal(again, features) and np.array_equal(labels_again, labels)


def test_replicas_share_the_gpus_when_more_are_asked_for_than_there_are():
    from fedray.runtime.placement import gpu_share

    assert [gpu_share(1, n) for n in (1, 2, 3, 4)] == [1.0, 0.5, 0.3333, 0.25]
    assert gpu_share(4, 3) == 1.0 and gpu_share(2, 3) == 0.6666 and 3 * gpu_share(2, 3) <= 2
