"""Differential privacy for closed-form statistics, sample- or client-level: each sample's features clipped to norm R
(and, per client, at most m samples), Gaussian noise on what the clients release, ε(δ) from Google's
``dp-accounting`` (PLD or RDP accountant), reported in every row.

    fedray run --method fed3r --postprocessor dp --option clip_norm=1 --option dp_epsilon=2 --option dp_delta=1e-5
    fedray run --method fedncm --postprocessor dp --option clip_norm=1 --option dp_noise=3 --option dp_delta=1e-5 \\
        --option dp_placement=distributed
    fedray run --method fedcof --postprocessor dp --option clip_norm=1 --option dp_epsilon=2 --option dp_delta=1e-5 \\
        --option dp_placement=distributed
    fedray run --method fed3r --postprocessor dp --option clip_norm=1 --option dp_epsilon=2 --option dp_delta=1e-5 \\
        --option dp_unit=client --option dp_client_samples=100

**Contribution bound.** A closed-form upload is a sum over the client's samples, so the bound comes before the sum:
the :meth:`~fedray.Postprocessor.features` hook clips each feature row z to ‖z‖ ≤ R (``clip_norm``), z·min(1, R/‖z‖),
in the shards, before the method computes its statistics (rows already within R keep their bits); labels are one-hot
(the methods' class sums and ZᵀY). Test features are not clipped: the classifier is post-processing of the release.

**Sensitivity** (neighbouring data sets: one sample added or removed, dp-accounting's ``ADD_OR_REMOVE_ONE``; under
replace-one every bound below doubles), per released tensor, in L2 (Frobenius) norm:

- FedNCM (``counts``, ``sums``): a sample adds e_y to the counts (Δ = 1) and z to row y of the sums (Δ = R);
- Fed3R (``gram``, ``targets``): it adds zzᵀ to ZᵀZ (‖zzᵀ‖_F = ‖z‖² ≤ R², Δ = R²; the noise is a symmetric matrix,
  the upper triangle, diagonal included, drawn i.i.d. and mirrored, which releases the upper triangle, whose norm is
  at most ‖zzᵀ‖_F) and z e_yᵀ to ZᵀY (Δ = R);
- FedCOF (``--means-per-class 1``): each client releases, per class c it holds, a row (c, n_c, μ_c). A mean is not a
  sum (its sensitivity 2R/n grows as n falls), and the set of rows says which classes the client holds, so the
  release is made of sums and thresholded instead: the row's count n_c (Δ = 1) and sum Σz (Δ = R) get the noise of
  FedNCM's (ñ = n_c + N(0, σ²), s̃ = Σz + N(0, (σR)²): the same Gaussian mechanism, one row changed by a sample),
  the row is released only if ñ ≥ τ, as (c, ñ, μ̃ = s̃/ñ), and the client's class totals and ``received`` are those
  of its released rows (post-processing). A sample whose class has other samples at its client changes a row that
  exists either way: the accountant's (ε, δ − δ_τ). A sample alone in its class makes a row that the neighbouring
  data set lacks: it appears with probability P(1 + N(0, σ²) ≥ τ) = δ_τ, whence τ = 1 + σ·Φ⁻¹(1 − δ_τ), δ_τ =
  ``dp_threshold_share``·δ (Gaussian thresholding: Korolova et al. 2009, Wilson et al. 2020); otherwise nothing of
  it is seen. The run is (ε, δ)-DP with δ = (δ − δ_τ) + δ_τ, the δ it reports (each neighbouring pair falls in one
  case, so max would do; the sum is the general argument and is the one reported), ε computed at δ − δ_τ (with a
  budget, σ is calibrated there). A row not released keeps its place in the upload (a hook returns the shapes it
  got) with count 0 and mean 0: a real client would not send it, and FedCOF's solve and second pass give it no
  weight (n·w_c = 0, not in ``received``). Released counts are ≥ τ ≥ 1, so the means are defined and every weight
  (N_c − 1)/(K_c − 1) is ≥ 0: Ĝ stays positive semidefinite plus γ's shrinkage. Only ``distributed`` placement:
  the rows reach the server client by client, never summed, so each client adds the full σ (not σ/√κ) and a block's
  ε is one release's whatever its size; central noise (the server's, on rows it has already seen) is refused.
- refused: any other upload (covariances, training updates: `--postprocessor dp-fedavg`), several means per class
  (their random split moves with every sample), and statistics whose width is not the clipped features' (fed3r
  ``--bias``'s ones column, fed3r-rf's random features, which the clip does not bound).

**Client level** (``dp_unit=client``: one client's data added or removed). Its contribution is bounded first: the
:meth:`~fedray.Postprocessor.select` hook keeps m = ``dp_client_samples`` of a client's n > m samples, uniformly at
random (the first m of a permutation drawn from the client's own seeded stream: the same on any shard layout; a client
of n ≤ m keeps every row, bit for bit), before the clip. A client is then at most m clipped samples, and each
sensitivity above is m times the sample's, by the triangle inequality over its samples: FedNCM's counts Δ = m (the
vector (n_c), Σ n_c ≤ m, has ‖·‖₂ ≤ m) and sums Δ = mR (‖Σ_i z_i e_yiᵀ‖_F ≤ Σ ‖z_i‖); Fed3R's ZᵀZ Δ = mR²
(‖Σ z zᵀ‖_F ≤ Σ ‖z‖²) and ZᵀY Δ = mR. The noise is σ·Δ with these Δ, the multiplier σ and the accounting are the
sample level's (a client is in one release, each block a disjoint set of clients), and distributed noise assumes,
as there, that the server sees only the block's sum. FedCOF is refused at client level: its mean rows reach the
server client by client, so a client's very presence shows unless none of its rows is released (a row of a client
absent from the neighbouring data set may appear with probability at most δ): no useful release exists, and the
class bound c it would need buys nothing.

**Mechanism.** Every released tensor t gets Gaussian noise of standard deviation σ·Δ_t, σ the noise multiplier
(``dp_noise``, or calibrated from ``dp_epsilon``): each tensor is a Gaussian mechanism of multiplier σ, and a sample
is in both tensors of its client's upload, so the accountant composes the two (``ComposedDpEvent``: the same as one
Gaussian mechanism of multiplier σ/√2). ``dp_placement``:

- ``central``: the server adds the noise to each evaluation block's sum, once, in :meth:`aggregate`;
- ``distributed``: each client adds its share, standard deviation σ·Δ_t/√κ (κ the clients per round), so a block of
  κ uploads carries the central variance σ²Δ_t², and a block of b uploads b/κ of it: the accountant is given the
  block's own multiplier σ·√(b/κ) (a block of fewer than κ new uploaders, as when clients are drawn again, is less
  private, and the reported ε says so). Its guarantee assumes the server sees only the sum (what `--secure-aggregation`
  simulates) and clients that add their noise.

**Releases.** A closed-form run releases each client's statistics once (a client uploads once), in one block; the
blocks hold disjoint samples, so by parallel composition a sample's ε is its block's: the run's ``dp_epsilon`` is the
largest over the blocks released so far (with central noise, that of one release, the same in every row). The
server's cumulative sum, its solves and evaluations are post-processing and spend nothing.

**A well-defined solve.** The server post-processes each block's noisy sum: ZᵀZ's negative eigenvalues are set to 0
(its nearest positive semidefinite matrix in Frobenius norm), so the running Σ ZᵀZ + λI stays positive definite and
Fed3R's Cholesky solve is defined; FedNCM's noisy counts are clamped at 0 (a class of count 0 divides its sums by 1).

**Budget.** Give δ (``dp_delta``) and either ε (``dp_epsilon``: σ is the smallest multiplier in [0.1, 1000] whose
ε(δ) is at most ε, by bisection; a budget that needs more than 1000 is refused) or σ
(``dp_noise``: ε is computed; FedCOF's ε at δ − δ_τ). σ = 0 (``dp_noise=0``) is no privacy, ε = ∞: no noise is drawn
and no sum projected (FedCOF: every row released as it is, τ = 1 ≤ n), so with a clip no row reaches the run is
the plain run bit for bit. Both given: σ is used, and the run refused if it spends more than ε (a run's
``config.yaml`` records both). The accountant is the PLD one (near exact for the Gaussian mechanism, its discretization
chosen from ε: :mod:`fedray.postprocessors.accounting`) or ``dp_accountant=rdp``. The σ used (FedCOF's: its rows') is
recorded in ``config.yaml`` and every row (``dp_noise``), beside the clip and the accountant: ``dp_noise=σ`` re-runs
the run bit for bit.

Not supported, refused in one line: any upload other than FedNCM's, Fed3R's and FedCOF's (above), and FedCOF at
client level or with central noise (before the run: its method's ``uploads_summed`` is False). Every row reports
``dp_epsilon`` and ``dp_delta``; FedCOF's also ``dp_threshold`` (τ); under ``dp_accountant=rdp`` also
``dp_rdp_orders``, the orders ε was minimized over (all of them: a Gaussian's RDP is finite at every order). Noise
draws come from the context's generator (the run's seed, round, client or aggregate, place in the list), one tensor
after another in the order of the upload's names (FedCOF: the rows' counts, then their sums), so a run is the same on
any layout.
"""

from __future__ import annotations

import math
from functools import cache, cached_property
from statistics import NormalDist
from typing import TYPE_CHECKING, Annotated

import fedray
from fedray.core.lazy_modules import lazy_module
from fedray.core.options import Option
from fedray.postprocessors import accounting
from fedray.postprocessors.accounting import ACCOUNTANTS, DEFAULT_ACCOUNTANT, RDP

torch = lazy_module("torch", globals())

if TYPE_CHECKING:
    import dp_accounting

PLACEMENTS = ("central", "distributed")
UNITS = ("sample", "client")

RELEASED_SUMS = 2
"""A summed upload this postprocessor privatizes is two sums over samples (:func:`release` composes two mechanisms)."""
NAME = "--postprocessor dp"
FLAGS = (
    Option("clip_norm", float, None, "differential privacy (docs/privacy.md): each sample's features clipped to norm "
           "≤ R (a training method: each client's update). Any --clip-norm or --dp-* adds --postprocessor dp "
           "(dp-fedavg for a training method) after yours and before secagg, with these as its options", optional=True,
           unset="no DP", metavar="R"),
    Option("dp_unit", str, None, "what DP protects: one sample, or all of one client's data", optional=True,
           choices=UNITS, unset="the DP postprocessor's own, sample for dp"),
    Option("dp_epsilon", float, None, "DP budget ε at --dp-delta: the noise is calibrated to it (or give --dp-noise); "
           "the rows' dp_epsilon is the ε spent", optional=True, unset="none: give --dp-noise", metavar="EPSILON"),
    Option("dp_delta", float, None, "δ of the (ε, δ) guarantee, below 1/samples (e.g. 1e-5); required with DP",
           optional=True, unset="none", metavar="DELTA"),
    Option("dp_noise", float, None, "DP noise multiplier σ (the noise's std is σ × the sensitivity), ε computed (with "
           "--dp-epsilon: σ is used, and must meet it); 0: no noise, ε = ∞", optional=True,
           unset="calibrated to --dp-epsilon (config.yaml and the rows record it)", metavar="SIGMA"),
    Option("dp_placement", str, None, "who adds the DP noise: the server, to each aggregate, or each client its share "
           "σ/√κ", optional=True, choices=PLACEMENTS, unset="the DP postprocessor's own, central for dp"),
)
"""The DP flags (``--clip-norm``, ``--dp-*``): any of them set adds ``dp`` to a closed-form run and ``dp-fedavg`` to a
training run, with their values as its options (by these names, which both declare)."""


def release(noise: float) -> dp_accounting.DpEvent:
    """One client's upload as the accountant sees it: two tensors, each a Gaussian mechanism of multiplier ``noise``."""
    import dp_accounting

    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(noise)] * 2)


@cache
def epsilon(noise: float, delta: float, kind: str = DEFAULT_ACCOUNTANT) -> float:
    """ε(δ) of one release (:func:`release`) with noise multiplier ``noise``, from ``kind``'s accountant."""
    return accounting.spent(release(noise), delta, kind)


@cache
def rdp_orders(noise: float) -> str:
    """The orders the RDP accountant minimizes one release's ε over
    (:func:`~fedray.postprocessors.accounting.rdp_orders`: all of them, a Gaussian's RDP being finite at every
    order)."""
    return accounting.rdp_orders(release(noise))


def calibrated(target: float, delta: float, kind: str = DEFAULT_ACCOUNTANT) -> float:
    """The smallest noise multiplier in :data:`~fedray.postprocessors.accounting.NOISE_RANGE` whose ε(δ) is at most
    ``target``."""
    return accounting.calibrated(lambda noise: epsilon(noise, delta, kind), target,
                                 f"no noise multiplier up to {{high:g}} meets dp_epsilon={target:g} at "
                                 f"dp_delta={delta:g} (ε there is {{spent:.3g}}); ask for a larger ε or δ")


def budget_met(noise: float, target: float | None, spent: float, where: str) -> None:
    """A ``ValueError`` when both a noise multiplier and a budget are given and the noise spends more than the budget
    (over ``where``): given both, σ is used as it is (a recorded run's ``config.yaml`` re-runs so)."""
    if target is not None and spent > target:
        raise ValueError(f"dp_noise={noise!r} spends ε = {spent:.6g} over {where}, more than dp_epsilon={target:g}: "
                         f"give one of them, or a larger σ")


def check_options(clip_norm: float | None, clip: str, dp_delta: float | None, dp_epsilon: float | None,
                  dp_noise: float | None, dp_placement: str, dp_accountant: str, units: str) -> None:
    """The options every DP postprocessor here takes, refused in one line each: ``clip`` says what ``clip_norm`` bounds,
    ``units`` what δ is to be below one over."""
    if dp_placement not in PLACEMENTS:
        raise ValueError(f"option dp_placement must be central or distributed, got {dp_placement!r}")
    if dp_accountant not in ACCOUNTANTS:
        raise ValueError(f"option dp_accountant must be pld or rdp, got {dp_accountant!r}")
    if clip_norm is None or not clip_norm > 0 or not math.isfinite(clip_norm):
        raise ValueError(f"option clip_norm is required: {clip} (> 0), got {clip_norm}")
    if dp_delta is None:
        raise ValueError(f"option dp_delta is required: the δ of the (ε, δ) guarantee (e.g. 1e-5, below 1/{units})")
    if not 0 < dp_delta < 1:
        raise ValueError(f"option dp_delta must be in (0, 1), got {dp_delta}")
    if dp_epsilon is None and dp_noise is None:
        raise ValueError("give one of option dp_epsilon (the budget; the noise is calibrated) or option dp_noise "
                         "(the noise multiplier; ε is computed), got neither")
    if dp_noise is not None and not (dp_noise >= 0 and math.isfinite(dp_noise)):
        raise ValueError(f"option dp_noise must be ≥ 0 (0: no privacy, ε = ∞), got {dp_noise}")
    if dp_epsilon is not None and not (dp_epsilon > 0 and math.isfinite(dp_epsilon)):
        raise ValueError(f"option dp_epsilon must be > 0 (no privacy: dp_noise=0), got {dp_epsilon}")


class GaussianMechanism(fedray.Postprocessor):
    """(ε, δ)-DP for FedNCM, Fed3R and FedCOF (sample level) or FedNCM and Fed3R (client level: at most m samples a
    client): features clipped to R, Gaussian noise σ·Δ on each released sum (FedCOF: on each mean row's count and sum,
    a row released above a threshold)."""

    flags = FLAGS
    training_counterpart = "dp-fedavg"

    def __init__(self, clip_norm: Annotated[float | None, "R: each sample's features clipped to norm ≤ R (required)"] = None,
                 dp_delta: Annotated[float | None, "δ of the (ε, δ) guarantee, 0 < δ < 1 (required)"] = None,
                 dp_epsilon: Annotated[float | None, "ε: calibrate the noise to this budget (or give dp_noise)"] = None,
                 dp_noise: Annotated[float | None, "σ: the noise multiplier, std σ·Δ per tensor (or give dp_epsilon)"] = None,
                 dp_placement: Annotated[str, "central (the server, once per block) or distributed (each client, "
                                              "σ/√κ; fedcof: σ, distributed only)"] = "central",
                 dp_unit: Annotated[str, "what is protected: sample (one sample) or client (all of a client's, "
                                         "at most dp_client_samples)"] = "sample",
                 dp_accountant: Annotated[str, "pld or rdp (dp-accounting)"] = DEFAULT_ACCOUNTANT,
                 dp_threshold_share: Annotated[float, "fedcof: the share of δ spent on releasing a mean row only "
                                                      "when its noisy count clears a threshold, in (0, 1)"] = 0.5,
                 dp_client_samples: Annotated[int | None, "m: with dp_unit=client, each client's samples bounded to m, "
                                                          "the excess dropped at random (required there)"] = None) -> None:
        super().__init__()
        if dp_unit not in UNITS:
            raise ValueError(f"option dp_unit must be sample or client, got {dp_unit!r}")
        if dp_unit == "client" and (dp_client_samples is None or dp_client_samples < 1):
            raise ValueError(f"option dp_client_samples is required with dp_unit=client: the most samples a client "
                             f"contributes, m ≥ 1 (its excess dropped at random), got {dp_client_samples}")
        if dp_unit == "sample" and dp_client_samples is not None:
            raise ValueError("option dp_client_samples bounds a client's contribution: it needs dp_unit=client")
        check_options(clip_norm, "each sample's feature norm bound R", dp_delta, dp_epsilon, dp_noise, dp_placement,
                      dp_accountant, "samples")
        if not 0 < dp_threshold_share < 1:
            raise ValueError(f"option dp_threshold_share must be in (0, 1), got {dp_threshold_share}")
        self.clip_norm, self.delta, self.placement, self.kind = float(clip_norm), float(dp_delta), dp_placement, dp_accountant
        self.client_samples = dp_client_samples
        """m with dp_unit=client (None: sample level): every sensitivity is m times the sample's."""
        self.threshold_delta = self.delta * dp_threshold_share
        """δ_τ: the probability bound of a mean row appearing for a class its client does not hold (FedCOF)."""
        self.target = dp_epsilon
        self.noise_given = dp_noise is not None
        """σ given (with a budget too: σ is used, and the budget checked in :meth:`start`)."""
        self.noise = float(dp_noise) if dp_noise is not None else calibrated(dp_epsilon, self.delta, dp_accountant)
        self.used: dict[str, object] = {}
        """What :meth:`start` resolved, as options (:meth:`recorded`)."""
        self.clipped_width: int | None = None
        """The width of the rows this copy (in a shard) last clipped: a client's statistics must be of that width."""

    def start(self, stages: tuple[fedray.StageUploads, ...]) -> None:
        """Refused before any work: a stage of training updates (their DP is DP-FedAvg's), and a stage whose uploads
        the server sees client by client (FedCOF's mean rows) with a server's noise or at client level."""
        training = next((told.stage for told in stages if told.training), None)
        if training is not None:
            raise ValueError(f"the {training} stage uploads training updates, and this postprocessor privatizes "
                             f"closed-form statistics; DP for training is --postprocessor dp-fedavg (the DP flags pick "
                             f"it for a training method)")
        apart = next((told.stage for told in stages if not told.summed), None)
        if apart is not None and self.placement == "central":
            raise ValueError(f"the {apart} stage's uploads (like fedcof's mean rows) reach the server client by "
                             f"client, not summed, so a server's noise would come after they are seen: use "
                             f"dp_placement=distributed")
        if apart is not None and self.client_samples is not None:
            raise ValueError(f"dp_unit=client with the {apart} stage's uploads (like fedcof's mean rows), which reach "
                             f"the server client by client: whether a client took part shows unless none of its rows "
                             f"is released; use dp_unit=sample, or fedncm or fed3r, whose uploads are summed")
        noise, delta = (self.rows_noise, self.delta - self.threshold_delta) if apart else (self.noise, self.delta)
        if self.noise_given:
            budget_met(noise, self.target, math.inf if noise == 0 else epsilon(noise, delta, self.kind), "one release")
        self.used = {"dp_noise": noise}

    def recorded(self) -> dict[str, object]:
        """σ, calibrated to ``dp_epsilon`` or given (FedCOF's mean rows': the one they get): ``dp_noise=σ`` re-runs
        the same."""
        return self.used

    @property
    def per_client(self) -> bool:
        return True

    @cached_property
    def rows_noise(self) -> float:
        """σ of FedCOF's mean rows: the accountant has δ − δ_τ, so a budget ε is calibrated at that δ."""
        if self.noise_given:
            return self.noise
        try:
            return calibrated(self.target, self.delta - self.threshold_delta, self.kind)
        except ValueError as error:
            raise fedray.FedrayError(f"{NAME}: fedcof's mean rows: {error}") from None

    def threshold(self) -> float:
        """τ: a mean row is released when its noisy count is ≥ τ = 1 + σ·Φ⁻¹(1 − δ_τ), so that a class its client does
        not hold (whose row a sample of count 1 would create) appears with probability P(1 + N(0, σ²) ≥ τ) = δ_τ."""
        return 1.0 - self.rows_noise * NormalDist().inv_cdf(self.threshold_delta)

    def select(self, labels: torch.Tensor, context: fedray.UploadContext) -> torch.Tensor | None:
        """Client level: m of a client's n > m samples, uniformly at random (the first m of a seeded permutation)."""
        if self.client_samples is None or len(labels) <= self.client_samples:
            return None
        return torch.randperm(len(labels), generator=context.generator)[:self.client_samples].sort().values

    def features(self, features: torch.Tensor) -> torch.Tensor:
        self.clipped_width = features.shape[1]
        norms = torch.linalg.vector_norm(features, dim=1, keepdim=True)
        return torch.where(norms > self.clip_norm, features * (self.clip_norm / norms), features)

    def scales(self, tensors: fedray.Params, parts: fedray.UploadParts | None) -> dict[str, float]:
        """σ·Δ_t for each tensor of an upload of two sums over samples of declared degree (FedNCM's, Fed3R's), or of
        per-client rows beside their class counts and sums (FedCOF's); a one-line error for any other."""
        powers = sensitivities(tensors, parts)
        if powers is None:
            raise fedray.FedrayError(
                f"{NAME}: an upload of {', '.join(tensors) or 'no tensors'} is not supported; sample-level DP covers "
                f"fedncm's class sums, fed3r's ZᵀZ, ZᵀY and fedcof's mean rows (--means-per-class 1); covariances "
                f"(fedcof-oracle, ccvr) are not, and training updates need --postprocessor dp-fedavg")
        if parts.rows is not None:
            if self.client_samples is not None:
                raise fedray.FedrayError(
                    f"{NAME}: dp_unit=client with fedcof: its mean rows reach the server client by client, so whether "
                    f"a client took part shows unless none of its rows is released (with probability 1 − δ); use "
                    f"dp_unit=sample, or fedncm or fed3r, whose uploads are summed")
            return {name: self.rows_noise * self.clip_norm**power for name, power in powers.items()}
        bound = self.client_samples or 1
        return {name: self.noise * bound * self.clip_norm**power for name, power in powers.items()}

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        tensors, parts = upload.tensors, upload.parts
        scales = self.scales(tensors, parts)
        width = next((width for width in feature_widths(tensors, parts) if width != self.clipped_width), None)
        if width is not None:
            raise fedray.FedrayError(f"{NAME}: statistics of width {width} from clipped features of width "
                                     f"{self.clipped_width}: a bias column (fed3r --bias) or a feature map (fed3r-rf) "
                                     f"the clip does not bound; run without them")
        if parts.rows is not None:
            check_mean_rows(tensors, parts, self.placement)
            if self.rows_noise == 0:
                return upload
            return fedray.Upload(released_rows(tensors, parts, scales, self.threshold(), context.generator),
                                 upload.weight)
        if self.placement == "central" or self.noise == 0:
            return upload
        share = 1 / math.sqrt(context.sampling.per_round)
        return fedray.Upload(noisy(tensors, {name: scale * share for name, scale in scales.items()}, context.generator,
                                   parts), upload.weight)

    def aggregate(self, total: fedray.Params, context: fedray.UploadContext) -> fedray.Params:
        parts = context.parts
        if parts is not None and parts.rows is not None:
            return self.rows_released(total)
        scales = self.scales(total, parts)
        if self.noise == 0:
            fedray.report(dp_epsilon=math.inf, dp_delta=self.delta)
            return total
        if self.placement == "central":
            total, multiplier = noisy(total, scales, context.generator, parts), self.noise
        else:
            multiplier = self.noise * math.sqrt(context.clients / context.sampling.per_round)
        spent = max(epsilon(multiplier, self.delta, self.kind), float(self.state.get("dp_epsilon", 0.0)))
        self.state = {"dp_epsilon": torch.tensor(spent, dtype=torch.float64)}
        self._report_epsilon(spent, multiplier)
        return well_defined(total, parts)

    def _report_epsilon(self, spent: float, noise: float) -> None:
        """ε and δ in the rows, and where the RDP accountant computed ε (noise ``noise`` > 0) the orders it was
        minimized over."""
        fedray.report(dp_epsilon=spent, dp_delta=self.delta)
        if self.kind == RDP and noise > 0:
            fedray.report(dp_rdp_orders=rdp_orders(noise))

    def rows_released(self, total: fedray.Params) -> fedray.Params:
        """FedCOF's block totals, sums of the released rows (post-processing): reported, not changed. Each client noised
        its own rows with the full σ, so a block's ε is one release's at δ − δ_τ, whatever its size; the row says δ."""
        spent = math.inf if self.rows_noise == 0 else epsilon(self.rows_noise, self.delta - self.threshold_delta, self.kind)
        self._report_epsilon(spent, self.rows_noise)
        fedray.report(dp_threshold=self.threshold())
        return total


def sensitivities(tensors: fedray.Params, parts: fedray.UploadParts | None) -> dict[str, int] | None:
    """Each released tensor's L2 sensitivity as a power of R (Δ = R^power: a sum over samples of degree ``power``):
    the class counts and sums of an upload of per-client rows, or the two sums of a summed upload; None for any other
    (undeclared parts, sums of unknown degree, another number of sums)."""
    if parts is None:
        return None
    if parts.rows is not None:
        released = {parts.named(0): 0, parts.named(1): 1}
        names = parts.rows.names | released.keys()
        return released if frozenset(tensors) == names else None
    powers = {name: parts.of(name).degree for name in tensors}
    return powers if len(powers) == RELEASED_SUMS and None not in powers.values() else None


def feature_widths(tensors: fedray.Params, parts: fedray.UploadParts) -> list[int]:
    """The width of the features each sum of ``tensors`` is of, where its parts declare it."""
    axes = {name: part.width_axis for name, part in parts.sums.items() if part.width_axis is not None}
    return [tensors[name].shape[axis] for name, axis in axes.items() if name in tensors]


def check_mean_rows(tensors: fedray.Params, parts: fedray.UploadParts, placement: str) -> None:
    """That a FedCOF upload has one mean row per class held and the noise is the client's, else a one-line error."""
    if placement == "central":
        raise fedray.FedrayError(f"{NAME}: fedcof's mean rows reach the server client by client, not summed, so a "
                                 f"server's noise would come after they are seen: use dp_placement=distributed")
    classes, counts = tensors[parts.rows.classes], tensors[parts.named(0)]
    held = torch.nonzero(counts > 0).flatten()
    if not torch.equal(classes, held) or not torch.equal(tensors[parts.rows.counts], counts[classes]):
        raise fedray.FedrayError(f"{NAME}: fedcof's upload has several means for a class (--means-per-class > 1), "
                                 f"whose split moves with every sample; it privatizes one mean row per class held")


def released_rows(tensors: fedray.Params, parts: fedray.UploadParts, scales: dict[str, float], threshold: float,
                  generator: torch.Generator) -> fedray.Params:
    """A FedCOF client's rows under the Gaussian mechanism with thresholding: for each row (class c, in the order of
    its classes), ñ = n_c + N(0, σ_n²) (r draws), then s̃ = Σz + N(0, σ_s²) (r × d draws), n_c and Σz being the
    client's class totals (its class counts and sums, noised at their ``scales`` σ_n and σ_s); a row is released
    when ñ ≥ ``threshold``, as (c, ñ, s̃/ñ), and otherwise kept in its place with count 0 and mean 0 (no weight in
    FedCOF's solve). The class totals and the rows per class (``received``) are those of the released rows."""
    rows, counts_name, sums_name = parts.rows, parts.named(0), parts.named(1)
    classes, counts, sums = tensors[rows.classes], tensors[counts_name], tensors[sums_name]
    count = counts[classes] + scales[counts_name] * torch.randn(len(classes), generator=generator, dtype=torch.float64)
    total = sums[classes] + scales[sums_name] * torch.randn(sums[classes].shape, generator=generator,
                                                            dtype=torch.float64)
    released = count >= threshold
    count = torch.where(released, count, 0.0)
    total = torch.where(released.unsqueeze(1), total, 0.0)
    means = total / torch.where(released, count, 1.0).unsqueeze(1)
    return {**tensors, counts_name: torch.zeros_like(counts).index_copy(0, classes, count),
            sums_name: torch.zeros_like(sums).index_copy(0, classes, total.to(sums.dtype)),
            rows.per_class: torch.zeros_like(tensors[rows.per_class]).index_copy(0, classes, released.to(counts.dtype)),
            rows.counts: count, rows.means: means.to(tensors[rows.means].dtype)}


def noisy(tensors: fedray.Params, scales: dict[str, float], generator: torch.Generator,
          parts: fedray.UploadParts | None = None) -> fedray.Params:
    """``tensors`` plus N(0, scale²) per entry, tensor after tensor in sorted name order; a symmetric sum's (ZᵀZ's, as
    ``parts`` declares it) noise symmetric. A training update (``parts`` None) has no symmetric part."""
    out = dict(tensors)
    for name in sorted(scales):
        value = tensors[name]
        draw = torch.randn(value.shape, generator=generator, dtype=torch.float64)
        if parts is not None and parts.of(name).symmetric:
            draw = torch.triu(draw) + torch.triu(draw, 1).T
        out[name] = value + (scales[name] * draw).to(value.dtype)
    return out


def well_defined(total: fedray.Params, parts: fedray.UploadParts) -> fedray.Params:
    """A noisy block sum the server can solve with: a symmetric sum (ZᵀZ) projected onto the PSD cone, class counts
    clamped at 0."""
    out = dict(total)
    for name, part in parts.sums.items():
        if name in total and part.symmetric:
            values, vectors = torch.linalg.eigh(total[name])
            projected = (vectors * values.clamp(min=0)) @ vectors.T
            out[name] = (projected + projected.T) / 2
        elif name in total and part.by_class and part.degree == 0:
            out[name] = total[name].clamp(min=0)
    return out
