#!/usr/bin/env bash
# Installs the Debian packages Mooncake needs at import time, when missing.
set -euo pipefail
# A non-root user's PATH on Debian has no /sbin: look there too, or every run would take the
# libraries for missing and call apt-get.
LDCONFIG=$(PATH="$PATH:/usr/sbin:/sbin" command -v ldconfig || true)
if [ -z "$LDCONFIG" ]; then
    echo "ensure-debian-libs: ldconfig not found; cannot tell whether libibverbs1 and libnuma1 are installed" >&2
    exit 1
fi
missing=()
for lib in libibverbs.so.1 libnuma.so.1; do
    # grep reads all of it (no -q): an early exit would SIGPIPE ldconfig and fail the pipe.
    "$LDCONFIG" -p | grep -F "$lib" >/dev/null || missing+=("$lib")
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
