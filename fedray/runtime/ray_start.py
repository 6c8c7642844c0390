"""Ray started (or joined) on a thread of its own, while the driver imports torch and reads its data.

``ray.init`` spends seconds waiting on the processes it starts (the GCS, the raylet and its agents): a run spends them
importing torch, reading its federation and planning its stages instead. :class:`RayStart` begins the start on a
thread once the checks that need neither the data nor Ray have passed; :meth:`RayStart.join` waits for it where Ray is
first needed. A block (``with RayStart(...)``) that ends in an error before the join (a refusal that read the data,
Ctrl-C, SIGTERM) stops what the start began: it waits for ``ray.init`` to end and shuts that Ray down, so that no
process of it outlives the refusal; a second signal meanwhile SIGKILLs those processes at once.

Signals reach the main thread only, so a start on its own thread is never cut short halfway (the driver's core worker
half-built, which :func:`fedray.runtime.session.init_ray` defers interrupts for on the main thread). The thread lives
on once Ray is up, as long as the process (or until :meth:`RayStart.stop`): Ray ties its GCS, raylet and monitors to
the thread that started them (Linux's PR_SET_PDEATHSIG fires when that thread ends, not the process), and they would
be killed with it.

A command that finished its work on an embedded Ray it started ends without Ray's shutdown (:func:`end_process`):
the watchdog (:mod:`fedray.runtime.watchdog`) ends Ray's processes as it does whenever the driver ends, and the command
returns as soon as its work is done (a refused or signalled one still ends through Ray's shutdown).

This module imports neither torch nor Ray; the thread imports Ray, :meth:`RayStart.join` torch. It imports the
standard modules that register fork hooks taking a lock before a fork and releasing it after (``logging``,
``concurrent.futures``'s threads): torch's import on the main thread imported them while the start thread forked
Ray's processes, and a hook registered between a fork's two halves released a lock it had never taken (``Exception
ignored in: <built-in method release of _thread.lock object> ... RuntimeError: release unlocked lock`` in the middle
of a refusal's one line).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  fork hooks registered before any start thread forks (see above)
import logging  # noqa: F401  the same
import os
import sys
import threading
import time
from types import TracebackType
from typing import NoReturn

from fedray.core import interrupts
from fedray.runtime import watchdog


def ray_is_up() -> bool:
    """Whether this process is connected to Ray, without importing Ray (``fedray --help`` stays quick; a signal may
    have stopped its import halfway)."""
    is_initialized = getattr(sys.modules.get("ray"), "is_initialized", None)
    return is_initialized is not None and is_initialized()


def started_embedded_ray() -> bool:
    """Whether this process is connected to an embedded Ray that it started itself (not to a cluster it joined),
    without importing Ray."""
    worker = getattr(sys.modules.get("ray"), "_private", None)
    node = getattr(getattr(worker, "worker", None), "_global_node", None)
    return ray_is_up() and node is not None and node.head


def end_process(code: int) -> NoReturn:
    """End this process with exit ``code``. A process that finished its work (``code`` 0) on an embedded Ray it started
    ends at once: its exit handlers run (flushing its output), all but Ray's shutdown, and then it leaves without
    Python's interpreter teardown. A refusal or a signal (any other code) ends through Ray's shutdown as before: a
    signal may come while Ray's processes are still being started, which only the shutdown waits for.

    Ray's shutdown stops its processes one after another, each given time to end (1.3–1.7 s at a load of 8 on 2
    cores), and the teardown of a process that imported torch and Ray takes about as long again: neither is needed
    once the command's results are written, since Ray's processes end with the driver anyway (the raylet and the GCS
    with its Ray-start thread, their workers with the raylet, and the rest by the watchdog,
    :mod:`fedray.runtime.watchdog`). Files a plugin left open and unflushed are not flushed. Elsewhere (no Ray, or a
    cluster joined), the process exits as usual."""
    if code != 0 or not started_embedded_ray():
        sys.exit(code)
    atexit.unregister(sys.modules["ray"]._private.worker.shutdown)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


class RayStart:
    """:func:`~fedray.runtime.session.init_ray` begun on a thread of its own (nothing to begin when this process is
    connected to Ray already: a Tune trial, a second run in a notebook)."""

    def __init__(self, address: str | None = None, verbose: bool = False) -> None:
        self.address, self.verbose = address, verbose
        self.up_s: float | None = None
        """Seconds the start took on its thread, from its beginning until Ray was up (None: none was begun)."""
        self._error: BaseException | None = None
        self._joined = False
        self._imported, self._up, self._released = threading.Event(), threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        if ray_is_up():
            return
        interrupts.check()  # no Ray is started for a run that a signal already stopped
        self._spared = set(watchdog.descendants(os.getpid()))
        self._thread = threading.Thread(target=self._start, name="fedray-ray-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        begun = time.perf_counter()
        try:
            try:
                from fedray.runtime import session  # imports Ray
            finally:
                self._imported.set()
            session.start_or_join(self.address, self.verbose)
        except BaseException as error:  # raised in the main thread by join
            self._error = error
        self.up_s = time.perf_counter() - begun
        self._up.set()
        self._released.wait()  # Ray's processes die with this thread

    def ray_imported(self) -> None:
        """Wait until the thread has imported Ray (or failed to): the main thread imports Ray's modules only after
        that, since one module imported by two threads at once can be seen half-initialized (``cannot import name
        'get_address' from partially initialized module 'ray._private.services'``).

        Called before the main thread imports torch, too: an import holds Python's lock for most of its time, so
        Ray's import beside torch's took 0.96 s where alone it takes 0.25 s, and Ray's processes (which then start
        on the other core while torch imports) began 0.7 s later."""
        if self._thread is not None:
            self._imported.wait()

    def join(self) -> None:
        """Wait until Ray is up (the start's error, e.g. a cluster that refused the driver, is raised here); this
        process then sends its tensors as numpy buffers (see :func:`~fedray.runtime.session.init_ray`)."""
        if self._thread is not None:
            self._up.wait()
            self._joined = True
            if self._error is not None:
                raise self._error
        from fedray.runtime import session

        session.init_ray(self.address, self.verbose)  # Ray is up: registers the tensors' serializer only

    def stop(self) -> None:
        """Wait for the start to end, then shut down the Ray it started (or disconnect from the cluster it joined);
        a second signal meanwhile SIGKILLs the processes it started instead (``ray.init`` may hang)."""
        if self._thread is None or self._joined:
            return
        try:
            self._up.wait()
        except BaseException:
            with watchdog.adopting_orphans():
                watchdog.kill_descendants(self._spared)
            raise
        self._joined = True
        if ray_is_up():
            with interrupts.ignoring_interrupts():
                sys.modules["ray"].shutdown()
        self._released.set()

    def __enter__(self) -> RayStart:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if error is not None:
            self.stop()
