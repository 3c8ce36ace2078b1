"""GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME from a node's Ray IP: gloo would otherwise bind to what the host name
resolves to, often loopback (`127.0.1.1 <hostname>`), and NCCL to the first interface not loopback or docker's (a
virtual bridge, a management NIC), which ranks on other nodes may not reach."""

from __future__ import annotations

import socket

import psutil
import pytest

from rlinf_pipe.utils.net import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV, interface_of, socket_interface_env

# What psutil reports on a typical machine: loopback, the NIC Ray advertises, a container bridge.
INTERFACES = {
    "lo": ["127.0.0.1", "::1", "00:00:00:00:00:00"],
    "ens5": ["10.0.3.17", "fe80::8ff:feff:fe12:3456%ens5", "0a:ff:fe:12:34:56"],
    "docker0": ["172.17.0.1", "02:42:ac:11:00:01"],
    "ib0": ["fd00:1::7"],
}


@pytest.mark.parametrize(("ip", "name"), [
    ("10.0.3.17", "ens5"), ("172.17.0.1", "docker0"), ("fd00:1::7", "ib0"), ("fe80::8ff:feff:fe12:3456", "ens5"),
    ("10.0.3.18", None),
])
def test_the_interface_holding_an_address(ip, name):
    assert interface_of(ip, INTERFACES) == name


def test_a_worker_uses_the_interface_of_its_node_ip_unless_told_otherwise():
    both = (GLOO_IFNAME_ENV, NCCL_IFNAME_ENV)
    # (NCCL's with `=`: that interface alone, not every one whose name it starts)
    assert socket_interface_env("10.0.3.17", {}, INTERFACES) == {GLOO_IFNAME_ENV: "ens5", NCCL_IFNAME_ENV: "=ens5"}
    assert socket_interface_env("fd00:1::7", {}, INTERFACES) == {GLOO_IFNAME_ENV: "ib0", NCCL_IFNAME_ENV: "=ib0"}
    # the user's choices stay
    assert socket_interface_env("10.0.3.17", {GLOO_IFNAME_ENV: "ib0"}, INTERFACES) == {NCCL_IFNAME_ENV: "=ens5"}
    assert socket_interface_env("10.0.3.17", {NCCL_IFNAME_ENV: "ib0"}, INTERFACES) == {GLOO_IFNAME_ENV: "ens5"}
    assert socket_interface_env("10.0.3.17", dict.fromkeys(both, "ib0"), INTERFACES) == {}
    assert socket_interface_env("127.0.0.1", {}, INTERFACES) == {}  # one machine: whatever gloo picks works
    assert socket_interface_env("10.9.9.9", {}, INTERFACES) == {}  # not here (NAT): leave gloo's own choice


@pytest.mark.parametrize(("ip", "interfaces"), [
    ("10.0.3.99", {"ens5": ["10.0.3.17", "10.0.3.99"]}),  # a second address: gloo would bind the first
    ("fd00::2", {"eth0": ["192.0.2.2", "fd00::2"]}),  # IPv6 beside IPv4: gloo would bind the IPv4 one
    ("10.77.0.1", {"lo": ["127.0.0.1", "10.77.0.1", "::1"]}),  # a routed address on loopback (L3 fabrics)
])
def test_no_interface_is_named_where_gloo_would_bind_another_address(ip, interfaces):
    """Named an interface, gloo binds its first IPv4 address, else its first IPv6 one, not the node IP: naming it
    there would move gloo off an address that may have worked (the host name resolving to the node IP)."""
    assert interface_of(ip, interfaces) is not None and socket_interface_env(ip, {}, interfaces) == {}


def test_this_machines_interfaces_are_read_from_psutil():
    name, addresses = next((n, a) for n, a in psutil.net_if_addrs().items() if a)
    assert interface_of(addresses[0].address) == name


def test_rendezvous_ports_come_from_below_the_kernels_ephemeral_range(tmp_path, monkeypatch):
    """A port chosen now and bound seconds later by another process must not be one the kernel may hand meanwhile to
    any bind(0) or outgoing connection (a relaunch of every worker lost its actor's store port that way)."""
    from rlinf_pipe.utils import net

    ports = {net.rendezvous_port() for _ in range(5)}
    low, high = net.RENDEZVOUS_PORTS
    assert all(low <= p < high for p in ports)
    for port in ports:  # free now, for a store that binds as torch's does
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", port))
    squeezed = tmp_path / "ip_local_port_range"
    squeezed.write_text("10500\t60999\n")  # no room below the ephemeral range: any free port
    monkeypatch.setattr(net, "EPHEMERAL_RANGE", squeezed)
    monkeypatch.setattr(net, "free_port", lambda host="": 4242)
    assert net.rendezvous_port() == 4242


def test_a_rendezvous_port_is_never_one_to_avoid(tmp_path, monkeypatch):
    """Ports handed out for rendezvous not bound yet are free too, and must not be drawn again."""
    from rlinf_pipe.utils import net

    low, high = net.RENDEZVOUS_PORTS
    keep = 20123
    avoid = frozenset(range(low, high)) - {keep}
    assert all(net.rendezvous_port(avoid=avoid) not in avoid for _ in range(5))  # `keep`, or one outside the range
    squeezed = tmp_path / "ip_local_port_range"
    squeezed.write_text("10500\t60999\n")  # any free port: the kernel's offers are skipped while avoided
    monkeypatch.setattr(net, "EPHEMERAL_RANGE", squeezed)
    offers = iter([4242, 4242, 4243])
    monkeypatch.setattr(net, "free_port", lambda host="": next(offers))
    assert net.rendezvous_port(avoid={4242}) == 4243
    monkeypatch.setattr(net, "free_port", lambda host="": 4242)
    with pytest.raises(OSError, match="no free port for a rendezvous"):
        net.rendezvous_port(avoid={4242})
