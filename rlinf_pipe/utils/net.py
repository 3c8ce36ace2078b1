"""Small networking helpers."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now ("" for every interface), e.g. a rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def interface_of(ip: str, interfaces: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """The name of the network interface holding `ip` (None when none does); `interfaces` maps each interface's
    name to its addresses (default: this machine's)."""
    if interfaces is None:
        import psutil

        interfaces = {name: [a.address for a in addrs] for name, addrs in psutil.net_if_addrs().items()}
    for name, addresses in interfaces.items():
        if any(address.split("%")[0] == ip for address in addresses):  # (IPv6 link-local: "fe80::1%eth0")
            return name
    return None


def gloo_interface_env(node_ip: str, env: Mapping[str, str],
                       interfaces: Mapping[str, Sequence[str]] | None = None) -> dict[str, str]:
    """`GLOO_SOCKET_IFNAME` for a worker on the node Ray knows as `node_ip`: the interface holding that IP, the
    address the other nodes reach this one at. Unset, gloo takes the address the host name resolves to, which
    on many machines (`127.0.1.1 <hostname>` in /etc/hosts) is loopback: the ranks on other nodes cannot connect
    to it, and a gloo group across nodes (Megatron's data-parallel ones among them) waits until its timeout.
    Empty (nothing to set) when already set, when `node_ip` is loopback (a single machine), or when no interface
    here holds it."""
    if env.get(GLOO_IFNAME_ENV) or ipaddress.ip_address(node_ip).is_loopback:
        return {}
    name = interface_of(node_ip, interfaces)
    return {GLOO_IFNAME_ENV: name} if name else {}
