"""Noise on the class counts clients share (FedCOF, Appendix I.1): ñ_kc = max(n_kc + σ, 0), the class means unchanged.

    fedray run --method fedcof --postprocessor count-noise --option count_noise=laplace --option count_noise_epsilon=0.1
    fedray run --method fedncm --postprocessor count-noise --option count_noise=uniform --option count_noise_epsilon=0.5

Each client perturbs the count n_kc of every class c it holds before it
uploads, with noise of intensity ε (lower ε: more noise), as FedCOF Eq. 23:

- ``uniform``: σ ~ U(−(1−ε) n_kc, +(1−ε) n_kc), proportional to the count (0 < ε ≤ 1; ε = 1 is no noise);
- ``gaussian``: σ ~ N(0, 1/ε), read as the paper's N(μ, σ²) notation: variance 1/ε, standard deviation 1/√ε;
- ``laplace``: σ ~ Laplace(0, 1/ε), scale b = 1/ε (standard deviation √2/ε): the Laplace mechanism for a count
  (sensitivity 1) at privacy ε.

(The paper gives the distributions only; its authors' published code has no noise to read the Gaussian's parameter
from.) The client sends its class means as they are and its sums as ñ_kc · μ_kc (its sums rescaled by ñ_kc / n_kc),
so the server weights each mean by ñ_kc. A class whose ñ_kc is 0 is not sent: count 0, sums 0, and for FedCOF not
counted as received, its mean row zeroed with a count of 0, so it enters neither the class total nor the unbiased
covariance estimator (a row of count 0 adds nothing to FedCOF's weighted Gram of the means).

The noisy counts are real numbers, as the paper's are, and are sent as they are: rounding them would undo the uniform
noise on small counts (with ε = 0.9, a count of 3 moves by at most 0.3). The servers divide a class's sums by its
total count, which may then be below 1 (fedray's methods use :func:`~fedray.methods.base.class_divisors`, not
max(N_c, 1)); FedCOF's weight (N_c − 1)/(K_c − 1) and shrinkage (N_c − 1)⁺ take the real totals as they are.

It applies to the uploads that carry per-class counts with their class sums (as their methods declare them, in
:attr:`fedray.Upload.parts`): FedNCM's (counts, sums) and FedCOF's with one mean per class held
(``--means-per-class 1``). Any other upload (Fed3R's ZᵀZ, FedCOF-oracle's or CCVR's
covariances, several means per class, a training update) is refused in one line on its first client, before
anything is summed: the postprocessor interface does not hand it the method beforehand.

The draws come from the context's generator (the run's seed, the round, the client, the postprocessor's place):
one value per class of the upload, class 0 to C − 1, whether the client holds the class or not (uniform: one
U[0, 1) draw u, σ = (1−ε) n (2u − 1); Gaussian: one standard normal z, σ = z/√ε; Laplace: two U[0, 1) draws of C
values each, u then v, σ = (log(1 − v) − log(1 − u))/ε, the difference of two exponentials), so a class's noise
does not depend on which other classes the client holds nor on the shard layout. With uniform noise at ε = 1 nothing
changes and the run is the plain one, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import fedray

if TYPE_CHECKING:
    import torch

KINDS = ("uniform", "gaussian", "laplace")


class ClassCountNoise(fedray.Postprocessor):
    """FedCOF App. I: each client's class counts ñ = max(n + σ, 0), σ uniform, Gaussian or Laplace; its means as they are."""

    def __init__(self, count_noise: Annotated[str, "the noise on each class count: uniform (±(1−ε) n), gaussian "
                                                   "(variance 1/ε) or laplace (scale 1/ε)"] = "laplace",
                 count_noise_epsilon: Annotated[float | None, "the noise intensity ε (> 0, ≤ 1 for uniform; lower is "
                                                              "noisier; required)"] = None) -> None:
        super().__init__()
        if count_noise not in KINDS:
            raise ValueError(f"option count_noise must be {', '.join(KINDS[:-1])} or {KINDS[-1]}, got {count_noise!r}")
        if count_noise_epsilon is None:
            raise ValueError("option count_noise_epsilon is required: the noise intensity ε (> 0; the paper's 0.1 to 0.9)")
        if not count_noise_epsilon > 0:
            raise ValueError(f"option count_noise_epsilon must be > 0, got {count_noise_epsilon}")
        if count_noise == "uniform" and count_noise_epsilon > 1:
            raise ValueError(f"option count_noise_epsilon must be ≤ 1 with uniform noise, got {count_noise_epsilon}")
        self.kind, self.epsilon = count_noise, count_noise_epsilon

    @property
    def per_client(self) -> bool:
        return True

    def noise(self, counts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """σ for each class of ``counts`` (float64), drawn class after class from ``generator``."""
        import torch  # where used: reading the options (fedray --help) needs no torch

        shape = (len(counts),)
        if self.kind == "uniform":
            u = torch.rand(shape, generator=generator, dtype=torch.float64)
            return (1 - self.epsilon) * counts * (2 * u - 1)
        if self.kind == "gaussian":
            return torch.randn(shape, generator=generator, dtype=torch.float64) / self.epsilon**0.5
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        v = torch.rand(shape, generator=generator, dtype=torch.float64)
        return (torch.log1p(-v) - torch.log1p(-u)) / self.epsilon

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        import torch  # where used: reading the options (fedray --help) needs no torch

        tensors, parts = upload.tensors, check_counts(upload)
        counts_name, sums_name = parts.named(0), parts.named(1)
        counts = tensors[counts_name]
        noisy = torch.where(counts > 0, (counts + self.noise(counts, context.generator)).clamp(min=0), 0.0)
        scale = noisy / torch.where(counts > 0, counts, 1.0)
        sums = tensors[sums_name]
        out = {**tensors, counts_name: noisy, sums_name: sums * scale.to(sums.dtype).unsqueeze(1)}
        if parts.rows is not None:
            rows = parts.rows
            classes = tensors[rows.classes]
            sent = noisy[classes] > 0
            out.update({rows.per_class: (noisy > 0).to(counts.dtype), rows.counts: noisy[classes],
                        rows.means: torch.where(sent.unsqueeze(1), tensors[rows.means], 0.0)})
        return fedray.Upload(out, upload.weight)


def check_counts(upload: fedray.Upload) -> fedray.UploadParts:
    """The parts of ``upload`` if it is class counts and class sums (FedNCM's), or those with one mean row per class
    held (FedCOF's), else a one-line error naming its tensors."""
    import torch  # where used: reading the options (fedray --help) needs no torch

    tensors, parts = upload.tensors, upload.parts
    names = frozenset(tensors)
    what = f"an upload of {', '.join(tensors) or 'no tensors'}"
    counted = parts is not None and parts.named(0) is not None and parts.named(1) is not None
    rows = frozenset() if parts is None or parts.rows is None else parts.rows.names
    if not counted or names != {parts.named(0), parts.named(1)} | rows:
        raise fedray.FedrayError(f"--postprocessor count-noise: {what} has no class counts to perturb; it applies to "
                                 f"fedncm's class sums and fedcof's class means (--means-per-class 1), not to Fed3R's "
                                 f"Gram matrix, covariances (fedcof-oracle, ccvr) or training updates")
    counts, sums = tensors[parts.named(0)], tensors[parts.named(1)]
    if counts.dtype != torch.float64 or counts.dim() != 1 or sums.dim() != 2 or len(sums) != len(counts):
        raise fedray.FedrayError(f"--postprocessor count-noise: {what} whose counts are not one float64 per class "
                                 f"(counts {tuple(counts.shape)}, sums {tuple(sums.shape)})")
    if parts.rows is not None:
        classes = tensors[parts.rows.classes]
        held = torch.nonzero(counts > 0).flatten()
        if not torch.equal(torch.sort(classes).values, held) or not torch.equal(tensors[parts.rows.counts],
                                                                                counts[classes]):
            raise fedray.FedrayError("--postprocessor count-noise: fedcof's upload has several means for a class "
                                     "(--means-per-class > 1); it perturbs one count and mean per class held")
    return parts
