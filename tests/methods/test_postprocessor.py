"""Postprocessors see every upload: each client's on its way out and the server's sum, for closed-form methods and
training algorithms alike; examples/gaussian_noise.py at σ = 0 is the plain run bit for bit, at σ > 0 its noise has
the variance σ²."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.stats
import torch

import fedray
from fedray.engine.config import resolve
from fedray.engine.run_config import run
from fedray.methods.postprocessor import AGGREGATE, Postprocessing, Sampling, UploadContext, flatten, unflatten

REPO = Path(__file__).resolve().parents[2]
NOISE = f"{REPO / 'examples' / 'gaussian_noise.py'}:GaussianNoise"
DATASET = "synthetic:inat-geo-100?dim=24&scale=0.3&classes=20"


@dataclass
class Sums:
    counts: torch.Tensor
    sums: torch.Tensor


class ClassSums(fedray.ClosedFormMethod):
    """Per-class feature sums, whose 'classifier' is the sums themselves: the aggregate the server received."""

    features_dtype = torch.float64

    def client_statistics(self, batch):
        sums = torch.zeros(self.num_classes, self.dim, dtype=torch.float64).index_add_(0, batch.labels, batch.features.double())
        return Sums(torch.bincount(batch.labels, minlength=self.num_classes).double(), sums)

    def combine(self, a, b):
        return Sums(a.counts + b.counts, a.sums + b.sums)

    def solve(self, stats):
        return fedray.Classifier(stats.sums.T.contiguous())


def test_uploads_of_any_shape_reach_a_postprocessor_as_named_tensors_and_go_back_as_they_were():
    stats = (Sums(torch.ones(2), torch.zeros(2, 3)), {"rows": torch.arange(4.0)})
    tensors = flatten(stats)
    assert list(tensors) == ["0.counts", "0.sums", "1.rows"]
    rebuilt = unflatten(stats, {name: tensor + 1 for name, tensor in tensors.items()})
    assert isinstance(rebuilt, tuple) and isinstance(rebuilt[0], Sums)
    assert torch.equal(rebuilt[0].sums, torch.ones(2, 3)) and torch.equal(rebuilt[1]["rows"], torch.arange(1.0, 5.0))


class Marks(fedray.Postprocessor):
    """Records the seed of each draw: what the generators of the uploads were."""

    def client(self, upload, context):
        return fedray.Upload({name: tensor + torch.rand((), generator=context.generator)
                              for name, tensor in upload.tensors.items()}, upload.weight)


def test_the_random_draws_depend_on_the_seed_round_client_and_place_only():
    upload = fedray.Upload({"w": torch.zeros(())}, 3.0)
    draws = {(seed, number, client, index):
             float(Postprocessing((Marks(),) * (index + 1), seed).client(upload, client, number).tensors["w"])
             for seed in (0, 1) for number in (1, 2) for client in (3, 4) for index in (0, 1)}
    assert len(set(draws.values())) == len(draws)
    again = Postprocessing((Marks(),), 0).client(upload, 3, 1).tensors["w"]
    assert float(again) == draws[0, 1, 3, 0]
    assert Postprocessing((Marks(),), 0).aggregate(upload.tensors, 1, 5) is not upload.tensors  # the aggregate too
    assert Postprocessing((), 0).client(upload, 3, 1) is upload
    assert Postprocessing((), 0).aggregate(upload.tensors, 1, 5) is upload.tensors


class Weigh(fedray.Postprocessor):
    """Sets every upload's weight to ``weight`` and adds ``shift`` to its tensors; records what it was handed."""

    def __init__(self, weight: float | None = None, shift: float = 0.0) -> None:
        super().__init__()
        self.weight, self.shift, self.seen = weight, shift, []

    def client(self, upload, context):
        self.seen.append((upload.weight, context.sampling))
        weight = upload.weight if self.weight is None else self.weight
        return fedray.Upload({name: tensor + self.shift for name, tensor in upload.tensors.items()}, weight)


def test_a_client_hook_gets_the_upload_with_its_weight_and_the_stages_sampling():
    upload = fedray.Upload({"w": torch.ones(2)}, 7.0)
    weigh = Weigh(weight=1.0)
    processed = Postprocessing((weigh,), 0).sampled(9275, 10, True).client(upload, 3, 1)
    assert processed.weight == 1.0 and torch.equal(processed.tensors["w"], torch.ones(2))
    assert weigh.seen == [(7.0, Sampling(population=9275, per_round=10, replacement=True))]


def test_an_upload_no_hook_changed_is_the_same_object_and_a_changed_one_is_new():
    upload = fedray.Upload({"w": torch.tensor([-0.0, 1.0])}, 2.0)
    assert Postprocessing((Weigh(),), 0).client(upload, 3, 1) is upload     # + 0.0 turns −0.0 into 0.0: the original stays
    assert Postprocessing((Weigh(shift=1e-3),), 0).client(upload, 3, 1) is not upload
    assert Postprocessing((Weigh(weight=2.5),), 0).client(upload, 3, 1).weight == 2.5


def test_a_closed_form_upload_keeps_weight_one():
    from fedray.core.errors import FedrayError

    stats = Sums(torch.ones(2), torch.zeros(2, 3))
    assert Postprocessing((Weigh(),), 0).statistics(stats, 3, 1) is stats
    with pytest.raises(FedrayError, match=r"client returned an Upload of weight 2 \(round 1, client 3\); expected weight 1: "
                                          "a closed-form method's statistics are summed as they are"):
        Postprocessing((Weigh(weight=2),), 0).statistics(stats, 3, 1)


class ExactWeigh(Weigh):
    """:class:`Weigh` asking for exact sums, as secure aggregation does: a training upload reaches it weighted."""

    @property
    def exact_sum(self):
        return True


def test_an_exact_sums_hook_may_not_change_a_training_uploads_weight_and_says_why():
    from fedray.core.errors import FedrayError

    upload = fedray.Upload({"w": torch.ones(2)}, 3.0)
    with pytest.raises(FedrayError, match=r"^the plugin tests.methods.test_postprocessor:ExactWeigh: client returned "
                                          r"an Upload of weight 2.5 \(round 5, client 3\); expected weight 3 or 0 "
                                          r"\(dropped\): training round 5's update reaches --postprocessor ExactWeigh "
                                          r"\(exact_sum\) with its weight w_k already multiplied into its tensors"):
        Postprocessing((ExactWeigh(weight=2.5),), 0, first_round=4).client(upload, 3, 1)
    dropped = Postprocessing((ExactWeigh(weight=0.0),), 0).client(upload, 3, 1)
    assert dropped.weight == 0.0 and torch.equal(dropped.tensors["w"], torch.full((2,), 3.0, dtype=torch.float64))


class Denominator(fedray.Postprocessor):
    """Divides every training round's sum by ``weight``."""

    def __init__(self, weight: float = 0.0) -> None:
        super().__init__()
        self.weight = weight

    def aggregate_weight(self, weight, context):
        return self.weight


@pytest.mark.parametrize("weight", [0.0, -2.0])
def test_a_zero_or_negative_aggregate_weight_stops_in_one_line_naming_the_postprocessor(weight):
    from fedray.core.errors import FedrayError

    named = Postprocessing((Denominator(weight),), 0, names=("my.py:Denominator",), first_round=2)
    with pytest.raises(FedrayError, match=rf"^--postprocessor my.py:Denominator: aggregate_weight returned {weight} in "
                                          rf"training round 3 \(handed 12\); expected a finite weight > 0"):
        named.aggregate_weight(12.0, 1, 4)
    assert Postprocessing((Denominator(0.0),), 0).aggregate_weight(0.0, 1, 0) == 0.0  # nothing arrived: nothing changes
    assert Postprocessing((Denominator(2.5),), 0).aggregate_weight(0.0, 1, 0) == 2.5


def test_a_training_run_whose_postprocessor_divides_by_zero_stops_at_its_first_round(ray_session, tmp_path):
    from fedray.core.errors import FedrayError

    with pytest.raises(FedrayError, match=r"^--postprocessor tests.methods.test_postprocessor:Denominator: "
                                          r"aggregate_weight returned 0.0 in training round 1 \(handed \d+\)"):
        fedray.run(method="fedavg", dataset="synthetic:inat-geo-100?dim=8&scale=0.2&classes=6", out=tmp_path / "run",
                   postprocessor=Denominator, rounds=2, clients_per_round=4, num_shards=1, cpus_per_shard=0.5,
                   quiet=True)
    assert not (tmp_path / "run" / "metrics.parquet").exists()


def runs(tmp_path: Path, method: str, name: str, on_point=None, **values) -> tuple[list[dict], dict[str, np.ndarray]]:
    """The run's rows and its classifier's arrays; ``on_point`` hears each evaluation point with its classifier."""
    config = resolve({}, {"method": method, "dataset": DATASET, "out": str(tmp_path / name), "client_lr": 0.01,
                          "clients_per_round": 8, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True, **values},
                     drop_unused=True)  # client_lr applies to the training runs only
    run(config, on_point=on_point)
    rows = pq.read_table(tmp_path / name / "metrics.parquet").drop(["wall_s"]).to_pylist()
    keep = ("round", "accuracy", "bytes_up", "bytes_down", "train_loss", "clients_seen", "samples_seen")
    return [{key: row[key] for key in keep} for row in rows], dict(np.load(tmp_path / name / "classifier.npz"))


@pytest.mark.parametrize("method, values", [("fed3r", {"rounds": 6, "eval_every": 3}),
                                            ("fedavg", {"rounds": 4, "eval_every": 2})])
def test_noise_at_sigma_zero_is_the_plain_run_bit_for_bit(ray_session, tmp_path, method, values):
    plain = runs(tmp_path, method, "plain", **values)
    noiseless = runs(tmp_path, method, "noiseless", postprocessor=NOISE, options={"noise_std": 0.0}, **values)
    assert noiseless[0] == plain[0]
    assert noiseless[1].keys() == plain[1].keys()
    assert all(np.array_equal(noiseless[1][key], plain[1][key]) for key in plain[1])


def assert_gaussian(noise: np.ndarray, sigma: float) -> None:
    """Σ noise² / σ² is χ² with as many degrees of freedom as coordinates: inside its central 99.9%."""
    statistic = float(np.sum(noise.astype(np.float64) ** 2)) / sigma**2
    assert scipy.stats.chi2.ppf(0.0005, noise.size) < statistic < scipy.stats.chi2.ppf(0.9995, noise.size)
    assert abs(float(noise.mean())) < 4 * sigma / np.sqrt(noise.size)


def test_the_noise_on_a_closed_form_aggregate_has_variance_sigma_squared(ray_session, tmp_path):
    method = f"{__name__}:ClassSums"
    values = {"rounds": 5, "eval_every": 5}
    _, plain = runs(tmp_path, method, "plain", **values)
    _, noisy = runs(tmp_path, method, "noisy", postprocessor=NOISE, options={"noise_std": 2.0}, **values)
    assert_gaussian(noisy["W"] - plain["W"], 2.0)   # one evaluation block: one aggregate, W = its sums


def test_the_noise_on_a_training_round_has_variance_sigma_squared(ray_session, tmp_path):
    """One FedAvg round at η = 1: the head moves by the noisy sum over Σ n_k, so the difference is noise / Σ n_k."""
    values = {"rounds": 1, "eval_every": 1}
    rows, plain = runs(tmp_path, "fedavg", "plain", **values)
    _, noisy = runs(tmp_path, "fedavg", "noisy", postprocessor=NOISE, options={"noise_std": 3.0}, **values)
    samples = rows[-1]["samples_seen"]
    noise = np.concatenate([(noisy[key] - plain[key]).ravel() for key in ("W", "bias")]) * samples
    assert_gaussian(noise, 3.0)


def test_clipping_bounds_each_clients_upload_in_training_and_closed_form(ray_session, tmp_path):
    clip = 1e-3
    _, clipped = runs(tmp_path, "fedavg", "clipped", rounds=1, eval_every=1, client_lr=0.5, postprocessor=NOISE,
                      options={"clip": clip})
    heads = []
    _, unclipped = runs(tmp_path, "fedavg", "unclipped", rounds=1, eval_every=1, client_lr=0.5,
                        on_point=lambda point, classifier: heads.append(classifier))
    start = {"W": heads[0].weight.numpy(), "bias": heads[0].bias.numpy()}  # round 0's head: where both runs start
    moved = np.sqrt(sum(np.sum((clipped[key] - start[key]) ** 2) for key in ("W", "bias")))
    free = np.sqrt(sum(np.sum((unclipped[key] - start[key]) ** 2) for key in ("W", "bias")))
    assert moved <= clip * (1 + 1e-4) < free / 100   # a sample-weighted mean of updates of norm ≤ R has norm ≤ R
    method = f"{__name__}:ClassSums"
    _, sums = runs(tmp_path, method, "sums", rounds=2, eval_every=2, postprocessor=NOISE, options={"clip": clip})
    clients = 16
    # each client's (counts, sums) was clipped to norm R, so the sums of the 16 clients are within 16 R
    assert np.linalg.norm(sums["W"]) <= clients * clip * (1 + 1e-9)


def test_a_postprocessor_is_checked_before_any_work():
    from fedray.core.errors import FedrayError
    from fedray.engine.plan import postprocessing

    with pytest.raises(FedrayError, match="option noise_std must be ≥ 0"):
        postprocessing(resolve({}, {"method": "fed3r", "postprocessor": NOISE, "options": {"noise_std": "-1"}}))
    with pytest.raises(FedrayError, match="unknown postprocessor 'gaussian'; built-in: .*; or your own fedray.Postprocessor"):
        resolve({}, {"method": "fed3r", "postprocessor": "gaussian"})
    assert isinstance(UploadContext(AGGREGATE, 1, 2, torch.Generator()).generator, torch.Generator)


def test_an_upload_contexts_generator_is_made_only_when_a_hook_reads_it():
    made = []
    context = UploadContext(3, 1, 1, lambda: made.append(1) or torch.Generator().manual_seed(7))
    assert made == [] and context.client == 3
    generator = context.generator
    assert made == [1] and context.generator is generator
    assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=torch.Generator().manual_seed(7)))


class Halve(fedray.Postprocessor):
    """Each value halved, on its own (0 to 0), or as float32 where ``bad``."""

    def __init__(self, bad: bool = False) -> None:
        super().__init__()
        self.bad = bad

    @property
    def entrywise(self) -> bool:
        return True

    def client(self, upload: fedray.Upload, context: UploadContext) -> fedray.Upload:
        return fedray.Upload({name: tensor / 2 for name, tensor in upload.tensors.items()}, upload.weight)

    def entry_map(self, context: UploadContext):
        return (lambda values: (values / 2).float()) if self.bad else (lambda values: values / 2)


class HalveClipped(Halve):
    def features(self, features: torch.Tensor) -> torch.Tensor:
        return features.clamp(-1, 1)


@pytest.mark.parametrize("postprocessors, entrywise", [
    ((Halve(),), True), ((Halve(), Weigh()), False), ((HalveClipped(),), False), ((Denominator(),), False),
    ((Halve(), Denominator()), True)])
def test_uploads_are_mapped_value_by_value_only_where_every_postprocessor_that_changes_them_does(postprocessors,
                                                                                                 entrywise):
    assert Postprocessing(postprocessors).entrywise == entrywise


def test_entry_maps_are_the_postprocessors_maps_in_order_each_clients_own_each_checked():
    from fedray.core.errors import FedrayError

    values, counts = torch.tensor([2.0, 0.0, -6.0, 1.0, 3.0], dtype=torch.float64), torch.tensor([3, 0, 2])
    assert torch.equal(Postprocessing((Halve(), Offset())).entry_maps([3, 4, 5], [1, 1, 2])(values, counts),
                       torch.tensor([1.0, 0.0, -3.0, 0.5, 1.5], dtype=torch.float64)
                       + torch.tensor([0.03, 0.03, 0.03, 0.05, 0.05], dtype=torch.float64))
    with pytest.raises(FedrayError, match=r"^--postprocessor halve: entry_maps' map returned torch.float32 \(5,\) "
                                          r"for 3 clients \(client 3 of round 1 first\); expected float64 \(5,\), like "
                                          r"the values it got$"):
        Postprocessing((Halve(), Halve(bad=True)), names=("halve", "halve")).entry_maps([3, 4, 5], [1, 1, 2])(values,
                                                                                                             counts)


class Offset(Halve):
    """Each value of client k plus k / 100: each client's own map (``entry_maps`` is :class:`fedray.Postprocessor`'s,
    client by client)."""

    def entry_map(self, context: UploadContext):
        return lambda values: values + context.client / 100


class Handshake(fedray.Postprocessor):
    """A protocol of two messages: 10 multiply-adds and 8 bytes received a participant, its upload sent with 16 more."""

    def protocol_cost(self, participants, values):
        return fedray.TaskCost(10.0, 8.0, 4.0 * values + 16)


class Wrong(fedray.Postprocessor):
    def protocol_cost(self, participants, values):
        return fedray.TaskCost(np.ones(participants))


def test_the_protocols_costs_add_up_and_the_last_ones_upload_is_sent():
    """The identity has no protocol; two handshakes add their work and received bytes, the second's upload is sent."""
    assert Postprocessing([fedray.Postprocessor()]).protocol_cost(5, 3) is None
    cost = Postprocessing([Handshake(), fedray.Postprocessor(), Handshake()]).protocol_cost(5, 3)
    assert (cost.macs, cost.down_bytes, cost.up_bytes) == (20.0, 16.0, 28.0)
    from fedray.core.errors import FedrayError

    with pytest.raises(FedrayError, match=r"^--postprocessor w.py:Wrong: protocol_cost returned TaskCost\(.*\); expected "
                                          r"a TaskCost of one amount each \(a participant's\), or None$"):
        Postprocessing([Wrong()], names=["w.py:Wrong"]).protocol_cost(5, 3)
