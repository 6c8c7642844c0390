"""A postprocessor in one file: every client's upload clipped to L2 norm R, Gaussian noise N(0, σ²) on the aggregate.

    fedray run --method fed3r --postprocessor examples/gaussian_noise.py:GaussianNoise --option clip=10 --option noise_std=0.5
    fedray run --method fedavg --postprocessor examples/gaussian_noise.py:GaussianNoise --option noise_std=0.01 ...

The Gaussian mechanism's two halves as fedray places them: each client scales
its upload's tensors (all together: a closed-form method's statistics, a
training algorithm's update) by min(1, R / ‖tensors‖₂) before it leaves, and
the server adds independent N(0, σ²) noise to every coordinate of the sum it
receives (a training round's sum, or a closed-form evaluation block's). The
server sums weight_k · tensors_k: a training upload's weight (FedAvg: n_k) is
left as it is here, so a client's share of the sum is bounded by n_k · R; fix
the weight too (``fedray.Upload(tensors, 1.0)``) for the uniformly weighted
sum DP-FedAvg analyses. This is the mechanism only: choosing σ for a privacy
budget needs an accountant. With ``noise_std`` 0 and a ``clip`` no upload
reaches, the run is the plain one, bit for bit.
"""

from typing import Annotated

import torch

import fedray


class GaussianNoise(fedray.Postprocessor):
    def __init__(self, clip: Annotated[float | None, "clip each client's upload to this L2 norm (none: no clipping)"] = None,
                 noise_std: Annotated[float, "σ of the noise added to each coordinate of the aggregate"] = 0.0) -> None:
        super().__init__()
        if clip is not None and not clip > 0:
            raise ValueError(f"option clip must be > 0, got {clip}")
        if not noise_std >= 0:
            raise ValueError(f"option noise_std must be ≥ 0, got {noise_std}")
        self.clip, self.noise_std = clip, noise_std

    @property
    def per_client(self) -> bool:
        return self.clip is not None

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        norm = torch.sqrt(sum(torch.sum(tensor.double() ** 2) for tensor in upload.tensors.values()))
        if norm <= self.clip:
            return upload
        scale = self.clip / float(norm)
        return fedray.Upload({name: tensor * scale for name, tensor in upload.tensors.items()}, upload.weight)

    def aggregate(self, total: fedray.Params, context: fedray.UploadContext) -> fedray.Params:
        if self.noise_std == 0:
            return total
        return {name: tensor + self.noise_std * torch.randn(tensor.shape, generator=context.generator, dtype=tensor.dtype)
                for name, tensor in total.items()}
