"""The driver's peak private memory over a benchmark's run, beside its peak resident memory.

A process's peak resident memory (``ru_maxrss``) counts every page it has mapped, the object store's shared pages
too: each ``ray.put`` or fetched result touches the store's pages where it lies, and they stay counted in the
driver's RSS as long as the store stays mapped, however long ago the object was freed. So a run that keeps more
objects in the store at once (an asynchronous run's queued batches) shows a higher driver RSS with the same driver
heap. Linux keeps no peak of the private (anonymous) part, so it is sampled here: every ``interval_s``.
"""

from __future__ import annotations

import threading
import time
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


@dataclass
class PeakPrivateMemory:
    """Samples :func:`resident_parts` in a daemon thread from :meth:`start`; :meth:`figures` reads the peaks."""

    interval_s: float = 0.02
    peaks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0))

    def start(self) -> "PeakPrivateMemory":
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        while True:
            time.sleep(self.interval_s)
            for name, value in resident_parts().items():
                self.peaks[name] = max(self.peaks[name], value)

    def figures(self) -> dict[str, int]:
        """The peaks so far, in MB: ``driver_peak_private_mb`` and ``driver_peak_store_pages_mb``."""
        now = resident_parts()
        return {"driver_peak_private_mb": round(max(self.peaks["RssAnon"], now["RssAnon"]) / MB),
                "driver_peak_store_pages_mb": round(max(self.peaks["RssShmem"], now["RssShmem"]) / MB)}
