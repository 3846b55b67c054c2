#!/usr/bin/env bash
# Install Debian's SLURM daemons, client and munge for the SLURM test (root on Debian only).
# Exits 0 when they are installed (or already were), 1 with the reason on stderr otherwise.
set -uo pipefail
need=(slurmctld slurmd sbatch munged)
missing() { for b in "${need[@]}"; do command -v "$b" >/dev/null 2>&1 || return 0; done; return 1; }
missing || exit 0
if [ "$(id -u)" != 0 ]; then echo "not root: cannot install slurmctld/slurmd/munge" >&2; exit 1; fi
if ! command -v apt-get >/dev/null 2>&1; then echo "no apt-get: not a Debian system" >&2; exit 1; fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
# The packages enable systemd units; there is no systemd here, so nothing starts by itself.
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends \
         slurmctld slurmd slurm-client munge; } >"$log" 2>&1; then
  echo "apt-get could not install slurmctld slurmd slurm-client munge:" >&2
  tail -5 "$log" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
missing && { echo "installed, but ${need[*]} not all on PATH" >&2; exit 1; }
exit 0
