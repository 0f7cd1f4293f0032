"""The local Ray start-up's retry, with real Ray: the first attempt fails for a real reason (a GCS
port-file wait of 0 s, which no start-up meets), the driver says so, ends what the failed start left
running, and the second attempt, with longer waits, comes up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

_CHILD = textwrap.dedent(
    """
    import os
    from pathlib import Path

    import ray
    from rich.console import Console

    from ppo_driver.children import child_pids
    from ppo_driver.config import load_config
    from ppo_driver.ray_start import start_local_ray

    config = load_config(None, ["ray.num_cpus=1", "ray.object_store_memory_mb=128"])
    start_local_ray(config, Console(stderr=True, width=400))
    print("cpus", ray.cluster_resources().get("CPU"))
    print("port wait", os.environ["RAY_gcs_server_port_wait_time_s"])
    names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in child_pids()]
    print("gcs servers", names.count("gcs_server"))
    ray.shutdown()
    """
)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads child processes from /proc")
def test_a_failed_start_is_named_cleaned_up_and_retried_with_longer_waits() -> None:
    env = {**os.environ, "RAY_gcs_server_port_wait_time_s": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "the local Ray instance did not start (RuntimeError: Timed out waiting for file" in done.stderr
    assert "trying once more with longer start-up waits" in done.stderr
    assert done.stderr.count("Started a local Ray instance") == 1, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert "cpus 1.0" in lines, done.stdout
    assert "port wait 180" in lines, done.stdout
    # The failed attempt's GCS server was ended: only the running instance's is left.
    assert "gcs servers 1" in lines, done.stdout


_WORKER_DIES = textwrap.dedent(
    """
    import os, signal, time
    import ray
    from rich.console import Console
    from ppo_driver.config import load_config
    from ppo_driver.ray_start import ray_session, session_dir

    config = load_config(None, ["ray.num_cpus=1", "ray.object_store_memory_mb=128"])
    with ray_session(config, Console(stderr=True)):
        session = session_dir()

        @ray.remote(num_cpus=0)
        class Worker:
            def pid(self):
                return os.getpid()

            def hang(self):
                time.sleep(60)

        worker = Worker.remote()
        pid = ray.get(worker.pid.remote())
        ref = worker.hang.remote()
        time.sleep(1)
        os.kill(pid, signal.SIGKILL)  # dies while executing a task: the raylet's notice
        try:
            ray.get(ref, timeout=60)
        except Exception as exc:
            print("caught", type(exc).__name__, flush=True)
        time.sleep(3)  # the notice reaches the driver's error listener
    print("session", session.name, session.exists(), flush=True)
    """
)


@pytest.mark.timeout(240)
def test_a_worker_death_prints_no_raylet_notice_and_the_session_folder_goes() -> None:
    """Ray's "(raylet) A worker died" line would precede the run's own one-line report; the local
    instance's /tmp/ray/session_* folder is this run's to remove at a clean end."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _WORKER_DIES],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "caught ActorDiedError" in done.stdout
    assert "A worker died" not in done.stdout + done.stderr
    session = next(line.split() for line in done.stdout.splitlines() if line.startswith("session "))
    assert session[1].startswith("session_")
    assert session[2] == "False"


_JOIN_NOT_RAY = textwrap.dedent(
    """
    import faulthandler, socket, threading
    from rich.console import Console
    from ppo_driver import ray_start
    from ppo_driver.config import ConfigError, load_config

    faulthandler.dump_traceback_later(150, exit=True)  # a hang ends with every thread's stack in stderr
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)
    port = server.getsockname()[1]
    held = []  # every connection accepted and kept open, however many Ray's retries make

    def accept_all():
        while True:
            held.append(server.accept())

    threading.Thread(target=accept_all, daemon=True).start()
    ray_start.JOIN_TIMEOUT_S = 3
    try:
        with ray_start.ray_session(load_config(None, [f"ray.address=127.0.0.1:{port}"]), Console()):
            print("joined")
    except ConfigError as exc:
        import os
        print("RAY_gcs_server_port_wait_time_s left:", os.environ.get("RAY_gcs_server_port_wait_time_s"))
        print("refused:", str(exc).splitlines()[-1].strip())
    """
)


@pytest.mark.timeout(240)
def test_joining_an_address_that_is_not_ray_is_bounded() -> None:
    """A port that answers but is not Ray's GCS: Ray retries it for minutes; the join gives up after
    JOIN_TIMEOUT_S (the interrupt, between two of Ray's attempts) or after Ray's attempts that fit in it
    (at least one), whichever comes first, with one line naming ray.address and nothing left set."""
    # Each of Ray's connection attempts waits RAY_py_gcs_connect_timeout_s (30 s by default) and about
    # 10 s more: 2 s here keeps the test short, the bounds the same.
    env = {**os.environ, "RAY_py_gcs_connect_timeout_s": "2"}
    env.pop("RAY_gcs_server_port_wait_time_s", None)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _JOIN_NOT_RAY],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("refused: - ray.address='127.0.0.1:"), done.stdout
    assert "no Ray cluster answered there in " in line
    assert "drop --ray-address for a local run" in line
    assert time.monotonic() - start < 90, "one attempt of Ray's takes about 13 s here"
    assert "RAY_gcs_server_port_wait_time_s left: None" in done.stdout
