#!/usr/bin/env bash
# The control plane's floor in C: what a room's asks and statuses cost over ZMQ with no
# Python and no Mooncake (scripts/zmq_floor.c), cell by cell, to set beside
# `epd-transfer bench --cpu --paths raw,floor,epd`. See docs/performance.md.
#
# usage: scripts/zmq-floor.sh [--fanouts 1,4] [--inflight 1,8] [--write-us 0,300] [--rooms 3000]
#   --write-us: how long the encode rank waits between a room's last ask and its statuses
#               (a write it would poll), in microseconds; 0 measures the messages alone.
# Needs a C compiler and a Python with pyzmq (EPD_PYTHON, else .venv/bin/python, else python3).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
fanouts=1,4 inflight=1,8 write_us=0,300 rooms=3000
while [ $# -gt 0 ]; do
    case "$1" in
        --fanouts) fanouts=$2; shift 2 ;;
        --inflight) inflight=$2; shift 2 ;;
        --write-us) write_us=$2; shift 2 ;;
        --rooms) rooms=$2; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "zmq-floor: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

python=${EPD_PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$here/../.venv/bin/python" ]; then python="$here/../.venv/bin/python"; else python=python3; fi
fi
# The very libzmq pyzmq loads, read from the process's own mappings.
libzmq=$("$python" -c "import zmq; print(next(l.split()[-1] for l in open('/proc/self/maps') if 'libzmq' in l))") || {
    echo "zmq-floor: $python cannot import zmq, or pyzmq loaded no libzmq" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# An RPATH, not a RUNPATH: it also finds the libraries libzmq needs beside it (pyzmq 25 bundles libsodium so).
cc -O2 -Wall -Wextra -o "$work/zmq_floor" "$here/zmq_floor.c" "$libzmq" -Wl,--disable-new-dtags,-rpath,"$(dirname "$libzmq")"

# A base port with its FANOUT ports above it all free, below the kernel's ephemeral range (whose
# ports other processes' connections take at any moment).
free_ports() {
    "$python" - "$1" <<'PY'
import random, socket, sys
count = int(sys.argv[1]) + 1
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(200):
    base = random.randrange(10000 if low > 12000 else 1024, max(low - count, 1025))
    socks = []
    try:
        for port in range(base, base + count):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        for s in socks:
            s.close()
    print(base)
    break
else:
    sys.exit("zmq-floor: no free run of ports below the ephemeral range")
PY
}

printf '%-7s %-9s %-9s %9s %8s %16s %10s %11s\n' fanout inflight write_us rooms/s "p50 ms" "control ms/room" "encode ms" "prefill ms"
IFS=, read -r -a fanout_list <<< "$fanouts"
IFS=, read -r -a inflight_list <<< "$inflight"
IFS=, read -r -a write_list <<< "$write_us"
for write in "${write_list[@]}"; do
    for fanout in "${fanout_list[@]}"; do
        for depth in "${inflight_list[@]}"; do
            port=$(free_ports "$fanout")
            read -r f i w rate p50 control enc pre < <("$work/zmq_floor" "$fanout" "$depth" "$rooms" "$write" "$port")
            printf '%-7s %-9s %-9s %9s %8s %16s %10s %11s\n' "$f" "$i" "$w" "$rate" "$p50" "$control" "$enc" "$pre"
        done
    done
done
