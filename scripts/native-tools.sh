#!/usr/bin/env bash
# What the compiled null processor (bench/null_extproc.c, the data-path benchmark's floor
# of any processor) is built with: a C compiler and nghttp2's headers, from Debian where
# missing. Fails loudly: its test must run, not skip.
set -euo pipefail
need=()
command -v cc >/dev/null 2>&1 || need+=(gcc)
[ -e /usr/include/nghttp2/nghttp2.h ] || need+=(libnghttp2-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "native-tools: need ${need[*]} (run as root, or install them)" >&2; exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
