"""The driver's peak private memory over a benchmark's run, beside its peak resident memory.

A process's peak resident memory (``ru_maxrss``) counts every page it has mapped, the object store's shared pages
too: each ``ray.put`` or fetched result touches the store's pages where it lies, and they stay counted in the
driver's RSS as long as the store stays mapped, however long ago the object was freed. So a run that keeps more
objects in the store at once (an asynchronous run's queued batches) shows a higher driver RSS with the same driver
heap. Linux keeps no peak of the private (anonymous) part, so it is sampled here: every ``interval_s``.

The private part still moves with the allocator: pages malloc freed but kept (a thread's arena, a freed block short of
the trim threshold) stay counted, so two runs that allocate the same bytes in another order can peak tens of MB apart.
Beside it, the bytes malloc has handed out and not had back (glibc's ``mallinfo2``: ``uordblks + hblkhd``) are
sampled too: what the process's code holds through malloc (numpy's and torch's arrays, Python's objects over 512
bytes, Ray's C++ core), without the allocator's own slack, nor what is mapped without malloc (Python's arenas of
small objects, OpenBLAS's buffers).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MB = 2**20
FIELDS = ("RssAnon", "RssFile", "RssShmem")


def resident_parts() -> dict[str, int]:
    """This process's resident bytes now, by kind: private (``RssAnon``), mapped files (``RssFile``: torch's and Ray's
    libraries, shared with every process that loads them) and shared memory (``RssShmem``: the object store's pages
    it has touched)."""
    parts = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in FIELDS:
                parts[name] = int(value.split()[0]) * 1024
    return parts


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)  # glibc 2.33 and later
    if mallinfo2 is not None:
        mallinfo2.restype = _MallInfo2
    return mallinfo2


def heap_in_use() -> int | None:
    """The bytes malloc has handed out to this process and not had back, in every arena and mapped block (None without
    glibc's ``mallinfo2``)."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return info.uordblks + info.hblkhd


@dataclass
class PeakPrivateMemory:
    """Samples :func:`resident_parts` in a daemon thread from :meth:`start`; :meth:`figures` reads the peaks."""

    interval_s: float = 0.02
    peaks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0))
    peak_heap: int | None = field(default_factory=heap_in_use)

    def start(self) -> "PeakPrivateMemory":
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        while True:
            time.sleep(self.interval_s)
            for name, value in resident_parts().items():
                self.peaks[name] = max(self.peaks[name], value)
            self._sample_heap()

    def _sample_heap(self) -> None:
        if self.peak_heap is not None:
            self.peak_heap = max(self.peak_heap, heap_in_use() or 0)

    def figures(self) -> dict[str, int]:
        """The peaks so far, in MB: ``driver_peak_private_mb``, ``driver_peak_store_pages_mb`` and, with glibc,
        ``driver_peak_heap_mb``."""
        now = resident_parts()
        self._sample_heap()
        heap = {} if self.peak_heap is None else {"driver_peak_heap_mb": round(self.peak_heap / MB)}
        return {"driver_peak_private_mb": round(max(self.peaks["RssAnon"], now["RssAnon"]) / MB),
                "driver_peak_store_pages_mb": round(max(self.peaks["RssShmem"], now["RssShmem"]) / MB), **heap}
