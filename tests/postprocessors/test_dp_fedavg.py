"""dp-fedavg (DP-FedAvg, user-level DP for training): the joint clip and the weight against a plain reference, SCAFFOLD's
control variates inside the clip, the noise's variance and the fixed denominator, ε against independent computations
(the Poisson-subsampled Gaussian's RDP at integer orders, Mironov et al. 2019; the analytic Gaussian mechanism, Balle &
Wang 2018), calibration, runs that report ε in every row and are the same on any shard layout, σ = 0 the plain run bit
for bit, and the one-line refusals before any work."""

import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.optimize
import scipy.special
import scipy.stats
import torch

import fedray
from fedray.core.errors import FedrayError
from fedray.core.reports import reporting
from fedray.engine.config import resolve
from fedray.engine.plan import postprocessing, training_uploads
from fedray.engine.run_config import run
from fedray.methods.postprocessor import Postprocessing, Sampling
from fedray.methods.training_algorithms import CONTROL
from fedray.postprocessors.dp_fedavg import DPFedAvg, calibrated, epsilon
from fedray.runtime.sampling import schedule

SPEC = "fedray.postprocessors.dp_fedavg:DPFedAvg"
DATASET = "synthetic:inat-geo-100?dim=24&scale=0.3&classes=20"
DELTA = 1e-5
FEW_CLIENTS = "synthetic:inat-user-120k?dim=8&scale=0.01&classes=6&seed=1&split=dirichlet&alpha=0.3&clients=24"


# --- independent references


def poisson_rdp_epsilon(q: float, noise: float, rounds: int, delta: float) -> float:
    """ε(δ) of ``rounds`` Poisson-subsampled Gaussian mechanisms, written out here: at integer orders α the RDP is
    log A_α / (α − 1), A_α = Σ_k C(α, k) (1 − q)^(α−k) q^k exp((k² − k)/(2σ²)) (Mironov, Talwar & Zhang 2019, §3.3),
    composed by adding, then ε = min_α T·RDP(α) + log((α − 1)/α) − (log δ + log α)/(α − 1) (the conversion of Balle
    et al. 2020 that dp-accounting uses), over the integer orders 2..256."""
    best = math.inf
    for order in range(2, 257):
        k = np.arange(order + 1)
        terms = (scipy.special.gammaln(order + 1) - scipy.special.gammaln(k + 1) - scipy.special.gammaln(order - k + 1)
                 + (order - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * noise**2))
        rdp = float(scipy.special.logsumexp(terms)) / (order - 1)
        best = min(best, rounds * rdp + math.log((order - 1) / order) - (math.log(delta) + math.log(order)) / (order - 1))
    return best


def gaussian_rdp_epsilon(noise: float, rounds: int, delta: float) -> float:
    """``rounds`` Gaussian mechanisms of multiplier ``noise`` (RDP α/(2σ²) each), by the same conversion."""
    return min(rounds * order / (2 * noise**2) + math.log((order - 1) / order)
               - (math.log(delta) + math.log(order)) / (order - 1) for order in range(2, 257))


def analytic_epsilon(mu: float, delta: float) -> float:
    """The exact ε(δ) of a Gaussian mechanism of sensitivity ``mu`` standard deviations (Balle & Wang 2018, Thm 8)."""
    norm = scipy.stats.norm
    return scipy.optimize.brentq(lambda eps: norm.cdf(mu / 2 - eps / mu) - math.exp(eps + norm.logcdf(-mu / 2 - eps / mu))
                                 - delta, 0.0, 500.0, xtol=1e-12)


# --- the client hook


def upload(scale: float, seed: int = 0, control: bool = False) -> fedray.Upload:
    rng = np.random.default_rng(seed)
    tensors = {"weight": torch.from_numpy(rng.normal(size=(6, 3)) * scale).float(),
               "bias": torch.from_numpy(rng.normal(size=3) * scale).float()}
    if control:
        tensors[CONTROL + "weight"] = torch.from_numpy(rng.normal(size=(6, 3)) * scale).float()
        tensors[CONTROL + "bias"] = torch.from_numpy(rng.normal(size=3) * scale).float()
    return fedray.Upload(tensors, 37.0)


def through_client(postprocessor: DPFedAvg, given: fedray.Upload) -> fedray.Upload:
    pipeline = Postprocessing((postprocessor,), seed=1).sampled(100, 10, True, poisson=True)
    return pipeline.client(given, client=4, round_number=2)


def test_the_whole_upload_is_clipped_jointly_and_its_weight_is_one():
    given = upload(1.0)
    flat = np.concatenate([given.tensors["weight"].double().numpy().ravel(), given.tensors["bias"].double().numpy()])
    norm = float(np.sqrt((flat**2).sum()))
    clip = norm / 3
    out = through_client(DPFedAvg(clip_norm=clip, dp_delta=DELTA, dp_noise=1.0), given)
    assert out.weight == 1.0
    for name in ("weight", "bias"):
        np.testing.assert_allclose(out.tensors[name].double().numpy(), given.tensors[name].double().numpy() / 3,
                                   rtol=1e-6)
    joint = math.sqrt(sum(float((t.double() ** 2).sum()) for t in out.tensors.values()))
    assert joint == pytest.approx(clip, rel=1e-6)


def test_an_upload_within_the_clip_keeps_its_bits_and_without_noise_its_weight():
    given = upload(0.01)
    noisy = through_client(DPFedAvg(clip_norm=100.0, dp_delta=DELTA, dp_noise=1.0), given)
    assert all(torch.equal(noisy.tensors[name], given.tensors[name]) for name in given.tensors) and noisy.weight == 1.0
    assert through_client(DPFedAvg(clip_norm=100.0, dp_delta=DELTA, dp_noise=0.0), given) is given


def test_scaffolds_control_variates_count_in_the_norm_and_are_clipped_with_the_update():
    """An update within S whose control-variate change takes the upload past S: all of it is scaled, the update too."""
    given = upload(1.0, control=True)
    update_norm = math.sqrt(sum(float((given.tensors[name].double() ** 2).sum()) for name in ("weight", "bias")))
    whole = math.sqrt(sum(float((t.double() ** 2).sum()) for t in given.tensors.values()))
    clip = (update_norm + whole) / 2
    out = through_client(DPFedAvg(clip_norm=clip, dp_delta=DELTA, dp_noise=1.0), given)
    for name, tensor in given.tensors.items():
        np.testing.assert_allclose(out.tensors[name].double().numpy(), tensor.double().numpy() * clip / whole, rtol=1e-6)


# --- the aggregate hook


KAPPA, NOISE, CLIP = 10, 1.3, 0.7


def test_central_noise_has_variance_sigma_s_squared_and_the_denominator_is_fixed():
    """Zero sums of many rounds: every entry N(0, (σS)²) (KS test), independent across rounds; the weight the server
    divides by is κ = qW whatever was received (an empty round's 0 included)."""
    pipeline = Postprocessing((DPFedAvg(clip_norm=CLIP, dp_delta=DELTA, dp_noise=NOISE),), seed=3).sampled(
        100, KAPPA, True, poisson=True)
    zeros = {"weight": torch.zeros(20, 10, dtype=torch.float64), "bias": torch.zeros(10, dtype=torch.float64)}
    draws, reported = [], {}
    for number in range(1, 31):
        with reporting(reported):
            total = pipeline.aggregate(zeros, number, 7)
        draws.append(np.concatenate([total["weight"].numpy().ravel(), total["bias"].numpy()]))
        assert pipeline.aggregate_weight(float(number % 13), number, number % 13) == KAPPA
    draws = np.array(draws)
    assert scipy.stats.kstest(draws.ravel(), scipy.stats.norm(scale=NOISE * CLIP).cdf).pvalue > 1e-3
    assert abs(np.corrcoef(draws[:-1].ravel(), draws[1:].ravel())[0, 1]) < 0.05
    assert reported["dp_epsilon"] == epsilon(NOISE, DELTA, "pld", "poisson", 100, KAPPA, 30)


def test_distributed_noise_sums_to_the_central_variance():
    """κ clients' shares N(0, σ²S²/κ) on zero uploads: their sum is N(0, σ²S²); the server adds nothing."""
    postprocessor = DPFedAvg(clip_norm=CLIP, dp_delta=DELTA, dp_noise=NOISE, dp_placement="distributed")
    pipeline = Postprocessing((postprocessor,), seed=5).sampled(100, KAPPA, False)
    zero = fedray.Upload({"weight": torch.zeros(40, dtype=torch.float64)}, 3.0)
    sums = []
    for number in range(1, 61):
        total = sum(pipeline.client(zero, client, number).tensors["weight"] for client in range(KAPPA))
        sums.append(total.numpy())
        with reporting({}):
            assert torch.equal(pipeline.aggregate({"weight": total}, number, KAPPA)["weight"], total)
    assert scipy.stats.kstest(np.ravel(sums), scipy.stats.norm(scale=NOISE * CLIP).cdf).pvalue > 1e-3


# --- the accountant


@pytest.mark.parametrize("q, noise, rounds", [(0.01, 1.0, 1000), (0.1, 1.5, 50), (0.05, 0.8, 200)])
def test_poisson_epsilon_is_the_subsampled_gaussians_written_out_here(q, noise, rounds):
    """The RDP accountant: within 3% of the integer-order bound above and not above it (it also tries fractional
    orders); the PLD accountant: tighter still, and within 40% (the RDP conversion is loose)."""
    reference = poisson_rdp_epsilon(q, noise, rounds, DELTA)
    rdp = epsilon(noise, DELTA, "rdp", "poisson", 1000, int(q * 1000), rounds)
    assert reference * 0.97 <= rdp <= reference * (1 + 1e-9)
    pld = epsilon(noise, DELTA, "pld", "poisson", 1000, int(q * 1000), rounds)
    assert reference * 0.6 <= pld <= rdp


@pytest.mark.parametrize("noise, rounds", [(2.0, 25), (5.0, 100)])
def test_without_replacement_composes_the_gaussian_once_a_pass(noise, rounds):
    """K = 100, κ = 10: a pass is 10 rounds, so ⌈t/10⌉ Gaussian mechanisms, which compose to one of sensitivity
    √c/σ std devs: PLD within 0.5% of the exact ε, RDP above it."""
    passes = -(-rounds // 10)
    exact = analytic_epsilon(math.sqrt(passes) / noise, DELTA)
    assert exact * (1 - 1e-6) <= epsilon(noise, DELTA, "pld", "without", 100, 10, rounds) <= exact * 1.005
    rdp = epsilon(noise, DELTA, "rdp", "without", 100, 10, rounds)
    assert rdp == pytest.approx(gaussian_rdp_epsilon(noise, passes, DELTA), rel=0.03) and rdp > exact


def test_fixed_size_sampling_is_replace_one_with_sensitivity_two_s_and_costs_more_than_poisson():
    """At κ = K nothing is subsampled: replace-one moves the sum by 2S, a Gaussian of multiplier σ/2 each round. At
    q = 0.01 fixed-size sampling's ε is several times Poisson's for the same σ and rounds."""
    assert epsilon(3.0, DELTA, "rdp", "with", 50, 50, 40) == pytest.approx(gaussian_rdp_epsilon(1.5, 40, DELTA),
                                                                           rel=0.03)
    poisson = epsilon(1.0, DELTA, "rdp", "poisson", 1000, 10, 1000)
    fixed = epsilon(1.0, DELTA, "rdp", "with", 1000, 10, 1000)
    assert fixed > 4 * poisson


@pytest.mark.parametrize("target", [1.0, 4.0])
def test_a_calibrated_noise_gives_back_its_budget_over_the_runs_rounds(target):
    noise = calibrated(target, DELTA, "rdp", "poisson", 1000, 10, 500)
    assert target * 0.98 <= poisson_rdp_epsilon(0.01, noise, 500, DELTA) <= target * 1.03
    assert epsilon(noise, DELTA, "rdp", "poisson", 1000, 10, 500) <= target


def test_poisson_rounds_are_told_as_kappa_expected_and_possibly_empty():
    stage = training_uploads("training", Sampling(100, 10, True, True), 30)
    assert (stage.group, stage.smallest_group, stage.sampling.rate) == (10, 0, 0.1)


# --- runs


def metrics(tmp_path: Path, name: str, method: str = "fedavg", sampling: str = "poisson", **values) -> list[dict]:
    config = resolve({}, {"method": method, "dataset": DATASET, "out": str(tmp_path / name), "clients_per_round": 10,
                          "rounds": 8, "eval_every": 4, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
                          "sampling": sampling, **values})
    run(config)
    return pq.read_table(tmp_path / name / "metrics.parquet").to_pylist()


def private(**options) -> dict:
    return {"postprocessor": SPEC, "options": {key: str(value) for key, value in options.items()}}


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_poisson_run_reports_the_subsampled_gaussians_epsilon_and_is_the_same_on_any_layout(ray_session, tmp_path):
    rows = metrics(tmp_path, "two", **private(clip_norm=0.5, dp_noise=1.0, dp_delta=DELTA, dp_accountant="rdp"))
    assert [row["round"] for row in rows] == [0, 4, 8]
    one = metrics(tmp_path, "one", num_shards=1, **private(clip_norm=0.5, dp_noise=1.0, dp_delta=DELTA,
                                                             dp_accountant="rdp"))
    # the same noise on any layout: the models differ by the shards' float sums' rounding, not by a draw of σS
    assert np.allclose(np.load(tmp_path / "one" / "classifier.npz")["W"], np.load(tmp_path / "two" / "classifier.npz")["W"],
                       rtol=0, atol=1e-5)
    num_clients = fedray_clients()
    for row in rows[1:]:
        reference = poisson_rdp_epsilon(10 / num_clients, 1.0, row["round"], DELTA)
        # few rounds: the best order is far from an integer, where the library's fractional orders gain most
        assert row["dp_delta"] == DELTA and reference * 0.9 <= row["dp_epsilon"] <= reference * (1 + 1e-9)
    plain = metrics(tmp_path, "plain")
    assert rows[-1]["accuracy"] != plain[-1]["accuracy"]


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_rdp_rows_name_the_orders_epsilon_was_minimized_over_and_pld_rows_none(ray_session, tmp_path, accountant):
    """q = 6/24, σ = 1: dp-accounting's series does not converge at orders 1.1 to 1.7, left out of ε."""
    rows = metrics(tmp_path, accountant, dataset=FEW_CLIENTS, clients_per_round=6, rounds=2, eval_every=1,
                   **private(clip_norm=1, dp_noise=1, dp_delta=DELTA, dp_accountant=accountant))
    assert [row["round"] for row in rows] == [0, 1, 2]
    if accountant == "rdp":
        assert [row["dp_rdp_orders"] for row in rows] == [None, "1.8-1024", "1.8-1024"]
    else:
        assert "dp_rdp_orders" not in rows[0]


def fedray_clients() -> int:
    from fedray.data.registry import load_federation
    return load_federation(DATASET).num_clients


@pytest.mark.parametrize("method, sampling", [("fedavg", "poisson"), ("fednova", "with")])
def test_no_noise_with_a_clip_no_upload_reaches_is_the_plain_run_bit_for_bit(ray_session, tmp_path, method, sampling):
    """σ = 0: the clip only (none reached), weights and denominator the algorithm's: the plain run's model and rows,
    every row ε = ∞ (the dual form's batched sums and autograd's)."""
    plain = metrics(tmp_path, "plain", method, sampling)
    noiseless = metrics(tmp_path, "noiseless", method, sampling, **private(clip_norm=1e9, dp_noise=0, dp_delta=DELTA))
    assert [row["accuracy"] for row in plain] == [row["accuracy"] for row in noiseless]
    a, b = np.load(tmp_path / "plain" / "classifier.npz"), np.load(tmp_path / "noiseless" / "classifier.npz")
    assert a.files == b.files and all(np.array_equal(a[key], b[key]) for key in a.files)
    assert all(row["dp_epsilon"] == math.inf for row in noiseless[1:])


@pytest.mark.parametrize("method", ["fedavg", "feddyn"])
def test_an_empty_poisson_round_still_releases_noise_and_steps(ray_session, tmp_path, method):
    """κ = 1: about a third of the rounds are empty; in them the server still adds σS noise and divides by κ, so the
    model moves (σ = 5: the accuracy changes) where a plain run's stays."""
    rows = metrics(tmp_path, method, method, clients_per_round=1, rounds=12, eval_every=1,
                   **private(clip_norm=1, dp_noise=5, dp_delta=DELTA))
    rounds = schedule(fedray_clients(), 1, True, 0, 12, past_coverage=True, poisson=True)
    empty = [number + 1 for number, clients in enumerate(rounds) if len(clients) == 0]
    assert empty and all(np.isfinite(row["dp_epsilon"]) for row in rows[1:])
    assert sum(rows[number]["accuracy"] != rows[number - 1]["accuracy"] for number in empty) >= len(empty) / 2


class SeesControl(DPFedAvg):
    """dp-fedavg that refuses an upload without SCAFFOLD's control-variate change: what it clips holds them."""

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        if not any(name.startswith(CONTROL) for name in upload.tensors):
            raise fedray.FedrayError(f"no control variates among {sorted(upload.tensors)}")
        return super().client(upload, context)


def test_scaffolds_clients_hand_their_control_variates_to_the_clip(ray_session, tmp_path):
    rows = metrics(tmp_path, "scaffold", "scaffold", "with",
                   postprocessor=f"{__name__}:SeesControl", options={"clip_norm": "0.5", "dp_noise": "1", "dp_delta": "1e-5"})
    assert all(np.isfinite(row["accuracy"]) for row in rows)


@pytest.mark.parametrize("values, error", [
    ({"options": {"clip_norm": "1", "dp_epsilon": "1"}}, "option dp_delta is required"),
    ({"options": {"dp_delta": "1e-5", "dp_epsilon": "1"}}, "option clip_norm is required"),
    ({"options": {"clip_norm": "1", "dp_delta": "1e-5"}}, r"give one of option dp_epsilon .* got neither"),
    ({"options": {"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "-1"}}, r"option dp_noise must be ≥ 0"),
    ({"options": {"clip_norm": "1", "dp_delta": "1e-5", "dp_epsilon": "1e-7"}},
     r"no noise multiplier up to 1000 meets dp_epsilon=1e-07 at dp_delta=1e-05 over 8 rounds of --sampling poisson"),
    ({"options": {"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "1"}, "method": "fed3r", "sampling": "without"},
     r"the closed form stage uploads closed-form statistics, which DP-FedAvg does not cover: --postprocessor dp"),
    ({"options": {"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "1", "dp_accountant": "pld"}, "sampling": "with"},
     r"dp_accountant=pld cannot account fixed-size sampling \(--sampling with\)"),
    ({"options": {"clip_norm": "1", "dp_delta": "1e-5", "dp_noise": "1", "dp_placement": "distributed"}},
     r"dp_placement=distributed needs a fixed number of clients a round"),
])
def test_bad_options_and_runs_it_cannot_serve_are_refused_in_one_line_before_any_work(ray_session, tmp_path, values, error):
    values = {"sampling": "poisson", **values, "postprocessor": SPEC}
    with pytest.raises(FedrayError, match=rf"^--postprocessor {SPEC}: {error}") as raised:
        metrics(tmp_path, "refused", **values)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "refused").exists()
