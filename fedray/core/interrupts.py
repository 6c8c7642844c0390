"""Ctrl-C and SIGTERM stop a command cleanly, at any moment: every ``finally`` runs, Ray is shut down, one line says
what is left.

Inside :func:`handling_interrupts` (``fedray``'s ``main`` enters it before it
imports anything heavy), SIGINT raises :class:`KeyboardInterrupt` and SIGTERM
:class:`Terminated` in the main thread, so both unwind through the ``finally``
blocks that shut shard pools down instead of killing the process where it
stands. The signal is recorded too, because a handler's exception does not
always arrive as itself: raised inside a C extension (a library's import,
Ray deserializing a result) it can come out as another error (an
``AttributeError`` of a half-imported pandas, a ``SystemError``), or be
cleared there and never arrive. :func:`signal_behind` takes any error after a
signal for that signal, and :func:`check`, called between a run's stages and
rounds, raises a signal's interrupt that was lost. Where an interrupt must not
come in the middle (the driver's connection to Ray, torch's import),
:func:`deferring_interrupts` holds it until the step is done.
:mod:`fedray.runtime.session` keeps these handlers through ``ray.init``, which
would replace them. A command says what it leaves behind with :func:`reporting`;
``main`` prints that line and exits 128 + the signal's number: 130 for
SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import ctypes
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import FrameType, ModuleType


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as :class:`KeyboardInterrupt` is for SIGINT."""


HANDLED = (signal.SIGINT, signal.SIGTERM)

_received: int | None = None
"""The first signal :func:`handling_interrupts` caught, None before one."""
_deferring = False
"""Inside :func:`deferring_interrupts`."""


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


def interrupt_of(signal_number: int) -> BaseException:
    """What a signal raises: :class:`KeyboardInterrupt` for SIGINT, :class:`Terminated` for SIGTERM."""
    return KeyboardInterrupt() if signal_number == signal.SIGINT else Terminated()


def signal_behind(error: BaseException) -> int | None:
    """The signal that ``error`` comes from, None when it is an error of its own.

    An interrupt, or an error raised while one was handled or from one (a C
    extension turns a handler's exception into ``SystemError``), is that
    interrupt's signal; any error after a caught signal is that signal's doing.
    """
    if isinstance(error, Stopped):
        return error.signal_number
    for link in (error, error.__cause__, error.__context__):
        if isinstance(link, KeyboardInterrupt):
            return signal.SIGINT
        if isinstance(link, Terminated):
            return signal.SIGTERM
    return _received


def received() -> int | None:
    """The signal caught inside :func:`handling_interrupts`, None if none came."""
    return _received


def check() -> None:
    """Raise the interrupt of a caught signal whose exception was lost (cleared in a library's C code)."""
    if _received is not None:
        raise interrupt_of(_received)


@contextmanager
def reporting(left: Callable[[], str]) -> Iterator[None]:
    """An error a signal caused inside becomes :class:`Stopped`, with ``left()`` saying what the work leaves behind."""
    try:
        yield
    except Stopped:
        raise
    except BaseException as error:
        number = signal_behind(error)
        if number is None:
            raise
        raise Stopped(number, _what_is_left(left)) from None


def _what_is_left(left: Callable[[], str]) -> str:
    """``left()``; empty when the interrupt broke what it needs (a module whose import it stopped halfway)."""
    try:
        return left()
    except Exception:
        return ""


AT_FORK = {("logging", "_acquireLock"), ("logging", "_releaseLock")}
"""Functions ``os.register_at_fork`` runs around a fork (a library's subprocess, Ray's): Python prints an exception
raised in them ("Exception ignored in ... _releaseLock" and a traceback) and drops it."""


def _record_and_raise(signal_number: int, frame: FrameType | None) -> None:
    global _received
    first = _received is None
    if first:
        _received = signal_number
        if _deferring or _drops_exceptions(frame):
            return  # raised by check() or at the block's end, where it cannot be dropped
    raise interrupt_of(signal_number)


def _drops_exceptions(frame: FrameType | None) -> bool:
    """Whether the signal arrived inside an at-fork callback (:data:`AT_FORK`, anywhere up the stack), which would drop
    an exception raised there."""
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in AT_FORK:
            return True
        frame = frame.f_back
    return False


@contextmanager
def deferring_interrupts() -> Iterator[None]:
    """Inside, the first signal is recorded only; its interrupt is raised when the block ends. A second one raises
    at once (for a block that hangs).

    For steps that an exception raised in their middle would leave half-done
    in C code: a driver's Ray core worker interrupted while ``ray.init``
    builds it crashes the process (SIGSEGV) when it exits.
    """
    global _deferring
    outer, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = outer
    if not outer:  # inside another such block, its end raises it
        check()


def import_whole(name: str) -> ModuleType:
    """``import name`` with interrupts deferred to its end: an import cut short inside a C extension's initialisation
    cannot be retried, and torch's retry (to say what a stopped run left) crashed the interpreter (SIGSEGV)."""
    with deferring_interrupts():
        return importlib.import_module(name)


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


@contextmanager
def handling_interrupts() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM are recorded and raise their interrupt in the main thread."""
    global _received
    _received = None
    with _handling(HANDLED, _record_and_raise):
        try:
            yield
        finally:
            if _in_main_thread():
                # The command has ended (and said how): a signal the C handler caught but Python has not run yet is
                # dropped here, not raised by the default handler put back next (KeyboardInterrupt after the last
                # line, exit -2 instead of 130).
                for number in HANDLED:
                    signal.signal(number, signal.SIG_IGN)
            _forget_unhandled_keyboard_interrupt()
            _received = None  # said; a later import made whole (a lazy module, another command) does not raise it


def _forget_unhandled_keyboard_interrupt() -> None:
    """Clear CPython's record that a KeyboardInterrupt left code it ran through ``PyRun_*``.

    A C extension's import can run Python that way (embedded code); a Ctrl-C
    that lands there leaves a flag that ``python -m`` reads after the command
    has returned, and it then kills the process with SIGINT: exit -2, not the
    130 the command chose. Running any code through ``PyRun_*`` resets it.
    """
    if sys.implementation.name == "cpython":
        ctypes.pythonapi.PyRun_SimpleString(b"")


def ignoring_interrupts() -> AbstractContextManager[None]:
    """Inside, SIGINT and SIGTERM are ignored: for the short cleanup after the first one."""
    return _handling(HANDLED, signal.SIG_IGN)


@contextmanager
def keeping_sigterm_handler() -> Iterator[None]:
    """Whatever handles SIGTERM before is put back after (the C part of ``ray.init`` installs its own)."""
    if not _in_main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
