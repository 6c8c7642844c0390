"""Running a computation on a given number of torch intra-op threads, for tests of bits that must not depend on them."""

from typing import Callable, TypeVar

import torch

Result = TypeVar("Result")


def on_threads(count: int, compute: Callable[[], Result]) -> Result:
    """``compute()`` with torch set to ``count`` threads (more than the machine's cores still splits the work so), then
    the caller's count back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return compute()
    finally:
        torch.set_num_threads(threads)
