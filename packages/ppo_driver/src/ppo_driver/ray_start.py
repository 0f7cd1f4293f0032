"""The run's Ray: join ``ray.address`` when given, else start (and at the end stop) a local instance,
with start-up waits long enough for a loaded machine and one retry."""

from __future__ import annotations

import _thread
import contextlib
import gc
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
import ray._private.worker
from rich.console import Console

from ppo_driver import children, reaper
from ppo_driver.config import ConfigError, RunConfig
from ppo_driver.resume import first_line


@contextmanager
def ray_session(config: RunConfig, console: Console) -> Iterator[None]:
    """Join ``ray.address`` when given; otherwise start (and later stop) a local Ray instance."""
    if ray.is_initialized():
        yield
        return
    watchdog: reaper.Reaper | None = None
    session: Path | None = None
    quiet_worker_deaths()
    if config.ray.address:
        join_cluster(config)
    else:
        # Ends the local instance's processes if this one dies without a word (reaper.py).
        watchdog = reaper.start()
        try:
            start_local_ray(config, console)
        except BaseException:
            if watchdog is not None:
                watchdog.stop()
            raise
        session = session_dir()
    ok = False
    try:
        yield
        ok = True
    finally:
        # Garbage that still holds Ray objects is freed while Ray is up: freed after the shutdown (by
        # whichever thread's allocation runs the collector) it would end the process at once, output
        # unflushed ("The core worker has already been shutdown").
        gc.collect()
        ray.shutdown()
        if watchdog is not None:
            watchdog.stop()  # whatever Ray's shutdown left running is ended now
        if ok and session is not None:
            remove_session(session)  # a failed run keeps Ray's logs of its workers


# How long joining a cluster may take: Ray retries an address that answers but is no Ray cluster's
# (a port of another service) for many minutes. A closed port is refused before, in pre-flight.
JOIN_TIMEOUT_S = 120.0
# One of Ray's attempts to reach a GCS at its default timeouts (the connection, its pubsub, the cluster
# id): about 40 s. Ray's own retry count (RAY_gcs_server_port_wait_time_s) bounds the join as well.
GCS_ATTEMPT_S = 40.0
GCS_RETRIES_ENV = "RAY_gcs_server_port_wait_time_s"


def join_cluster(config: RunConfig) -> None:
    """``ray.init(address=ray.address)``, bounded twice: Ray makes at most ``JOIN_TIMEOUT_S /
    GCS_ATTEMPT_S`` attempts (unless ``RAY_gcs_server_port_wait_time_s`` is set) and then raises; and past
    ``JOIN_TIMEOUT_S`` the main thread is interrupted (between Ray's connection attempts), once a second
    until it leaves ``ray.init`` (an interrupt that lands inside Ray's own code can be lost there). Either
    way the join is refused in one line."""
    gave_up, left = threading.Event(), threading.Event()

    def give_up() -> None:
        gave_up.set()
        while not left.is_set():
            _thread.interrupt_main()
            left.wait(1.0)

    timer = threading.Timer(JOIN_TIMEOUT_S, give_up)
    timer.daemon = True
    start = time.monotonic()
    timer.start()
    try:
        with _bounded_gcs_retries():
            ray.init(address=config.ray.address, log_to_driver=config.logging.worker_logs)
    except KeyboardInterrupt:
        left.set()
        if not gave_up.is_set():
            raise  # the user's Ctrl-C
        with contextlib.suppress(Exception, KeyboardInterrupt):  # an interrupt sent as it left
            ray.shutdown()
        raise _not_ray(config, start) from None
    except ConnectionError as exc:  # Ray's attempts ran out
        if not str(exc).startswith("Failed to connect to Ray cluster"):
            raise
        raise _not_ray(config, start) from None
    finally:
        left.set()
        timer.cancel()


@contextmanager
def _bounded_gcs_retries() -> Iterator[None]:
    """Ray's attempts to reach the GCS, at most ``JOIN_TIMEOUT_S / GCS_ATTEMPT_S`` while joining (Ray
    reads the variable when it connects); a value the user set is kept."""
    if GCS_RETRIES_ENV in os.environ:
        yield
        return
    os.environ[GCS_RETRIES_ENV] = str(max(1, round(JOIN_TIMEOUT_S / GCS_ATTEMPT_S)))
    try:
        yield
    finally:
        os.environ.pop(GCS_RETRIES_ENV, None)


def _not_ray(config: RunConfig, start: float) -> ConfigError:
    return ConfigError(
        f"invalid config (1 error):\n  - ray.address={config.ray.address!r}: no Ray cluster answered "
        f"there in {time.monotonic() - start:.0f} s (something listens, but not Ray's GCS); give the "
        "head node's GCS address (`ray status` on it prints it), or drop --ray-address for a local run"
    )


def session_dir() -> Path | None:
    """The folder the local Ray instance this process started writes to (``/tmp/ray/session_*``)."""
    node = ray._private.worker._global_node
    return Path(node.get_session_dir_path()) if node is not None else None


def remove_session(session: Path) -> None:
    """Remove a local run's Ray session folder (about 260 KB of logs and sockets a run, kept by Ray
    forever), and the ``session_latest`` link when it names it. Only this run's own folder."""
    if not session.name.startswith("session_"):
        return
    shutil.rmtree(session, ignore_errors=True)
    latest = session.parent / "session_latest"
    with contextlib.suppress(OSError):
        if latest.is_symlink() and Path(os.readlink(latest)).name == session.name:
            latest.unlink()


# Ray's error listener prints each worker death as "(raylet) A worker died or was killed ..." on the
# driver's stdout, above the run's own one-line report of the same death (``faults.RunFailed``).
_WORKER_DEATH = "A worker died or was killed"
_log = logging.getLogger(__name__)


def quiet_worker_deaths() -> None:
    """Route Ray's "(raylet) A worker died" notices to this module's debug log. Ray offers no switch:
    its listener thread looks up ``print_to_stdstream`` in its module at each message, so the filter
    wraps that function (the worker logs of ``logging.worker_logs`` go through their own handler)."""
    worker_module = ray._private.worker
    current = worker_module.print_to_stdstream
    if getattr(current, "_ppo_quiet", False):
        return

    def filtered(data: dict[str, Any], ignore_prefix: bool) -> None:
        lines = data.get("lines") or []
        if data.get("pid") == "raylet" and any(_WORKER_DEATH in str(line) for line in lines):
            _log.debug("ray: %s", " ".join(str(line) for line in lines))
            return
        current(data, ignore_prefix)

    filtered._ppo_quiet = True  # type: ignore[attr-defined]
    worker_module.print_to_stdstream = filtered


# Ray waits a fixed 30 s for its raylet to register; on a loaded machine (load average above 10 on
# 2 cores) that is too short, and a worker importing torch can miss its registration window.
LOCAL_RAY_ENV = {
    "RAY_worker_register_timeout_seconds": "300",
    # The raylet waits 30 s for its dashboard agent's port file, then aborts (a Python process that
    # took longer than that to import at a load average of 20 on 2 cores).
    "RAY_agent_register_timeout_ms": "300000",
    "RAY_gcs_server_port_wait_time_s": "60",
    "RAY_gcs_server_request_timeout_seconds": "180",
}
# Ray turns token authentication on for a new local instance and warns that it did on every start
# (``_warn_token_auth_enabled`` in ray/_private/authentication/authentication_token_setup.py; see
# https://docs.ray.io/en/latest/ray-security/token-auth.html). The authentication stays; its notice goes.
# (Setting RAY_AUTH_MODE=token instead, after Ray's import, leaves the driver's RayConfig without token
# mode, and the driver is then refused by its own GCS: InvalidAuthToken.)
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
# The retry waits at least this long for each start-up stage, whatever the environment asked for.
LOCAL_RAY_RETRY_ENV = {"RAY_gcs_server_port_wait_time_s": "180"}


def start_local_ray(config: RunConfig, console: Console) -> None:
    """Start a local Ray instance; if it does not come up, say so, end what the failed start left
    running, and try once more with longer start-up waits."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    logging.getLogger(TOKEN_AUTH_LOGGER).setLevel(logging.ERROR)
    if config.ray.write_bytecode:
        # The workers inherit this environment: with the variable set, each of them compiled torch,
        # transformers and Ray from source at every start (a worker's imports took 11.6 CPU-s instead
        # of 5.3 with the caches; most of a CPU run's start-up).
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    kwargs: dict[str, Any] = {
        # "local": a new instance, whatever RAY_ADDRESS or an earlier `ray start` on this machine say
        # (Ray's default joins the cluster /tmp/ray/ray_current_cluster names); ray.address joins one.
        "address": "local",
        "num_cpus": config.ray.num_cpus,
        "num_gpus": 0 if config.placement.device == "cpu" else None,
        "object_store_memory": config.ray.object_store_memory_mb * 1024**2,
        "include_dashboard": False,
        "log_to_driver": config.logging.worker_logs,
    }
    before = children.child_pids()
    try:
        ray.init(**kwargs)
    except Exception as exc:  # Ray raises a bare Exception for "timed out during startup"
        console.print(
            f"[yellow]warning:[/] the local Ray instance did not start ({first_line(exc)}); "
            "the machine may be loaded: trying once more with longer start-up waits",
            highlight=False,
        )
        ray.shutdown()
        # A start that failed midway leaves its GCS server (and maybe a raylet) running: ray.shutdown()
        # knows nothing of a node that never finished starting.
        children.end_processes(children.child_pids() - before)
        for key, value in LOCAL_RAY_RETRY_ENV.items():
            if float(os.environ.get(key, "0")) < float(value):
                os.environ[key] = value
        ray.init(**kwargs)
