"""A module named at the top of another is imported where it is first used, then is that module itself."""

import pickle
import sys

import pytest

from fedray.core import interrupts
from fedray.core.lazy_modules import lazy_module


def test_a_lazy_module_is_imported_on_first_use_and_then_named_by_the_module_itself(tmp_path, monkeypatch):
    (tmp_path / "fedray_test_heavy.py").write_text("VALUE = 41\n\ndef plus_one(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fedray_test_heavy", raising=False)
    namespace = {}
    namespace["heavy"] = namespace["alias"] = lazy_module("fedray_test_heavy", namespace)
    assert "fedray_test_heavy" not in sys.modules
    assert namespace["heavy"].plus_one(namespace["heavy"].VALUE) == 42
    module = sys.modules["fedray_test_heavy"]
    assert namespace == {"heavy": module, "alias": module}


def test_a_lazy_module_not_yet_used_pickles_as_the_module():
    assert pickle.loads(pickle.dumps(lazy_module("json", {}))) is sys.modules["json"]


def test_a_lazy_module_is_imported_whole_before_a_signal_s_interrupt(tmp_path, monkeypatch):
    """Torch imported on first use (the data's features, a method's solve) as ``import_whole`` imports it: a Ctrl-C
    during its import waits for its end, which a cut-short C extension's retry would crash (SIGSEGV)."""
    (tmp_path / "fedray_test_signalled.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(100):\n    time.sleep(0.001)\n"
        "FINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace = {}
    namespace["heavy"] = lazy_module("fedray_test_signalled", namespace)
    with pytest.raises(KeyboardInterrupt):
        with interrupts.handling_interrupts():
            namespace["heavy"].FINISHED
    assert sys.modules.pop("fedray_test_signalled").FINISHED
