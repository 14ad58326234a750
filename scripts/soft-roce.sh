#!/usr/bin/env bash
# Brings a soft-RoCE (rdma_rxe) device up on an Ethernet interface, tears it
# down, or reports what RDMA devices exist. With it, Mooncake's `rdma` protocol
# runs on a host without an RDMA NIC.
#
#   scripts/soft-roce.sh up [NETDEV]     load rdma_rxe, add $RXE_NAME on NETDEV
#   scripts/soft-roce.sh down            delete $RXE_NAME
#   scripts/soft-roce.sh status          list RDMA devices and rdma links
#
# NETDEV defaults to the interface of the default route, else the first
# non-loopback interface that is UP. RXE_NAME defaults to rxe0.
# Exit codes: 0 done, 1 this host cannot (with the reason), 2 usage.
set -euo pipefail

RXE_NAME="${RXE_NAME:-rxe0}"
IB_SYSFS="${IB_SYSFS:-/sys/class/infiniband}"
PACKAGES="iproute2 rdma-core ibverbs-utils"

usage() {
    echo "usage: $0 up|down|status [NETDEV]" >&2
    exit 2
}

# Prints a reason and the fix on stderr, then exits 1.
cannot() {
    echo "soft-roce: $1" >&2
    shift
    local line
    for line in "$@"; do
        echo "  $line" >&2
    done
    exit 1
}

need_rdma_tool() {
    command -v rdma >/dev/null 2>&1 ||
        cannot "the 'rdma' tool is missing." "fix: apt-get install $PACKAGES"
}

need_root() {
    [ "$(id -u)" -eq 0 ] ||
        cannot "'$1' changes kernel state and needs root." "fix: sudo $0 $1 ${NETDEV:-}"
}

# Explains an error from `rdma link`: no netlink, no module, or something else.
explain_rdma_error() {
    local err="$1"
    case "$err" in
        *NETLINK_RDMA*|*"Protocol not supported"*|*"Address family not supported"*)
            cannot "this kernel ($(uname -r)) has no RDMA netlink: $err" \
                "The kernel was built without InfiniBand/RDMA support (CONFIG_INFINIBAND)," \
                "or a sandbox/VM layer does not pass NETLINK_RDMA through. Soft-RoCE cannot" \
                "run on this host; use protocol tcp here, or a host/VM whose kernel has rdma_rxe."
            ;;
        *"Operation not supported"*|*"Unknown device type"*|*"type rxe"*)
            cannot "the kernel refused an rxe link: $err" \
                "The rdma_rxe module is not loaded or not built (CONFIG_RDMA_RXE)." \
                "fix: modprobe rdma_rxe (on Ubuntu: apt-get install linux-modules-extra-$(uname -r))"
            ;;
        *"Operation not permitted"*)
            cannot "not permitted: $err" "fix: run as root (in a container: --cap-add NET_ADMIN," \
                "or --privileged for module loading)"
            ;;
        *)
            cannot "rdma link failed: $err"
            ;;
    esac
}

# Runs `rdma link show` and explains it when the kernel cannot answer.
probe_rdma_netlink() {
    local err
    if ! err="$(rdma link show 2>&1 >/dev/null)"; then
        explain_rdma_error "${err:-rdma link show exited non-zero}"
    fi
}

default_netdev() {
    local dev=""
    if command -v ip >/dev/null 2>&1; then
        dev="$(ip -o route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')"
        if [ -z "$dev" ]; then
            dev="$(ip -o link show up 2>/dev/null | awk -F': ' '$2 !~ /^lo(@|$)/ {sub(/@.*/, "", $2); print $2; exit}')"
        fi
    fi
    echo "$dev"
}

load_module() {
    if [ -d /sys/module/rdma_rxe ]; then
        return 0
    fi
    if ! command -v modprobe >/dev/null 2>&1; then
        echo "soft-roce: modprobe not found (apt-get install kmod); trying without loading rdma_rxe" >&2
        return 0
    fi
    local err
    if ! err="$(modprobe rdma_rxe 2>&1)"; then
        cannot "cannot load the kernel module rdma_rxe on kernel $(uname -r): $err" \
            "This kernel was built without CONFIG_RDMA_RXE, or its modules are not installed" \
            "(/lib/modules/$(uname -r)). fix: apt-get install linux-modules-extra-$(uname -r)" \
            "(Ubuntu), or use protocol tcp on this host."
    fi
}

show_devices() {
    local dev port
    if [ ! -d "$IB_SYSFS" ] || [ -z "$(ls -A "$IB_SYSFS" 2>/dev/null)" ]; then
        echo "no RDMA devices under $IB_SYSFS"
        return 0
    fi
    for dev in "$IB_SYSFS"/*; do
        for port in "$dev"/ports/*; do
            [ -d "$port" ] || continue
            printf '%s port %s: %s, %s\n' "$(basename "$dev")" "$(basename "$port")" \
                "$(cat "$port/state" 2>/dev/null || echo '?')" \
                "$(cat "$port/link_layer" 2>/dev/null || echo '?')"
        done
    done
}

cmd_up() {
    need_rdma_tool
    need_root up
    if [ -d "$IB_SYSFS/$RXE_NAME" ]; then
        echo "$RXE_NAME already exists"
        cmd_status
        return 0
    fi
    NETDEV="${NETDEV:-$(default_netdev)}"
    [ -n "$NETDEV" ] || cannot "no network interface found to bind $RXE_NAME to." \
        "fix: $0 up NETDEV  (see: ip link)"
    [ -e "/sys/class/net/$NETDEV" ] || cannot "no such network interface: $NETDEV" "see: ip link"
    load_module
    probe_rdma_netlink
    local err
    if ! err="$(rdma link add "$RXE_NAME" type rxe netdev "$NETDEV" 2>&1)"; then
        explain_rdma_error "$err"
    fi
    echo "$RXE_NAME added on $NETDEV"
    rdma link show
    if command -v ibv_devices >/dev/null 2>&1; then
        ibv_devices
    else
        echo "(ibv_devices not installed: apt-get install ibverbs-utils)"
    fi
}

cmd_down() {
    need_rdma_tool
    need_root down
    probe_rdma_netlink
    if [ ! -d "$IB_SYSFS/$RXE_NAME" ]; then
        echo "$RXE_NAME does not exist; nothing to do"
        return 0
    fi
    local err
    if ! err="$(rdma link delete "$RXE_NAME" 2>&1)"; then
        explain_rdma_error "$err"
    fi
    echo "$RXE_NAME deleted"
}

cmd_status() {
    echo "== RDMA devices ($IB_SYSFS)"
    show_devices
    echo "== rdma link show"
    if ! command -v rdma >/dev/null 2>&1; then
        echo "the 'rdma' tool is missing (apt-get install $PACKAGES)"
        return 0
    fi
    local out
    if out="$(rdma link show 2>&1)"; then
        echo "${out:-no rdma links}"
    else
        echo "cannot list links: $out"
        case "$out" in
            *NETLINK_RDMA*) echo "this kernel ($(uname -r)) has no RDMA netlink: soft-RoCE cannot run here" ;;
        esac
    fi
}

main() {
    [ $# -ge 1 ] || usage
    local action="$1"
    NETDEV="${2:-}"
    case "$action" in
        up) cmd_up ;;
        down) cmd_down ;;
        status) cmd_status ;;
        -h|--help|help) usage ;;
        *) usage ;;
    esac
}

main "$@"
