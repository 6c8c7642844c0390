"""The driver's private memory is sampled: pages held longer than a sample's interval show in its peak, and the
peak stays once they are freed."""

import ctypes
import mmap
import time

from jobs.private_memory import MB, PeakPrivateMemory, heap_in_use, resident_parts

PAGE = mmap.PAGESIZE


def test_pages_held_for_a_few_samples_raise_the_private_peak_by_their_size():
    memory = PeakPrivateMemory(interval_s=0.01).start()
    time.sleep(0.05)
    before = memory.figures()["driver_peak_private_mb"]
    # private anonymous pages of their own (not the allocator's, which may reuse pages already resident), each written
    held = mmap.mmap(-1, 200 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, 200 * MB, PAGE):
        held[offset] = 1
    time.sleep(0.2)
    held.close()
    time.sleep(0.05)
    grown = memory.figures()["driver_peak_private_mb"] - before
    assert 190 <= grown <= 230, grown
    assert resident_parts()["RssAnon"] < (before + 100) * MB  # unmapped, while the peak stays


def test_bytes_malloc_hands_out_raise_the_heap_peak_by_their_size_whether_or_not_their_pages_are_touched():
    memory = PeakPrivateMemory(interval_s=0.01).start()
    time.sleep(0.05)
    before = memory.figures()["driver_peak_heap_mb"]
    held = ctypes.CDLL(None).malloc  # malloc's own: numpy's and torch's arrays come from it too
    held.restype, held.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    block = held(200 * MB)  # never written: no page of it is resident
    time.sleep(0.2)
    ctypes.CDLL(None).free(ctypes.c_void_p(block))
    time.sleep(0.05)
    grown = memory.figures()["driver_peak_heap_mb"] - before
    assert 199 <= grown <= 210, grown
    assert heap_in_use() < (before + 100) * MB  # given back, while the peak stays
