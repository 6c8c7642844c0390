"""The driver's private memory is sampled: pages held longer than a sample's interval show in its peak, and the
peak stays once they are freed."""

import mmap
import time

from jobs.private_memory import MB, PeakPrivateMemory, resident_parts

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
