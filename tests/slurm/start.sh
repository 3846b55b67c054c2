#!/usr/bin/env bash
# Start a real SLURM cluster of nine nodes on this one machine, for tests/test_slurm.py:
# partition test (node1, node2; the default), faults (node3, node4: ranks killed and stopped),
# nodeloss (node5-node7: one node lost whole, and a spare that replaces it) and elastic (node8,
# node9: a job that continues on one node while the other is drained, then on both again).
#
#   tests/slurm/start.sh STATE_DIR
#
# Runs its own munged (own key and socket), slurmctld, and one slurmd per fake node
# (`slurmd -N node1`, `slurmd -N node2`, each on its own port) with Debian's 22.05 packages.
# The node names resolve through /etc/hosts lines tagged "deepnet-slurm-test" (node1 → 127.0.0.11,
# node2 → 127.0.0.12, …), so `scontrol show hostnames` gives names a job can connect to.
# proctrack/linuxproc and task/none: no cgroups or systemd needed. Every daemon runs in the
# foreground of a background job; their PIDs go to STATE_DIR/pids and stop.sh kills exactly those.
# Clients find the cluster through SLURM_CONF=STATE_DIR/slurm.conf.
set -euo pipefail
STATE=$(realpath -m "${1:?usage: start.sh STATE_DIR}")
NODES=(node1 node2 node3 node4 node5 node6 node7 node8 node9)
mkdir -p "$STATE"/{munge,ctld,log}
: >"$STATE/pids"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# -- /etc/hosts: one loopback address per node name (removed again by stop.sh) --------------------
sed -i '/deepnet-slurm-test/d' /etc/hosts
for i in "${!NODES[@]}"; do
  echo "127.0.0.$((11 + i)) ${NODES[$i]} # deepnet-slurm-test" >>/etc/hosts
done

# -- munge: a private key and socket, so a system munged (if any) is neither used nor disturbed ---
chmod 0700 "$STATE/munge"
dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$STATE/munge/munge.key"
SOCKET="$STATE/munge/munge.socket"
munged --foreground --force --key-file="$STATE/munge/munge.key" --socket="$SOCKET" \
  --pid-file="$STATE/munge/munged.pid" --seed-file="$STATE/munge/seed" \
  --log-file="$STATE/log/munged.log" >>"$STATE/log/munged.out" 2>&1 &
echo $! >>"$STATE/pids"

# -- slurm.conf ----------------------------------------------------------------------------------
CTLD_PORT=$(free_port)
{
  cat <<CONF
ClusterName=deepnet-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$SOCKET,cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
# Evaluate pending jobs every 2 s (default 60 s), so a requeued job restarts soon after it may.
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=10
InactiveLimit=0
CONF
  # Two CPUs per node, so that two single-CPU-per-rank jobs can run side by side.
  for i in "${!NODES[@]}"; do
    echo "NodeName=${NODES[$i]} NodeAddr=127.0.0.$((11 + i)) Port=$(free_port) CPUs=2 RealMemory=4000 State=UNKNOWN"
  done
  echo "PartitionName=test Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP"
  echo "PartitionName=faults Nodes=node3,node4 MaxTime=INFINITE State=UP"
  echo "PartitionName=nodeloss Nodes=node5,node6,node7 MaxTime=INFINITE State=UP"
  echo "PartitionName=elastic Nodes=node8,node9 MaxTime=INFINITE State=UP"
} >"$STATE/slurm.conf"
export SLURM_CONF="$STATE/slurm.conf"

# -- daemons -------------------------------------------------------------------------------------
for _ in $(seq 50); do [ -S "$SOCKET" ] && break; sleep 0.1; done
[ -S "$SOCKET" ] || { echo "munged did not start; see $STATE/log/munged.log" >&2; exit 1; }
slurmctld -D -c -i >>"$STATE/log/slurmctld.out" 2>&1 &
echo $! >>"$STATE/pids"
for node in "${NODES[@]}"; do
  mkdir -p "$STATE/spool-$node"
  slurmd -D -N "$node" >>"$STATE/log/slurmd-$node.out" 2>&1 &
  echo $! >>"$STATE/pids"
done

# -- wait until every node takes jobs ------------------------------------------------------------
for _ in $(seq 120); do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle' || true)
  [ "$idle" = "${#NODES[@]}" ] && { echo "SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.5
done
echo "the cluster did not come up within 60 s; node states:" >&2
sinfo -N >&2 || true
tail -5 "$STATE"/log/*.log >&2 || true
exit 1
