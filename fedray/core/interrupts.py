"""Ctrl-C and SIGTERM stop a command cleanly: every ``finally`` runs, Ray is shut down, one line says what is left.

Python turns SIGINT into :class:`KeyboardInterrupt`; :func:`raising_on_sigterm`
turns SIGTERM into :class:`Terminated` the same way, so both unwind through
the ``finally`` blocks that shut shard pools down instead of killing the
process where it stands. ``ray.init`` replaces the SIGTERM handler (in C, with
a failure-signal handler that aborts with 134), so :func:`keeping_sigterm_handler`
puts the caller's back around it. A command says what it leaves behind with
:func:`reporting`; ``fedray``'s ``main`` prints that line and exits 128 + the
signal's number: 130 for SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as :class:`KeyboardInterrupt` is for SIGINT."""


INTERRUPTS = (KeyboardInterrupt, Terminated)


class Stopped(BaseException):
    """A command stopped by a signal; ``left`` says in one line what it leaves behind (empty: nothing to say)."""

    def __init__(self, signal_number: int, left: str = "") -> None:
        super().__init__(signal_number, left)
        self.signal_number = signal_number
        self.left = left

    @property
    def exit_code(self) -> int:
        return 128 + self.signal_number

    def __str__(self) -> str:
        name = signal.Signals(self.signal_number).name
        return f"stopped by {name}" + (f": {self.left}" if self.left else "")


def stopped(interrupt: BaseException, left: str = "") -> Stopped:
    """The :class:`Stopped` of a :class:`KeyboardInterrupt` (SIGINT) or :class:`Terminated` (SIGTERM)."""
    if isinstance(interrupt, Stopped):
        return interrupt
    return Stopped(signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT, left)


@contextmanager
def reporting(left: Callable[[], str]) -> Iterator[None]:
    """An interrupt inside becomes :class:`Stopped`, with ``left()`` saying what the work leaves behind."""
    try:
        yield
    except INTERRUPTS as interrupt:
        raise stopped(interrupt, left()) from None
    except SystemError as error:
        # A signal handler that raises while C code runs a Python callback (Ray deserializing a result in
        # ray.get) surfaces as "SystemError: ... returned a result with an exception set", the interrupt its cause.
        if isinstance(error.__cause__, INTERRUPTS):
            raise stopped(error.__cause__, left()) from None
        raise


def _raise_terminated(signal_number: int, frame: object) -> None:
    raise Terminated


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def _handling(signals: tuple[signal.Signals, ...], handler: object) -> Iterator[None]:
    """``handler`` for ``signals`` inside (main thread only: Python allows no other), the previous ones after."""
    if not _in_main_thread():
        yield
        return
    previous = {number: signal.signal(number, handler) for number in signals}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


def raising_on_sigterm() -> AbstractContextManager[None]:
    """Inside, SIGTERM raises :class:`Terminated` in the main thread."""
    return _handling((signal.SIGTERM,), _raise_terminated)


def ignoring_interrupts() -> AbstractContextManager[None]:
    """Inside, SIGINT and SIGTERM are ignored: for the short cleanup after the first one."""
    return _handling((signal.SIGINT, signal.SIGTERM), signal.SIG_IGN)


@contextmanager
def keeping_sigterm_handler() -> Iterator[None]:
    """Whatever handles SIGTERM before is put back after (``ray.init`` installs its own)."""
    if not _in_main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
