"""An interrupt that Ray's C code wraps in a SystemError still stops a command cleanly (the e2e signal tests race it)."""

import signal

import pytest

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
