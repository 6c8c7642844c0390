"""A benchmark's point measured in a fresh process: its wall time and memory then start from nothing."""

from __future__ import annotations

import json
import subprocess
import sys


def json_line_of(module: str, *arguments: str) -> dict:
    """The last line ``python -m module arguments...`` prints, read as JSON; its stderr, on failure, as the exit."""
    done = subprocess.run([sys.executable, "-m", module, *arguments], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(arguments)}: exit {done.returncode}\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])
