"""CPU tests of ipc/counters.py: real shared-memory files, mapped by two real processes."""

from __future__ import annotations

import multiprocessing
import os
import re
import stat
import tempfile
import time

import pytest

from ppo_weight_sync.ipc.counters import SharedCounters

pytestmark = pytest.mark.timeout(120)

FIELDS = ("go", "done")


class Counters(SharedCounters):
    FIELDS = FIELDS
    PREFIX = "ppo-test-counters"
    LABEL = "a test's counter file"
    EXTRA_BYTES = 16


class NoExtra(SharedCounters):
    FIELDS = FIELDS
    PREFIX = "ppo-test-counters"
    LABEL = "a test's counter file"


def _child(path: str) -> None:
    """The other process: wait for the parent's ``go``, then bump ``done`` to 3 and leave a note."""
    counters = Counters.attach(path)
    try:
        counters.wait_at_least("go", 1, 60.0, "the parent's go")
        counters.write(4, b"hello")
        for value in range(1, 4):
            counters.set("done", value)
    finally:
        counters.close()


def test_one_process_waits_while_the_other_bumps_a_counter() -> None:
    counters = Counters.create()
    try:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        assert os.path.dirname(counters.path) == shm
        assert stat.S_IMODE(os.stat(counters.path).st_mode) == 0o600  # only this user
        assert os.path.getsize(counters.path) == 2 * 8 + 16
        assert [counters.get(f) for f in FIELDS] == [0, 0]
        assert counters.read(0, 16) == b"\0" * 16
        child = multiprocessing.get_context("spawn").Process(target=_child, args=(counters.path,))
        child.start()
        time.sleep(0.2)  # the child is (most likely) waiting by now; it must not have moved
        assert counters.get("done") == 0
        counters.set("go", 1)
        counters.wait_at_least("done", 3, 60.0, "the child's done")
        assert counters.get("done") == 3
        assert counters.read(4, 5) == b"hello"
        child.join(30)
        assert child.exitcode == 0
        assert counters.exists  # the child only attached: it leaves the file to its owner
    finally:
        counters.close()
    assert not counters.exists
    counters.close()  # idempotent


def test_a_wait_that_times_out_says_what_it_waited_for() -> None:
    counters = NoExtra.create()
    try:
        counters.set("done", 2)
        counters.wait_at_least("done", 2, 0.0, "already there")  # met: returns without polling
        start = time.monotonic()
        with pytest.raises(
            TimeoutError, match=r"^the child's bucket 7: not done within 0.05 s \(done 2 < 8\)$"
        ):
            counters.wait_at_least("done", 8, 0.05, "the child's bucket 7")
        assert time.monotonic() - start < 10

        polls = []

        def stop() -> None:
            polls.append(1)
            if len(polls) == 3:
                raise RuntimeError("the other side gave up")

        with pytest.raises(RuntimeError, match="the other side gave up"):
            counters.wait_at_least("done", 8, 60.0, "the child's bucket 7", stop)
        assert len(polls) == 3
    finally:
        counters.close()


def test_attach_refuses_what_is_not_such_a_file_and_a_closed_file_says_so() -> None:
    small = NoExtra.create()
    counters = Counters.create()
    try:
        missing = counters.path + "-missing"
        with pytest.raises(
            ValueError, match=re.escape(f"{missing!r} is not a test's counter file on this host")
        ):
            Counters.attach(missing)
        with pytest.raises(ValueError, match=re.escape(f"{small.path!r} is not a test's counter file")):
            Counters.attach(small.path)  # too small: no room for the extra bytes
        with pytest.raises(
            ValueError, match=r"a test's counter file: 17 bytes at offset 0 do not fit its 16"
        ):
            counters.write(0, b"x" * 17)
        with pytest.raises(ValueError, match=r"2 bytes at offset 15 do not fit its 16 extra bytes"):
            counters.read(15, 2)
        with pytest.raises(ValueError, match=r"1 bytes at offset 0 do not fit its 0 extra bytes"):
            small.read(0, 1)
        other = Counters.attach(counters.path)
        other.set("go", 5)
        other.write(0, b"seen")
        assert counters.get("go") == 5  # one file, two mappings
        assert counters.read(0, 4) == b"seen"
        other.close()
        assert counters.exists  # only the owner removes it
    finally:
        small.close()
        counters.close()
    assert not counters.exists
    is_closed = re.escape(f"a test's counter file {counters.path!r} is closed")
    for closed in (lambda: counters.get("go"), lambda: counters.set("go", 1), lambda: counters.read(0, 1)):
        with pytest.raises(RuntimeError, match=is_closed):
            closed()
