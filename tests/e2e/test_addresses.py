"""A malformed cluster address, given as --address or $RAY_ADDRESS, ends a whole ``fedray`` process in one line within
seconds, before Ray is called: no hang (a port out of range), no ValueError traceback (the other forms)."""

import pytest

from tests.app.test_cli import SPEC, fedray_subprocess, nothing_written

FORMS = "(HOST:PORT, ray://HOST[:PORT], auto or local)"
DASHBOARD = ("a dashboard's address, which `ray job submit` takes; fedray joins a cluster at HOST:6379 (the head's GCS) "
             "or ray://HOST:10001 (Ray Client)")


@pytest.mark.parametrize("source, address, error", [
    ("--address", "127.0.0.1:99999", "127.0.0.1:99999: port 99999 is out of range (1 to 65535)"),
    ("--address", "not an address", f"'not an address': not an address {FORMS}"),
    ("RAY_ADDRESS", "garbage",
     "garbage: no port (HOST:PORT; a head's GCS listens on 6379 unless `ray start --port` says otherwise)"),
    ("RAY_ADDRESS", "http://127.0.0.1:8265", f"http://127.0.0.1:8265: {DASHBOARD}"),
], ids=["port-out-of-range", "not-an-address", "no-port", "dashboard"])
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_malformed_address_ends_the_command_in_one_line(tmp_path, command, source, address, error):
    out = tmp_path / "out"
    if command == "run":
        args = ["run", "--dataset", SPEC, "--out", out, "--quiet"]
    else:
        sweep = tmp_path / "sweep.yaml"
        sweep.write_text(f"name: tiny\nbase:\n  dataset: '{SPEC}'\n  method: fed3r\ngrid:\n  seed: [0, 1]\n")
        args = ["sweep", "--config", sweep, "--out", out, "--quiet"]
    given = ["--address", address] if source == "--address" else []
    rc, stdout, err, seconds = fedray_subprocess([*args, *given], env={"RAY_ADDRESS": "" if given else address},
                                                 timeout=60)
    assert (rc, stdout, err) == (2, "", f"fedray: error: {source} {error}\n")
    assert seconds < 20, "refused before Ray is called (the time is Python's start and imports)"
    assert nothing_written(out)
