"""numpy's BLAS on one thread: set by the outermost caller, kept through nested ones, restored when it leaves."""

import threadpoolctl

from fedray.core import threads
from fedray.core.threads import numpy_blas_single_threaded


def blas_threads() -> int:
    return threadpoolctl.ThreadpoolController().select(user_api="blas").info()[0]["num_threads"]


def test_nested_callers_keep_one_thread_until_the_outermost_leaves():
    with threadpoolctl.threadpool_limits(limits=3, user_api="blas"):
        with numpy_blas_single_threaded():
            with numpy_blas_single_threaded():
                assert blas_threads() == 1
            assert blas_threads() == 1  # the inner one left: the outer one still holds
        assert blas_threads() == 3



def test_nested_callers_set_the_limit_once(monkeypatch):
    """A loop of small products inside one caller pays the limit once (8 µs), not once a product."""
    limited = []
    controller = threads._numpy_blas()

    class Counting:
        def limit(self, limits: int):
            limited.append(limits)
            return controller.limit(limits=limits)

    monkeypatch.setattr(threads, "_numpy_blas", Counting)
    with numpy_blas_single_threaded():
        for _ in range(3):
            with numpy_blas_single_threaded():
                pass
    with numpy_blas_single_threaded():
        pass
    assert limited == [1, 1]
