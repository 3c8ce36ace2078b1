#!/usr/bin/env bash
# Stop this node's part of the Ray cluster that ray_utils/start_ray.sh started, and nothing else: other Ray
# clusters on the machine (another user's, another job's) keep running, unlike with `ray stop`.
#   RANK=n bash ray_utils/stop_ray.sh     with the RANK (and RAY_HEAD_IP_FILE, if set) given to start_ray.sh
# Stopping the head (RANK=0) also removes the head-ip and token files, so `cluster.ray_address: auto` no longer
# points at the stopped cluster.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() {
  echo "stop_ray.sh: error: $*" >&2
  exit 1
}

RANK="${RANK:-}"
[[ "$RANK" =~ ^[0-9]+$ ]] ||
  die "RANK must be the node rank given to start_ray.sh (0 on the head node), got '${RANK}'." \
    "Example: RANK=0 bash ray_utils/stop_ray.sh"
RANK=$((10#$RANK))
grace="${RAY_STOP_GRACE:-10}"
[[ "$grace" =~ ^[0-9]+$ ]] || die "RAY_STOP_GRACE must be a number of seconds, got '${grace}'."
head_ip_file="${RAY_HEAD_IP_FILE:-$script_dir/ray_head_ip.txt}"
[[ "$head_ip_file" == /* ]] || head_ip_file="$PWD/$head_ip_file"
token_file="${RAY_AUTH_TOKEN_FILE:-$(dirname "$head_ip_file")/ray_auth_token}"
[[ "$token_file" == /* ]] || token_file="$PWD/$token_file"
node_id_file="$(dirname "$head_ip_file")/ray_node_${RANK}_${HOSTNAME:-$(uname -n)}.id"

[ -s "$node_id_file" ] ||
  die "no Ray node of rank ${RANK} started by start_ray.sh on ${HOSTNAME:-$(uname -n)} is recorded (${node_id_file} is missing);" \
    "give the RANK and RAY_HEAD_IP_FILE it was started with."
node_id="$(tr -d '[:space:]' <"$node_id_file")"

# The processes whose environment holds this node's id (grep -z reads each environ entry as one line), and every
# descendant of theirs: a process a raylet starts while it is being stopped (it restarts its agents) may not carry
# the id, and is found as its child instead.
node_pids() {
  local tagged
  tagged="$(grep -lxzs "RLINF_PIPE_RAY_NODE=${node_id}" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 |
    grep -vx "$$" || true)"
  [ -n "$tagged" ] || return 0
  if ! command -v ps >/dev/null 2>&1; then
    echo "$tagged"
    return 0
  fi
  ps -e -o pid=,ppid= | awk -v tagged="$tagged" -v self="$$" '
    BEGIN { n = split(tagged, t, "\n"); for (i = 1; i <= n; i++) keep[t[i]] = 1 }
    { parent[$1] = $2 }
    END {
      do { grew = 0; for (p in parent) if (!(p in keep) && (parent[p] in keep) && p != self) { keep[p] = 1; grew = 1 } }
      while (grew)
      for (p in keep) if (p in parent) print p
    }'
}

pids="$(node_pids)"
count="$(echo "$pids" | grep -c . || true)"
if [ -n "$pids" ]; then
  # SIGTERM lets the raylet unregister from the head; what is still there after the grace period is killed.
  kill -TERM $pids 2>/dev/null || true
  waited=0
  while [ -n "$(node_pids)" ] && [ "$waited" -lt "$((grace * 10))" ]; do
    sleep 0.1
    waited=$((waited + 1))
  done
  # Then kill what is left, again until nothing is: a process the raylet started while it was being stopped (it
  # restarts its agents) was not in the first list.
  tries=0
  while left="$(node_pids)" && [ -n "$left" ] && [ "$tries" -lt 50 ]; do
    kill -KILL $left 2>/dev/null || true
    sleep 0.1
    tries=$((tries + 1))
  done
fi
rm -f "$node_id_file"
if [ "$RANK" -eq 0 ]; then
  rm -f "$head_ip_file" "$token_file"
fi
echo "Ray node rank ${RANK} on ${HOSTNAME:-$(uname -n)} stopped (${count} processes)"
