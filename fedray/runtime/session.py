"""Joining a Ray cluster (``--address`` or $RAY_ADDRESS), or starting an embedded one that ends with this process.

The embedded Ray is started with ``address="local"``: a bare ``ray.init()``
would join a cluster that ``ray start`` left running on the machine instead.

Ctrl-C and SIGTERM stop ``ray.init`` as they stop any other step (see
:func:`_interruptible`): the caller's SIGTERM handler stays in place
throughout (Ray's own would ``sys.exit(15)``: the command would end with exit
code 15 and no word), and the processes of an embedded Ray that an interrupt
(or any error) stops halfway are killed at once (the raylet's two agents
would otherwise live on for a minute).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path

import ray
import ray._private.node
import ray._private.ray_constants
import ray._private.utils
import ray._private.worker

from fedray.core import interrupts
from fedray.core.errors import FedrayError
from fedray.runtime import watchdog
from fedray.runtime.address import LOCAL, check_address, check_reachable, cluster_address
from fedray.runtime.messages import without_messages

__all__ = ["check_address", "init_ray", "start_or_join", "where_written"]


WORKING_DIR_COPIES = "/runtime_resources/working_dir_files/"
"""Where Ray unpacks a job's ``--working-dir`` on the node that runs it (under its session folder)."""


def where_written(folder: str | Path) -> tuple[str, str | None]:
    """``folder`` as an absolute path, and, when it lies in Ray's unpacked copy of a job's ``--working-dir`` (a
    relative ``--out`` of a command sent with ``ray job submit``), a line saying so: that copy is on the node that ran
    the job, not where it was sent from, and goes when Ray cleans its session files."""
    absolute = Path(folder).absolute()
    if WORKING_DIR_COPIES not in f"{absolute.as_posix()}/":
        return str(absolute), None
    return str(absolute), (f"{absolute} is inside Ray's copy of the job's --working-dir on the node that ran it (not "
                           "where the job was sent from), removed with Ray's session files: give an absolute --out on "
                           "storage you can read to keep the results")


TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"
WORKER_LOGGER = "ray._private.worker"
NOT_MAIN_THREAD_NOTICE = "SIGTERM handler is not set because current thread is not the main thread"


def _without_token_auth_notice() -> AbstractContextManager[None]:
    """Token authentication stays on, as Ray enables it for a new local cluster; only its notice on every run is dropped."""
    return without_messages(TOKEN_AUTH_LOGGER, TOKEN_AUTH_NOTICE)


def init_ray(address: str | None = None, verbose: bool = False) -> None:
    """Join ``address`` (or $RAY_ADDRESS); with neither (or ``local``), start an embedded Ray, which ends with this
    process: a new one, never a cluster that ``ray start`` left on the machine.

    What Ray's workers print (a plugin's client code, in the shards) reaches this process's output only when
    ``verbose`` (Ray's ``log_to_driver``); else it stays in Ray's log files (``/tmp/ray/session_latest/logs/``). A
    process already connected to Ray keeps its own setting.

    The caller's SIGTERM handler stays (``ray.init`` would replace it). Either way, this process then sends its
    tensors through the object store as numpy buffers (:mod:`fedray.runtime.tensor_transfer`).
    """
    start_or_join(address, verbose)
    from fedray.runtime import tensor_transfer  # torch: a start in the background (fedray.runtime.ray_start) needs none

    tensor_transfer.register()


def start_or_join(address: str | None = None, verbose: bool = False) -> None:
    """:func:`init_ray` but for the tensors' serializer; from the main thread or another
    (:class:`~fedray.runtime.ray_start.RayStart`'s)."""
    if not ray.is_initialized():
        interrupts.check()  # no Ray is started for a run that a signal already stopped
        _start_or_join(address, verbose)


@contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    """``owner.name`` is ``value`` inside, what it was after."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _deferring_interrupts(connect: Callable) -> Callable:
    """``connect`` with Ctrl-C and SIGTERM held until it returns (see :func:`_interruptible`)."""

    def connecting(*args: object, **kwargs: object) -> object:
        with interrupts.deferring_interrupts():
            return connect(*args, **kwargs)

    return connecting


@contextmanager
def _interruptible() -> Iterator[None]:
    """Around ``ray.init``: Ctrl-C and SIGTERM stop it cleanly, and the caller's SIGTERM handler stays, after it too.

    Ray's Python part would put its own SIGTERM handler in place of the
    caller's (``sys.exit(15)``). Its C part, the driver's core worker, would
    install Abseil's failure-signal handler, which on SIGTERM prints a stack
    and sets an alarm that aborts the process 3 s later (exit 134), whatever
    the process does meanwhile: the driver's core worker starts without it
    (``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, read when it starts; Ray's workers
    keep theirs). An interrupt while that core worker is built would leave it
    half-built, and the process would crash (SIGSEGV) as it exits: the
    interrupt waits until the driver is connected (a second signal does not). On a thread other than the main one
    (:mod:`fedray.runtime.ray_start`) no signal reaches the start: nothing waits, and Ray's warning that it sets no
    SIGTERM handler there (the caller's is the one wanted) is dropped.
    """
    worker = ray._private.worker
    on_main_thread = threading.current_thread() is threading.main_thread()
    connect = _deferring_interrupts(worker.connect) if on_main_thread else worker.connect
    quiet = nullcontext() if on_main_thread else without_messages(WORKER_LOGGER, NOT_MAIN_THREAD_NOTICE)
    with _patched(ray._private.utils, "set_sigterm_handler", lambda handler: None), \
            _patched(ray._private.ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", True), \
            _patched(worker, "connect", connect), interrupts.keeping_sigterm_handler(), quiet:
        yield


@contextmanager
def _killing_what_a_failed_start_leaves() -> Iterator[None]:
    """The processes started inside are SIGKILLed if it fails (an interrupt included) before Ray is up; once Ray is
    up, shutting it down is the caller's part, as after any later interrupt."""
    before = set(watchdog.descendants(os.getpid()))
    with watchdog.adopting_orphans():
        try:
            yield
        except BaseException:
            if not ray.is_initialized():
                watchdog.kill_descendants(before)
            raise


def _raylet_messages(verbose: bool) -> AbstractContextManager[None]:
    """Around ``ray.init``: unless ``verbose``, the driver does not listen to the messages Ray pushes to it, which it
    would print as yellow ``(raylet) ...`` lines (a worker that died, as a killed shard does, which fedray restarts);
    they stay in Ray's logs."""
    if verbose:
        return nullcontext()
    return _patched(ray._private.worker, "listen_error_messages", lambda worker, threads_stopped: None)


def _without_dashboard_packages() -> AbstractContextManager[None]:
    """Around the start of an embedded Ray (whose dashboard is left out): its processes run as a minimal install of Ray
    runs them, without the dashboard's optional packages.

    ``ray.init`` imports those packages (aiohttp, grpc, opentelemetry, pydantic, ...: 2 s, and more on a loaded
    machine) only to tell whether they are installed, which decides whether the dashboard's processes load the parts
    that need them; with the dashboard left out, those parts (the agent's HTTP and gRPC servers, its metrics and
    reports) serve nothing fedray uses. The check is answered as a minimal install's: nothing is imported.
    """
    return _patched(ray._private.utils, "get_dashboard_dependency_error",
                    lambda: ImportError("fedray starts an embedded Ray without its dashboard"))


def _skip(node: object, *args: object, **kwargs: object) -> None:
    """A :class:`ray._private.node.Node` step not taken."""


@contextmanager
def _without_unused_head_processes(verbose: bool) -> Iterator[None]:
    """Around the start of an embedded Ray: the head's processes that serve nothing an embedded run uses are not
    started.

    - The API server (``dashboard.py``): with the dashboard left out it loads only Ray's usage-stats module, yet
      ``ray.init`` waits until it has published its address before it begins the raylet (``ray.init`` alone took
      4.6 s with it and 2.4 s without on a 2-core machine).
    - The autoscaler's monitor: an embedded Ray has no autoscaler (:func:`fedray.runtime.cluster.may_add_nodes` says so
      without asking it).
    - The log monitor, unless ``verbose``: it forwards the workers' output to a driver that listens (``log_to_driver``,
      which only ``verbose`` sets); that output is written to Ray's log files either way.

    Together about 2 CPU-seconds of Python start-up on a machine whose driver imports torch meanwhile. A cluster joined
    with ``--address`` keeps every process its own start gave it.
    """
    node = ray._private.node.Node
    steps = ["start_api_server", "start_monitor"] + ([] if verbose else ["start_log_monitor"])
    with ExitStack() as skipped:
        for step in steps:
            skipped.enter_context(_patched(node, step, _skip))
        yield


QUICK_STORE_CONNECT = {"raylet_client_connect_timeout_milliseconds": 50, "raylet_client_num_connect_attempts": 200}
"""An embedded Ray's clients retry their connection to the raylet's object store every 50 ms, 200 times, rather than
every second, 10 times: the raylet connects to the store it starts on a thread of its own at once, and found it not
yet listening in a third of the starts on a 2-core machine, which then waited a whole second (one start in three
took 1 s longer). The same 10 s in all before a start fails. ``ray.init`` adds its session's entries to the dict it is
given: it is given a copy."""


def _start_or_join(address: str | None, verbose: bool) -> None:
    given = cluster_address(address)
    options = {"log_to_driver": verbose, "logging_level": logging.WARNING}
    if given is None:
        with _without_token_auth_notice(), _without_dashboard_packages(), _without_unused_head_processes(verbose), \
                _interruptible(), _killing_what_a_failed_start_leaves(), _raylet_messages(verbose):
            ray.init(address=LOCAL, include_dashboard=False, _system_config=dict(QUICK_STORE_CONNECT), **options)
        watchdog.start()
        return
    check_reachable(*given)
    try:
        with _interruptible(), _raylet_messages(verbose):
            ray.init(address=given[0], **options)
    except ConnectionError as error:  # e.g. "auto" on a machine without a cluster
        raise FedrayError(f"{given[1]} {given[0]}: {str(error).splitlines()[0]}") from None
