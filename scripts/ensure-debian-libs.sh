#!/usr/bin/env bash
# Installs the Debian packages Mooncake needs at import time, when missing.
set -euo pipefail
missing=()
for lib in libibverbs.so.1 libnuma.so.1; do
    # grep reads all of it (no -q): an early exit would SIGPIPE ldconfig and fail the pipe.
    ldconfig -p | grep -F "$lib" >/dev/null || missing+=("$lib")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing Debian packages for: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
else
    SUDO=
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 libnuma1 ibverbs-providers >/dev/null
