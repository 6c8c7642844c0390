"""A signal stops a command cleanly whatever becomes of its interrupt: wrapped by Ray's C code in a SystemError,
turned into another error or swallowed by a library, or held while a step must not be cut (the e2e signal tests
race these; here they happen on purpose)."""

import os
import subprocess
import sys
import signal
import time

import pytest

from fedray.core import interrupts
from fedray.core.interrupts import Stopped, Terminated, reporting


def test_a_sigterm_wrapped_in_a_system_error_is_a_clean_stop():
    # What CPython raises when a signal handler's exception is set while C code returns a result (seen in ray.get).
    with pytest.raises(Stopped) as stop:
        with reporting(lambda: "nothing written"):
            raise SystemError("<built-in method __new__> returned a result with an exception set") from Terminated()
    assert stop.value.exit_code == 128 + signal.SIGTERM and str(stop.value) == "stopped by SIGTERM: nothing written"


def test_other_system_errors_are_not_taken_for_interrupts():
    with pytest.raises(SystemError):
        with reporting(lambda: ""):
            raise SystemError("a real bug") from ValueError()


def signalled(number: int) -> None:
    """Send ``number`` to this process and give its handler the moment to run (at the next bytecode of the main thread)."""
    os.kill(os.getpid(), number)
    for _ in range(1000):
        time.sleep(0.001)


def test_an_error_that_a_library_made_of_the_interrupt_is_the_signal_s_stop():
    """pyarrow importing pandas, stopped halfway, failed with "AttributeError: partially initialized module 'pandas'"."""
    with interrupts.handling_interrupts():
        with pytest.raises(Stopped) as stop:
            with reporting(lambda: "nothing written"):
                try:
                    signalled(signal.SIGTERM)
                except Terminated:  # what a C extension's import did with it
                    pass
                raise AttributeError("partially initialized module 'pandas' has no attribute '_pandas_datetime_CAPI'")
    assert stop.value.exit_code == 143 and str(stop.value) == "stopped by SIGTERM: nothing written"


def test_an_interrupt_that_a_library_swallowed_is_raised_at_the_next_check():
    with interrupts.handling_interrupts():
        try:
            signalled(signal.SIGINT)
        except KeyboardInterrupt:  # cleared by C code: the run would go on
            pass
        assert interrupts.received() == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()


def test_a_signal_in_an_at_fork_callback_is_raised_at_the_next_check_not_dropped_there(capfd):
    """A SIGTERM arriving while logging's at-fork callback releases its lock (a fork by Ray or a library) raised there
    would be printed ("Exception ignored in ... _releaseLock", a traceback) and dropped by Python: it waits instead."""
    namespace = {"__name__": "logging", "signalled": signalled, "signal": signal}
    exec("def _releaseLock():\n    signalled(signal.SIGTERM)\n    return 'released'\n", namespace)
    with interrupts.handling_interrupts():
        assert namespace["_releaseLock"]() == "released"  # the callback finishes
        assert interrupts.received() == signal.SIGTERM
        with pytest.raises(Terminated):
            interrupts.check()
    assert capfd.readouterr().err == ""


def test_a_deferred_signal_is_raised_when_the_step_is_done_and_a_second_one_at_once():
    steps = []
    with interrupts.handling_interrupts():
        with pytest.raises(Terminated):
            with interrupts.deferring_interrupts():
                signalled(signal.SIGTERM)
                steps.append("the step went on")
        with pytest.raises(Terminated):
            with interrupts.deferring_interrupts():
                with pytest.raises(KeyboardInterrupt):
                    signalled(signal.SIGINT)  # the first signal (SIGTERM) is still the one recorded
                steps.append("a second signal raised at once")
    assert steps == ["the step went on", "a second signal raised at once"]


def test_a_signal_deferred_by_nested_steps_is_raised_when_the_outer_one_is_done():
    steps = []
    with interrupts.handling_interrupts():
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferring_interrupts():
                with interrupts.deferring_interrupts():  # an import made whole inside ray.init's connection
                    signalled(signal.SIGINT)
                steps.append("the inner step ended; the outer goes on")
    assert steps == ["the inner step ended; the outer goes on"]


def test_handlers_are_put_back_and_an_error_of_its_own_is_no_stop():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupts.handling_interrupts():
        assert interrupts.signal_behind(ValueError("a real bug")) is None
        interrupts.check()  # no signal: nothing raised
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


EMBEDDED_INTERRUPT = '''
import ctypes, sys
from fedray.core import interrupts

run_string = ctypes.pythonapi.PyRun_String  # how a C extension runs embedded Python (pybind11's py::exec does)
run_string.restype = ctypes.py_object
run_string.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
with interrupts.handling_interrupts():
    try:
        run_string(b"raise KeyboardInterrupt", 257, {}, {})  # a Ctrl-C during such an extension's import
    except KeyboardInterrupt:
        code = 130
sys.exit(code)
'''


def test_an_interrupt_through_an_extension_s_embedded_code_keeps_the_exit_code_under_python_m(tmp_path):
    """CPython remembers a KeyboardInterrupt that left code run through ``PyRun_*`` and, under ``python -m`` (as the
    e2e tests start fedray), killed the process with SIGINT after the command had printed its line and chosen 130: it
    ended with -2 (seen in CI when Ctrl-C landed in torch's import)."""
    (tmp_path / "embedded_interrupt.py").write_text(EMBEDDED_INTERRUPT)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    finished = subprocess.run([sys.executable, "-m", "embedded_interrupt"], env=environment, capture_output=True)
    assert finished.returncode == 130, finished.stderr.decode()


def test_an_import_made_whole_finishes_before_the_signal_s_interrupt(tmp_path, monkeypatch):
    """A Ctrl-C during torch's import cut its C extension's initialisation short, and the next import of torch (to say
    what the run had left) crashed the interpreter with SIGSEGV: ``import_whole`` lets the module finish first."""
    (tmp_path / "signalled_while_imported.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(100):\n    time.sleep(0.001)\n"
        "FINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # the signal this test sends stays recorded after the block (as in a command that a signal stopped): it is this
    # test's, not the next in-process run's, whose first interrupts.check() would raise it
    monkeypatch.setattr(interrupts, "_received", None)
    with pytest.raises(KeyboardInterrupt):
        with interrupts.handling_interrupts():
            interrupts.import_whole("signalled_while_imported")
    assert sys.modules.pop("signalled_while_imported").FINISHED
