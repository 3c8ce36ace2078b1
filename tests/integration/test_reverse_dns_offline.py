"""The real glibc resolver against a nameserver that never answers (as on a machine without network): run in a
mount namespace whose /etc/resolv.conf names a UDP socket that this test binds and never reads. The probe finds
the stalled lookup, and the quick resolver the workers get makes the same lookup give up instead (torch's store
then stops looking names up in that process). Skipped where mount namespaces cannot be made (not root, no
`unshare`)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from support.namespaces import require_mount_namespace, run_in_mount_namespace

from rlinf_pipe.utils.net import QUICK_RESOLVER, RESOLVER_ENV

LOOKED_UP = "192.0.2.77"  # (TEST-NET-1: in no /etc/hosts, so its reverse lookup goes to the nameserver)
CHILD = f"""
import socket, sys
from rlinf_pipe.utils.net import stalled_reverse_lookups
print("stalled", stalled_reverse_lookups(["{LOOKED_UP}"], within_s=float(sys.argv[1])))
if len(sys.argv) > 2:  # the lookup itself, to its end
    try:
        socket.getnameinfo(("{LOOKED_UP}", 0), 0)
    except socket.gaierror as exc:
        print("gaierror", exc.errno == socket.EAI_AGAIN)
"""


@pytest.fixture
def silent_nameserver(tmp_path):
    """A resolv.conf naming a bound UDP socket that never answers."""
    require_mount_namespace()  # (before binding port 53: root only)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        try:
            server.bind(("127.0.0.53", 53))
        except OSError:
            server.bind(("127.0.0.54", 53))
        conf = tmp_path / "resolv.conf"
        conf.write_text(f"nameserver {server.getsockname()[0]}\n")
        yield conf


def run_offline(conf: Path, within_s: float, resolver: str | None, *lookup: str) -> str:
    """The child's output, run in a mount namespace with `conf` as /etc/resolv.conf and `resolver` as RES_OPTIONS."""
    script = (f"mount --bind {conf} /etc/resolv.conf && "
              f"exec {sys.executable} -c \"$CHILD\" {within_s} {' '.join(lookup)}")
    env = {k: v for k, v in os.environ.items() if k != RESOLVER_ENV} | {"CHILD": CHILD}
    proc = run_in_mount_namespace(script, env | ({RESOLVER_ENV: resolver} if resolver else {}))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_silent_nameserver_stalls_the_lookup_and_the_quick_resolver_gives_up(silent_nameserver):
    # glibc's defaults (2 tries of 5 s): still waiting after 1 s
    assert f"stalled ['{LOOKED_UP}']" in run_offline(silent_nameserver, 1.0, None)
    # the workers' quick resolver (1 try of 1 s): given up (EAI_AGAIN) well within 4 s, where the defaults take 10
    out = run_offline(silent_nameserver, 4.0, QUICK_RESOLVER, "lookup")
    assert "stalled []" in out and "gaierror True" in out
