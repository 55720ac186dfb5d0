#!/usr/bin/env bash
# Fail one node of the local cluster as a dead machine would: kill its slurmd by pid,
# and the job steps it was running (on one host they would outlive it).
#   slurm/kill-node.sh node2
set -euo pipefail
node=${1:?node name}
here=$(cd "$(dirname "$0")" && pwd)
kill -9 "$("$here/local-cluster.sh" pid "$node")"
for p in /proc/[0-9]*; do
  { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qx "SLURMD_NODENAME=$node" && kill -9 "${p#/proc/}" 2>/dev/null || true
done
echo "killed $node" >&2
