#!/usr/bin/env bash
# netns-cluster.sh: a small EPD cluster on one machine, each node in its own network namespace.
#
#   <id>-enc   10.231.0.1   bootstrap server + EPD_ENCODE_TP encode ranks (launch-encode.sh)
#   <id>-pre0  10.231.0.2   EPD_PREFILL_TP prefill ranks                   (launch-prefill.sh)
#   <id>-pre1  10.231.0.3   a second prefill node (with --prefill-nodes 2)
#   <id>-sw    -            a bridge joining the nodes' veth pairs
#
# The bridge lives in a namespace of its own and the addresses (10.231.0.0/24) exist only
# inside these namespaces, so no packet of the run touches the host's network stack or
# its interfaces. Everything is torn down on exit, Ctrl-C, SIGTERM and SIGHUP included
# (SIGKILL leaves no chance: `ip netns list` shows what is left, named epd<pid>-*).
# Needs root and a kernel with network namespaces, veth and bridge support.
#
# usage: netns-cluster.sh [--prefill-nodes 1|2] [--protocol tcp|wire|rdma|auto] [--items N]
#                         [--span ROWS] [--hidden WIDTH] [--log-dir DIR] [--keep-logs]
# The EPD_* variables of launch.sh apply as well (EPD_ENCODE_TP, EPD_PREFILL_TP, EPD_TOKEN, ...).
# Exit status: 0 when every rank on every node moved and verified every byte.
set -euo pipefail

NODES=2
PROTOCOL=${EPD_PROTOCOL:-tcp}
ITEMS=${EPD_ITEMS:-16}
SPAN=${EPD_SPAN:-256}
HIDDEN=${EPD_HIDDEN:-4096}
LOG_DIR=${EPD_LOG_DIR:-}
KEEP_LOGS=0
SUBNET=10.231.0

usage_error() {
    echo "$0: $1 (see --help)" >&2
    exit 2
}

whole_number() {
    # whole_number VAR OPTION VALUE: VALUE must be a whole number >= 1; VAR gets it in plain decimal.
    if ! [[ "$3" =~ ^[0-9]{1,12}$ ]] || ((10#$3 < 1)); then
        usage_error "$2 must be a whole number >= 1, got '$3'"
    fi
    printf -v "$1" '%d' "$((10#$3))"
}

while (($#)); do
    case "$1" in
        --prefill-nodes | --protocol | --items | --span | --hidden | --log-dir)
            (($# >= 2)) || usage_error "$1 needs a value"
            ;;
    esac
    case "$1" in
        --prefill-nodes)
            [[ "$2" == 1 || "$2" == 2 ]] || usage_error "--prefill-nodes must be 1 or 2, got '$2'"
            NODES=$(($2 + 1)); shift 2 ;;
        --protocol) PROTOCOL=$2; shift 2 ;;
        --items) whole_number ITEMS --items "$2"; shift 2 ;;
        --span) whole_number SPAN --span "$2"; shift 2 ;;
        --hidden) whole_number HIDDEN --hidden "$2"; shift 2 ;;
        --log-dir) LOG_DIR=$2; shift 2 ;;
        --keep-logs) KEEP_LOGS=1; shift ;;
        -h | --help) sed -n '2,/^set -euo/{/^#/p}' "$0"; exit 0 ;;
        *) usage_error "unknown option $1" ;;
    esac
done
case "$PROTOCOL" in
    auto | tcp | rdma | wire) ;;
    *) usage_error "--protocol must be tcp, wire, rdma or auto, got '$PROTOCOL'" ;;
esac
if ((EUID != 0)); then
    echo "$0: needs root (ip netns add); run it with sudo" >&2
    exit 2
fi
command -v ip >/dev/null || { echo "$0: the ip command (iproute2) is missing" >&2; exit 2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Names unique to this run, so concurrent runs never collide (interface names <= 15 chars).
ID="epd$$"
SW="$ID-sw"
NAMES=("$ID-enc")
for ((i = 1; i < NODES; i++)); do NAMES+=("$ID-pre$((i - 1))"); done
if [[ -z "$LOG_DIR" ]]; then
    LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/epd-netns.XXXXXX")
    MADE_LOG_DIR=1
else
    mkdir -p "$LOG_DIR"
    MADE_LOG_DIR=0
fi
launchers=()

# shellcheck disable=SC2317,SC2329  # invoked by the trap below (0.9 says SC2317, 0.10+ SC2329)
teardown() {
    local pid ns
    trap - EXIT INT TERM
    for pid in "${launchers[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${launchers[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    for ns in "${NAMES[@]}" "$SW"; do
        if ip netns pids "$ns" >/dev/null 2>&1; then
            # Nothing may outlive its namespace: kill stragglers, then delete it.
            ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
            ip netns del "$ns" 2>/dev/null || true
        fi
    done
    if ((MADE_LOG_DIR && !KEEP_LOGS)); then
        rm -rf "$LOG_DIR"
    fi
}
trap teardown EXIT
trap 'exit 130' INT TERM HUP

ip netns add "$SW"
ip -n "$SW" link add br0 type bridge
ip -n "$SW" link set br0 up
ip -n "$SW" link set lo up
for i in "${!NAMES[@]}"; do
    ns=${NAMES[$i]}
    ip netns add "$ns"
    # One veth pair per node: eth0 in the node, port<i> on the bridge.
    ip -n "$ns" link add eth0 type veth peer name "port$i" netns "$SW"
    ip -n "$SW" link set "port$i" master br0
    ip -n "$SW" link set "port$i" up
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
done

# Wait until the encode node answers from every prefill node, where ping exists (the bridge
# has STP off, so its ports forward at once; the ranks also retry the bootstrap server).
for ((i = 1; i < NODES; i++)); do
    command -v ping >/dev/null || break
    for _ in $(seq 1 50); do
        if ip netns exec "${NAMES[$i]}" ping -c 1 -W 1 "$SUBNET.1" >/dev/null 2>&1; then
            break
        fi
        sleep 0.1
    done
done

export EPD_ENCODE_HOST="$SUBNET.1" EPD_PROTOCOL="$PROTOCOL" EPD_ITEMS="$ITEMS" EPD_SPAN="$SPAN"
export EPD_HIDDEN="$HIDDEN" EPD_LOG_DIR="$LOG_DIR" EPD_PREFILL_NODES=$((NODES - 1))
export EPD_BOOTSTRAP_PORT=${EPD_BOOTSTRAP_PORT:-8998}
echo "netns-cluster: encode node ${NAMES[0]} ($SUBNET.1), $((NODES - 1)) prefill node(s), protocol $PROTOCOL," \
    "$ITEMS item(s) of ${SPAN}x$HIDDEN per prefill node, logs in $LOG_DIR" >&2

ip netns exec "${NAMES[0]}" "$HERE/launch-encode.sh" >"$LOG_DIR/encode-node.out" 2>&1 &
launchers+=($!)
for ((i = 1; i < NODES; i++)); do
    EPD_PREFILL_NODE=$((i - 1)) EPD_PREFILL_HOST="$SUBNET.$((i + 1))" \
        ip netns exec "${NAMES[$i]}" "$HERE/launch-prefill.sh" >"$LOG_DIR/prefill-node$((i - 1)).out" 2>&1 &
    launchers+=($!)
done

status=0
for pid in "${launchers[@]}"; do
    wait "$pid" || status=1
done
launchers=()
for out in "$LOG_DIR"/encode-node.out "$LOG_DIR"/prefill-node*.out; do
    grep -E '^(encode|prefill)-[0-9]+: ' "$out" || true
done
if ((status)); then
    echo "netns-cluster: FAILED (logs in $LOG_DIR)" >&2
    KEEP_LOGS=1
else
    echo "netns-cluster: every rank verified its bytes" >&2
fi
exit "$status"
