#!/usr/bin/env bash
# Wait until the running Ray cluster reports exactly N GPUs on its alive nodes, then print one line per node.
#   bash ray_utils/check_ray.sh 32        (N = num_nodes x num_gpus_per_node)
# Address: RAY_ADDRESS, else the head-ip file written by start_ray.sh, else "auto". Timeout: RAY_CHECK_TIMEOUT (300 s).
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_dir="$(dirname "$script_dir")"

if [ $# -ne 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]] || [ "$((10#$1))" -eq 0 ]; then
  echo "usage: bash ray_utils/check_ray.sh N" >&2
  echo "  N: the total number of GPUs the cluster must report (num_nodes x num_gpus_per_node), e.g. 32" >&2
  exit 2
fi
expected=$((10#$1))
timeout_s="${RAY_CHECK_TIMEOUT:-300}"
if ! [[ "$timeout_s" =~ ^[0-9]+$ ]]; then
  echo "check_ray.sh: error: RAY_CHECK_TIMEOUT must be a number of seconds, got '${timeout_s}'." >&2
  exit 2
fi

head_ip_file="${RAY_HEAD_IP_FILE:-$script_dir/ray_head_ip.txt}"
[[ "$head_ip_file" == /* ]] || head_ip_file="$PWD/$head_ip_file"
token_file="${RAY_AUTH_TOKEN_FILE:-$(dirname "$head_ip_file")/ray_auth_token}"
[[ "$token_file" == /* ]] || token_file="$PWD/$token_file"
address="${RAY_ADDRESS:-}"
if [ -z "$address" ] && [ -s "$head_ip_file" ]; then
  address="$(tr -d '[:space:]' <"$head_ip_file")"
fi
address="${address:-auto}"

# Connect with the same authentication settings start_ray.sh gave the nodes: unless RAY_AUTH_MODE says otherwise,
# token mode with the token file the head wrote next to the head-ip file, if there is one (a head started with
# RAY_AUTH_MODE=disabled removes it), as the job does with cluster.ray_address: auto.
if [ -z "${RAY_AUTH_MODE:-}" ]; then
  RAY_AUTH_MODE=disabled
  [ -s "$token_file" ] && RAY_AUTH_MODE=token
fi
export RAY_AUTH_MODE
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ] &&
  [ -s "$token_file" ]; then
  export RAY_AUTH_TOKEN_PATH="$token_file"
fi

python_bin="$repo_dir/.venv/bin/python"
[ -x "$python_bin" ] || python_bin=python3

export CHECK_EXPECTED="$expected" CHECK_TIMEOUT="$timeout_s" CHECK_ADDRESS="$address"
# The outer timeout is a safety net; the Python side enforces CHECK_TIMEOUT itself.
exec timeout --kill-after=10 "$((timeout_s + 60))" "$python_bin" - <<'PY'
import os
import socket
import sys
import time

expected = int(os.environ["CHECK_EXPECTED"])
timeout = float(os.environ["CHECK_TIMEOUT"])
address = os.environ["CHECK_ADDRESS"]
deadline = time.monotonic() + timeout
RANK_LABEL = "rlinf_pipe/node-rank"
HINTS = (
    "Check that every node ran 'RANK=<n> bash ray_utils/start_ray.sh' and printed 'Ray started', that "
    "RAY_NUM_GPUS (or the GPUs nvidia-smi shows) is right on every node, that nodes can reach the head "
    "(firewall, RAY_NODE_IP) and that RAY_AUTH_MODE is the same everywhere; 'ray status' on the head lists the nodes."
)


def say(msg):
    print(f"[check_ray] {msg}", flush=True)


def fail(msg):
    print(f"check_ray.sh: FAILED: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def reachable(addr):
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


# ray.init blocks for many minutes on an address nobody listens on, so wait for the port first.
if address != "auto":
    last = 0.0
    while not reachable(address):
        if time.monotonic() >= deadline:
            fail(f"nothing answers at the Ray head address {address} after {timeout:.0f}s. Is the head running "
                 "(RANK=0 bash ray_utils/start_ray.sh)? A stale ray_utils/ray_head_ip.txt from an earlier cluster "
                 "also causes this: remove it and restart the head.")
        if time.monotonic() - last >= 5:
            say(f"waiting for the Ray head at {address} to answer")
            last = time.monotonic()
        time.sleep(1)

import ray  # noqa: E402  (imported late: it takes a second)
from ray.exceptions import AuthenticationError  # noqa: E402

try:
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
except AuthenticationError as e:
    fail(f"authentication failed at {address} with RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE')}: {e}. "
         "Use the RAY_AUTH_MODE the nodes were started with; for 'token', the head's token file "
         "(ray_utils/ray_auth_token) or RAY_AUTH_TOKEN must be available here.")
except Exception as e:  # noqa: BLE001
    fail(f"cannot connect to the Ray cluster at {address}: {type(e).__name__}: {e}. If the log above says "
         f"InvalidAuthToken, this shell's RAY_AUTH_MODE ({os.environ['RAY_AUTH_MODE']}) or token differs from the "
         "nodes': use the RAY_AUTH_MODE start_ray.sh ran with (for 'token', the head's token file must be readable).")


def order_key(node):
    rank = node.get("Labels", {}).get(RANK_LABEL, "")
    head = "node:__internal_head__" in node["Resources"]
    return (not head, int(rank) if rank.isdigit() else float("inf"), node["NodeManagerAddress"])


def describe(node):
    rank = node.get("Labels", {}).get(RANK_LABEL, "?")
    head = " (head)" if "node:__internal_head__" in node["Resources"] else ""
    gpus = node["Resources"].get("GPU", 0)
    return f"node rank {rank}  ip {node['NodeManagerAddress']}  {gpus:g} GPUs  id {node['NodeID'][:8]}{head}"


last = 0.0
while True:
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=order_key)
    gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
    if gpus == expected:
        say(f"OK: {gpus:g} GPUs on {len(nodes)} node(s) at {address}")
        for n in nodes:
            say("  " + describe(n))
        sys.exit(0)
    if gpus > expected:
        fail(f"the cluster at {address} has {gpus:g} GPUs on {len(nodes)} node(s), more than the expected {expected}: "
             + "; ".join(describe(n) for n in nodes)
             + ". Check the argument (num_nodes x num_gpus_per_node), RAY_NUM_GPUS on each node, and whether a node "
             "from another cluster joined.")
    if time.monotonic() >= deadline:
        fail(f"timed out after {timeout:.0f}s: saw {gpus:g} of {expected} expected GPUs on {len(nodes)} alive node(s) "
             f"at {address} ({'; '.join(describe(n) for n in nodes)}). " + HINTS)
    if time.monotonic() - last >= 5:
        ranks = ", ".join(n.get("Labels", {}).get(RANK_LABEL, "?") for n in nodes)
        say(f"{len(nodes)} node(s) joined (ranks {ranks}), {gpus:g} of {expected} GPUs seen; waiting")
        last = time.monotonic()
    time.sleep(1)
PY
