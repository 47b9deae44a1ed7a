#!/usr/bin/env bash
# The real components the integration tests drive: Docker Engine (started here), Prometheus and sshd
# binaries (the tests start their own instances on 127.0.0.1), headless Chromium (the live page's browser
# test), debootstrap for the offline base image, and a
# one-node Slurm (munge, slurmctld, slurmd: scripts/slurm-local.sh) for the slurm backend.
# Debian packages only; needs root.
set -euo pipefail
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v prometheus >/dev/null || need+=(prometheus)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v debootstrap >/dev/null || need+=(debootstrap)
# headless Chromium + its driver: the live page's browser test (tests/meters/test_dashboard_live.py)
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  # A dockerd ended with the previous session leaves its pid file behind, and a new one refuses to start.
  pgrep -x dockerd >/dev/null || rm -f /var/run/docker.pid
  nohup dockerd >/var/log/runner-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info --format 'docker engine {{.ServerVersion}} up' || { tail -20 /var/log/runner-dockerd.log; exit 1; }
# The reference-server image the docker tests run (offline: debootstrap base + wheelhouse; cached).
"$(dirname "$0")/../docker/refserver/build.sh"
"$(dirname "$0")/slurm-local.sh"
