"""The closed-form methods' shared numerics: the weighted Gram against its sum of outer products, the Gram and the
solve give the same bits whatever the threads; their features' dtype, named without importing torch; which methods give compact statistics, and each client's held classes."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedray.methods.base import (ClientBatch, TorchDtype, client_gram_triangles, gram, HeldClasses,
                                 offers_compact_statistics, single_threaded, spd_solve)
from fedray.methods.ccvr import CCVR
from fedray.methods.fedcof import FedCOF, FedCOFOracle
from fedray.methods.ncm import FedNCM
from fedray.methods.ridge import Fed3R, RidgeStatistics
from fedray.methods.triangle import Triangle
from tests.threads import on_threads


def system(ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """XᵀX (+ ridge·I) of 12 samples in 51 dimensions, singular without the ridge, and a right-hand side of 3 columns."""
    generator = torch.Generator().manual_seed(0)
    samples = torch.randn(12, 51, generator=generator, dtype=torch.float64)
    rhs = torch.randn(51, 3, generator=generator, dtype=torch.float64)
    return samples.T @ samples + ridge * torch.eye(51, dtype=torch.float64), rhs


# 1e-3: positive definite, solved by Cholesky; 0: rank 12, solved by least squares. MKL gave different last bits on
# 1 and on 2 threads for both.
@pytest.mark.parametrize("ridge", [1e-3, 0.0])
def test_solve_has_the_same_bits_on_one_and_two_threads(ridge):
    matrix, rhs = system(ridge)
    one, two = (on_threads(count, lambda: spd_solve(matrix, rhs)) for count in (1, 2))
    assert torch.equal(one, two)


@pytest.mark.parametrize("signs", ["positive", "mixed", "none"])
def test_the_weighted_gram_is_the_sum_of_each_rows_weighted_outer_product(signs):
    generator = np.random.default_rng(3)
    rows = generator.standard_normal((40, 7))
    weights = {"positive": generator.random(40), "none": np.ones(40),
               # noisy counts (FedCOF App. I) can make a class's weight negative; some rows weigh nothing
               "mixed": np.where(np.arange(40) % 5 == 0, 0.0, generator.standard_normal(40))}[signs]
    expected = np.zeros((7, 7))
    for row, weight in zip(rows, weights):
        expected += weight * np.outer(row, row)
    computed = gram(torch.from_numpy(rows), None if signs == "none" else torch.from_numpy(weights)).numpy()
    np.testing.assert_allclose(computed, expected, rtol=1e-12, atol=1e-12)
    assert np.array_equal(computed, computed.T)


GRAM_BITS = """
import hashlib, torch
from fedray.methods.base import gram
generator = torch.Generator().manual_seed(0)
rows = torch.randn(3001, 300, generator=generator, dtype=torch.float64)
weights = torch.rand(3001, generator=generator, dtype=torch.float64) - 0.2
print(hashlib.sha256(gram(rows, weights).numpy().tobytes()).hexdigest())
"""


def test_the_weighted_gram_has_the_same_bits_on_one_and_two_blas_threads():
    """numpy's BLAS takes its threads from the environment when it loads (a shard's from its CPUs), hence the
    processes. Unlimited, this Gram had other last bits on 2 threads than on 1: OpenBLAS splits its sums by them."""
    def digest(threads: int) -> str:
        environment = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        return subprocess.run([sys.executable, "-c", GRAM_BITS], env=environment, capture_output=True, text=True,
                              check=True).stdout

    assert digest(1) == digest(2)


def test_single_threaded_restores_the_callers_threads():
    def inside_and_after() -> tuple[int, int]:
        with single_threaded():
            inside = torch.get_num_threads()
        return inside, torch.get_num_threads()

    assert on_threads(3, inside_and_after) == (1, 3)


def test_a_torch_dtype_attribute_reads_as_torchs_dtype_on_the_class_and_its_instances():
    class Stored:
        dtype = TorchDtype("float64")

    assert Stored.dtype is torch.float64 and Stored().dtype is torch.float64
    assert [method.features_dtype for method in (FedNCM, Fed3R, FedCOF, CCVR)] == [torch.float64] * 4
    assert Fed3R(8, 3).features_dtype is torch.float64


class OwnStatistics(Fed3R):
    """A plugin's Fed3R that uploads other statistics: the compact ones it inherits are not its own."""

    def client_statistics(self, batch: ClientBatch) -> RidgeStatistics:
        stats = super().client_statistics(batch)
        return RidgeStatistics(2 * stats.gram, stats.targets)


class OwnCompactStatistics(OwnStatistics):
    def compact_statistics(self, batch: ClientBatch):
        stats, held = super().compact_statistics(batch)
        return RidgeStatistics(2 * stats.gram, stats.targets), held


@pytest.mark.parametrize("method, offers", [(Fed3R(4, 3), True), (FedNCM(4, 3), True), (FedCOFOracle(4, 3), False),
                                            (OwnStatistics(4, 3), False), (OwnCompactStatistics(4, 3), True)])
def test_compact_statistics_are_offered_only_by_the_class_that_computes_the_statistics(method, offers):
    assert offers_compact_statistics(method) == offers


def test_held_classes_are_each_clients_classes_with_its_labels_as_indices_and_the_pairs_sums_and_counts():
    batch = ClientBatch(torch.arange(12.0).reshape(6, 2), torch.tensor([4, 1, 4, 2, 0, 2]), np.array([0, 3, 3, 6]),
                        np.array([7, 8, 9]))
    held = HeldClasses.of(batch)
    assert [held.classes[held.of_client(position)].tolist() for position in range(3)] == [[1, 4], [], [0, 2]]
    assert [held.local_labels(batch, position).tolist() for position in range(3)] == [[1, 0, 1], [], [1, 0, 1]]
    # the pairs (7, 1), (7, 4), (9, 0), (9, 2): rows [2, 3]; [0, 1] + [4, 5]; [8, 9]; [6, 7] + [10, 11]
    counts, sums = held.class_sums(batch.features)
    assert counts.tolist() == [1, 2, 1, 2]
    assert sums.tolist() == [[2, 3], [4, 6], [8, 9], [16, 18]]
    assert sums.dtype == torch.float64


def test_client_gram_triangles_are_each_clients_own_gram_bit_for_bit():
    """Clients of 0 to 40 rows at every offset of one tensor (so at every alignment), in float64 as their own
    uploads compute them, at an even and an odd width: each row the distinct entries of ``gram`` of the client's rows
    alone, in the triangle's order."""
    rng = np.random.default_rng(3)
    sizes = [0, *rng.integers(1, 41, size=30).tolist(), 1]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    for width in (22, 23):
        rows = torch.from_numpy(rng.normal(size=(sum(sizes), width)))
        triangles = client_gram_triangles(rows, offsets)
        positions = torch.from_numpy(Triangle.of(width).positions)
        assert triangles.shape == (len(sizes), width * (width + 1) // 2)
        for client, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
            own = gram(rows[start:end].clone())
            assert torch.equal(triangles[client], own.reshape(-1)[positions]), (width, client)
