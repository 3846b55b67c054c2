#!/usr/bin/env bash
# Stop the cluster started by start.sh: kill the PIDs it recorded (and nothing else), wait for
# them to exit, and remove its /etc/hosts lines.
#
#   tests/slurm/stop.sh STATE_DIR
set -uo pipefail
STATE=${1:?usage: stop.sh STATE_DIR}
# Jobs first (by id, through SLURM): their processes would outlive the daemons.
if [ -f "$STATE/slurm.conf" ] && [ -s "$STATE/pids" ]; then
  export SLURM_CONF="$STATE/slurm.conf"
  jobs=$(squeue -h -o %i 2>/dev/null || true)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
  fi
fi
if [ -f "$STATE/pids" ]; then
  # slurmd first, slurmctld next, munged last: the reverse of the start order.
  mapfile -t pids < <(tac "$STATE/pids")
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  done
  : >"$STATE/pids"
fi
sed -i '/deepnet-slurm-test/d' /etc/hosts
exit 0
