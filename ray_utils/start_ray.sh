#!/usr/bin/env bash
# Start this node's part of the Ray cluster.
#   RANK=0 bash ray_utils/start_ray.sh    on the head node: starts Ray, writes IP:PORT to the head-ip file
#   RANK=n bash ray_utils/start_ray.sh    on every other node: waits for that file, then joins the head
# Every node gets the Ray label rlinf_pipe/node-rank=<RANK>; rlinf_pipe orders nodes (and so global GPU ids) by it.
# Ray requires a token on every connection (RAY_AUTH_MODE=token, the default): the head writes a fresh one next to
# the head-ip file (mode 600), where the other nodes read it. The dashboard listens on localhost only.
# Environment variables and their defaults are listed in docs/multi-node.md; what a run exposes, in docs/security.md.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_dir="$(dirname "$script_dir")"

die() {
  echo "start_ray.sh: error: $*" >&2
  exit 1
}

# ---- inputs -------------------------------------------------------------------------------------
RANK="${RANK:-}"
[[ "$RANK" =~ ^[0-9]+$ ]] ||
  die "RANK must be a non-negative integer (0 on the head node, 1, 2, ... on the others), got '${RANK}'." \
    "Example: RANK=0 bash ray_utils/start_ray.sh"
RANK=$((10#$RANK))

port="${RAY_PORT:-29500}"
[[ "$port" =~ ^[0-9]+$ ]] || die "RAY_PORT must be a port number, got '${port}'."
join_timeout="${RAY_JOIN_TIMEOUT:-600}"
[[ "$join_timeout" =~ ^[0-9]+$ ]] || die "RAY_JOIN_TIMEOUT must be a number of seconds, got '${join_timeout}'."
head_ip_file="${RAY_HEAD_IP_FILE:-$script_dir/ray_head_ip.txt}"
[[ "$head_ip_file" == /* ]] || head_ip_file="$PWD/$head_ip_file"
token_file="${RAY_AUTH_TOKEN_FILE:-$(dirname "$head_ip_file")/ray_auth_token}"
[[ "$token_file" == /* ]] || token_file="$PWD/$token_file"

export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
case "$RAY_AUTH_MODE" in
  token) ;;
  disabled)
    echo "start_ray.sh: warning: RAY_AUTH_MODE=disabled: anyone who can reach this cluster's Ray ports (the" \
      "head's, every raylet's and worker's) can run any code on it as $(id -un 2>/dev/null || id -u) (docs/security.md)" >&2
    ;;
  *) die "RAY_AUTH_MODE must be 'token' (the default) or 'disabled', got '${RAY_AUTH_MODE}'." ;;
esac

if [ -z "${RAY_BIN:-}" ]; then
  RAY_BIN=ray
  [ -x "$repo_dir/.venv/bin/ray" ] && RAY_BIN="$repo_dir/.venv/bin/ray"
fi
command -v "$RAY_BIN" >/dev/null 2>&1 ||
  die "cannot find the 'ray' command ('${RAY_BIN}'). Run 'bash scripts/setup.sh' first (it installs Ray into .venv)," \
    "or set RAY_BIN to the ray executable."

# Every process of this node's Ray (its daemons and the workers they start) inherits this id, by which
# ray_utils/stop_ray.sh stops exactly them and no other Ray on the machine.
node_id_file="$(dirname "$head_ip_file")/ray_node_${RANK}_${HOSTNAME:-$(uname -n)}.id"
export RLINF_PIPE_RAY_NODE="${RANK}-${HOSTNAME:-$(uname -n)}-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"

args=(start --disable-usage-stats --labels "rlinf_pipe/node-rank=${RANK}")
[ -n "${RAY_NUM_GPUS:-}" ] && args+=("--num-gpus=${RAY_NUM_GPUS}")
[ -n "${RAY_NUM_CPUS:-}" ] && args+=("--num-cpus=${RAY_NUM_CPUS}")
[ -n "${RAY_TEMP_DIR:-}" ] && args+=("--temp-dir=${RAY_TEMP_DIR}")
read -r -a extra_args <<<"${RAY_EXTRA_ARGS:-}"

# The IP Ray itself would pick: the source address of the route to a public IP (no packet is sent).
detect_ip() {
  local py ip=""
  for py in "$(dirname "$(command -v "$RAY_BIN")")/python" python3; do
    if command -v "$py" >/dev/null 2>&1; then
      ip="$("$py" -c 'import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("8.8.8.8", 80))
print(s.getsockname()[0])' 2>/dev/null)" && break
    fi
  done
  [ -n "$ip" ] || ip="$(hostname -I 2>/dev/null | awk '{print $1}')"
  echo "${ip:-127.0.0.1}"
}

# write_atomic FILE MODE CONTENT: write a temp file in the same directory, then rename it into place.
write_atomic() {
  local tmp
  tmp="$(mktemp "${1}.tmp.XXXXXX")"
  chmod "$2" "$tmp"
  printf '%s\n' "$3" >"$tmp"
  mv -f "$tmp" "$1"
}

start_failed() {
  die "'ray start' failed (see its output above). If a cluster started by this script already runs on this node," \
    "stop exactly it with 'RANK=${RANK} bash ray_utils/stop_ray.sh' ('ray stop' would stop every Ray on the machine," \
    "other users' too); check that RAY_AUTH_MODE is the same on every node."
}

# ---- head node ----------------------------------------------------------------------------------
if [ "$RANK" -eq 0 ]; then
  mkdir -p "$(dirname "$head_ip_file")"
  # A stale address from an earlier cluster must not lead joining nodes astray.
  rm -f "$head_ip_file" "$token_file"
  ip="${RAY_NODE_IP:-$(detect_ip)}"
  if [ "$RAY_AUTH_MODE" = token ]; then
    # Share the token through a file next to the head-ip file; joining nodes read it from there.
    token="${RAY_AUTH_TOKEN:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}"
    write_atomic "$token_file" 600 "$token"
    unset RAY_AUTH_TOKEN
    export RAY_AUTH_TOKEN_PATH="$token_file"
  fi
  # (env -u RANK: Ray's processes, and so every worker, would inherit this node's rank under torch's name for a
  # process's rank in its distributed world)
  # (the dashboard, which takes jobs, on localhost unless asked: RAY_DASHBOARD_HOST, or RAY_EXTRA_ARGS, which come last)
  env -u RANK "$RAY_BIN" "${args[@]}" --head --port="$port" --node-ip-address="$ip" \
    --dashboard-host="${RAY_DASHBOARD_HOST:-127.0.0.1}" ${extra_args[@]+"${extra_args[@]}"} || start_failed
  write_atomic "$node_id_file" 644 "$RLINF_PIPE_RAY_NODE"
  write_atomic "$head_ip_file" 644 "${ip}:${port}"
  echo "Ray head started at ${ip}:${port} (node rank 0, auth ${RAY_AUTH_MODE}); address written to ${head_ip_file}"
  exit 0
fi

# ---- other nodes --------------------------------------------------------------------------------
echo "Node rank ${RANK}: waiting up to ${join_timeout}s for the head address in ${head_ip_file}"
start=$SECONDS
last_report=$start
until [ -s "$head_ip_file" ]; do
  if ((SECONDS - start >= join_timeout)); then
    die "the head address file ${head_ip_file} did not appear within ${join_timeout}s." \
      "Start the head node first (RANK=0 bash ray_utils/start_ray.sh), and make sure this path is on a filesystem" \
      "shared with the head node, or set RAY_HEAD_IP_FILE to the file the head wrote."
  fi
  if ((SECONDS - last_report >= 5)); then
    echo "Node rank ${RANK}: still waiting for ${head_ip_file} ($((SECONDS - start))s of ${join_timeout}s)"
    last_report=$SECONDS
  fi
  sleep 1
done
address="$(tr -d '[:space:]' <"$head_ip_file")"
# The head writes its token file before the address file, so it must be there now.
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
  [ -s "$token_file" ] ||
    die "RAY_AUTH_MODE=token (the default) but the token file ${token_file} is missing. Start every node with the" \
      "same RAY_AUTH_MODE (a head started with 'token' writes that file), set RAY_AUTH_TOKEN_FILE to its path, or" \
      "set RAY_AUTH_TOKEN to the head's token."
  export RAY_AUTH_TOKEN_PATH="$token_file"
fi

# 'ray start' can hang for many minutes on an address nobody listens on (e.g. a stale file): wait for the port.
until timeout 3 bash -c ": <>/dev/tcp/${address%:*}/${address##*:}" 2>/dev/null; do
  if ((SECONDS - start >= join_timeout)); then
    die "nothing answers at the head address ${address} (read from ${head_ip_file}) within ${join_timeout}s." \
      "Is the head running? If the file is left over from an earlier cluster, remove it on the head node" \
      "(rm -f ${head_ip_file}) and start the head again; also check firewalls between the nodes."
  fi
  if ((SECONDS - last_report >= 5)); then
    echo "Node rank ${RANK}: waiting for the head at ${address} to answer ($((SECONDS - start))s of ${join_timeout}s)"
    last_report=$SECONDS
  fi
  sleep 1
done

[ -n "${RAY_NODE_IP:-}" ] && args+=("--node-ip-address=${RAY_NODE_IP}")

env -u RANK "$RAY_BIN" "${args[@]}" --address="$address" ${extra_args[@]+"${extra_args[@]}"} || start_failed
mkdir -p "$(dirname "$node_id_file")"
write_atomic "$node_id_file" 644 "$RLINF_PIPE_RAY_NODE"
echo "Ray started: node rank ${RANK} joined ${address} (auth ${RAY_AUTH_MODE})"
