"""A module named at the top of another is imported where it is first used, then is that module itself."""

import pickle
import sys

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
