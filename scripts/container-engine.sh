#!/usr/bin/env bash
# Make a container engine available for the container suite, the way CI needs it:
# install Debian's docker.io and debootstrap where missing, start dockerd with host
# networking only (no bridge, no iptables), and build the local debootstrap base image
# (no image registry is reachable). Fails loudly: the suite must run, not skip.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "container-engine: need ${need[*]} (run as root, or install them)" >&2; exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  mkdir -p .tools
  nohup dockerd --bridge=none --iptables=false >.tools/dockerd.log 2>&1 &
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { echo "container-engine: dockerd did not start" >&2;
                                   tail -20 .tools/dockerd.log >&2; exit 1; }
fi
if [ -z "${BASE_IMAGE:-}" ]; then
  docker/debootstrap-base.sh narwhal-base:bookworm
fi
