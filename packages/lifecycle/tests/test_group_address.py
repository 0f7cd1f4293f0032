"""A one-machine run's gloo group listens on the store's address alone, even where the host name
resolves to a LAN address: checked in a private mount namespace whose /etc/hosts maps the host name to
this machine's first non-loopback IPv4 address (``unshare -m``, root or user namespaces needed)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_lifecycle.process_groups import interface_of

PROBE = """
import json, os, socket, sys
from datetime import timedelta
from ppo_lifecycle.process_groups import ReloadableProcessGroups


def listening():
    # This process's listening IPv4 TCP sockets: its socket inodes (/proc/self/fd) in /proc/net/tcp.
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            out.add(socket.inet_ntoa(bytes.fromhex(fields[1].split(":")[0])[::-1]))
    return out


with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
groups = ReloadableProcessGroups()
groups.init_default("gloo", f"tcp://127.0.0.1:{port}", 1, 0, timedelta(seconds=60))
print(json.dumps({"hostname": socket.gethostbyname(socket.gethostname()), "listening": sorted(listening())}))
"""


def _lan_address() -> str | None:
    """The address this machine would send from to the outside (no packet is sent), if not loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))  # TEST-NET-3
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


def test_the_loopback_interface_is_found() -> None:
    assert interface_of("127.0.0.1") is not None
    assert interface_of("203.0.113.254") is None  # TEST-NET-3: on no interface here


def test_a_local_gloo_group_listens_on_loopback_with_the_host_name_on_the_lan(tmp_path: Path) -> None:
    lan = _lan_address()
    if lan is None:
        pytest.skip("this machine has no non-loopback IPv4 address to map the host name to")
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no private mount namespace here (`unshare -m` needs root or user namespaces)")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{lan} {socket.gethostname()}\n127.0.0.1 localhost\n")
    (tmp_path / "probe.py").write_text(PROBE)
    script = f"mount --bind {hosts} /etc/hosts && exec {sys.executable} {tmp_path / 'probe.py'}"
    done = subprocess.run([unshare, "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["hostname"] == lan  # the mapping took: without the binding gloo would listen there
    assert seen["listening"] == ["127.0.0.1"], seen
