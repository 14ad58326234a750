"""`epd-transfer`: demo | doctor | bench | bootstrap | rank."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transfer import config
from transfer.errors import ConfigError, ListenError
from transfer.frames import normalize_dtype
from transfer.ports import is_wildcard

if TYPE_CHECKING:
    from transfer.bootstrap import BootstrapServer


def _demo(args: argparse.Namespace) -> int:
    from transfer.harness import Scenario, run

    if (not _output_folders_writable("demo", args, ("json",)) or _environment_refused("demo")
            or _protocol_refused("demo", args.protocol)):
        return 2
    sc = Scenario(
        encode_ranks=args.encode_ranks, prefill_ranks=args.prefill_ranks, items=args.items,
        span=args.span, hidden=args.hidden, dtype=args.dtype, sharded=not args.identity,
        per_block=args.per_block, deepstack=args.deepstack, inflight=args.inflight, protocol=args.protocol, host=args.host,
        integrity=not args.no_integrity, deadline_s=args.deadline,
        timeout_s=args.timeout,
    )
    # Said now, not by a rank's traceback once it fails to allocate its items or slots.
    if _memory_refused("demo", sc, {"encode": sc.encode_ranks, "prefill": sc.prefill_ranks}):
        return 2
    _arm_run_stops()
    summary = run(sc)
    ok = summary["failed"] == 0 and summary["verified"]
    if args.json == "-":
        _emit_json("demo", summary, "-")
        return 0 if ok else 1
    mode = _shard_mode(sc)
    print(
        f"epd-transfer demo: {sc.encode_ranks} encode -> {sc.prefill_ranks} prefill ranks over "
        f"{summary['protocol']} ({mode}, {sc.span} x {sc.hidden} {sc.dtype.removeprefix('torch.')}"
        f"{f', deepstack x{sc.deepstack}' if sc.deepstack else ''})"
    )
    landed = f"{summary['bytes'] / 2**20:.1f} MiB landed"
    print(f"  items     {summary['items']}")
    print(f"  bytes     {summary['bytes']} ({landed}{', every byte checked' if summary['verified'] else ''})")
    written = ", ".join(f"{n / 2**20:.2f}" for n in summary["encode_bytes"])
    print(f"  written   {written} MiB by encode rank{'s' if len(summary['encode_bytes']) > 1 else ''} "
          f"{', '.join(str(r) for r in range(len(summary['encode_bytes'])))}")
    print(f"  failed    {summary['failed']}")
    if summary["retried"]:
        print(f"  retried   {summary['retried']} (asked for again after their bootstrap server's pause)")
    print(f"  verified  {_verified_text(summary)}")
    print(f"  GB/s      {summary['gbps']:.2f}")
    print(f"  rooms/s   {summary['rooms_per_s']:.1f}")
    print(f"  latency   p50 {summary['p50_ms']:.2f} ms, p99 {summary['p99_ms']:.2f} ms")
    for line in summary["failures"] + summary["mismatches"]:
        print(f"  ! {line}")
    if args.json:
        _emit_json("demo", summary, args.json)
    return 0 if ok else 1


def _memory_refused(command: str, sc: Any, ranks: dict[str, int]) -> bool:
    """True, saying why in one line, when the ranks (`ranks[role]` of each role, on this host) of scenario
    `sc` would allocate more memory than this host has."""
    from transfer import harness

    need = sum(count * harness.rank_memory(sc, role) for role, count in ranks.items())
    whose = " and ".join(f"{count} {role} rank{'s' if count > 1 else ''}" for role, count in ranks.items() if count)
    refusal = harness.memory_refusal(need, f"{whose} of items {sc.max_span} x {sc.hidden} {sc.dtype}")
    if refusal is not None:
        print(f"epd-transfer {command}: {refusal}: {harness.SMALLER_ITEMS}", file=sys.stderr)
    return refusal is not None


def _host_refused(command: str, host: str) -> bool:
    """True, saying why in one line, when `host` is not an address of this host that an engine can
    listen on (it does not resolve, or it is another host's)."""
    from transfer.engine import check_hostname

    try:
        check_hostname(host)
    except ConfigError as error:
        print(f"epd-transfer {command}: --host {host}: {error}", file=sys.stderr)
        return True
    return False


def _shard_mode(sc) -> str:
    """How the demo splits each item's rows over the prefill ranks, in words."""
    if not sc.sharded:
        return "identity"
    if sc.encode_ranks == 1:
        return "sharded"
    return "sharded per encode block" if sc.per_block else "sharded over the prefill group"


def _verified_text(summary: dict) -> str:
    """`yes` only when a room landed and every landed byte matched; otherwise NO and why."""
    if summary["verified"]:
        return "yes"
    if summary["mismatches"]:  # first: a rank whose shards are empty may still find bytes written outside them
        return "NO (landed bytes differ from what was sent)"
    if summary["bytes"] == 0:
        return "NO (no item landed)"
    return "NO (not every landed byte was checked)"


def _doctor(args: argparse.Namespace) -> int:
    from transfer import doctor

    if not _output_folders_writable("doctor", args, ("json",)):
        return 2
    if args.json in (None, "-"):
        return doctor.run(as_json=args.json == "-")
    report = doctor.collect_report()
    sys.stdout.write(doctor.format_checks(report.checks))
    _emit_json("doctor", report.as_dict(), args.json)
    return report.exit_status()


def _bench(args: argparse.Namespace) -> int:
    from transfer import bench

    if (not _output_folders_writable("bench", args, ("json", "plot")) or not _log_dir_usable(getattr(args, "log_dir", None))
            or _environment_refused("bench")):
        return 2
    refusal = bench.calls_refusal() if getattr(args, "calls", False) else None
    if refusal is not None:
        print(f"epd-transfer bench: {refusal}", file=sys.stderr)
        return 2
    # Only the wire and memcpy paths run without a Mooncake engine of --protocol.
    if set(bench.options_from(args).paths) - {"wire", "memcpy"} and _protocol_refused("bench", args.protocol):
        return 2
    _arm_run_stops()
    return bench.main(args)


def _log_dir_usable(folder: str | None) -> bool:
    """True when `bench --log-dir` names a folder the ranks can write their logs in, made here if
    missing; else False, saying why in one line, before any rank starts."""
    import tempfile

    if not folder:
        return True
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        why = "it is not a folder" if os.path.lexists(folder) and not os.path.isdir(folder) else (
            error.strerror or str(error))
        print(f"epd-transfer bench: --log-dir {folder} cannot hold the ranks' logs ({why}): name a folder you "
              f"may write (it is made if missing)", file=sys.stderr)
        return False
    return True


def _environment_refused(command: str) -> bool:
    """True, saying why in one line, when an EPD_* variable set would make the ranks refuse to start; a
    warning line for EPD_* names set that nothing reads (a misspelt one would be ignored without a word), and
    one for a quarantine too short for the fanout timeout (doctor.epd_env_warnings)."""
    from transfer import doctor

    for warning in doctor.epd_env_warnings(os.environ):
        print(f"epd-transfer {command}: warning: {warning}", file=sys.stderr)
    problems = doctor.epd_env_problems(os.environ)
    if problems:
        print(f"epd-transfer {command}: {'; '.join(problems)}", file=sys.stderr)
    return bool(problems)


def _probe_mooncake() -> tuple[bool, str]:
    """Whether mooncake.engine imports here, tried in a child process as `doctor` tries it, and how."""
    from transfer import doctor

    return doctor.probe_mooncake_import()


def _protocol_refused(command: str, protocol: str, device: str = "") -> bool:
    """True, saying why in one line, when a Mooncake engine of `protocol` cannot start here (rdma and no
    usable device, or mooncake.engine does not import): every rank would otherwise fail with a traceback."""
    from transfer.engine import _unavailable_message, effective_protocol
    from transfer.errors import EngineError

    if protocol == "wire":
        return False
    try:
        effective_protocol(protocol, device)
    except (ConfigError, EngineError) as error:
        print(f"epd-transfer {command}: {error}", file=sys.stderr)
        return True
    imports, how = _probe_mooncake()
    if not imports:
        wire = "--paths wire,memcpy" if command == "bench" else "--protocol wire"
        print(f"epd-transfer {command}: {_unavailable_message(ImportError(how))}; or run the framed wire, "
              f"which needs no Mooncake: {wire}", file=sys.stderr)
        return True
    return False


#: What `bench --plot` can write without knowing the installed matplotlib's backends: its common formats.
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps")


def _output_folders_writable(command: str, args: argparse.Namespace, options: tuple[str, ...]) -> bool:
    """False, saying why in one line, when an output FILE cannot be written, now rather than after the run:
    its folder is missing or read-only, it is a folder, opening it for writing fails, or a --plot suffix
    names no format we know."""
    for option in options:
        path = getattr(args, option, None)
        if not path or path == "-":
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            print(f"epd-transfer {command}: --{option} {path}: folder {folder} does not exist or is not writable",
                  file=sys.stderr)
            return False
        if os.path.isdir(path):
            print(f"epd-transfer {command}: --{option} {path} is a folder: name a file in it", file=sys.stderr)
            return False
        why = _cannot_write(path)
        if why:
            print(f"epd-transfer {command}: --{option} {path} cannot be written ({why}): name a file you may "
                  f"write", file=sys.stderr)
            return False
        if option == "plot" and not path.lower().endswith(PLOT_SUFFIXES):
            print(f"epd-transfer {command}: --plot {path}: name a file ending in "
                  f"{', '.join(PLOT_SUFFIXES)} (the format is taken from the suffix)", file=sys.stderr)
            return False
    return True


def _cannot_write(path: str) -> str | None:
    """Why the file at path cannot be written, found by opening it for appending (and removing it
    again when it was not there), or None. os.access() alone says yes to root for a folder no file
    can be made in (/proc), and asks nothing about an existing file that is read-only. A path
    that is there and not a plain file (a pipe, a device) is not opened: that could block."""
    existed = os.path.lexists(path)
    if existed and not os.path.isfile(path):
        return None if os.access(path, os.W_OK) else "not writable"
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        return error.strerror or str(error)
    if not existed:
        try:
            os.unlink(path)
        except OSError:
            pass
    return None


#: How often --exit-with looks whether its process is still there, where it cannot wait on it.
EXIT_WITH_CHECK_S = 0.5

#: The wire's last room number (a room is a non-negative signed 64-bit integer: transfer.frames.check_room).
LAST_ROOM = (1 << 63) - 1


def _exit_with(pid: int | None) -> threading.Event:
    """--exit-with PID: this process stops (as on SIGTERM) once process PID ended, so a launcher
    killed with SIGKILL leaves no server holding its port and no rank waiting for its timeout.
    Returns the event that disarms it (a caller that returns instead of exiting sets it).

    It waits on a pidfd (Linux), which names that very process whatever number is reused
    later; elsewhere it looks every EXIT_WITH_CHECK_S.
    """
    disarmed = threading.Event()
    if pid is None:
        return disarmed
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGTERM)
        return disarmed
    except (AttributeError, OSError):  # no pidfd here: look now and then
        fd = -1

    def ended() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def watch() -> None:
        if fd >= 0:
            poller = select.poll()
            poller.register(fd, select.POLLIN)  # readable once the process ended
            poller.poll()
        else:
            while not ended():
                time.sleep(EXIT_WITH_CHECK_S)
        if not disarmed.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="epd-exit-with", daemon=True).start()
    return disarmed


def _add_exit_with(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--exit-with", type=_running_pid, metavar="PID", default=None,
                        help="stop once process PID ends, e.g. the launch script's $$ (default: never)")


def _bootstrap(args: argparse.Namespace) -> int:
    from transfer.bootstrap import BootstrapServer

    # Taken by sigwait() below, never by a handler: a handler runs only in the main thread, and
    # one delivered to another thread would leave the main thread waiting forever. SIGHUP (a dropped
    # terminal or ssh session) stops it as SIGTERM does, unless it was ignored when it started (nohup).
    stops = {signal.SIGINT, signal.SIGTERM}
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        stops.add(signal.SIGHUP)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # the server's threads, started later, too
    disarm = None
    try:
        disarm = _exit_with(args.exit_with)
        try:
            server = BootstrapServer(args.host, args.port, token=args.token)
        except OSError as error:  # its message already names the server and the address (or the range)
            raise OSError(error.strerror or str(error)) from None
        with server:
            print(f"bootstrap server on http://{server.address}", flush=True)
            stopped = signal.sigwait(stops)  # one that came meanwhile is pending, and taken at once
        print(f"epd-transfer bootstrap: stopped by {signal.Signals(stopped).name}", file=sys.stderr, flush=True)
    finally:
        if disarm is not None:
            disarm.set()
        while pending := signal.sigpending() & stops:  # a second stop, taken here rather than by its default
            signal.sigwait(pending)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return 0


def _rank(args: argparse.Namespace) -> int:
    """One rank of a real deployment (launch scripts): encode or prefill, no parent to sync with."""
    from transfer import harness

    if _environment_refused("rank") or _rank_options_refused(args):
        return 2
    sc = harness.Scenario(
        encode_ranks=args.encode_ranks, prefill_ranks=args.prefill_ranks, items=args.items, span=args.span,
        hidden=args.hidden, dtype=args.dtype, sharded=not args.identity, per_block=args.per_block,
        deepstack=args.deepstack,
        inflight=args.inflight, protocol=args.protocol, host=args.host, integrity=not args.no_integrity,
        deadline_s=args.deadline, fanout_timeout_s=args.bootstrap_timeout, register_timeout_s=args.bootstrap_timeout,
        token=args.token, timeout_s=args.timeout, first_room=args.first_room, ports=args.ports,
    )
    sc.device = args.device
    # As demo and bench: said now, not after a prefill rank waited out --bootstrap-timeout for its encode rank.
    if (_host_refused("rank", args.host) or _memory_refused("rank", sc, {args.role: 1})
            or _protocol_refused("rank", args.protocol, args.device)):
        return 2

    _arm_rank_stops(args.exit_with, args.timeout)

    def start_bound() -> tuple[float, str]:  # what ends a wait at the start (what is left of --timeout: its alarm)
        return _start_bound(args.bootstrap_timeout, signal.getitimer(signal.ITIMER_REAL)[0])

    noop = lambda: None  # nobody to sync with in a real deployment
    server = _served_bootstrap(args) if args.serve_bootstrap else None
    try:
        if args.role == "encode":
            if server is None:  # its registration then goes on within what is left (2 s at least: a try's bound)
                left = _wait_for_bootstrap(f"encode rank {args.rank}", args.bootstrap, args.bootstrap_timeout,
                                           start_bound())
                sc.register_timeout_s = max(round(left, 1), 2.0)
            # After its rooms concluded, linger so the last statuses reach the prefill ranks.
            report = harness.encode_rank(sc, args.rank, args.bootstrap, noop, noop, lambda: time.sleep(args.linger),
                                         say=_say, rank_left=lambda: signal.getitimer(signal.ITIMER_REAL)[0])
            summary = {"role": "encode", "node": 0, "rank": args.rank, "items": sc.items,
                       "failed": len(report["failed"]),
                       "failures": [f"room {room}: {why}" for room, why in report["failed"]][:20]}
            ok = not report["failed"]
        else:
            _wait_for_route(f"prefill rank {args.rank}", args.bootstrap, args.rank // sc.fanout, args.bootstrap_timeout,
                            start_bound())
            report = harness.prefill_rank(sc, args.rank, args.bootstrap, noop, noop, noop, say=_say,
                                          rank_left=lambda: signal.getitimer(signal.ITIMER_REAL)[0])
            summary = {"role": "prefill", "node": args.node, "rank": args.rank, **harness.summarize(sc, [report])}
            ok = summary["failed"] == 0 and summary["verified"]
    except KeyboardInterrupt as stopped:
        code = _stop_code(stopped)
        print(f"{args.role} rank {args.rank}: stopped by {_stop_name(stopped)} (exit {code})", file=sys.stderr,
              flush=True)
        return code
    except _RankTimeout:
        print(f"{args.role} rank {args.rank}: stopped after --timeout {args.timeout:g}s", file=sys.stderr)
        return 1
    except harness.NoMemory as error:
        print(f"epd-transfer rank: {args.role} rank {args.rank}: {error}: {harness.SMALLER_ITEMS}", file=sys.stderr)
        return 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if server is not None:
            server.close()
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


def _rank_options_refused(args: argparse.Namespace) -> bool:
    """Says on stderr what does not fit, and returns True, where `epd-transfer rank`'s options contradict
    each other: -P no multiple of -E, a --rank past its role's ranks, one --ports port or a --device for a
    wire rank."""
    limit = args.encode_ranks if args.role == "encode" else args.prefill_ranks
    if args.prefill_ranks % args.encode_ranks:
        print(f"epd-transfer rank: prefill ranks {args.prefill_ranks} (-P) must be a multiple of encode ranks "
              f"{args.encode_ranks} (-E)", file=sys.stderr)
    elif not 0 <= args.rank < limit:
        flag = "-E/--encode-ranks" if args.role == "encode" else "-P/--prefill-ranks"
        print(f"epd-transfer rank: --rank {args.rank} is no {args.role} rank: with {flag} {limit} they are 0 to "
              f"{limit - 1}{' on each prefill node' if args.role == 'prefill' else ''}; give a --rank below "
              f"{limit}, or the deployment's {flag}", file=sys.stderr)
    elif args.protocol == "wire" and isinstance(args.ports, int) and args.ports:
        print(f"--ports {args.ports} is one port, and a wire rank listens twice (its ZMQ socket and its wire "
              f"listener): give a range FIRST-LAST", file=sys.stderr)
    elif args.device and args.protocol == "wire":
        print(f"--device {args.device} names a Mooncake RDMA device; the wire protocol uses none "
              f"(unset EPD_DEVICE or pick another --protocol)", file=sys.stderr)
    else:
        return False
    return True


def _arm_rank_stops(exit_with: int | None, timeout_s: float) -> None:
    """Makes the rank's stops unwind it through its context managers (its route is withdrawn, its rooms
    fail with a reason, its engine, sockets and bootstrap server close), wherever it waits.

    SIGTERM (what Kubernetes, Slurm and the launch scripts send), SIGHUP (a dropped terminal or ssh
    session) and SIGINT raise `_Stopped`: the rank exits 128 + the signal's number. A signal ignored
    when the rank started (nohup, a background job's SIGINT) stays ignored. `exit_with` is
    --exit-with's (see `_exit_with`); SIGALRM after `timeout_s` (--timeout, the bound on the whole
    rank) raises `_RankTimeout`.
    """
    for stop in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        if stop == signal.SIGTERM or signal.getsignal(stop) is not signal.SIG_IGN:
            signal.signal(stop, _raise_stopped)
    _exit_with(exit_with)
    signal.signal(signal.SIGALRM, _raise_rank_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)


def _served_bootstrap(args: argparse.Namespace) -> BootstrapServer:
    """The bootstrap server --serve-bootstrap runs beside the rank, on --bootstrap-bind (else the host of
    --bootstrap) and the port of --bootstrap; its address goes to stderr."""
    from transfer.bootstrap import BootstrapServer

    bind = args.bootstrap_bind or args.bootstrap.rpartition(":")[0].strip("[]")
    port = int(args.bootstrap.rpartition(":")[2])
    try:
        server = BootstrapServer(bind, port, token=args.token)
    except OSError as error:  # its message already names the server and the address (or the range)
        raise OSError(error.strerror or str(error)) from None
    except ConfigError as error:  # an address not of this host
        if args.bootstrap_bind:
            raise
        raise ConfigError(f"--serve-bootstrap binds the host of --bootstrap {args.bootstrap} unless "
                          f"--bootstrap-bind gives another, and {error}; where peers reach the server at an "
                          f"address this host does not hold (a load balancer's, a Kubernetes service's), keep "
                          f"it in --bootstrap and give this host's as --bootstrap-bind (0.0.0.0: every "
                          f"interface)") from None
    print(f"bootstrap server on http://{server.address}", file=sys.stderr, flush=True)
    return server


class _Stopped(KeyboardInterrupt):
    """A stop signal taken by `_raise_stopped`: unwinds like Ctrl-C, and says which signal it was."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _arm_run_stops() -> None:
    """Makes demo's and bench's stops unwind the run, which stops its ranks instead of orphaning them and
    takes their logs along, once.

    SIGTERM and SIGHUP (a dropped terminal or ssh session) raise `_Stopped` (exit 143, 129), Ctrl-C a plain
    KeyboardInterrupt (`interrupted`, exit 130); after any of them the command is stopping (_stopping), so a
    second one while the run stops its ranks is noted instead of cutting that stop short. A SIGHUP or Ctrl-C
    ignored when the command started (nohup, a background job's Ctrl-C) stays ignored.
    """
    signal.signal(signal.SIGTERM, _raise_stopped)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _raise_stopped)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _raise_interrupted)


def _raise_interrupted(_signum: int, _frame: object) -> None:
    """Ctrl-C's handler in demo and bench: unwinds as Python's own does, and the command is stopping from
    then on (_stopping)."""
    _stopping()
    raise KeyboardInterrupt


def _raise_stopped(signum: int, _frame: object) -> None:
    """A stop signal's handler (rank, demo, bench): unwinds through the context managers, naming the signal.
    The process is stopping from then on (_stopping)."""
    _stopping()
    raise _Stopped(signum)


#: The signals that stop a rank, and so are only noted once it is stopping (`_stopping`).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGALRM)


def _stopping() -> None:
    """The rank unwinds from now on: its --timeout alarm is off, and a stop signal that comes meanwhile (a
    supervisor's second SIGTERM, a second Ctrl-C) is noted instead of raised, so it cannot cut the closing
    short halfway (a route left listed, rooms never failed); the closing is bounded by itself
    (EPD_CLOSE_TIMEOUT_S). SIGKILL still ends the rank at once. A signal ignored when
    the rank started stays ignored."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    for stop in _STOP_SIGNALS:
        if signal.getsignal(stop) in (_raise_stopped, _raise_interrupted, _raise_rank_timeout):
            signal.signal(stop, _noted_while_stopping)


def _noted_while_stopping(signum: int, _frame: object) -> None:
    """A stop signal's handler once the command (a rank, demo, bench) is stopping: says it is already stopping
    (written in one call: the handler may run in the middle of a print to stderr)."""
    os.write(2, f"{signal.Signals(signum).name} ignored: already stopping (SIGKILL ends it at once)\n".encode())


def _stop_code(stopped: KeyboardInterrupt) -> int:
    """The exit status of a process stopped by a signal, as a shell reports one killed by it: 128 + its
    number (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + getattr(stopped, "signum", signal.SIGINT)


def _stop_name(stopped: KeyboardInterrupt) -> str:
    """`SIGTERM`, or `SIGINT` for a plain Ctrl-C."""
    return signal.Signals(getattr(stopped, "signum", signal.SIGINT)).name


class _RankTimeout(BaseException):
    """The rank ran past its --timeout (a BaseException, like Ctrl-C, so no `except Exception` retries it)."""


def _raise_rank_timeout(*_: object) -> None:
    """The SIGALRM handler of `rank --timeout`; the rank is stopping from then on (_stopping)."""
    _stopping()
    raise _RankTimeout


def _start_bound(bootstrap_timeout_s: float, rank_left_s: float) -> tuple[float, str]:
    """How long a rank's wait at its start may last, and the option that ends it: --bootstrap-timeout, or
    --timeout where what is left of it (`rank_left_s`) ends the rank first."""
    if rank_left_s < bootstrap_timeout_s:
        return round(rank_left_s, 1), "--timeout"
    return bootstrap_timeout_s, "--bootstrap-timeout"


def _wait_for_route(who: str, bootstrap: str, encode_rank: int, timeout_s: float,
                    ends: tuple[float, str] | None = None) -> None:
    """Blocks until the bootstrap server lists encode_rank (prefill ranks may start first), saying so
    (_waited); BootstrapError naming the bootstrap address and the last reason past timeout_s."""
    from transfer.bootstrap import BootstrapClient

    client = BootstrapClient(bootstrap)

    def listed(bound_s: float) -> None:  # both look-ups within the try's bound (the route's 0.05 s at least)
        ends = time.monotonic() + bound_s
        client.parallel_info(bound_s)
        client.route(encode_rank, 0, max(0.05, ends - time.monotonic()))

    _waited(who, f"encode rank {encode_rank} to register at bootstrap {bootstrap}", timeout_s, listed,
            f"encode rank {encode_rank} never registered at bootstrap {bootstrap}",
            f"start encode rank {encode_rank} (and the bootstrap server, `epd-transfer bootstrap` or its "
            f"--serve-bootstrap), or give this rank the address they use (--bootstrap)", ends=ends)


def _wait_for_bootstrap(who: str, bootstrap: str, timeout_s: float, ends: tuple[float, str] | None = None) -> float:
    """Blocks until the bootstrap server answers at all (encode ranks may start first), saying so
    (_waited); returns the seconds left of timeout_s, BootstrapError past it."""
    from transfer.bootstrap import BootstrapClient
    from transfer.errors import BootstrapError, BootstrapUnreachable

    client = BootstrapClient(bootstrap)

    def answers(bound_s: float) -> None:
        try:
            client.parallel_info(bound_s)
        except BootstrapUnreachable:
            raise
        except BootstrapError:  # it answered (no encode rank registered yet, say): the registration goes on
            pass

    return _waited(who, f"the bootstrap server at {bootstrap} to answer", timeout_s, answers,
                   f"nothing answered at bootstrap {bootstrap}",
                   "start the bootstrap server (`epd-transfer bootstrap`, or --serve-bootstrap on one encode "
                   "rank) first, or check --bootstrap and the firewall", ends=ends)


def _waited(who: str, what: str, timeout_s: float, attempt: Callable[[float], None], never: str, fix: str,
            say: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep, ends: tuple[float, str] | None = None) -> float:
    """bootstrap.waited() for a rank's operator: its lines begin with `who` and go to `say` (else stderr),
    naming what ends the wait: `ends` (seconds, option), --bootstrap-timeout (timeout_s) by default.
    Returns the seconds left of timeout_s, BootstrapError past it (`NEVER within Ts (N tries), the last:
    WHY: FIX`); a wait that `ends` cuts shorter is ended by that option (the rank's --timeout alarm)."""
    from transfer.bootstrap import waited

    told = _say if say is None else say
    ends_s, bound = (timeout_s, "--bootstrap-timeout") if ends is None else ends
    return waited(what, timeout_s, attempt, never, fix, lambda _level, line: told(line), who=who, bound=bound,
                  ends_s=ends_s, clock=clock, sleep=sleep)


def _say(line: str) -> None:
    """A rank's line for its operator: stderr, at once."""
    print(line, file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (the usage block buries it) and exit 2."""

    #: The subcommands' parsers by name (build_parser fills it on the top-level parser).
    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> None:  # type: ignore[override]
        """Print `PROG: error: MESSAGE (see PROG --help)` and exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def _running_pid(text: str) -> int:
    """The number of a process that is running now (one already gone would stop the command at once)."""
    pid = _positive_int(text)
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: past a C int, which no process number is
        raise argparse.ArgumentTypeError(f"no process {pid} is running") from None
    except PermissionError:
        pass  # running, as another user
    return pid


def _non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0, "a non-negative integer")


def _room(text: str) -> int:
    """A room number the wire carries: 0 to LAST_ROOM."""
    what = f"a room number (0 to {LAST_ROOM}, the wire's last room)"
    value = _int_at_least(text, 0, what)
    if value > LAST_ROOM:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _int_at_least(text: str, low: int, what: str) -> int:
    """An integer >= low, or an argparse error saying it is not `what`."""
    try:
        value = int(text) if text.isascii() else low - 1  # int() takes any script's digits ("٣" is 3)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _ports(text: str) -> int | str:
    """A TCP port (0: any free one), or a range FIRST-LAST whose first free port is taken."""
    from transfer.ports import parse_ports

    try:
        first, last = parse_ports(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return first if first == last else f"{first}-{last}"


def _seconds(text: str) -> float:
    """A number of seconds > 0 and at most config.MAX_SECONDS."""
    return _seconds_from(text, zero_ok=False)


def _non_negative_seconds(text: str) -> float:
    """A number of seconds >= 0 and at most config.MAX_SECONDS."""
    return _seconds_from(text, zero_ok=True)


def _seconds_from(text: str, zero_ok: bool) -> float:
    """Seconds > 0 (>= 0 with zero_ok) up to config.MAX_SECONDS, as the EPD_* seconds settings take them."""
    try:
        return config.parse_seconds(text, zero_ok)
    except ValueError as what:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def _dtype(text: str) -> str:
    """A torch dtype name the wire knows, as `torch.NAME` (`bfloat16` works too)."""
    try:
        return normalize_dtype(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _host_port(text: str) -> str:
    """HOST:PORT (or [V6]:PORT) with a port of ASCII digits from 1 to 65535, and a host the bootstrap client
    takes (transfer.bootstrap.split_address)."""
    from transfer.bootstrap import split_address

    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
    plain = not ("[" in host or "]" in host or ":" in host)  # an IPv6 address needs its brackets
    # str.isdigit() takes any script's digits and int() some of them ("٣" is 3, "²" raises): ASCII only.
    digits = port.isascii() and port.isdigit() and len(port.lstrip("0")) <= 5
    if not sep or not host or not (bracketed or plain) or not digits or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (an IPv6 address in brackets: [::1]:PORT)")
    try:
        split_address(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _bind_host(text: str) -> str:
    """The address a bootstrap server binds: a host alone (IPv4, IPv6 without brackets, or a name), not
    HOST:PORT, which would be looked up as a host name and fail with 'Name or service not known'."""
    bracketed = re.fullmatch(r"\[([^\[\]]+)\](?::(\d+))?", text)
    if bracketed and bracketed.group(2) is None:
        raise argparse.ArgumentTypeError(f"{text!r} has brackets: give the address without them "
                                         f"({bracketed.group(1)})")
    host, sep, port = text.rpartition(":")
    if bracketed or (sep and ":" not in host and port.isdigit()):
        alone = bracketed.group(1) if bracketed else host
        raise argparse.ArgumentTypeError(f"{text!r} is HOST:PORT: give the address alone ({alone}), and the port "
                                         f"with --port")
    return text


def _rank_host(text: str) -> str:
    """An address ranks bind: not an IPv6 literal (Mooncake's sessions and the ranks' ZMQ sockets take IPv4)."""
    if ":" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is an IPv6 address, and the ranks run over IPv4 only "
                                         f"(Mooncake cannot reach an IPv6 session): give an IPv4 address, "
                                         f"e.g. 127.0.0.1")
    if is_wildcard(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a wildcard address: the rank sends it to its peers to "
                                         f"connect to, and there it would name their own host; give this "
                                         f"node's IPv4 address (the one peers reach it on)")
    return text


def _token(text: str) -> str:
    """A bearer token: printable ASCII (it travels in an HTTP header), at most 4096 characters."""
    from transfer.bootstrap import check_token

    try:
        token = check_token(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if token is None:
        raise argparse.ArgumentTypeError("the token must be 1 to 4096 printable ASCII characters "
                                         "(it travels in an HTTP header)")
    return token


class _FromEnv:
    """An option's default read from an EPD_* variable once its command runs (`parse_args`), so a bad
    variable fails the commands that read it, not `doctor` or `--help`."""

    def __init__(self, env: str, check: Callable[[str], Any] | None = None, absent: Any = None,
                 secret: bool = False) -> None:
        self.env, self.check, self.absent, self.secret = env, check, absent, secret

    def __repr__(self) -> str:
        return f"${self.env}"

    def resolve(self) -> Any:
        value = config.resolve(self.env)
        if value is None:
            return self.absent
        if self.check is not None:
            try:
                return self.check(value)
            except argparse.ArgumentTypeError as error:
                shown = self.env if self.secret else f"{self.env}={value!r}"  # a secret stays off terminals and logs
                raise ConfigError(f"{shown}: {error}") from None
        return value


def _token_default() -> _FromEnv:
    """EPD_TOKEN from the environment (the launch scripts keep the token off command lines)."""
    return _FromEnv("EPD_TOKEN", _token, secret=True)


def _device(text: str) -> str:
    """RDMA device names separated by commas, as Mooncake is to get them (engine.device_names: each stripped,
    empty ones dropped; a name no device has refused)."""
    from transfer.engine import device_names

    try:
        return device_names(text, what="")
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _device_default() -> _FromEnv:
    """EPD_DEVICE from the environment (read as --device is), else "" (Mooncake uses every device it finds)."""
    return _FromEnv("EPD_DEVICE", _device, absent="")


def _add_item_shape(parser: argparse.ArgumentParser) -> None:
    """The options demo and rank share: each item's shape and how its rows are sharded."""
    parser.add_argument("--span", type=_positive_int, default=1024, help="rows per item")
    parser.add_argument("--hidden", type=_positive_int, default=4096, help="elements per row")
    parser.add_argument("--dtype", type=_dtype, default="torch.bfloat16",
                        help="element type, e.g. torch.float16 or float32 (default: torch.bfloat16)")
    parser.add_argument("--deepstack", type=_non_negative_int, default=0, metavar="K",
                        help="deepstack width factor k (0: none)")
    parser.add_argument("--identity", action="store_true", help="every prefill rank receives the full rows")
    parser.add_argument("--per-block", action="store_true",
                        help="shard each item over an encode rank's block of prefill ranks (default: over the "
                             "whole prefill group, as the reference peer does; each encode rank then writes 1/E)")


def _conflicting_options(args: argparse.Namespace) -> str | None:
    """Why options given together make no sense (one would be silently ignored, or their rooms would not fit the
    wire), or None."""
    if getattr(args, "bootstrap_bind", None) is not None and not getattr(args, "serve_bootstrap", False):
        return "--bootstrap-bind is the address of the bootstrap server this rank serves: it needs --serve-bootstrap"
    if getattr(args, "role", None) == "encode" and args.linger >= args.timeout:
        return (f"--linger {args.linger:g} is not shorter than --timeout {args.timeout:g}: the rank would be "
                f"stopped while it lingers after its last room and exit 1")
    encode, prefill = getattr(args, "encode_ranks", None), getattr(args, "prefill_ranks", None)
    if isinstance(encode, int) and isinstance(prefill, int) and prefill % encode:  # demo, rank
        lower = prefill // encode * encode
        fits = f"{lower} or {lower + encode}" if lower else f"{encode}"
        return (f"--prefill-ranks {prefill} is not a multiple of --encode-ranks {encode}: each encode rank serves "
                f"an equal block of prefill ranks (-P {fits}, say)")
    first, items = getattr(args, "first_room", None), getattr(args, "items", None)
    if isinstance(first, int) and isinstance(items, int) and first + items - 1 > LAST_ROOM:  # rank
        highest = LAST_ROOM - items + 1
        fix = f"give a --first-room of at most {highest}" if highest >= 0 else "give fewer --items"
        return (f"--first-room {first} with --items {items} runs to room {first + items - 1}, past the wire's last "
                f"room {LAST_ROOM} (2**63 - 1): {fix}")
    if getattr(args, "command", None) == "demo" and isinstance(items, int) and items - 1 > LAST_ROOM:
        return (f"--items {items} runs to room {items - 1}, past the wire's last room {LAST_ROOM} (2**63 - 1): "
                f"give at most {LAST_ROOM + 1}")
    if getattr(args, "identity", False) and getattr(args, "per_block", False):
        return ("--identity (every prefill rank receives the full rows) and --per-block (how rows are sharded) "
                "exclude each other")
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults that come from EPD_* variables read (ConfigError naming a bad one)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    conflict = _conflicting_options(args)
    if conflict:
        parser.commands[args.command].error(conflict)
    for key, value in vars(args).items():
        if isinstance(value, _FromEnv):
            setattr(args, key, value.resolve())
    return args


def _version() -> str:
    """The installed distribution's version, or the source tree's when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("epd-transfer")
    except metadata.PackageNotFoundError:
        from transfer import __version__

        return f"{__version__} (not installed)"


#: `--json [FILE]` on every command: alone it prints one JSON document instead of the text
#: report; with FILE it writes the document there and says so on stderr.
_JSON_HELP = (
    "print the result as JSON instead of text, or also write it to FILE and say where (default: text only)")


def _add_protocol(parser: argparse.ArgumentParser) -> None:
    """The `--protocol` option demo and rank share."""
    parser.add_argument("--protocol", default="auto", choices=["auto", "tcp", "rdma", "wire"],
                        help="data path: auto (rdma when an RDMA device has an ACTIVE port, else tcp), tcp, rdma, "
                             "or our framed wire")


def _add_json(parser: argparse.ArgumentParser) -> None:
    """The shared `--json [FILE]` option."""
    parser.add_argument("--json", metavar="FILE", nargs="?", const="-", default=None, help=_JSON_HELP)


def _emit_json(command: str, value: object, dest: str) -> None:
    """Print `value` as JSON (dest "-") or write it to the file dest and name it on stderr."""
    text = json.dumps(value, indent=1)
    if dest == "-":
        print(text, flush=True)
        return
    with open(dest, "w") as fh:
        fh.write(text + "\n")
    print(f"epd-transfer {command}: wrote JSON to {os.path.abspath(dest)}", file=sys.stderr)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to an option's help unless the help already says its default or it is an off flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        # `is`, not `in`: 0 == False, and a zero default is worth showing.
        if "default" in help or any(action.default is v for v in (None, False, argparse.SUPPRESS)) or action.required:
            return help
        return super()._get_help_string(action) or help


def _subparser(sub: argparse._SubParsersAction, name: str, help: str, common: argparse.ArgumentParser,
               ) -> argparse.ArgumentParser:
    """A subcommand that shows every option's default and takes -v after its name too."""
    return sub.add_parser(name, help=help, description=help, parents=[common],
                          formatter_class=_Help)


def build_parser() -> _Parser:
    """The command line."""
    parser = _Parser(prog="epd-transfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    # The subcommands take -v as well; SUPPRESS keeps a flag given before the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = _subparser(sub, "demo", "loopback run: bootstrap + E encode + P prefill ranks, every byte checked", common)
    demo.add_argument("--encode-ranks", "-E", type=_positive_int, default=1, help="encode ranks")
    demo.add_argument("--prefill-ranks", "-P", type=_positive_int, default=4,
                      help="prefill ranks, a multiple of the encode ranks")
    demo.add_argument("--items", type=_positive_int, default=64, help="items (rooms) to move")
    _add_item_shape(demo)
    demo.add_argument("--inflight", type=_positive_int, default=8, help="rooms in flight per rank")
    _add_protocol(demo)
    demo.add_argument("--host", type=_rank_host, default="127.0.0.1", help="IPv4 address every rank binds")
    demo.add_argument("--no-integrity", action="store_true", help="skip the checksums of landed bytes")
    demo.add_argument("--deadline", type=_seconds, default=_FromEnv("EPD_DEADLINE_S"),
                      help="per-room receive deadline, seconds (default: $EPD_DEADLINE_S, else 60)")
    demo.add_argument("--timeout", type=_seconds, default=600.0, help="bound on the whole run, seconds")
    _add_json(demo)
    demo.set_defaults(func=_demo)

    doctor = _subparser(sub, "doctor", "what is installed and usable here, and how to fix what is not", common)
    _add_json(doctor)
    doctor.set_defaults(func=_doctor)

    bench = _subparser(sub, "bench", "raw Mooncake vs the epd path vs the framed wire, side by side", common)
    try:
        from transfer import bench as bench_mod

        bench_mod.add_arguments(bench)
    except ImportError:
        pass
    bench.set_defaults(func=_bench)

    boot = _subparser(sub, "bootstrap", "run the HTTP bootstrap server until interrupted", common)
    boot.add_argument("--host", type=_bind_host, default="127.0.0.1", help="address to bind (the port: --port)")
    boot.add_argument("--port", type=_ports, default=8998,
                      help="port to bind (0: any free port), or a range FIRST-LAST: its first free port")
    boot.add_argument("--token", type=_token, default=_token_default(),
                      help="require 'Authorization: Bearer TOKEN' on PUT and DELETE /route (default: $EPD_TOKEN, "
                           "else none)")
    _add_exit_with(boot)
    boot.set_defaults(func=_bootstrap)

    rank = _subparser(sub, "rank", "run ONE rank of a real deployment (what the launch scripts start)", common)
    rank.add_argument("--role", required=True, choices=["encode", "prefill"], help="which side this rank is on")
    rank.add_argument("--rank", type=_non_negative_int, required=True, help="this rank's index within its role")
    rank.add_argument("--node", type=_non_negative_int, default=0,
                      help="prefill: this prefill node's index (reported in the summary)")
    rank.add_argument("--encode-ranks", "-E", type=_positive_int, default=1, help="encode ranks")
    rank.add_argument("--prefill-ranks", "-P", type=_positive_int, default=1,
                      help="prefill ranks per prefill node, a multiple of the encode ranks")
    rank.add_argument("--bootstrap", type=_host_port, required=True, help="HOST:PORT of the bootstrap server")
    rank.add_argument("--serve-bootstrap", action="store_true", help="also run the bootstrap server here")
    rank.add_argument("--bootstrap-bind", type=_bind_host, default=None,
                      help="address the served bootstrap binds (default: the host of --bootstrap)")
    rank.add_argument("--host", type=_rank_host, default="127.0.0.1",
                      help="this node's IPv4 address (engine and sockets)")
    rank.add_argument("--ports", type=_ports, default=0,
                      help="port, or range FIRST-LAST, of this rank's listeners (its ZMQ socket and, with "
                           "--protocol wire, its wire listener: consecutive free ports of the range); 0: any "
                           "free port. Mooncake's own: MC_MIN_RPC_PORT/MC_MAX_RPC_PORT")
    _add_protocol(rank)
    rank.add_argument("--items", type=_positive_int, default=64, help="items (rooms) to move")
    rank.add_argument("--first-room", type=_room, default=0,
                      help="rooms are first-room .. first-room + items - 1")
    rank.add_argument("--device", type=_device, default=_device_default(),
                      help="Mooncake RDMA device(s), comma-separated, e.g. mlx5_0,mlx5_1 (default: $EPD_DEVICE, "
                           "else every device found)")
    _add_item_shape(rank)
    rank.add_argument("--inflight", type=_positive_int, default=8, help="rooms in flight")
    rank.add_argument("--no-integrity", action="store_true", help="skip the checksums of landed bytes")
    rank.add_argument("--token", type=_token, default=_token_default(),
                      help="bootstrap bearer token (default: $EPD_TOKEN, else none)")
    rank.add_argument("--deadline", type=_seconds, default=_FromEnv("EPD_DEADLINE_S"),
                      help="per-room deadline, seconds (default: $EPD_DEADLINE_S, else 60)")
    rank.add_argument("--bootstrap-timeout", type=_seconds, default=_FromEnv("EPD_FANOUT_TIMEOUT_S"),
                      help="how long to wait for the bootstrap server and the peers, seconds: an encode rank's "
                           "registration and its rooms' fanout, a prefill rank's wait for its encode rank "
                           "(default: $EPD_FANOUT_TIMEOUT_S, else 120)")
    rank.add_argument("--linger", type=_non_negative_seconds, default=2.0,
                      help="encode: seconds to stay up after the last room")
    rank.add_argument("--timeout", type=_seconds, default=600.0,
                      help="bound on the whole rank, seconds: past it the rank stops and exits 1")
    _add_exit_with(rank)
    rank.set_defaults(func=_rank)
    parser.commands = dict(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `epd-transfer` console script."""
    try:
        args = parse_args(argv)
    except ConfigError as error:  # an EPD_* variable a default of this command comes from
        print(f"epd-transfer: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return args.func(args)
    except KeyboardInterrupt as stopped:
        if isinstance(stopped, _Stopped):
            print(f"epd-transfer {args.command}: stopped by {_stop_name(stopped)}", file=sys.stderr)
        else:
            print(f"epd-transfer {args.command}: interrupted", file=sys.stderr)
        return _stop_code(stopped)
    except Exception as error:  # noqa: BLE001 - an operator gets one line; -v shows the traceback
        if args.verbose:
            traceback.print_exc()
        if isinstance(error, ConfigError):  # a setting given is wrong (a --host not of this host): 2, as argparse
            print(f"epd-transfer {args.command}: {error}", file=sys.stderr)
            return 2
        zmq = sys.modules.get("zmq")  # a listener that cannot bind raises zmq.ZMQError naming it and its address
        expected = (isinstance(error, (OSError, RuntimeError, ValueError))  # TimeoutError is an OSError
                    or (zmq is not None and isinstance(error, zmq.ZMQError)))
        if isinstance(error, ListenError):  # its text names the listener and what to do; "[Errno 98]" adds nothing
            what = error.strerror or str(error)
        else:
            what = str(error) if expected else f"{type(error).__name__}: {error} (run with -v for the traceback)"
        print(f"epd-transfer {args.command}: {what}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
