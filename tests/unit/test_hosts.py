"""Separate hosts on one machine (devstack/hosts.py): their addresses and names, without making any."""

from __future__ import annotations

from devstack.hosts import Hosts


def test_every_host_has_an_address_of_its_own_beside_the_control_hosts() -> None:
    hosts = Hosts(["node-a", "node-b", "node-c"], tag="ab12", subnet="10.77.42")
    assert hosts.control == "10.77.42.1"
    assert [hosts.address(name) for name in hosts.names] == ["10.77.42.11", "10.77.42.12", "10.77.42.13"]
    assert hosts.prefix("node-b") == ["ip", "netns", "exec", "tyab12-node-b"]


def test_interface_names_stay_within_linuxs_fifteen_characters() -> None:
    hosts = Hosts([f"node-{i}" for i in range(40)])
    assert len(hosts.bridge) <= 15
    assert all(len(hosts.link(name)) <= 15 for name in hosts.names)

