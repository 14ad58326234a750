#!/usr/bin/env bash
# Installs, when missing, the Debian packages `make setup` needs: Mooncake's libraries
# (libibverbs1, libnuma1), and what building the venv and the C core takes (python3-venv
# unless $VENV already exists, a C compiler, Python's headers). $PYTHON is the interpreter
# the venv is made from (default python3).
set -euo pipefail
PYTHON=${PYTHON:-python3}
# A non-root user's PATH on Debian has no /sbin: look there too, or every run would take the
# libraries for missing and call apt-get.
LDCONFIG=$(PATH="$PATH:/usr/sbin:/sbin" command -v ldconfig || true)
if [ -z "$LDCONFIG" ]; then
    echo "ensure-debian-packages: ldconfig not found; cannot tell whether libibverbs1 and libnuma1 are installed" >&2
    exit 1
fi
if ! command -v "$PYTHON" >/dev/null; then
    echo "ensure-debian-packages: no $PYTHON on PATH; install python3 (3.10 or later) or set PYTHON" >&2
    exit 1
fi
packages=()
for lib in libibverbs.so.1 libnuma.so.1; do
    # grep reads all of it (no -q): an early exit would SIGPIPE ldconfig and fail the pipe.
    "$LDCONFIG" -p | grep -F "$lib" >/dev/null || packages+=("${lib%.so.1}1")
done
# Debian splits ensurepip (which `python3 -m venv` runs) into python3-venv.
if [ ! -x "${VENV:-.venv}/bin/python" ] && ! "$PYTHON" -c "import ensurepip" 2>/dev/null; then
    packages+=(python3-venv)
fi
command -v cc >/dev/null || command -v gcc >/dev/null || packages+=(gcc)
"$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || packages+=(python3-dev)
[ ${#packages[@]} -eq 0 ] && exit 0
echo "installing Debian packages: ${packages[*]}"
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
else
    SUDO=
fi
# ibverbs-providers comes with libibverbs1: the user-space drivers its devices need.
case " ${packages[*]} " in *" libibverbs1 "*) packages+=(ibverbs-providers) ;; esac
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${packages[@]}" >/dev/null
