"""The fast layer (``pytest -m "not slow"``) keeps at least one test of every test module outside tests/e2e/: a
module whose tests are all slow would drop its code from the developer's quick check. Checked on what this session
collected (the whole suite and the fast layer both collect every module; a run of a few files checks those files)."""

from tests.conftest import E2E

ONLY_SLOW = {
    "tests/jobs/test_bench_async.py": "runs the benchmark as a user does, a whole process",
    "tests/jobs/test_bench_closedform.py": "runs the benchmark as a user does, a whole process",
    "tests/jobs/test_bench_flower.py": "runs the benchmark as a user does, a whole process",
    "tests/jobs/test_bench_scale.py": "runs the benchmark as a user does, a whole process",
    "tests/methods/test_random_features.py": "an accuracy trend in D, which needs a half-size stand-in",
    "tests/runtime/test_evaluator.py": "test rows over several chunks, which need a half-size stand-in",
}
"""The modules allowed to have slow tests only, and why."""


def module_of(item) -> str:
    return item.nodeid.split("::")[0]


def test_every_test_module_outside_e2e_keeps_a_fast_test(collected_tests):
    modules = {module_of(item) for item in collected_tests if E2E not in item.path.parents}
    with_a_fast_test = {module_of(item) for item in collected_tests if item.get_closest_marker("slow") is None}
    only_slow = modules - with_a_fast_test
    assert sorted(only_slow - ONLY_SLOW.keys()) == [], "modules whose tests are all slow"
    assert sorted((modules & ONLY_SLOW.keys()) - only_slow) == [], "modules ONLY_SLOW lists that keep a fast test"
