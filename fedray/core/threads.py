"""Torch's and numpy's CPU work on one thread where the result or the speed depends on it."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

from fedray.core.lazy_modules import lazy_module

if TYPE_CHECKING:
    import threadpoolctl

torch = lazy_module("torch", globals())


@contextmanager
def single_threaded() -> Iterator[None]:
    """Torch's CPU work inside on one intra-op thread, the caller's thread count restored after.

    MKL's LAPACK and GEMMs and torch's reductions over more than 32,768
    elements split their work, and with it the order of their additions, by
    the number of threads: the same 51 × 51 system solved on 1 and on 2
    threads differs in the last bits, and a residual summed to ~1e-17 changes
    sign. The driver's thread count is its machine's (or its Tune trial's
    CPUs), not the run's configuration, so what it computes for a result row
    runs here; one thread gives one order, wherever it runs.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _numpy_blas() -> threadpoolctl.ThreadpoolController:
    """The BLAS numpy loaded, found once a process (a few ms) by threadpoolctl."""
    import numpy  # noqa: F401  (loads the BLAS the controller is to find)
    import threadpoolctl

    return threadpoolctl.ThreadpoolController().select(user_api="blas")


class _NumpyBlasOnOneThread:
    """The one-thread limit on numpy's BLAS while any caller is inside it: set by the first to enter, restored by the
    last to leave."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._limit: threadpoolctl._ThreadpoolLimiter | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if not self._inside:
                self._limit = _numpy_blas().limit(limits=1)
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if not self._inside:
                    self._limit.restore_original_limits()


_ONE_THREAD = _NumpyBlasOnOneThread()


def numpy_blas_single_threaded() -> AbstractContextManager[None]:
    """numpy's BLAS calls inside on one thread, its thread count restored after (8 µs the outermost; nothing more
    inside another: a loop of small products enters once around them).

    OpenBLAS takes its threads from the environment (a Ray actor's from its CPUs) and splits a product's sums by
    them: the same rank-k update Xᵀ X of 3,001 rows in 300 dimensions had other last bits on 2 threads than on 1.
    """
    return _ONE_THREAD.held()
