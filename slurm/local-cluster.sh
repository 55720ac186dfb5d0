#!/usr/bin/env bash
# A real multi-node SLURM cluster on this one machine, for trying the SLURM path and
# for the test suite: Debian's slurmctld + one `slurmd -N nodeX` per node, munge,
# slurmdbd + MariaDB for accounting (submitit reads job states from sacct), fake
# GPUs as GRES. Needs root (packages, /etc/hosts, /run/munge, daemons).
#
#   slurm/local-cluster.sh up        # idempotent: installs what is missing, starts what is down
#   slurm/local-cluster.sh down      # stops every daemon it started (by pid), removes the hosts line
#   slurm/local-cluster.sh status    # sinfo
#   slurm/local-cluster.sh pid node2 # the pid of one node's slurmd (kill it to fail that node)
#   export SLURM_CONF=$(slurm/local-cluster.sh conf)   # for sbatch/squeue/sacct and submitit
#
# Parameters (environment): NODES (2), GPUS per node (4), CPUS per node (8),
# SLURM_LOCAL_DIR (/var/tmp/orchestrator-slurm), TOPOLOGY (none | tree): with tree, the nodes sit
# under LEAVES (2) leaf switches listed interleaved (node i on leaf (i-1) % LEAVES + 1; so node1 and
# node2 are on different leaves) below one spine, in $SLURM_LOCAL_DIR/etc/topology.conf
# (TopologyPlugin=topology/tree; `scontrol show topology` prints it).
set -euo pipefail

NODES=${NODES:-2}
GPUS=${GPUS:-4}
CPUS=${CPUS:-8}
TOPOLOGY=${TOPOLOGY:-none}
LEAVES=${LEAVES:-2}
DIR=${SLURM_LOCAL_DIR:-/var/tmp/orchestrator-slurm}
CONF=$DIR/etc/slurm.conf
HOST=$(hostname -s)
TAG="# orchestrator-local-slurm"
export SLURM_CONF=$CONF

say() { echo "local-cluster: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }

install_packages() {
  local missing=()
  for c in slurmctld slurmd sbatch munged slurmdbd mariadbd; do command -v "$c" >/dev/null || missing+=("$c"); done
  ((${#missing[@]} == 0)) && return 0
  say "installing Debian packages (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  # apt drops to its _apt user for downloads; where /tmp is not world-writable (seen here: mode
  # 700) that user cannot write its temporary files and `apt-get update` fails, so run it as root.
  local sandbox=()
  [[ $(stat -c %a /tmp) == 1777 ]] || sandbox=(-o APT::Sandbox::User=root)
  apt-get "${sandbox[@]}" update -qq >/dev/null
  apt-get "${sandbox[@]}" install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge slurmdbd mariadb-server >/dev/null
}

write_config() {
  mkdir -p "$DIR"/{etc,state,log,run,gres} "$DIR"/spool
  local gpus_last=$((GPUS - 1))
  for ((g = 0; g < GPUS; g++)); do ln -sf /dev/null "$DIR/gres/nvidia$g"; done
  cat >"$CONF" <<EOF
ClusterName=orchestrator
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=1
SlurmdTimeout=10
KillWait=5
MinJobAge=300
JobRequeue=1
# A clean start (slurmctld -c) restarts job ids; accounting keeps old jobs, so ids must not repeat
# or sacct (and submitit) would read a previous job's state.
FirstJobId=$(( $(date +%s) % 50000000 + 1000 ))
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
NodeName=node[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[17001-$((17000 + NODES))] CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=4000 Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  write_topology
  cat >"$DIR/etc/gres.conf" <<EOF
AutoDetect=off
NodeName=node[1-$NODES] Name=gpu File=$DIR/gres/nvidia[0-$gpus_last]
EOF
  cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurm
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"
}

write_topology() {
  rm -f "$DIR/etc/topology.conf"
  case $TOPOLOGY in
    none) return 0 ;;
    tree) ;;
    *) die "TOPOLOGY=$TOPOLOGY: use none or tree" ;;
  esac
  echo "TopologyPlugin=topology/tree" >>"$CONF"
  local leaves="" nodes l i
  for ((l = 1; l <= LEAVES; l++)); do
    nodes=""
    for ((i = l; i <= NODES; i += LEAVES)); do nodes+="${nodes:+,}node$i"; done
    [[ -n $nodes ]] || continue
    echo "SwitchName=leaf$l Nodes=$nodes" >>"$DIR/etc/topology.conf"
    leaves+="${leaves:+,}leaf$l"
  done
  echo "SwitchName=spine Switches=$leaves" >>"$DIR/etc/topology.conf"
}

hosts_line() {
  grep -q "$TAG" /etc/hosts 2>/dev/null && sed -i "/$TAG/d" /etc/hosts
  local names=""
  for ((i = 1; i <= NODES; i++)); do names+=" node$i"; done
  echo "127.0.0.1$names $TAG" >>/etc/hosts
}

start_munge() {
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  if ! alive /run/munge/munged.pid; then
    runuser -u munge -- /usr/sbin/munged --force 2>/dev/null || /usr/sbin/munged --force
    cp /run/munge/munged.pid "$DIR/run/munged.pid" 2>/dev/null || true
  fi
}

start_mariadb() {
  mkdir -p /run/mysqld
  chown mysql:mysql /run/mysqld 2>/dev/null || true
  if [[ ! -d $DIR/mysql/mysql ]]; then
    mkdir -p "$DIR/mysql"
    chown mysql:mysql "$DIR/mysql"
    mariadb-install-db --user=mysql --datadir="$DIR/mysql" --skip-test-db >/dev/null 2>&1
  fi
  if ! alive /run/mysqld/mysqld.pid; then
    rm -f /run/mysqld/mysqld.sock
    mariadbd --user=mysql --datadir="$DIR/mysql" --socket=/run/mysqld/mysqld.sock --skip-networking \
      --pid-file=/run/mysqld/mysqld.pid --log-error=/run/mysqld/mysqld.log >/dev/null 2>&1 &
    for _ in $(seq 100); do [[ -S /run/mysqld/mysqld.sock ]] && break; sleep 0.2; done
    [[ -S /run/mysqld/mysqld.sock ]] || die "MariaDB did not start (see /run/mysqld/mysqld.log)"
    for _ in $(seq 50); do [[ -s /run/mysqld/mysqld.pid ]] && break; sleep 0.1; done
    cp /run/mysqld/mysqld.pid "$DIR/run/mysqld.pid"
  fi
  mariadb --socket=/run/mysqld/mysqld.sock -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
}

end_frozen() {  # the processes of nodes kill-node.sh --freeze froze (a dead machine's): ended for good
  local f
  for f in "$DIR"/run/frozen-*; do
    [[ -f $f ]] || continue
    xargs -r kill -9 <"$f" 2>/dev/null || true
    rm -f "$f"
  done
}

start_slurm() {
  end_frozen
  if ! alive "$DIR/run/slurmdbd.pid"; then
    slurmdbd
    for _ in $(seq 100); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.2; done
  fi
  sacctmgr -n show cluster format=cluster 2>/dev/null | grep -qw orchestrator ||
    sacctmgr -i add cluster orchestrator >/dev/null 2>&1 || true
  if ! alive "$DIR/run/slurmctld.pid"; then
    slurmctld -c -i -f "$CONF"
  fi
  for ((i = 1; i <= NODES; i++)); do
    alive "$DIR/run/slurmd-node$i.pid" || slurmd -N "node$i" -f "$CONF"
  done
  for _ in $(seq 150); do
    local idle
    idle=$(sinfo -h -N -t idle,mix,alloc -o '%N' 2>/dev/null | sort -u | wc -l)
    ((idle >= NODES)) && return 0
    sleep 0.2
  done
  sinfo -N >&2 || true
  die "nodes did not come up (logs in $DIR/log)"
}

up() {
  [[ $EUID -eq 0 ]] || die "needs root (packages, /etc/hosts, /run/munge, the daemons)"
  install_packages
  write_config
  hosts_line
  start_munge
  start_mariadb
  start_slurm
  say "up: $NODES nodes x $GPUS GPUs (topology $TOPOLOGY); export SLURM_CONF=$CONF"
}

down() {
  end_frozen
  for f in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid" "$DIR/run/slurmdbd.pid" "$DIR/run/mysqld.pid" \
    "$DIR/run/munged.pid"; do
    [[ -f $f ]] || continue
    if alive "$f"; then
      kill "$(cat "$f")" 2>/dev/null || true
      for _ in $(seq 50); do alive "$f" || break; sleep 0.1; done
      alive "$f" && kill -9 "$(cat "$f")" 2>/dev/null || true
    fi
    rm -f "$f"
  done
  # job steps of a killed node may outlive it on one machine: end them by their node name
  for p in /proc/[0-9]*; do
    { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -q '^SLURM_CLUSTER_NAME=orchestrator$' &&
      kill -9 "${p#/proc/}" 2>/dev/null || true
  done
  # and their slurmstepds (they log to a node's slurmd log): one still ending a cancelled step would
  # report to the next cluster's slurmctld and drain its node ("Kill task failed")
  for p in /proc/[0-9]*; do
    tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q '^slurmstepd' || continue
    ls -l "$p/fd" 2>/dev/null | grep -q "$DIR/log/slurmd-" && kill -9 "${p#/proc/}" 2>/dev/null || true
  done
  sed -i "/$TAG/d" /etc/hosts 2>/dev/null || true
  rm -rf "$DIR/state" "$DIR/spool"
  say "down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) sinfo -N ;;
  conf) echo "$CONF" ;;
  topology) echo "$DIR/etc/topology.conf" ;;
  pid) cat "$DIR/run/slurmd-${2:?node name}.pid" ;;
  *) echo "usage: $0 up|down|status|conf|topology|pid NODE" >&2; exit 2 ;;
esac
