"""A plugin's wrong output, or a plugin that cannot load, is refused in one line naming the plugin, the method and what
was expected, and the run writes no results.

The plugins are small classes in files the tests write; each run is a few rounds of a tiny federation.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedray.app.cli import main

SPEC = "synthetic:inat-geo-100?dim=8&scale=0.2&classes=6"
DIM, CLASSES = 8, 6
SMALL_RUN = ["--num-shards", "1", "--cpus-per-shard", "0.5", "--quiet"]
CLOSED_FORM = ["--rounds", "4", "--eval-every", "2"]
TRAINING = ["--rounds", "2", "--eval-every", "1", "--client-lr", "0.01"]

CLOSED_FORM_PLUGINS = '''
import torch
import fedray


class NCM(fedray.ClosedFormMethod):
    def client_statistics(self, batch):
        counts = torch.bincount(batch.labels, minlength=self.num_classes).double()
        sums = torch.zeros(self.num_classes, self.dim, dtype=torch.float64).index_add_(0, batch.labels, batch.features.double())
        return counts, sums

    def combine(self, a, b):
        return a[0] + b[0], a[1] + b[1]

    def solve(self, stats):
        return fedray.Classifier((stats[1] / stats[0].clamp(min=1)[:, None]).T)


class NanClassifier(NCM):
    def solve(self, stats):
        return fedray.Classifier(torch.full((self.dim, self.num_classes), float("nan")))


class NanStatistics(NCM):
    def client_statistics(self, batch):
        counts, sums = super().client_statistics(batch)
        return counts, sums * float("inf")


class WrongShape(NCM):
    def solve(self, stats):
        return fedray.Classifier(torch.zeros(self.num_classes, self.dim))


class WrongBias(NCM):
    def solve(self, stats):
        return fedray.Classifier(torch.zeros(self.dim, self.num_classes), torch.zeros(self.num_classes + 1))


class BareTensor(NCM):
    def solve(self, stats):
        return torch.zeros(self.dim, self.num_classes)


class NoClassifier(NCM):
    def solve(self, stats):
        pass


class ShapeOfTheClients(NCM):
    """Statistics whose shape depends on the clients they hold (no client uploads twice): they cannot be added."""

    def client_statistics(self, batch):
        return batch.features.double().sum(0), torch.ones(1 + int(batch.clients.min()), dtype=torch.float64)

    def solve(self, stats):
        return fedray.Classifier(torch.zeros(self.dim, self.num_classes))


class HalvingCombine(NCM):
    def combine(self, a, b):
        return a[0] + b[0], (a[1] + b[1])[: self.num_classes // 2]
'''

TRAINING_PLUGINS = '''
from dataclasses import dataclass

import torch
import fedray


def plus_delta(params, delta):
    return {name: params[name] + change for name, change in delta.items()}


class NoStep(fedray.ServerOptimizer):
    def step(self, params, delta):
        return {}


class SummedStep(fedray.ServerOptimizer):
    def step(self, params, delta):
        return {name: value.sum(0) for name, value in plus_delta(params, delta).items()}


class CountingStep(fedray.ServerOptimizer):
    def step(self, params, delta):
        self.state["steps"] = {"count": self.state.get("steps", {}).get("count", 0) + 1}
        return plus_delta(params, delta)


@dataclass(frozen=True)
class PartialDelta(fedray.FederatedAlgorithm):
    def server_update(self, params, total, state, population):
        return {"weight": total.sums["weight"] / total.weight}, state


@dataclass(frozen=True)
class DeltaOnly(fedray.FederatedAlgorithm):
    def server_update(self, params, total, state, population):
        return super().server_update(params, total, state, population)[0]


@dataclass(frozen=True)
class NumberState(fedray.FederatedAlgorithm):
    def init_server_state(self, params):
        return {"rounds": 0}


@dataclass(frozen=True)
class NumberBroadcast(fedray.FederatedAlgorithm):
    def broadcast(self, params, state):
        return {"lr": 0.1}


@dataclass(frozen=True)
class TransposedUpload(fedray.FederatedAlgorithm):
    def upload(self, client, trained):
        upload, state = super().upload(client, trained)
        return fedray.Upload({**upload.tensors, "weight": upload.tensors["weight"].T.contiguous()}, upload.weight), state


@dataclass(frozen=True)
class FloatLoss(fedray.FederatedAlgorithm):
    def loss(self, output, labels, params, client):
        return float(super().loss(output, labels, params, client))


@dataclass(frozen=True)
class VectorLoss(fedray.FederatedAlgorithm):
    def loss(self, output, labels, params, client):
        return super().loss(output, labels, params, client).repeat(2)


@dataclass(frozen=True)
class ConstantLoss(fedray.FederatedAlgorithm):
    def loss(self, output, labels, params, client):
        return torch.tensor(1.0)


@dataclass(frozen=True)
class ListClientState(fedray.FederatedAlgorithm):
    def init_client_state(self, start):
        return [torch.zeros(1)]


@dataclass(frozen=True)
class BareUpload(fedray.FederatedAlgorithm):
    def upload(self, client, trained):
        return {name: trained[name] - client.start[name] for name in trained}


@dataclass(frozen=True)
class ZeroWeight(fedray.FederatedAlgorithm):
    def upload(self, client, trained):
        upload, state = super().upload(client, trained)
        return fedray.Upload(upload.tensors, 0.0), state


@dataclass(frozen=True)
class NanWeight(fedray.FederatedAlgorithm):
    def upload(self, client, trained):
        upload, state = super().upload(client, trained)
        return fedray.Upload(upload.tensors, float("nan")), state


@dataclass(frozen=True)
class NumberClientState(fedray.FederatedAlgorithm):
    def upload(self, client, trained):
        upload, _ = super().upload(client, trained)
        return upload, {"participations": 1}


@dataclass(frozen=True)
class OddClientsSendMore(fedray.FederatedAlgorithm):
    def upload(self, client, trained):
        upload, state = super().upload(client, trained)
        extra = {"norm": torch.ones(1)} if client.client % 2 else {}
        return fedray.Upload({**upload.tensors, **extra}, upload.weight), state


@dataclass(frozen=True)
class ReportsFromClients(fedray.FederatedAlgorithm):
    def upload(self, client, trained):
        fedray.report(steps=client.local_steps)
        return super().upload(client, trained)


class DropsUploads(fedray.Postprocessor):
    def client(self, upload, context):
        return fedray.Upload({}, upload.weight)


class ReturnsTensors(fedray.Postprocessor):
    def client(self, upload, context):
        return upload.tensors


class NanUploads(fedray.Postprocessor):
    def client(self, upload, context):
        return fedray.Upload({name: tensor * float("nan") for name, tensor in upload.tensors.items()}, upload.weight)


class NanSum(fedray.Postprocessor):
    def aggregate(self, total, context):
        return {name: tensor * float("nan") for name, tensor in total.items()}


class IntegerUploads(fedray.Postprocessor):
    def client(self, upload, context):
        return fedray.Upload({name: tensor.round().long() for name, tensor in upload.tensors.items()}, upload.weight)


class FloatUploads(fedray.Postprocessor):
    def client(self, upload, context):
        return fedray.Upload({name: tensor.double() for name, tensor in upload.tensors.items()}, upload.weight)


class WeighsNothing(fedray.Postprocessor):
    def client(self, upload, context):
        return fedray.Upload(upload.tensors, 0.0)


class FirstRowOfTheSum(fedray.Postprocessor):
    def aggregate(self, total, context):
        return {name: value[:1] for name, value in total.items()}


class CountsInState(fedray.Postprocessor):
    def aggregate(self, total, context):
        self.state = {"aggregates": 1}
        return total
'''


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "closed_form.py").write_text(CLOSED_FORM_PLUGINS)
    (folder / "training.py").write_text(TRAINING_PLUGINS)
    return folder


def refused(capsys, out: Path, *args: object) -> str:
    """The one line of a run refused with exit code 2 (its message after ``fedray: error: ``), which wrote no results."""
    capsys.readouterr()
    rc = main(["run", "--dataset", SPEC, "--out", str(out), *SMALL_RUN, *map(str, args)])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("fedray: error: ") and err.count("\n") == 1, err
    assert not (out / "metrics.parquet").exists() and not (out / "classifier.npz").exists()
    return err.removeprefix("fedray: error: ").rstrip("\n")


@pytest.mark.parametrize("plugin, message", [
    ("NanClassifier", "solve returned a classifier with NaN or inf in its weight after round 2 (its statistics are finite); "
                      "expected finite values"),
    ("NanStatistics", "solve returned a classifier with NaN or inf in its weight after round 2 (its statistics already hold "
                      "NaN or inf: from client_statistics or combine); expected finite values"),
])
def test_a_non_finite_classifier_is_refused_naming_the_plugin_and_the_round(ray_session, plugins, tmp_path, capsys,
                                                                            plugin, message):
    spec = f"{plugins / 'closed_form.py'}:{plugin}"
    assert refused(capsys, tmp_path, "--method", spec, *CLOSED_FORM) == f"the plugin {spec}: {message}"


@pytest.mark.parametrize("plugin, message", [
    ("WrongShape", f"solve returned a classifier whose weight is a Tensor of shape ({CLASSES}, {DIM}) after round 2; "
                   f"expected a fedray.Classifier with a ({DIM}, {CLASSES}) weight (features × classes)"),
    ("WrongBias", f"solve returned a classifier whose bias is a Tensor of shape ({CLASSES + 1},) after round 2; "
                  f"expected no bias or one of shape ({CLASSES},)"),
    ("BareTensor", f"solve returned a Tensor of shape ({DIM}, {CLASSES}) after round 2; "
                   f"expected a fedray.Classifier with a ({DIM}, {CLASSES}) weight (features × classes)"),
    ("NoClassifier", f"solve returned None after round 2; "
                     f"expected a fedray.Classifier with a ({DIM}, {CLASSES}) weight (features × classes)"),
    ("HalvingCombine", f"combine returned statistics of another shape than its arguments' (the tensor at '1' is "
                       f"({CLASSES}, {DIM}) in one and ({CLASSES // 2}, {DIM}) in another); expected the shapes of its arguments"),
])
def test_a_wrong_classifier_or_statistics_is_refused_naming_the_plugin_and_the_method(ray_session, plugins, tmp_path,
                                                                                        capsys, plugin, message):
    spec = f"{plugins / 'closed_form.py'}:{plugin}"
    assert refused(capsys, tmp_path, "--method", spec, *CLOSED_FORM) == f"the plugin {spec}: {message}"


def test_statistics_that_change_shape_from_client_to_client_are_refused(ray_session, plugins, tmp_path, capsys):
    spec = f"{plugins / 'closed_form.py'}:ShapeOfTheClients"
    line = refused(capsys, tmp_path, "--method", spec, *CLOSED_FORM)
    assert re.fullmatch(re.escape(f"the plugin {spec}: client_statistics returned statistics of changing shape (the tensor "
                                  "at '1' is (") + r"\d+,\) in one and \(\d+,\) in another\); " + re.escape(
        "expected the same shapes from every client and round (they are added; what grows with the clients goes in a "
        "list, as FedCOF's received means)"), line), line


@pytest.mark.parametrize("plugin, message", [
    ("NoStep", "step returned an empty dict; expected the next values of Δ's parameters: a dict of tensors named bias, "
               "weight with their shapes"),
    ("SummedStep", f"step returned weight of shape ({CLASSES},); expected the next values of Δ's parameters: weight of "
                   f"shape ({DIM}, {CLASSES})"),
])
def test_a_server_step_of_other_parameters_is_refused(ray_session, plugins, tmp_path, capsys, plugin, message):
    spec = f"{plugins / 'training.py'}:{plugin}"
    line = refused(capsys, tmp_path, "--method", "fedavg", "--server-optimizer", spec, *TRAINING)
    assert line == f"the plugin {spec}: {message}"


def test_a_server_optimizer_state_that_checkpoints_cannot_hold_is_refused_before_the_checkpoint(ray_session, plugins,
                                                                                               tmp_path, capsys):
    spec = f"{plugins / 'training.py'}:CountingStep"
    line = refused(capsys, tmp_path, "--method", "fedavg", "--server-optimizer", spec, "--checkpoint-every", "1", *TRAINING)
    assert line == f"the plugin {spec}: its state holds an int at steps.count after step; expected tensors in dicts by " \
        "name (checkpoints save it)"
    assert not (tmp_path / "checkpoint.pt").exists()


@pytest.mark.parametrize("plugin, message", [
    ("PartialDelta", "server_update returned tensors without bias; expected Δ for the model's parameters: a dict of "
                     "tensors named bias, weight with their shapes"),
    ("DeltaOnly", "server_update returned a dict; expected (Δ, the server's next state): a pair of dicts of tensors"),
    ("TransposedUpload", "upload (averaged by the default server_update) returned weight of shape (6, 8); expected Δ "
                         "for the model's parameters: weight of shape (8, 6)"),
    ("NumberState", "init_server_state returned a dict holding an int at 'rounds'; expected a dict of tensors by name"),
    ("NumberBroadcast", "broadcast returned a dict holding a float at 'lr'; expected a dict of tensors by name"),
])
def test_a_training_algorithms_wrong_server_half_is_refused(ray_session, plugins, tmp_path, capsys, plugin, message):
    spec = f"{plugins / 'training.py'}:{plugin}"
    assert refused(capsys, tmp_path, "--method", spec, *TRAINING) == f"the plugin {spec}: {message}"


LOSS = "one number as a tensor computed from the parameters (a 0-dim tensor autograd can differentiate)"


@pytest.mark.parametrize("plugin, message", [
    ("ListClientState", "init_client_state returned a list; expected None or a dict of tensors by name"),
    ("FloatLoss", f"loss returned a float; expected {LOSS}"),
    ("VectorLoss", f"loss returned a Tensor of shape (2,); expected {LOSS}"),
    ("ConstantLoss", f"loss returned a tensor that does not depend on the parameters (no grad_fn); expected {LOSS}"),
    ("BareUpload", "upload returned a dict; expected (fedray.Upload(tensors, weight), the client's next state or None)"),
    ("ZeroWeight", "upload returned an Upload of weight 0.0; expected a finite number > 0 as fedray.Upload's weight"),
    ("NanWeight", "upload returned an Upload of weight nan; expected a finite number > 0 as fedray.Upload's weight"),
    ("NumberClientState", "upload returned a dict holding an int at 'participations'; expected the client's next state "
                          "as its second item: None or a dict of tensors by name"),
])
def test_a_training_algorithms_wrong_client_half_is_refused_from_the_shards(ray_session, plugins, tmp_path, capsys,
                                                                           plugin, message):
    """These run in the shards (each client by autograd): the plugin is named by its file there too."""
    spec = f"{plugins / 'training.py'}:{plugin}"
    assert refused(capsys, tmp_path, "--method", spec, *TRAINING) == f"the plugin {spec}: {message}"


def test_uploads_of_other_names_than_the_other_clients_are_refused(ray_session, plugins, tmp_path, capsys):
    spec = f"{plugins / 'training.py'}:OddClientsSendMore"
    line = refused(capsys, tmp_path, "--method", spec, *TRAINING)
    assert line in {f"the plugin {spec}: upload returned tensors with norm too; expected what the other clients upload: "
                    "a dict of tensors named bias, weight with their shapes",
                    f"the plugin {spec}: upload returned tensors without norm; expected what the other clients upload: "
                    "a dict of tensors named bias, norm, weight with their shapes"}, line


# A closed form takes a leaf's uploading clients in id order (fedray.runtime.fixed_tree), so the first upload refused
# is the block's lowest-numbered client, here one of round 2's; training's are refused in round order.
@pytest.mark.parametrize("method, plugin, message", [
    ("fed3r", "DropsUploads", "client returned an empty dict; expected the upload's tensors: a dict of tensors named "
                              "gram, targets with their shapes"),
    ("fed3r", "ReturnsTensors", "client returned a dict (round 2, client K); expected the fedray.Upload it got, or a new "
                                "one (tensors and weight)"),
    ("fed3r", "NanUploads", "client returned gram with NaN or inf (round 2, client K; it got finite values); expected "
                            "finite values"),
    ("fedncm", "NanSum", "aggregate returned counts with NaN or inf (round 2; it got finite values); expected finite values"),
    ("fed3r", "IntegerUploads", "client returned gram of dtype torch.int64 (round 2, client K); expected gram of dtype "
                                "torch.float64, as it got"),
    ("fedcof", "FloatUploads", "client returned blocks.0.classes of dtype torch.float64 (round 2, client K); expected "
                               "blocks.0.classes of dtype torch.int64, as it got"),
    ("fedavg", "WeighsNothing", "client returned an Upload of weight 0.0 (round 1, client K); expected a finite number > 0 as "
                             "its weight"),
    ("fedavg", "NanUploads", "client returned weight with NaN or inf (round 1, client K; it got finite values); expected "
                             "finite values"),
    ("fedavg", "FirstRowOfTheSum", f"aggregate returned weight of shape (1, {CLASSES}); expected the sum's tensors: "
                                   f"weight of shape ({DIM}, {CLASSES})"),
    ("fedavg", "CountsInState", "its state holds an int at aggregates after aggregate; expected tensors by name "
                                "(checkpoints save it)"),
])
def test_a_postprocessor_must_return_the_names_and_shapes_it_got(ray_session, plugins, tmp_path, capsys, method, plugin,
                                                                 message):
    spec = f"{plugins / 'training.py'}:{plugin}"
    rounds = TRAINING if method == "fedavg" else CLOSED_FORM
    line = refused(capsys, tmp_path, "--method", method, "--postprocessor", spec, *rounds)
    assert re.sub(r"client \d+", "client K", line) == f"the plugin {spec}: {message}"   # K: the round's first client


# --- plugins that cannot load: refused before Ray starts, nothing written


ABSTRACT = "import fedray\n\n\nclass HalfDone(fedray.ClosedFormMethod):\n    def solve(self, stats):\n        pass\n"
UNDECORATED_ALGORITHM = '''
import fedray


class OwnConstructor(fedray.FederatedAlgorithm):
    def __init__(self, mu=0.1):
        object.__setattr__(self, "mu", mu)


class Undecorated(fedray.FederatedAlgorithm):
    alpha: float = 0.01
'''


def refused_to_load(capsys, out: Path, *args: object) -> str:
    line = refused(capsys, out, *args)
    assert not out.exists()
    return line


@pytest.mark.parametrize("source, message", [
    ("import fedray\n\nclass Broken(fedray.ClosedFormMethod:\n    pass\n",
     "the plugin failed to load (SyntaxError: invalid syntax ({name}, line 3))"),
    ("raise RuntimeError('no GPU here')\n", "the plugin failed to load (RuntimeError: no GPU here, at {path}:1)"),
    ("import sys\n\nsys.exit(3)\n", "the plugin failed to load (it called sys.exit(3) while loading)"),
])
def test_a_plugin_file_that_fails_to_load_is_one_line(tmp_path, capsys, source, message):
    path = tmp_path / "broken_file_plugin.py"
    path.write_text(source)
    line = refused_to_load(capsys, tmp_path / "out", "--method", f"{path}:Broken")
    assert line == f"{path}: " + message.format(name=path.name, path=path)


@pytest.mark.parametrize("module, source, message", [
    ("syntax_error_plugin", "import fedray\n\nclass Broken(fedray.ClosedFormMethod:\n    pass\n",
     "SyntaxError: invalid syntax (syntax_error_plugin.py, line 3)"),
    ("raising_plugin", "\nraise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here, at {path}:2"),
    ("exiting_plugin", "import sys\n\nsys.exit()\n", "it called sys.exit(None) while loading"),
])
def test_a_plugin_module_that_fails_to_import_is_one_line(tmp_path, capsys, monkeypatch, module, source, message):
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = refused_to_load(capsys, tmp_path / "out", "--method", f"{module}:Broken")
    assert line == f"{module}:Broken: cannot import {module} (" + message.format(path=tmp_path / f"{module}.py") + ")"


def test_an_abstract_method_is_one_line(tmp_path, capsys):
    (tmp_path / "abstract.py").write_text(ABSTRACT)
    spec = f"{tmp_path / 'abstract.py'}:HalfDone"
    assert refused_to_load(capsys, tmp_path / "out", "--method", spec) == \
        f"{spec}: HalfDone is abstract: it does not define client_statistics, combine, which a subclass of " \
        "fedray.ClosedFormMethod must"
    assert refused_to_load(capsys, tmp_path / "out", "--method", "fedray:ClosedFormMethod") == \
        "fedray:ClosedFormMethod: ClosedFormMethod is abstract: it does not define client_statistics, combine, solve, " \
        "which a subclass of fedray.ClosedFormMethod must"


@pytest.mark.parametrize("name", ["OwnConstructor", "Undecorated"])
def test_a_training_algorithm_that_is_not_a_dataclass_is_one_line_naming_that(tmp_path, capsys, name):
    """It was refused as "not a subclass of fedray.ClosedFormMethod": a training algorithm that failed to load was
    taken for a closed-form method."""
    (tmp_path / "undecorated.py").write_text(UNDECORATED_ALGORITHM)
    spec = f"{tmp_path / 'undecorated.py'}:{name}"
    assert refused_to_load(capsys, tmp_path / "out", "--method", spec) == \
        f"{spec}: {name} is not a dataclass: decorate it with @dataclass(frozen=True), as " \
        "fedray.FederatedAlgorithm is (its fields with defaults are its options)"


def test_a_number_reported_from_a_clients_hook_is_refused_in_one_line(ray_session, plugins, tmp_path, capsys):
    spec = f"{plugins / 'training.py'}:ReportsFromClients"
    assert refused(capsys, tmp_path, "--method", spec, *TRAINING) == (
        "fedray.report(...) is for the server's hooks (server_update, a server optimizer's step, a postprocessor's "
        "aggregate, solve); a client's quantity goes up in its upload")
