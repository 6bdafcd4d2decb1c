#!/usr/bin/env bash
# Build a local Debian bookworm base image with python3 (3.11) from a debootstrap root
# filesystem, for machines that reach Debian's package archive but no image registry:
#   docker/debootstrap-base.sh [IMAGE_TAG]      (default narwhal-base:bookworm)
# then build with --build-arg BASE_IMAGE=narwhal-base:bookworm.
set -euo pipefail
tag="${1:-narwhal-base:bookworm}"
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag exists"; exit 0
fi
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,passwd \
  bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import - "$tag"
echo "built $tag"
