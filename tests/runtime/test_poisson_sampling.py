"""--sampling poisson: every client in every round independently with probability q = κ/K (binomial tests on the
participation counts, the round sizes and pairs of clients and rounds), reproducible, read in any order, refused in one
line where it does not apply, and empty rounds a no-op step on every training path."""

from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.stats

import fedray

from fedray.core.errors import FedrayError
from fedray.engine.config import resolve
from fedray.engine.run_config import run
from fedray.runtime import sampling

K, KAPPA, ROUNDS = 60, 6, 6000
Q = KAPPA / K
ALPHA = 1e-4


def participation(seed: int = 0) -> np.ndarray:
    """``ROUNDS`` × K: whether each client took part in each round."""
    rounds = sampling.schedule(K, KAPPA, True, seed, ROUNDS, past_coverage=True, poisson=True)
    taken = np.zeros((ROUNDS, K), dtype=bool)
    for number, clients in enumerate(rounds):
        assert len(np.unique(clients)) == len(clients)
        taken[number, clients] = True
    return taken


def test_each_client_takes_part_in_each_round_with_probability_q():
    """Each client's count is Binomial(T, q) (every client tested, Bonferroni), and the counts over all clients a
    Binomial(T·K, q)."""
    taken = participation()
    for count in taken.sum(axis=0):
        assert scipy.stats.binomtest(int(count), ROUNDS, Q).pvalue > ALPHA / K
    assert scipy.stats.binomtest(int(taken.sum()), ROUNDS * K, Q).pvalue > ALPHA


def test_round_sizes_are_binomial_and_rounds_can_be_empty():
    """A chi-square test of the sizes against Binomial(K, q) (a fixed-size κ would fail it), empty rounds among them."""
    sizes = participation().sum(axis=1)
    pmf = scipy.stats.binom(K, Q).pmf(np.arange(K + 1))
    bins = [range(0, 3), *[range(m, m + 1) for m in range(3, 11)], range(11, K + 1)]
    observed = [int(np.isin(sizes, list(b)).sum()) for b in bins]
    expected = [ROUNDS * pmf[list(b)].sum() for b in bins]
    assert scipy.stats.chisquare(observed, expected).pvalue > ALPHA
    assert (sizes == 0).sum() > 0


def test_clients_and_rounds_are_independent():
    """Two given clients in the same round: Binomial(T, q²); a client in two consecutive rounds: Binomial(T − 1, q²)."""
    taken = participation(seed=5)
    for a, b in [(0, 1), (7, 42), (58, 59)]:
        assert scipy.stats.binomtest(int((taken[:, a] & taken[:, b]).sum()), ROUNDS, Q * Q).pvalue > ALPHA
    for client in (0, 30):
        both = int((taken[1:, client] & taken[:-1, client]).sum())
        assert scipy.stats.binomtest(both, ROUNDS - 1, Q * Q).pvalue > ALPHA


def test_a_schedule_is_reproducible_a_prefix_of_a_longer_one_and_read_in_any_order():
    longer = sampling.schedule(K, KAPPA, True, 3, 3000, past_coverage=True, poisson=True)
    shorter = sampling.schedule(K, KAPPA, True, 3, 1500, past_coverage=True, poisson=True)
    in_order = [clients.copy() for clients in longer]
    assert all(np.array_equal(a, b) for a, b in zip(shorter, in_order))
    again = sampling.schedule(K, KAPPA, True, 3, 3000, past_coverage=True, poisson=True)
    for number in np.random.default_rng(0).permutation(3000)[:300]:
        assert np.array_equal(again[int(number)], in_order[number])
    other = sampling.schedule(K, KAPPA, True, 4, 3000, past_coverage=True, poisson=True)
    assert not all(np.array_equal(a, b) for a, b in zip(other, in_order))


def test_until_every_client_was_seen_and_coverage():
    rounds = sampling.schedule(K, KAPPA, True, 1, poisson=True)
    seen = np.zeros(K, dtype=bool)
    for clients in rounds[:-1]:
        seen[clients] = True
    assert not seen.all()
    seen[rounds[-1]] = True
    assert seen.all()
    everyone = sampling.coverage(10, 10, True, 5, 0, poisson=True)  # q = 1: every client in the first round
    assert everyone == {f: (1.0, 0.0) for f in (0.25, 0.5, 0.75, 1.0)}
    mean, _ = sampling.coverage(K, KAPPA, True, 200, 0, fractions=(1 / K,), poisson=True)[1 / K]
    assert abs(mean - 1 / (1 - (1 - Q) ** K)) < 0.05  # the first round with anyone in it: geometric


DATASET = "synthetic:inat-geo-100?dim=24&scale=0.3&classes=20"


@pytest.mark.parametrize("options, error", [
    ({"method": "fed3r"}, "--sampling poisson applies to training rounds, not to --method fed3r's closed form"),
    ({"method": "fedavg", "init": "fed3r"}, "--sampling poisson applies to training rounds, not to --init fed3r's"),
    ({"method": "tct"}, "--sampling poisson is not supported with --method tct yet"),
    ({"method": "fedavg", "finetune": "ftlp", "dataset": "imagefolder:/nonexistent"},
     "--sampling poisson is not supported with --finetune yet"),
])
def test_poisson_sampling_is_refused_where_it_does_not_apply(tmp_path, options, error):
    with pytest.raises(FedrayError, match=error.replace("(", r"\(")) as raised:
        resolve({}, {"dataset": DATASET, "out": str(tmp_path / "out"), "sampling": "poisson", **options})
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["fedavg", "scaffold", "fednova", "feddyn", "fedadam"])
def test_empty_rounds_are_a_no_op_step_on_every_training_path(ray_session, tmp_path, method):
    """κ = 1 of 100 clients: about a third of the rounds are empty. The run completes; a stretch of empty rounds between
    two rows leaves the model as it was (the same accuracy), and so does a run whose every round is empty."""
    config = resolve({}, {"method": method, "dataset": DATASET, "out": str(tmp_path / method), "clients_per_round": 1,
                          "rounds": 12, "eval_every": 1, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
                          "sampling": "poisson"})
    run(config)
    rows = pq.read_table(tmp_path / method / "metrics.parquet").to_pylist()
    rounds = sampling.schedule(100, 1, True, 0, 12, past_coverage=True, poisson=True)
    empty = [number + 1 for number, clients in enumerate(rounds) if len(clients) == 0]
    assert len(rows) == 13 and len(empty) >= 3
    assert all(np.isfinite(row["accuracy"]) for row in rows)
    for number in empty:
        assert rows[number]["accuracy"] == rows[number - 1]["accuracy"]


@dataclass(frozen=True)
class ReadsItsUpload(fedray.FederatedAlgorithm):
    """FedAvg whose upload reads a value out of its update (``.item()``), which PyTorch's meta device has not."""

    def upload(self, client, trained):
        upload, state = super().upload(client, trained)
        largest = max(float(tensor.abs().max().item()) for tensor in upload.tensors.values())
        return fedray.Upload({name: tensor / max(largest, 1.0) for name, tensor in upload.tensors.items()},
                             upload.weight), state


class Unchanged(fedray.Postprocessor):
    """Changes nothing: a postprocessor, so that an empty round's sum of zeros is made."""


def test_an_upload_the_meta_device_cannot_run_stops_at_the_first_empty_round_in_one_line(ray_session, tmp_path):
    config = resolve({}, {"method": f"{__name__}:ReadsItsUpload", "dataset": DATASET, "out": str(tmp_path / "out"),
                          "clients_per_round": 1, "rounds": 30, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
                          "sampling": "poisson", "postprocessor": f"{__name__}:Unchanged"}, drop_unused=True)
    with pytest.raises(FedrayError, match=r"^the plugin .*:ReadsItsUpload: a round Poisson sampling left empty still "
                                          r"sends .* where they failed: RuntimeError: .*meta") as raised:
        run(config)
    assert "\n" not in str(raised.value)
