"""The driver's private memory is sampled: a buffer held longer than a sample's interval shows in its peak, and the
object store's pages are not counted in it."""

import time

import numpy as np

from jobs.private_memory import MB, PeakPrivateMemory, resident_parts


def test_a_buffer_held_for_a_few_samples_raises_the_private_peak_by_its_size():
    memory = PeakPrivateMemory(interval_s=0.01).start()
    time.sleep(0.05)
    before = memory.figures()["driver_peak_private_mb"]
    held = np.ones(200 * MB, dtype=np.uint8)  # written: its pages are resident
    time.sleep(0.1)
    del held
    time.sleep(0.05)
    grown = memory.figures()["driver_peak_private_mb"] - before
    assert 190 <= grown <= 260, grown
    assert resident_parts()["RssAnon"] < (before + 100) * MB  # freed, while the peak stays
