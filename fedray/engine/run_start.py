"""A run's first steps, before torch is imported and its data read: the checks that need neither, its output folder
held, and Ray starting in the background (:class:`~fedray.runtime.ray_start.RayStart`).

This module imports neither torch nor Ray, so that ``fedray run`` begins Ray's start (seconds of waiting on its
processes) before it imports torch and reads the data, and joins it where Ray is first needed
(:func:`fedray.engine.run_config.run_started`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedray.core.folder_lock import holding
from fedray.core.writable import check_folder
from fedray.engine.config import RunConfig
from fedray.runtime.address import check_address
from fedray.runtime.ray_start import RayStart


@contextmanager
def starting(config: RunConfig, address: str | None = None,
             verbose: bool = False) -> Iterator[tuple[RunConfig, RayStart]]:
    """``config`` validated and resolved, the cluster at ``address`` answering, the output folder writable: every
    check of a run that needs neither its data nor Ray, before anything starts. Then, with that folder held for the
    block (a second run into it is refused), Ray starts on a thread of its own (``verbose``: see
    :func:`~fedray.runtime.session.init_ray`), which the block joins where Ray is first needed; a block that ends in
    an error before then (a refusal that read the data, a signal) shuts that Ray down, and the folder is left as it
    was found."""
    config = config.validate().resolved()
    check_address(address)
    check_folder(Path(config.out))
    with holding(Path(config.out)), RayStart(address, verbose) as ray_start:
        yield config, ray_start
