"""The bundle sort key: IPs as numbers, hostnames resolved, else characters; GPU id as an int."""

from __future__ import annotations

import socket

from hypothesis import given
from hypothesis import strategies as st

from ppo_placement import bundle_sort_key, node_key, sort_bundles


def _no_dns(name: str) -> str:
    raise socket.gaierror(f"no such host {name}")


def _table(name: str) -> str:
    return {"node-a": "10.0.0.10", "node-b": "10.0.0.9"}[name]


def test_ip_numbers_not_text() -> None:
    # As text "10.0.0.10" < "10.0.0.9"; as numbers 9 comes first.
    assert node_key("10.0.0.9", _no_dns) < node_key("10.0.0.10", _no_dns)
    assert node_key("9.255.255.255", _no_dns) < node_key("10.0.0.0", _no_dns)
    assert node_key("10.0.0.9", _no_dns) == (10, 0, 0, 9)


def test_gpu_id_as_int_not_text() -> None:
    assert bundle_sort_key("10.0.0.1", "2", _no_dns) < bundle_sort_key("10.0.0.1", "10", _no_dns)
    assert bundle_sort_key("10.0.0.1", 7, _no_dns) < bundle_sort_key("10.0.0.2", 0, _no_dns)


def test_hostnames_are_resolved() -> None:
    # node-b resolves to 10.0.0.9, so it sorts before node-a (10.0.0.10) though "a" < "b".
    assert node_key("node-b", _table) < node_key("node-a", _table)
    assert node_key("node-a", _table) == node_key("10.0.0.10", _table)


def test_real_resolver_on_localhost() -> None:
    assert node_key("localhost") == (127, 0, 0, 1)


def test_unresolvable_falls_back_to_characters() -> None:
    assert node_key("ab", _no_dns) == (97, 98)
    assert node_key("node-x", _no_dns) < node_key("node-y", _no_dns)


def test_ipv6_is_numbers() -> None:
    assert node_key("::2", _no_dns) < node_key("::10", _no_dns)


def test_sort_bundles_orders_by_node_then_gpu() -> None:
    probes: list[tuple[str, int | str | None]] = [
        ("10.0.0.10", 1),
        ("10.0.0.9", 3),
        ("10.0.0.10", 0),
        ("10.0.0.9", "10"),
        ("10.0.0.9", 2),
    ]
    assert sort_bundles(probes, _no_dns) == [4, 1, 3, 2, 0]


def test_sort_bundles_cpu_bundles_keep_index_order_per_node() -> None:
    probes: list[tuple[str, int | str | None]] = [("10.0.0.2", None), ("10.0.0.1", None), ("10.0.0.2", None)]
    assert sort_bundles(probes, _no_dns) == [1, 0, 2]


def test_each_node_resolved_once() -> None:
    calls: list[str] = []

    def counting(name: str) -> str:
        calls.append(name)
        return "10.0.0.1"

    sort_bundles([("host", i) for i in range(8)], counting)
    assert calls == ["host"]


ips = st.tuples(*[st.integers(0, 255)] * 4)


@given(st.lists(st.tuples(ips, st.integers(0, 15)), min_size=1, max_size=16))
def test_sorted_matches_numeric_order(items: list[tuple[tuple[int, int, int, int], int]]) -> None:
    probes: list[tuple[str, int | str | None]] = [(".".join(map(str, ip)), gpu) for ip, gpu in items]
    order = sort_bundles(probes, _no_dns)
    assert sorted(order) == list(range(len(items)))
    keys = [(items[i][0], items[i][1]) for i in order]
    assert keys == sorted(keys)
