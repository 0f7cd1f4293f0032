"""Pieces that need no group: import without Ray, locks, endpoint errors, argument checks."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import threading
import time

import pytest

from ppo_weight_sync import (
    EngineUnavailableError,
    HttpEngineEndpoint,
    ThreadUpdateLock,
    WeightSender,
    free_port,
)
from ppo_weight_sync.testing import TensorEngine
from ppo_weight_sync.testing.http_engine import serve

BLOCK_RAY = """
import sys
class _NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("ray is blocked in this test")
        return None
sys.meta_path.insert(0, _NoRay())
import ppo_weight_sync
from ppo_weight_sync import WeightSender, WeightReceiver, HttpEngineEndpoint, checksum
from ppo_weight_sync.testing.http_engine import serve
WeightSender(backend="gloo")
HttpEngineEndpoint("http://127.0.0.1:1")
try:
    import ray
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block ray")
assert not any(m == "ray" or m.startswith("ray.") for m in sys.modules), "ray was imported"
print("OK", ppo_weight_sync.__version__)
"""


@pytest.mark.timeout(120)
def test_import_and_construct_without_ray() -> None:
    out = subprocess.run([sys.executable, "-c", BLOCK_RAY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # __version__ agrees with the installed distribution's metadata
    assert out.stdout.strip() == f"OK {importlib.metadata.version('ppo-weight-sync')}"


def test_thread_lock_times_out_naming_itself_and_releases() -> None:
    lock = ThreadUpdateLock("shared")
    lock.acquire(1.0)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            lock.acquire(0.2)
        except TimeoutError as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1
    assert "'shared'" in str(errors[0])
    lock.release()
    lock.release()  # not held: a no-op
    lock.acquire(0.1)
    lock.release()


@pytest.mark.timeout(60)
def test_unreachable_http_engine_fails_connect_fast_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    sender = WeightSender(timeout_s=8)
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="unreachable") as info:
        sender.connect([HttpEngineEndpoint(url, name="nowhere")])
    assert time.monotonic() - start < 6  # well before the timeout: the refused call, not the deadline
    assert info.value.engine == "nowhere"
    assert not sender.is_connected
    sender.disconnect()
    # The sender's own join waits out its rendezvous (timeout_s) on a daemon thread; let it end here, so
    # it never returns into an interpreter that is shutting down.
    for thread in threading.enumerate():
        if thread.name.startswith("join-"):
            thread.join(30)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"backend": "mpi"}, "backend"),
        ({"bucket_bytes": 0}, "bucket_bytes"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"load_format": "zip"}, "load_format"),
        ({"group_name": ""}, "group_name"),
    ],
)
def test_sender_rejects_bad_arguments_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WeightSender(**kwargs)


def test_endpoint_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="base_url"):
        HttpEngineEndpoint("127.0.0.1:30000")
    with pytest.raises(ValueError, match="num_gpus"):
        HttpEngineEndpoint("http://127.0.0.1:30000", num_gpus=0)


def test_connect_checks_engines_before_any_call() -> None:
    sender = WeightSender()
    with pytest.raises(ValueError, match="at least one"):
        sender.connect([])
    a = HttpEngineEndpoint("http://127.0.0.1:1", name="same")
    b = HttpEngineEndpoint("http://127.0.0.1:2", name="same")
    with pytest.raises(ValueError, match="unique"):
        sender.connect([a, b])


def test_update_checks_its_input() -> None:
    import torch

    sender = WeightSender()
    with pytest.raises(ValueError, match="version"):
        sender.update([("a", torch.zeros(1))], "")
    with pytest.raises(ValueError, match="twice"):
        sender.update([("a", torch.zeros(1)), ("a", torch.zeros(1))], "v")
    with pytest.raises(ValueError, match="empty"):
        sender.update([], "v")


class _BrokenStateEngine(TensorEngine):
    def checksum(self) -> str:
        raise TimeoutError("checksum: GPU work did not finish within 1 s")


@pytest.mark.timeout(60)
def test_http_engine_answers_an_error_instead_of_dropping_the_request() -> None:
    # A route whose engine call raises answers 500 with the error, so the caller sees why (no bare reset).
    server = serve(_BrokenStateEngine({"w": ("float32", [2])}, seed=0))
    try:
        ep = HttpEngineEndpoint(server.url, name="broken", timeout_s=30)
        with pytest.raises(EngineUnavailableError, match=r"HTTP 500.*TimeoutError: checksum: GPU work"):
            ep.request("GET", "/state")
        assert ep.request("GET", "/get_weight_version") == {"weight_version": None}  # still serving
    finally:
        server.shutdown()
        server.server_close()


def test_host_waits_for_device_work_return_at_once_on_cpu() -> None:
    import torch

    from ppo_weight_sync.device_sync import on_device, wait_stream

    start = time.monotonic()
    with on_device(torch.device("cpu")):
        wait_stream(torch.device("cpu"), 0.001, "nothing")
    assert time.monotonic() - start < 1.0
