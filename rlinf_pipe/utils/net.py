"""Small networking helpers."""

from __future__ import annotations

import ipaddress
import random
import socket
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now ("" for every interface), e.g. a rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# below the kernel's ephemeral range (32768 up by default) and sglang's 22000-29999, above the ports `ray start` gives
# its workers (10002-19999 by default)
RENDEZVOUS_PORTS = (20000, 22000)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def rendezvous_port(host: str = "", avoid: Collection[int] = ()) -> int:
    """A port for a rendezvous that another process binds later (a torch.distributed store, the weight group's):
    free now, not in `avoid` (ports handed out for other rendezvous not bound yet), and outside the range the kernel
    hands to every `bind(0)` and outgoing connection (which Ray, ZMQ and the other workers make by the hundred while a
    job starts) and the ports Ray gives its workers, so nothing else takes it meanwhile; from the ephemeral range
    only where it leaves no room below it."""
    low, high = RENDEZVOUS_PORTS
    try:
        high = min(high, int(EPHEMERAL_RANGE.read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    if high - low >= 500:
        for port in random.sample(range(low, high), 64):
            if port in avoid:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the store binds it)
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    for _ in range(64):
        port = free_port(host)
        if port not in avoid:
            return port
    raise OSError(f"no free port for a rendezvous on {host or 'this machine'} outside the {len(avoid)} handed out")


GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"


def _ips(addresses: Sequence[str]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = []
    for address in addresses:
        try:
            out.append(ipaddress.ip_address(address.split("%")[0]))  # (IPv6 link-local: "fe80::1%eth0")
        except ValueError:  # a MAC address
            continue
    return out


def local_interfaces() -> dict[str, list[str]]:
    """This machine's network interfaces: name -> addresses, in the system's order."""
    import psutil

    return {name: [a.address for a in addrs] for name, addrs in psutil.net_if_addrs().items()}


def interface_of(ip: str, interfaces: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """The name of the network interface holding `ip` (None when none does); `interfaces` maps each interface's
    name to its addresses in the system's order (default: this machine's)."""
    if interfaces is None:
        interfaces = local_interfaces()
    wanted = ipaddress.ip_address(ip)
    return next((name for name, addresses in interfaces.items() if wanted in _ips(addresses)), None)


def gloo_address(addresses: Sequence[str]) -> str | None:
    """The address gloo binds on an interface named in `GLOO_SOCKET_IFNAME`: its first IPv4 address, else its first
    IPv6 one."""
    ips = _ips(addresses)
    chosen = next((a for a in ips if a.version == 4), None) or next(iter(ips), None)
    return None if chosen is None else str(chosen)


def socket_interface_env(node_ip: str, env: Mapping[str, str],
                         interfaces: Mapping[str, Sequence[str]] | None = None) -> dict[str, str]:
    """`GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME` for a worker on the node Ray knows as `node_ip`: the interface
    holding that IP, the address the other nodes reach this one at (each unless already set). Unset, gloo takes the
    address the host name resolves to, which on many machines (`127.0.1.1 <hostname>` in /etc/hosts) is loopback:
    the ranks on other nodes cannot connect to it, and a gloo group across nodes (Megatron's data-parallel ones
    among them) waits until its timeout; NCCL takes the first interface that is not loopback or docker's, which on
    hosts with a virtual bridge (`virbr0`) or a management NIC listed first is one the other nodes may not reach
    (its bootstrap, and its data where no InfiniBand carries it, go there); NCCL's is given as `=name` (that
    interface alone: NCCL takes a bare name as a prefix, `eth0` matching `eth0.100`). Named, gloo binds the
    interface's first address (`gloo_address`), so it is named only where that is `node_ip` (not for a second
    address, an IPv6 node IP beside IPv4 ones, or a loopback interface). Empty (nothing to set) when both are set,
    when `node_ip` is loopback, or when no interface here binds it so."""
    unset = [key for key in (GLOO_IFNAME_ENV, NCCL_IFNAME_ENV) if not env.get(key)]
    if not unset or ipaddress.ip_address(node_ip).is_loopback:
        return {}
    if interfaces is None:
        interfaces = local_interfaces()
    name = interface_of(node_ip, interfaces)
    if name is None or gloo_address(interfaces[name]) != str(ipaddress.ip_address(node_ip)):
        return {}
    if any(ip.is_loopback for ip in _ips(interfaces[name])):  # (a node IP added to `lo`: other nodes route to it,
        return {}                                              # but gloo would take 127.0.0.1)
    return {key: ("=" if key == NCCL_IFNAME_ENV else "") + name for key in unset}


RESOLVER_ENV = "RES_OPTIONS"
QUICK_RESOLVER = "timeout:1 attempts:1"  # glibc's resolver: give up on a silent nameserver after 1 s, not 5 s x 2


def stalled_reverse_lookups(ips: Sequence[str], within_s: float = 1.0) -> list[str]:
    """Those of `ips` whose reverse DNS lookup has not answered within `within_s` (an answer that no name is known
    counts as one). torch.distributed's store looks up the address of each peer it connects or accepts, until a
    lookup fails, once per process: where the nameserver in /etc/resolv.conf never answers (an offline machine or
    cluster), that is glibc's 5 s timeout twice in every worker's first rendezvous. The lookups run in parallel
    daemon threads, left to finish on their own."""
    done = {ip: threading.Event() for ip in dict.fromkeys(ips)}

    def lookup(ip: str) -> None:
        try:
            socket.getnameinfo((ip, 0), 0)
        except OSError:  # (socket.gaierror: no name, or the nameserver failed)
            pass
        done[ip].set()

    for ip in done:
        threading.Thread(target=lookup, args=(ip,), name=f"reverse-dns-{ip}", daemon=True).start()
    deadline = time.monotonic() + within_s
    for event in done.values():
        event.wait(max(0.0, deadline - time.monotonic()))
    return [ip for ip, event in done.items() if not event.is_set()]


def quick_resolver_env(node_ips: Sequence[str], env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """`RES_OPTIONS` for the workers when reverse lookups of the nodes' IPs stall (`stalled_reverse_lookups`), so
    each process waits 1 s for its first one instead of 10 s; nothing where `env` sets `RES_OPTIONS` already (the
    user's choice stands) or every lookup answers. Returns the variables and the stalled IPs."""
    if env.get(RESOLVER_ENV):
        return {}, []
    stalled = stalled_reverse_lookups(node_ips)
    return ({RESOLVER_ENV: QUICK_RESOLVER} if stalled else {}), stalled
