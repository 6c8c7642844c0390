"""The ``ray job submit`` commands of docs/clusters.md, run as a user types them, against a head that ``ray start
--head`` started.

The commands are read from the manual's block and run in bash with only what
a test must change: the project's environment for ``.venv``, the loopback
dashboard address for ``HEAD:8265``, a small run for the quickstart, and, on
``ray start``, a temp folder and free ports of its own (so that the head is
no one else's cluster and ends with the test). Nothing about authentication
is set: the head has Ray 2.60's defaults, a HOME of its own (whose token
``ray get-auth-token --generate`` makes), and the client another HOME with no
token (another machine), so that the manual's ``export`` is all it has.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.local_cluster import free_port, stop_node, wait_started

REPO = Path(__file__).resolve().parents[2]
ACTIVATE = Path(sys.prefix) / "bin" / "activate"
README_COMMANDS = [
    "source .venv/bin/activate",
    "ray get-auth-token --generate",
    "ray start --head --dashboard-host=0.0.0.0",
    "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=TOKEN",
    "ray job submit --address http://HEAD:8265 --working-dir . -- python -m jobs.quickstart",
]
SMALL_RUN = ("fedray run --method fed3r --dataset 'synthetic:inat-user-120k?dim=8&scale=0.02&classes=20'"
             " --clients-per-round 10 --eval-every 5 --quiet --out {out}")
MISSING_TOKEN = "AuthenticationError: Authentication required: Unauthorized: Missing authentication token"


def readme_job_commands() -> list[str]:
    """The commands of the manual's job-submission block (the one with ``ray get-auth-token``), comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "clusters.md").read_text(), flags=re.DOTALL)
    block = next(block for block in blocks if "ray get-auth-token" in block)
    lines = (line.split("#", 1)[0].strip() for line in block.splitlines())
    return [line for line in lines if line]


def substituted(command: str, old: str, new: str) -> str:
    assert old in command, f"{old!r} is not in the manual's {command!r}"
    return command.replace(old, new)


def user_env(home: Path) -> dict[str, str]:
    """This environment as a fresh shell has it: no venv on PATH, no Ray settings, a HOME of its own."""
    venv_bin = str(ACTIVATE.parent)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("RAY_") and key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(part for part in env["PATH"].split(os.pathsep) if part != venv_bin)
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    return env


def bash(lines: list[str]) -> list[str]:
    return ["bash", "-c", "set -e\n" + "\n".join(lines)]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """The manual's head, from its own lines: activate, make the token, ``ray start --head``. Yields (dashboard, token)."""
    if not ACTIVATE.exists():
        pytest.skip(f"the tests do not run from a virtual environment ({sys.prefix} has no bin/activate)")
    activate, make_token, start = readme_job_commands()[:3]
    activate = substituted(activate, ".venv", str(ACTIVATE.parents[1]))
    env = user_env(tmp_path_factory.mktemp("head-home"))
    made = subprocess.run(bash([activate, make_token]), env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token == (Path(env["HOME"]) / ".ray" / "auth_token").read_text()

    temp_dir = tempfile.mkdtemp(prefix="frj", dir="/tmp")
    dashboard, port = free_port(), free_port()
    isolation = (f" --block --temp-dir={temp_dir} --node-ip-address=127.0.0.2 --port={port}"
                 f" --dashboard-port={dashboard} --ray-client-server-port={free_port()}"
                 f" --dashboard-agent-listen-port={free_port()} --metrics-export-port={free_port()}"
                 " --num-cpus=2 --num-gpus=0")
    process = subprocess.Popen(bash([activate, "exec " + start + isolation]), env=env, cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_started(process)
        yield dashboard, token
    finally:
        stop_node(process, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(head, client_home: Path, entrypoint: str, *, with_token: bool) -> subprocess.CompletedProcess:
    """The manual's client lines (activate, its ``export`` only ``with_token``, ``ray job submit``) in this clone."""
    dashboard, token = head
    activate, export, submit_command = (readme_job_commands()[i] for i in (0, 3, 4))
    activate = substituted(activate, ".venv", str(ACTIVATE.parents[1]))
    export = substituted(export, "=TOKEN", "=" + token)
    submit_command = substituted(submit_command, "HEAD:8265", f"127.0.0.1:{dashboard}")
    submit_command = substituted(submit_command, "jobs.quickstart", entrypoint)
    lines = [activate, export, submit_command] if with_token else [activate, submit_command]
    return subprocess.run(bash(lines), env=user_env(client_home), cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_the_readme_block_is_the_one_these_tests_run():
    assert readme_job_commands() == README_COMMANDS


def test_a_job_submitted_as_the_readme_says_succeeds_and_leaves_its_results_table(head, tmp_path):
    out = tmp_path / "run"
    done = submit(head, tmp_path, SMALL_RUN.format(out=out), with_token=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "succeeded" in done.stdout + done.stderr
    metrics = pq.read_table(out / "metrics.parquet")
    assert metrics.column("method").to_pylist()[0] == "fed3r" and metrics.num_rows >= 2


def test_without_the_token_export_the_submission_fails_as_the_readme_says(head, tmp_path):
    done = submit(head, tmp_path, "fedray --help", with_token=False)
    assert done.returncode == 1
    assert MISSING_TOKEN in done.stderr
    assert MISSING_TOKEN in (REPO / "docs" / "clusters.md").read_text().replace("\n", " ")
