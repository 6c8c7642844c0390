"""Sample-level differential privacy for closed-form statistics: each sample's features clipped to norm R, Gaussian noise
on what the clients release, ε(δ) from Google's ``dp-accounting`` (PLD or RDP accountant), reported in every row.

    fedray run --method fed3r --postprocessor dp --option clip_norm=1 --option dp_epsilon=2 --option dp_delta=1e-5
    fedray run --method fedncm --postprocessor dp --option clip_norm=1 --option dp_noise=3 --option dp_delta=1e-5 \\
        --option dp_placement=distributed

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
- FedCOF is refused: it releases each client's class means μ = sums/n and counts in clear, and which classes a client
  holds; a mean is not a sum of per-sample terms (its sensitivity 2R/n grows as n falls, and a class of one sample
  appears or vanishes with it), so noise on its sums alone would leave the means it sends unprotected. Likewise
  refused: any other upload (covariances, training updates: DP-FedAvg is issue 28 §2), and statistics whose width is
  not the clipped features' (fed3r ``--bias``'s ones column, fed3r-rf's random features, which the clip does not bound).

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
ε(δ) is at most ε, by ``calibrate_dp_mechanism``; a budget that needs more than 1000 is refused) or σ
(``dp_noise``: ε is computed). σ = 0 (``dp_noise=0``) is no privacy, ε = ∞: no noise is drawn
and no sum projected, so with a clip no row reaches the run is the plain run bit for bit. The accountant is
the PLD one (near exact for the Gaussian mechanism, value discretization 1e-3) or ``dp_accountant=rdp``.

Not supported yet, refused in one line: ``dp_unit=client`` (client-level DP) and any upload other than FedNCM's and
Fed3R's (above). Noise draws come from the context's generator (the run's seed, round, client or aggregate,
place in the list), one tensor after another in the order of the upload's names, so a run is the same on any layout.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Annotated

import dp_accounting
import torch
from dp_accounting import pld, rdp

import fedray

PLACEMENTS = ("central", "distributed")
ACCOUNTANTS = ("pld", "rdp")
NOISE_RANGE = (0.1, 1000.0)
"""The noise multipliers a budget is calibrated within: above the upper end no run learns anything."""
PLD_DISCRETIZATION = 1e-3

SENSITIVITY = {frozenset({"counts", "sums"}): {"counts": 0, "sums": 1},
               frozenset({"gram", "targets"}): {"gram": 2, "targets": 1}}
"""The uploads this postprocessor privatizes, each tensor's L2 sensitivity as a power of R (Δ = R^power)."""
NAME = "--postprocessor dp"


def release(noise: float) -> dp_accounting.DpEvent:
    """One client's upload as the accountant sees it: two tensors, each a Gaussian mechanism of multiplier ``noise``."""
    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(noise)] * 2)


def accountant(kind: str) -> dp_accounting.PrivacyAccountant:
    if kind == "pld":
        return pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    return rdp.RdpAccountant()


@cache
def epsilon(noise: float, delta: float, kind: str = "pld") -> float:
    """ε(δ) of one release (:func:`release`) with noise multiplier ``noise``, from ``kind``'s accountant."""
    spent = accountant(kind)
    spent.compose(release(noise))
    return float(spent.get_epsilon(delta))


def calibrated(target: float, delta: float, kind: str = "pld") -> float:
    """The smallest noise multiplier in :data:`NOISE_RANGE` whose ε(δ) is at most ``target``."""
    low, high = NOISE_RANGE
    if epsilon(high, delta, kind) > target:
        raise ValueError(f"no noise multiplier up to {high:g} meets dp_epsilon={target:g} at dp_delta={delta:g} "
                         f"(ε there is {epsilon(high, delta, kind):.3g}); ask for a larger ε or δ")
    if epsilon(low, delta, kind) <= target:
        return low
    return float(dp_accounting.calibrate_dp_mechanism(lambda: accountant(kind), release, target, delta,
                                                      dp_accounting.ExplicitBracketInterval(low, high)))


class GaussianMechanism(fedray.Postprocessor):
    """Sample-level (ε, δ)-DP for FedNCM and Fed3R: features clipped to R, Gaussian noise σ·Δ on each released sum."""

    def __init__(self, clip_norm: Annotated[float | None, "R: each sample's features clipped to norm ≤ R (required)"] = None,
                 dp_delta: Annotated[float | None, "δ of the (ε, δ) guarantee, 0 < δ < 1 (required)"] = None,
                 dp_epsilon: Annotated[float | None, "ε: calibrate the noise to this budget (or give dp_noise)"] = None,
                 dp_noise: Annotated[float | None, "σ: the noise multiplier, std σ·Δ per tensor (or give dp_epsilon)"] = None,
                 dp_placement: Annotated[str, "central (the server, once per block) or distributed (each client, "
                                              "σ/√κ)"] = "central",
                 dp_unit: Annotated[str, "what is protected: sample (client: not supported yet)"] = "sample",
                 dp_accountant: Annotated[str, "pld or rdp (dp-accounting)"] = "pld") -> None:
        super().__init__()
        if dp_unit != "sample":
            raise ValueError(f"option dp_unit must be sample, got {dp_unit!r} (client-level DP is not supported yet)")
        if dp_placement not in PLACEMENTS:
            raise ValueError(f"option dp_placement must be central or distributed, got {dp_placement!r}")
        if dp_accountant not in ACCOUNTANTS:
            raise ValueError(f"option dp_accountant must be pld or rdp, got {dp_accountant!r}")
        if clip_norm is None or not clip_norm > 0 or not math.isfinite(clip_norm):
            raise ValueError(f"option clip_norm is required: each sample's feature norm bound R (> 0), got {clip_norm}")
        if dp_delta is None:
            raise ValueError("option dp_delta is required: the δ of the (ε, δ) guarantee (e.g. 1e-5, below 1/samples)")
        if not 0 < dp_delta < 1:
            raise ValueError(f"option dp_delta must be in (0, 1), got {dp_delta}")
        if (dp_epsilon is None) == (dp_noise is None):
            raise ValueError("give one of option dp_epsilon (the budget; the noise is calibrated) or option dp_noise "
                             f"(the noise multiplier; ε is computed), got {'both' if dp_noise is not None else 'neither'}")
        if dp_noise is not None and not (dp_noise >= 0 and math.isfinite(dp_noise)):
            raise ValueError(f"option dp_noise must be ≥ 0 (0: no privacy, ε = ∞), got {dp_noise}")
        if dp_epsilon is not None and not (dp_epsilon > 0 and math.isfinite(dp_epsilon)):
            raise ValueError(f"option dp_epsilon must be > 0 (no privacy: dp_noise=0), got {dp_epsilon}")
        self.clip_norm, self.delta, self.placement, self.kind = float(clip_norm), float(dp_delta), dp_placement, dp_accountant
        self.noise = float(dp_noise) if dp_noise is not None else calibrated(dp_epsilon, self.delta, dp_accountant)
        self.clipped_width: int | None = None
        """The width of the rows this copy (in a shard) last clipped: a client's statistics must be of that width."""

    @property
    def per_client(self) -> bool:
        return True

    def features(self, features: torch.Tensor) -> torch.Tensor:
        self.clipped_width = features.shape[1]
        norms = torch.linalg.vector_norm(features, dim=1, keepdim=True)
        return torch.where(norms > self.clip_norm, features * (self.clip_norm / norms), features)

    def scales(self, tensors: fedray.Params) -> dict[str, float]:
        """σ·Δ_t for each tensor of a FedNCM or Fed3R upload; a one-line error for any other."""
        powers = SENSITIVITY.get(frozenset(tensors))
        if powers is None:
            raise fedray.FedrayError(
                f"{NAME}: an upload of {', '.join(tensors) or 'no tensors'} is not supported; sample-level DP covers "
                f"fedncm's class sums and fed3r's ZᵀZ, ZᵀY (fedcof sends class means and counts, which are not sums of "
                f"per-sample terms; training updates need DP-FedAvg, not built in yet)")
        return {name: self.noise * self.clip_norm**power for name, power in powers.items()}

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        scales = self.scales(upload.tensors)
        width = upload.tensors["sums"].shape[1] if "sums" in upload.tensors else upload.tensors["gram"].shape[0]
        if width != self.clipped_width:
            raise fedray.FedrayError(f"{NAME}: statistics of width {width} from clipped features of width "
                                     f"{self.clipped_width}: a bias column (fed3r --bias) or a feature map (fed3r-rf) "
                                     f"the clip does not bound; run without them")
        if self.placement == "central" or self.noise == 0:
            return upload
        share = 1 / math.sqrt(context.sampling.per_round)
        return fedray.Upload(noisy(upload.tensors, {name: scale * share for name, scale in scales.items()},
                                   context.generator), upload.weight)

    def aggregate(self, total: fedray.Params, context: fedray.UploadContext) -> fedray.Params:
        scales = self.scales(total)
        if self.noise == 0:
            fedray.report(dp_epsilon=math.inf, dp_delta=self.delta)
            return total
        if self.placement == "central":
            total, multiplier = noisy(total, scales, context.generator), self.noise
        else:
            multiplier = self.noise * math.sqrt(context.clients / context.sampling.per_round)
        spent = max(epsilon(multiplier, self.delta, self.kind), float(self.state.get("dp_epsilon", 0.0)))
        self.state = {"dp_epsilon": torch.tensor(spent, dtype=torch.float64)}
        fedray.report(dp_epsilon=spent, dp_delta=self.delta)
        return well_defined(total)


def noisy(tensors: fedray.Params, scales: dict[str, float], generator: torch.Generator) -> fedray.Params:
    """``tensors`` plus N(0, scale²) per entry, tensor after tensor in sorted name order; ``gram`` symmetric."""
    out = dict(tensors)
    for name in sorted(scales):
        value = tensors[name]
        draw = torch.randn(value.shape, generator=generator, dtype=torch.float64)
        if name == "gram":
            draw = torch.triu(draw) + torch.triu(draw, 1).T
        out[name] = value + (scales[name] * draw).to(value.dtype)
    return out


def well_defined(total: fedray.Params) -> fedray.Params:
    """A noisy block sum the server can solve with: ZᵀZ projected onto the PSD cone, counts clamped at 0."""
    out = dict(total)
    if "gram" in total:
        values, vectors = torch.linalg.eigh(total["gram"])
        projected = (vectors * values.clamp(min=0)) @ vectors.T
        out["gram"] = (projected + projected.T) / 2
    if "counts" in total:
        out["counts"] = total["counts"].clamp(min=0)
    return out
