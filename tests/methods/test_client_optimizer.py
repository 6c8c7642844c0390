"""The clients' local SGD as a component: built from its declared options, which it checks itself."""

import pytest

from fedray.core.errors import FedrayError
from fedray.core.options import build, options_of
from fedray.methods.training.client_optimizer import ClientOptimizer
from fedray.methods.training.local import LocalSGD
from fedray.methods.training.schedule import LrSchedule


def test_it_builds_the_local_sgd_its_options_say():
    options = ClientOptimizer(client_lr=0.5, weight_decay=0.0, batch_size=8, local_epochs=2, client_momentum=0.9,
                              lr_schedule="step", lr_milestones="3,6", lr_gamma=0.5, temperature=0.1)
    assert options.local_sgd(rounds=10) == LocalSGD(lr=0.5, weight_decay=0.0, batch_size=8, epochs=2, prox_mu=0.0,
                                                    temperature=0.1, momentum=0.9,
                                                    schedule=LrSchedule("step", 10, (3, 6), 0.5))
    assert ClientOptimizer().local_sgd(rounds=None) == LocalSGD()  # Fed3R Appendix C's defaults, one way


def test_its_options_are_typed_with_choices_from_the_declaration():
    declared = options_of(ClientOptimizer)
    assert list(declared) == ["client_lr", "weight_decay", "batch_size", "local_epochs", "client_momentum",
                              "lr_schedule", "lr_milestones", "lr_gamma", "temperature"]
    assert declared["lr_schedule"].choices == ("constant", "cosine", "step")
    assert (declared["lr_milestones"].optional, declared["lr_milestones"].metavar) == (True, "R1,R2,...")
    assert build(ClientOptimizer, {"client_lr": "0.25", "lam": 1.0}, "local SGD").client_lr == 0.25


@pytest.mark.parametrize("values, message", [
    ({"client_lr": 0.0}, "--client-lr must be > 0, got 0.0"),
    ({"batch_size": 0}, "--batch-size must be > 0, got 0"),
    ({"client_momentum": 1.0}, "--client-momentum must be in [0, 1), got 1.0"),
    ({"lr_schedule": "linear"}, "--lr-schedule must be one of constant, cosine, step, got 'linear'"),
    ({"lr_milestones": "5"}, "--lr-schedule step needs --lr-milestones, and --lr-milestones applies to step only"),
    ({"lr_schedule": "step", "lr_milestones": "0,5"}, "--lr-milestones takes comma-separated training rounds ≥ 1"),
])
def test_it_refuses_bad_options_in_one_line(values, message):
    with pytest.raises(FedrayError, match=f"^{message}".replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ClientOptimizer(**values)


def test_a_cosine_spans_the_runs_rounds():
    with pytest.raises(FedrayError, match="^--lr-schedule cosine anneals over the run's training rounds: give --rounds"):
        ClientOptimizer(lr_schedule="cosine").schedule(None)
    assert ClientOptimizer(lr_schedule="cosine").schedule(4) == LrSchedule("cosine", 4)
