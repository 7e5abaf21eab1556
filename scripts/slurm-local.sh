#!/usr/bin/env bash
# A real SLURM cluster of N emulated nodes on this one machine (root, Debian/Ubuntu, no systemd
# needed). For trying the SLURM path of `echobench sweep` and for CI.
#
#   bash scripts/slurm-local.sh up [N]    install slurm + munge if missing, configure, start N nodes
#   bash scripts/slurm-local.sh down      stop the controller, every node and munge
#   bash scripts/slurm-local.sh status    sinfo
#   bash scripts/slurm-local.sh kill NODE a node failure: SIGKILL the node's slurmd, its step daemons and
#                                         every process of its job steps (launchers, torchrun, workers)
#
# Idempotent: `up` with a cluster of N nodes already up does nothing but add missing host aliases
# and bring back a node whose slurmd died (or was killed); another N restarts the cluster.
# The nodes are node1..nodeN, each a slurmd on its own port, aliased to 127.0.0.1 in /etc/hosts,
# each with a second alias nodeK-ib at the same address: the stand-in for a site's InfiniBand names
# (a name per node with a suffix, as `slurm.rendezvous: {suffix: -ib}` meets at).
# No accounting daemon (sacct does not work, as on some real clusters); no cgroups.
# Why the less obvious settings (found with Debian 12's SLURM 22.05; its build allows several slurmd
# per host): config_overrides lets a node declare more CPUs than exist (else it goes INVAL);
# DefMemPerCPU lets jobs share a node (else each takes a whole node's memory); the
# SchedulerParameters start batch jobs at once (else up to 3 s late); EnforcePartLimits=ALL refuses
# a job too big for the partition at sbatch (else it pends forever); linuxproc + task/none need no
# cgroups; MinJobAge keeps a finished job in `scontrol show job` / `squeue -t all` for an hour,
# where job state is read without accounting.
set -euo pipefail

ACTION=${1:-}
N=${2:-2}
CONF=/etc/slurm/slurm.conf
STATE=/var/lib/slurm-local
LOGS=/var/log/slurm-local
CPUS=${SLURM_LOCAL_CPUS:-8}        # per node; may exceed the real cores (config_overrides)
MEM_MB=${SLURM_LOCAL_MEM_MB:-16000}  # per node, not enforced
MARK="# echobench slurm-local"
HOST=$(hostname -s)

say() { echo "slurm-local: $*"; }
die() { echo "slurm-local: error: $*" >&2; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return
  fi
  say "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  # Keep package scripts from starting services (there may be no init system).
  local made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.1; done
  die "munged did not start"
}

write_config() {
  if [ -e "$CONF" ] && ! grep -q "$MARK" "$CONF"; then
    die "$CONF exists and is not ours: refusing to overwrite a real cluster's config"
  fi
  mkdir -p /etc/slurm "$STATE/ctld" "$LOGS"
  local last_port=$((6817 + N))
  local ports="6818"; [ "$N" -gt 1 ] && ports="[6818-$last_port]"
  for i in $(seq 1 "$N"); do mkdir -p "$STATE/d/node$i"; done
  cat >"$CONF" <<EOF
$MARK: $N nodes on $HOST, written by scripts/slurm-local.sh
ClusterName=echobench-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
EnforcePartLimits=ALL
DependencyParameters=kill_invalid_depend
KillWait=5
MinJobAge=3600
InactiveLimit=0
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGS/jobcomp.txt
NodeName=node[1-$N] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$ports CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=node[1-$N] Default=YES MaxTime=INFINITE State=UP
EOF
}

IB_SUFFIX=-ib  # each node's interface-style name: node1-ib, ...

add_host_aliases() {
  local names="" line
  for i in $(seq 1 "$N"); do names="$names node$i node$i$IB_SUFFIX"; done
  line="127.0.0.1$names $MARK"
  grep -qxF "$line" /etc/hosts && return  # already there: leave the file alone (jobs may be resolving)
  remove_host_aliases
  echo "$line" >>/etc/hosts
}

remove_host_aliases() {
  if grep -q "$MARK" /etc/hosts; then
    # /etc/hosts may be a bind mount: rewrite it in place rather than replacing the file.
    local kept; kept=$(grep -v "$MARK" /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
  fi
}

running_nodes() {
  # Number of nodes the running controller knows, or nothing when it is down.
  scontrol ping 2>/dev/null | grep -q "is UP" || return 0
  sinfo -h -N -o '%N' 2>/dev/null | sort -u | wc -l
}

wait_idle() {
  for _ in $(seq 100); do
    local states; states=$(sinfo -h -N -o '%t' 2>/dev/null | sort -u | tr '\n' ' ')
    if [ "$states" = "idle " ]; then return; fi
    sleep 0.3
  done
  sinfo -N >&2 || true
  die "nodes did not reach idle; see $LOGS/"
}

slurmd_alive() {  # node name: whether its slurmd runs
  local pid; pid=$(cat "$STATE/slurmd-$1.pid" 2>/dev/null || true)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

revive() {
  # Nodes of a running cluster whose slurmd is gone: start it again, resume the node, wait until it answers.
  local dead=() i
  for i in $(seq 1 "$N"); do slurmd_alive "node$i" || dead+=("node$i"); done
  [ "${#dead[@]}" -gt 0 ] || return 0
  for node in "${dead[@]}"; do
    rm -f "$STATE/slurmd-$node.pid"
    slurmd -f "$CONF" -N "$node"
    scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true  # only where it was set down
  done
  for _ in $(seq 100); do
    local bad; bad=$(sinfo -h -N -n "$(IFS=,; echo "${dead[*]}")" -o '%t' 2>/dev/null | grep -E '\*|down|drain|fail' || true)
    if [ -z "$bad" ]; then say "brought back: ${dead[*]}"; return 0; fi
    sleep 0.3
  done
  sinfo -N >&2 || true
  die "${dead[*]} did not come back; see $LOGS/"
}

up() {
  need_root
  [[ "$N" =~ ^[1-9][0-9]?$ ]] || die "N must be a number of nodes from 1 to 99, got '$N'"
  if [ "$(running_nodes)" = "$N" ] && grep -q "$MARK" "$CONF" 2>/dev/null; then
    add_host_aliases  # a cluster brought up by an earlier version of this script has no -ib names
    revive
    say "up with $N nodes"; sinfo; return
  fi
  [ -n "$(running_nodes)" ] && down
  install_packages
  start_munge
  write_config
  add_host_aliases
  slurmctld -c -f "$CONF"  # -c: start clean, no jobs or nodes from an earlier cluster
  for i in $(seq 1 "$N"); do slurmd -f "$CONF" -N "node$i"; done
  wait_idle
  say "up: $N nodes (node1..node$N, also node1$IB_SUFFIX..node$N$IB_SUFFIX), partition debug"
  sinfo
}

down() {
  need_root
  if scontrol ping 2>/dev/null | grep -q "is UP"; then
    scontrol shutdown >/dev/null 2>&1 || true
  fi
  # Nodes whose controller was already gone: stop each by its own pid file.
  for pidfile in "$STATE"/slurmd-*.pid "$STATE"/slurmctld.pid; do
    [ -e "$pidfile" ] || continue
    local pid; pid=$(cat "$pidfile" 2>/dev/null || true)
    for _ in $(seq 50); do [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
    rm -f "$pidfile"
  done
  if [ -e /run/munge/munged.pid ]; then
    kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
    rm -f /run/munge/munged.pid
  fi
  remove_host_aliases
  say "down"
}

kill_node() {
  # As a node failure: everything of that node at once, with no chance to say so.
  local node=$1 pids=() p inodes
  [[ "$node" =~ ^node[0-9]+$ ]] || die "kill takes a node name (node1, node2, ...), got '$node'"
  pids+=("$(cat "$STATE/slurmd-$node.pid" 2>/dev/null || true)")
  # Step daemons: each listens on a socket in the node's spool directory.
  inodes=" $(awk -v d="$STATE/d/$node/" 'index($8, d) == 1 {printf "%s ", $7}' /proc/net/unix) "
  for p in /proc/[0-9]*; do
    for fd in "$p"/fd/*; do
      case "$(readlink "$fd" 2>/dev/null)" in
        "socket:["*) local inode; inode=$(readlink "$fd"); inode=${inode#socket:[}; inode=${inode%]}
                     [[ "$inodes" == *" $inode "* ]] && { pids+=("${p#/proc/}"); break; } ;;
      esac
    done
    # The steps' processes: SLURM names the node in their environment.
    { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qx "SLURMD_NODENAME=$node" && pids+=("${p#/proc/}")
  done
  mapfile -t pids < <(printf '%s\n' "${pids[@]}" | grep -E '^[0-9]+$' | sort -u)
  [ "${#pids[@]}" -gt 0 ] || die "nothing of $node is running"
  kill -KILL "${pids[@]}" 2>/dev/null || true
  say "killed $node: ${#pids[@]} processes (slurmd, step daemons, tasks); \`$0 up $(running_nodes)\` brings it back"
}

case "$ACTION" in
  up) up ;;
  down) down ;;
  status) sinfo ;;
  kill) need_root; kill_node "${2:-}" ;;
  *) die "usage: $0 up [N] | down | status | kill NODE" ;;
esac
