#!/usr/bin/env bash
# launch.sh encode|prefill: start one node's share of an EPD transfer deployment.
#
#   encode node:  the bootstrap server and EPD_ENCODE_TP encode ranks
#   prefill node: EPD_PREFILL_TP prefill ranks (one prefill instance)
#
# Every rank is `epd-transfer rank` (python -m transfer.cli rank): it moves EPD_ITEMS
# deterministic items per prefill node and checks every landed byte, so a cluster smoke
# test is one command per node. launch-encode.sh and launch-prefill.sh call this script.
# Logs: $EPD_LOG_DIR/<role>-<rank>.log (prefill ranks numbered node * EPD_PREFILL_TP + rank)
# and bootstrap.log. Ctrl-C, SIGTERM or SIGHUP (a dropped ssh session) stops every process
# this script started (each runs in its own process group, which is killed), waits for
# them, and exits 130. The first rank to fail stops the node's other ranks (bash >= 5.1), as does a
# bootstrap server that fails (its port taken), reported at once.
# Exit status: 0 when every rank exited 0, else 1 (2: bad settings, refused before anything
# starts; 130: stopped by Ctrl-C, SIGTERM or SIGHUP). --help prints this header and exits.
# Each rank's summary line is its JSON: role, node (prefill node index), rank within the node.
#
# Environment (default in brackets):
#   EPD_ENCODE_HOST      IP address of the encode node; the bootstrap server listens there [127.0.0.1]
#   EPD_BOOTSTRAP_PORT   bootstrap server port [8998]
#   EPD_BOOTSTRAP_BIND   address the bootstrap server binds [EPD_ENCODE_HOST]
#   EPD_NO_BOOTSTRAP=1   encode node: do not start a bootstrap server (one runs elsewhere) [0]
#   EPD_ENCODE_TP        encode ranks E [1]
#   EPD_PREFILL_TP       prefill ranks P per prefill node, a multiple of E [1]
#   EPD_PREFILL_NODES    prefill nodes the encode node serves [1]
#   EPD_PREFILL_NODE     this prefill node's index, 0-based [SLURM_PROCID, else 0]
#   EPD_PREFILL_HOST     IP address of this prefill node [127.0.0.1 if EPD_ENCODE_HOST is
#                        loopback, else the first address of `hostname -I`]
#   EPD_PROTOCOL         auto | tcp | rdma | wire [auto]
#   EPD_DEVICE           Mooncake RDMA device, e.g. mlx5_0 [every device found]; refused with wire
#   EPD_TOKEN            bearer token the bootstrap server requires for registrations [none];
#                        handed to the processes in their environment, never on a command line
#   EPD_ITEMS            items per prefill node [64]
#   EPD_SPAN, EPD_HIDDEN rows per item and row width (bf16) [1024, 4096]
#   EPD_INFLIGHT         rooms in flight per rank [8]
#   EPD_LOG_DIR          where the per-rank logs go [./epd-logs]
#   EPD_PYTHON           interpreter [<repo>/.venv/bin/python if present, else python3]
#   EPD_EXTRA_ARGS       more `epd-transfer rank` options, split on spaces (e.g. --no-integrity)
#
# Plain ssh (encode node 10.0.0.1, prefill nodes 10.0.0.2 and 10.0.0.3, repo in ~/epd; -tt so that
# a dropped connection sends SIGHUP):
#   ssh -tt 10.0.0.1 'cd epd && EPD_ENCODE_HOST=10.0.0.1 EPD_PREFILL_TP=4 EPD_PREFILL_NODES=2 scripts/launch-encode.sh' &
#   for i in 0 1; do ssh -tt 10.0.0.$((i + 2)) "cd epd && EPD_ENCODE_HOST=10.0.0.1 EPD_PREFILL_TP=4 EPD_PREFILL_NODES=2 EPD_PREFILL_NODE=$i scripts/launch-prefill.sh" & done; wait
#
# SLURM (inside an allocation of 3 nodes; one task per node, SLURM_PROCID numbers the prefill nodes):
#   nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
#   export EPD_ENCODE_HOST=$(getent hosts "${nodes[0]}" | awk '{print $1}') EPD_PREFILL_TP=4 EPD_PREFILL_NODES=2
#   srun -N1 -n1 -w "${nodes[0]}" scripts/launch-encode.sh &
#   srun -N2 -n2 --ntasks-per-node=1 -x "${nodes[0]}" scripts/launch-prefill.sh; wait
set -euo pipefail

usage() {
    # The header above is the help: every comment line up to `set -euo pipefail`.
    sed -n '2,/^set -euo pipefail/{/^#/{s/^# \{0,1\}//;p}}' "${BASH_SOURCE[0]}"
}

for arg in "$@"; do
    if [[ "$arg" == -h || "$arg" == --help ]]; then
        usage
        exit 0
    fi
done
ROLE=${1:-}
case "$ROLE" in
    encode | prefill) ;;
    *)
        echo "usage: $0 encode|prefill   (settings come from EPD_* variables; --help lists them)" >&2
        exit 2
        ;;
esac
if (($# > 1)); then
    echo "$0 $ROLE: unexpected argument '$2' (settings come from EPD_* variables; --help lists them)" >&2
    exit 2
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n "${EPD_PYTHON:-}" ]]; then
    PYTHON=$EPD_PYTHON
elif [[ -x "$REPO/.venv/bin/python" ]]; then
    PYTHON=$REPO/.venv/bin/python
else
    PYTHON=python3
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

ENCODE_HOST=${EPD_ENCODE_HOST:-127.0.0.1}
PORT=${EPD_BOOTSTRAP_PORT:-8998}
ENCODE_TP=${EPD_ENCODE_TP:-1}
PREFILL_TP=${EPD_PREFILL_TP:-1}
PREFILL_NODES=${EPD_PREFILL_NODES:-1}
PREFILL_NODE=${EPD_PREFILL_NODE:-${SLURM_PROCID:-0}}
PROTOCOL=${EPD_PROTOCOL:-auto}
ITEMS=${EPD_ITEMS:-64}
SPAN=${EPD_SPAN:-1024}
HIDDEN=${EPD_HIDDEN:-4096}
INFLIGHT=${EPD_INFLIGHT:-8}
LOG_DIR=${EPD_LOG_DIR:-./epd-logs}

bad_setting() {
    echo "$0: $1" >&2
    exit 2
}

whole_number() {
    # whole_number VAR SETTING LOW [HIGH]: VAR must hold a whole number in [LOW, HIGH]; it is stored
    # back in plain decimal (bash arithmetic reads 010 as octal 8 and refuses 08).
    local value=${!1} high=${4:-999999999999}
    if ! [[ "$value" =~ ^[0-9]{1,12}$ ]] || ((10#$value < $3 || 10#$value > high)); then
        bad_setting "$2 must be a whole number from $3 to $high, got '$value'"
    fi
    printf -v "$1" '%d' "$((10#$value))"
}

check_host() {
    # check_host SETTING VALUE: an IP address or host name, nothing a command line or URL would split.
    [[ "$2" =~ ^[][A-Za-z0-9.:%_-]+$ ]] || bad_setting "$1 must be an IP address or host name, got '$2'"
}

whole_number PORT EPD_BOOTSTRAP_PORT 1 65535
whole_number ENCODE_TP EPD_ENCODE_TP 1
whole_number PREFILL_TP EPD_PREFILL_TP 1
whole_number PREFILL_NODES EPD_PREFILL_NODES 1
whole_number PREFILL_NODE EPD_PREFILL_NODE 0
whole_number ITEMS EPD_ITEMS 1
whole_number SPAN EPD_SPAN 1
whole_number HIDDEN EPD_HIDDEN 1
whole_number INFLIGHT EPD_INFLIGHT 1
if ((PREFILL_TP % ENCODE_TP != 0)); then
    bad_setting "EPD_PREFILL_TP ($PREFILL_TP) must be a positive multiple of EPD_ENCODE_TP ($ENCODE_TP)"
fi
if ((PREFILL_NODE >= PREFILL_NODES)); then
    bad_setting "EPD_PREFILL_NODE ($PREFILL_NODE) must be below EPD_PREFILL_NODES ($PREFILL_NODES)"
fi
case "$PROTOCOL" in
    auto | tcp | rdma | wire) ;;
    *) bad_setting "EPD_PROTOCOL must be auto, tcp, rdma or wire, got '$PROTOCOL'" ;;
esac
case "${EPD_NO_BOOTSTRAP:-0}" in
    0 | 1) ;;
    *) bad_setting "EPD_NO_BOOTSTRAP must be 0 or 1, got '$EPD_NO_BOOTSTRAP'" ;;
esac
check_host EPD_ENCODE_HOST "$ENCODE_HOST"
[[ -z "${EPD_BOOTSTRAP_BIND:-}" ]] || check_host EPD_BOOTSTRAP_BIND "$EPD_BOOTSTRAP_BIND"
if [[ "$PROTOCOL" == wire && -n "${EPD_DEVICE:-}" ]]; then
    bad_setting "EPD_DEVICE ($EPD_DEVICE) names a Mooncake RDMA device; the wire protocol uses none"
fi
command -v "$PYTHON" >/dev/null 2>&1 || bad_setting "no Python interpreter '$PYTHON' (set EPD_PYTHON)"
# The library's own EPD_* settings (deadlines, token, poll schedule...), checked as the ranks would
# check them, by the repository's interpreter (the check needs only the standard library); where
# none can run it, the ranks still refuse a bad one when they start.
check_python=$REPO/.venv/bin/python
[[ -x "$check_python" ]] || check_python=python3
verdict=$("$check_python" -c 'import os; from transfer.doctor import epd_env_problems
print("epd-env:", "; ".join(epd_env_problems(os.environ)))' 2>/dev/null || true)
[[ "$verdict" != "epd-env: "?* ]] || bad_setting "${verdict#epd-env: }"
# The ranks and the bootstrap server read the token from the environment: on a command
# line every user of the host could read it (ps), and one starting with '-' reads as an option.
if [[ -n "${EPD_TOKEN:-}" ]]; then
    export EPD_TOKEN
fi

default_prefill_host() {
    # Same-machine runs stay on loopback; otherwise the node's first address.
    if [[ "$ENCODE_HOST" == 127.* || "$ENCODE_HOST" == localhost ]]; then
        echo 127.0.0.1
    else
        hostname -I 2>/dev/null | awk '{print $1}'
    fi
}

# Options every rank shares (both ends must agree on the items' geometry). --exit-with: were this
# script killed with SIGKILL, its ranks would wait for their --timeout, its bootstrap server forever.
common=(--exit-with $$ --encode-ranks "$ENCODE_TP" --prefill-ranks "$PREFILL_TP" --bootstrap "$ENCODE_HOST:$PORT"
    --protocol "$PROTOCOL" --span "$SPAN" --hidden "$HIDDEN" --inflight "$INFLIGHT")
[[ -n "${EPD_DEVICE:-}" ]] && common+=("--device=$EPD_DEVICE")
if [[ -n "${EPD_EXTRA_ARGS:-}" ]]; then
    read -r -a extra <<<"$EPD_EXTRA_ARGS"
    common+=("${extra[@]}")
fi

# How long a stopping rank may take before it is killed: its close (EPD_CLOSE_TIMEOUT_S, 10 s, checked above),
# then stopping Mooncake's engine and exiting (docs/operations.md), with room to spare.
close_s=${EPD_CLOSE_TIMEOUT_S:-10}
close_s=${close_s%%.*}
[[ "$close_s" =~ ^[0-9]{1,7}$ ]] || close_s=10
STOP_GRACE_S=$((10#$close_s + 6))

mkdir -p "$LOG_DIR"
pids=()
names=()
helper_pids=()
running=() # the ranks not waited for yet: what stop() may signal (a reaped pid may be another's now)

start() {
    # start NAME ARGS...: run ARGS in its own process group, output to $LOG_DIR/NAME.log.
    local name=$1
    shift
    if command -v setsid >/dev/null; then
        setsid "$@" >"$LOG_DIR/$name.log" 2>&1 &
    else
        "$@" >"$LOG_DIR/$name.log" 2>&1 &
    fi
}

stop() {
    # TERM every process group we started and did not wait for yet, give them STOP_GRACE_S, then KILL
    # what is left; then nothing is left to stop.
    local pid tries=0
    for pid in "${running[@]}" "${helper_pids[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
    while ((tries < STOP_GRACE_S * 10)); do
        local alive=0
        for pid in "${running[@]}" "${helper_pids[@]}"; do
            kill -0 "$pid" 2>/dev/null && alive=1
        done
        ((alive)) || break
        sleep 0.1
        tries=$((tries + 1))
    done
    for pid in "${running[@]}" "${helper_pids[@]}"; do
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    running=()
    helper_pids=()
}

term_ranks() {
    # TERM the process group of every rank still running (a rank or the bootstrap server failed).
    local pid
    for pid in "${running[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
}

forget() {
    # forget PID: it was waited for; it is no longer ours to signal.
    local pid kept=()
    for pid in "${running[@]}"; do
        [[ "$pid" == "$1" ]] || kept+=("$pid")
    done
    running=("${kept[@]}")
}

say() {
    # A line for whoever reads our output; a reader that went away (a dropped ssh session, `| head`)
    # must not end this script before it stopped what it started.
    echo "$@" 2>/dev/null || true
}

# shellcheck disable=SC2317,SC2329  # invoked by the trap below (0.9 says SC2317, 0.10+ SC2329)
on_signal() {
    trap - INT TERM HUP
    local ranks=${#running[@]}
    stop
    say "launch.sh $ROLE: interrupted, stopped $ranks rank(s)" >&2
    exit 130
}
# HUP too: a dropped ssh session must not leave the ranks (in sessions of their own) running.
trap on_signal INT TERM HUP
# Writing to a reader that went away fails the write instead of killing this script, and
# whatever way it exits, what it started is stopped.
trap '' PIPE
trap stop EXIT

if [[ "$ROLE" == encode ]]; then
    if [[ "${EPD_NO_BOOTSTRAP:-0}" != 1 ]]; then
        start bootstrap "$PYTHON" -m transfer.cli bootstrap --host "${EPD_BOOTSTRAP_BIND:-$ENCODE_HOST}" \
            --port "$PORT" --exit-with $$
        helper_pids+=($!)
    fi
    # The encode ranks serve every prefill node's rooms: node n asks for n*ITEMS .. (n+1)*ITEMS-1.
    for ((rank = 0; rank < ENCODE_TP; rank++)); do
        start "encode-$rank" "$PYTHON" -m transfer.cli rank --role encode --rank "$rank" --host "$ENCODE_HOST" \
            --items $((ITEMS * PREFILL_NODES)) "${common[@]}"
        pids+=($!)
        running+=($!)
        names+=("encode-$rank")
    done
else
    host=${EPD_PREFILL_HOST:-$(default_prefill_host)}
    [[ -n "$host" ]] || bad_setting "cannot tell this node's address; set EPD_PREFILL_HOST"
    check_host EPD_PREFILL_HOST "$host"
    for ((rank = 0; rank < PREFILL_TP; rank++)); do
        name="prefill-$((PREFILL_NODE * PREFILL_TP + rank))"
        start "$name" "$PYTHON" -m transfer.cli rank --role prefill --rank "$rank" --host "$host" \
            --node "$PREFILL_NODE" --items "$ITEMS" --first-room $((PREFILL_NODE * ITEMS)) "${common[@]}"
        pids+=($!)
        running+=($!)
        names+=("$name")
    done
fi
say "launch.sh $ROLE: started ${names[*]} (logs in $LOG_DIR)" >&2

status=0
report() {
    # report INDEX CODE: the rank's line; its last stdout line is its JSON summary, or without one
    # its last line says why.
    local i=$1 code=$2 result=ok summary
    ((code == 0)) || { result="FAILED (exit $code)"; status=1; }
    summary=$(grep '^{' "$LOG_DIR/${names[$i]}.log" | tail -n 1 || true)
    if [[ -z "$summary" && "$result" != ok ]]; then
        summary=$(grep -v '^[[:space:]]*$' "$LOG_DIR/${names[$i]}.log" | tail -n 1 || true)
    fi
    say "${names[$i]}: $result ${summary}"
}

report_bootstrap() {
    # report_bootstrap CODE: the bootstrap server's line, where it ended with an error (its port taken, say),
    # which explains the ranks' failures; its log's last line says why.
    ((${1} != 0)) || return 0
    say "bootstrap: FAILED (exit $1) $(grep -v '^[[:space:]]*$' "$LOG_DIR/bootstrap.log" | tail -n 1 || true)"
    status=1
}

if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501)); then
    # As the ranks end: the first to fail stops the others, which would only wait out their timeouts; so does
    # the bootstrap server failing (its port taken), which the encode ranks would wait for until
    # --bootstrap-timeout.
    stopping=0
    while ((${#running[@]})); do
        code=0
        ended=""
        wait -n -p ended "${running[@]}" "${helper_pids[@]}" || code=$?
        [[ -n "$ended" ]] || break
        if [[ " ${helper_pids[*]} " == *" $ended "* ]]; then
            kept=()
            for pid in "${helper_pids[@]}"; do
                [[ "$pid" == "$ended" ]] || kept+=("$pid")
            done
            helper_pids=("${kept[@]}")
            report_bootstrap "$code"
            if ((code != 0 && !stopping)); then
                stopping=1
                say "launch.sh $ROLE: the bootstrap server failed; stopping the ranks" >&2
                term_ranks
            fi
            continue
        fi
        for i in "${!pids[@]}"; do
            [[ "${pids[$i]}" == "$ended" ]] && break
        done
        forget "$ended"
        report "$i" "$code"
        if ((code != 0 && ${#running[@]} && !stopping)); then
            stopping=1
            say "launch.sh $ROLE: ${names[$i]} failed; stopping the other ranks" >&2
            term_ranks
        fi
    done
else
    for i in "${!pids[@]}"; do
        code=0
        wait "${pids[$i]}" || code=$?
        forget "${pids[$i]}"
        report "$i" "$code"
    done
fi
# A bootstrap server that could not start (its port taken, say) explains the ranks' failures.
serving=()
for pid in "${helper_pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
        serving+=("$pid")
        continue
    fi
    code=0
    wait "$pid" || code=$?
    report_bootstrap "$code"
done
helper_pids=("${serving[@]}")
stop # the bootstrap server, if it still serves
exit "$status"
