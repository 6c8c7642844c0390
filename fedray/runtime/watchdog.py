"""An embedded Ray's processes end with the driver that started them, even when it is SIGKILLed.

Ray ties its GCS, raylet, dashboard and monitors to the driver (Linux's
PR_SET_PDEATHSIG), and its workers to the raylet, so they die within a second
or two of the driver. The raylet's two agents (the dashboard agent and the
runtime-env agent) see the raylet die at once too, but then spend 60 s trying
to report that to the GCS, which died with it (``publish_error_to_driver``'s
timeout), before they exit. Nothing in Ray's options shortens that, so
:func:`start` leaves a small watchdog beside the driver: a process of its own
session (no terminal signal reaches it) that waits for the end of a pipe only
the driver holds, which comes however the driver ends, and then SIGKILLs
whichever of the processes the driver had started are still there.

Run as a script (``python watchdog.py PID:START ...``) it is that watchdog; it
imports nothing but the standard library, so it starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROC = Path("/proc")
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot: a reused pid has another), None if it is gone or a zombie."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _parent(pid: int) -> int | None:
    try:
        return int((PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` in the process tree, now."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parent = _parent(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@contextmanager
def adopting_orphans() -> Iterator[None]:
    """Inside, a process below this one whose parent dies becomes this process's child (Linux's child subreaper),
    not the init process's: it stays among :func:`descendants` (the raylet's agents, when a Ctrl-C to the terminal's
    process group ends the raylet before the driver looks)."""
    if not PROC.is_dir():
        yield
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    was = ctypes.c_int(0)
    prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        prctl(PR_SET_CHILD_SUBREAPER, was.value, 0, 0, 0)


def kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


KILL_PASSES, KILL_PASS_S = 100, 0.01


def kill_descendants(spared: set[int]) -> None:
    """SIGKILL every live process below this one but ``spared``, pass after pass until none is left: a process that a
    parent forked between a pass's look and its kill (the raylet starting an agent as Ctrl-C came) is the next
    pass's. Called inside :func:`adopting_orphans`, so that such a process stays below this one."""
    for _ in range(KILL_PASSES):
        left = {pid for pid in descendants(os.getpid()) if pid not in spared and _start_time(pid) is not None}
        if not left:
            return
        kill(left)
        time.sleep(KILL_PASS_S)


def start() -> None:
    """Watch this process's descendants (the Ray it just started): SIGKILL those that outlive it.

    The watchdog reads a pipe whose only writer is this process: the write end
    is not inherited by anything this process starts (Python opens it
    close-on-exec), and it is never closed, so EOF means this process has ended.
    """
    if not PROC.is_dir():
        return
    watched = [f"{pid}:{started}" for pid in descendants(os.getpid()) if (started := _start_time(pid))]
    if not watched:
        return
    read_end, _write_end = os.pipe()
    subprocess.Popen([sys.executable, "-I", __file__, *watched], stdin=read_end, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    os.close(read_end)


def _kill_survivors(watched: list[str]) -> None:
    kill({int(pid) for pid, started in (entry.split(":") for entry in watched) if _start_time(int(pid)) == started})


if __name__ == "__main__":
    sys.stdin.buffer.read()  # returns at EOF: the driver has ended
    _kill_survivors(sys.argv[1:])
