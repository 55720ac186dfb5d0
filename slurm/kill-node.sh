#!/usr/bin/env bash
# Fail one node of the local cluster as a dead machine would: kill its slurmd by pid,
# and the job steps it was running (on one host they would outlive it).
#   slurm/kill-node.sh node2
#   slurm/kill-node.sh --freeze node1
# --freeze: as a machine that lost power, which sends nothing (not even a connection reset): its
# slurmd is killed, and its slurmstepds and every process of its steps are frozen (SIGSTOP), so
# no step of it reports an end (a living slurmstepd would report the batch script's death and
# SLURM would end the job; srun clients on it would cancel their steps elsewhere). Their pids go
# to $SLURM_LOCAL_DIR/run/frozen-NODE; `local-cluster.sh up` and `down` end them.
set -euo pipefail
freeze=0
[[ ${1:-} == --freeze ]] && { freeze=1; shift; }
node=${1:?node name}
here=$(cd "$(dirname "$0")" && pwd)
dir=${SLURM_LOCAL_DIR:-/var/tmp/orchestrator-slurm}
slurmd=$("$here/local-cluster.sh" pid "$node")
pids=()
if ((freeze)); then
  kill -STOP "$slurmd"
  for p in /proc/[0-9]*; do  # its slurmstepds: they log to the node's slurmd log
    tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q '^slurmstepd' || continue
    ls -l "$p/fd" 2>/dev/null | grep -q "/slurmd-$node\.log" && pids+=("${p#/proc/}")
  done
fi
for p in /proc/[0-9]*; do
  { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qx "SLURMD_NODENAME=$node" && pids+=("${p#/proc/}")
done
if ((freeze)); then
  kill -STOP "${pids[@]}" 2>/dev/null || true
  printf '%s\n' "${pids[@]}" >>"$dir/run/frozen-$node"
  kill -9 "$slurmd"
  echo "froze $node (${#pids[@]} processes)" >&2
else
  kill -9 "$slurmd"
  kill -9 "${pids[@]}" 2>/dev/null || true
  echo "killed $node" >&2
fi
