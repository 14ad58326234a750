"""`epd-transfer`: demo | doctor | bench | bootstrap | rank."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading


def _demo(args: argparse.Namespace) -> int:
    from transfer.harness import Scenario, run

    sc = Scenario(
        encode_ranks=args.encode_ranks, prefill_ranks=args.prefill_ranks, items=args.items,
        span=args.span, hidden=args.hidden, dtype=args.dtype, sharded=not args.identity,
        deepstack=args.deepstack, inflight=args.inflight, protocol=args.protocol, host=args.host,
        integrity=not args.no_integrity, deadline_s=args.deadline,
        timeout_s=args.timeout,
    )
    if sc.prefill_ranks % sc.encode_ranks:
        print(f"prefill ranks {sc.prefill_ranks} must be a multiple of encode ranks {sc.encode_ranks}", file=sys.stderr)
        return 2
    summary = run(sc)
    ok = summary["failed"] == 0 and summary["verified"]
    if args.json:
        print(json.dumps(summary))
    else:
        mode = "identity" if args.identity else "sharded"
        print(
            f"epd-transfer demo: {sc.encode_ranks} encode -> {sc.prefill_ranks} prefill ranks over "
            f"{summary['protocol']} ({mode}, {sc.span} x {sc.hidden} {sc.dtype.removeprefix('torch.')}"
            f"{f', deepstack x{sc.deepstack}' if sc.deepstack else ''})"
        )
        print(f"  items     {summary['items']}")
        print(f"  bytes     {summary['bytes']} ({summary['bytes'] / 2**20:.1f} MiB landed, every byte checked)")
        print(f"  failed    {summary['failed']}")
        print(f"  verified  {'yes' if summary['verified'] else 'NO'}")
        print(f"  GB/s      {summary['gbps']:.2f}")
        print(f"  rooms/s   {summary['rooms_per_s']:.1f}")
        print(f"  latency   p50 {summary['p50_ms']:.2f} ms, p99 {summary['p99_ms']:.2f} ms")
        for line in summary["failures"] + summary["mismatches"]:
            print(f"  ! {line}")
    return 0 if ok else 1


def _doctor(args: argparse.Namespace) -> int:
    from transfer import doctor

    return doctor.run(as_json=args.json)


def _bench(args: argparse.Namespace) -> int:
    from transfer import bench

    return bench.main(args)


def _bootstrap(args: argparse.Namespace) -> int:
    from transfer.bootstrap import BootstrapServer

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with BootstrapServer(args.host, args.port, token=args.token) as server:
        print(f"bootstrap server on http://{server.address}", flush=True)
        stop.wait()
    return 0


def _rank(args: argparse.Namespace) -> int:
    """One rank of a real deployment (launch scripts): encode or prefill, no parent to sync with."""
    import time

    from transfer import harness
    from transfer.bootstrap import BootstrapServer

    limit = args.encode_ranks if args.role == "encode" else args.prefill_ranks
    if args.prefill_ranks % args.encode_ranks or not 0 <= args.rank < limit:
        print(f"rank {args.rank} of {args.role}: need 0 <= rank < {limit} and prefill ranks "
              f"{args.prefill_ranks} a multiple of encode ranks {args.encode_ranks}", file=sys.stderr)
        return 2
    sc = harness.Scenario(
        encode_ranks=args.encode_ranks, prefill_ranks=args.prefill_ranks, items=args.items, span=args.span,
        hidden=args.hidden, dtype=args.dtype, sharded=not args.identity, deepstack=args.deepstack,
        inflight=args.inflight, protocol=args.protocol, host=args.host, integrity=not args.no_integrity,
        deadline_s=args.deadline, bootstrap_timeout_s=args.bootstrap_timeout,
        token=args.token, timeout_s=args.timeout, first_room=args.first_room,
    )
    if args.device:
        if "device" in getattr(harness.Scenario, "__dataclass_fields__", {}):
            sc.device = args.device
        else:
            print(f"warning: --device {args.device} ignored: this build's harness cannot pick a Mooncake "
                  f"device, so Mooncake uses every device it finds", file=sys.stderr)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt  # unwinds through the context managers: engines and sockets close

    signal.signal(signal.SIGTERM, interrupted)
    noop = lambda: None  # noqa: E731 - nobody to sync with in a real deployment
    server = None
    if args.serve_bootstrap:
        bind = args.bootstrap_bind or args.bootstrap.rpartition(":")[0].strip("[]")
        server = BootstrapServer(bind, int(args.bootstrap.rpartition(":")[2]), token=args.token)
        print(f"bootstrap server on http://{server.address}", file=sys.stderr, flush=True)
    try:
        if args.role == "encode":
            # After its rooms concluded, linger so the last statuses reach the prefill ranks.
            report = harness.encode_rank(sc, args.rank, args.bootstrap, noop, noop, lambda: time.sleep(args.linger))
            summary = {"role": "encode", "rank": args.rank, "items": sc.items, "failed": len(report["failed"]),
                       "failures": [f"room {room}: {why}" for room, why in report["failed"]][:20]}
            ok = not report["failed"]
        else:
            _wait_for_route(args.bootstrap, args.rank // sc.fanout, args.bootstrap_timeout)
            report = harness.prefill_rank(sc, args.rank, args.bootstrap, noop, noop, noop)
            summary = {"role": "prefill", "rank": args.rank, **harness.summarize(sc, [report])}
            ok = summary["failed"] == 0 and summary["verified"]
    except KeyboardInterrupt:
        print(f"{args.role} rank {args.rank}: interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.close()
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


def _wait_for_route(bootstrap: str, encode_rank: int, timeout_s: float) -> None:
    """Blocks until the bootstrap server knows encode_rank (prefill ranks may start first)."""
    import time

    from transfer.bootstrap import BootstrapClient

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            BootstrapClient(bootstrap).route(encode_rank, 0)
            return
        except Exception as exc:  # noqa: BLE001 - server not up or rank not registered yet
            last = exc
            time.sleep(0.2)
    raise TimeoutError(f"encode rank {encode_rank} never registered at bootstrap {bootstrap} "
                       f"within {timeout_s:g}s (last: {last})")


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(prog="epd-transfer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="loopback run: bootstrap + E encode + P prefill ranks, every byte checked")
    demo.add_argument("--encode-ranks", "-E", type=int, default=1)
    demo.add_argument("--prefill-ranks", "-P", type=int, default=4)
    demo.add_argument("--items", type=int, default=64)
    demo.add_argument("--span", type=int, default=1024, help="rows per item")
    demo.add_argument("--hidden", type=int, default=4096)
    demo.add_argument("--dtype", default="torch.bfloat16")
    demo.add_argument("--deepstack", type=int, default=0, help="deepstack width factor k (0: none)")
    demo.add_argument("--identity", action="store_true", help="every prefill rank receives the full rows")
    demo.add_argument("--inflight", type=int, default=8, help="rooms in flight per rank")
    demo.add_argument("--protocol", default="auto", choices=["auto", "tcp", "rdma", "wire"])
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--no-integrity", action="store_true", help="skip the checksums of landed bytes")
    demo.add_argument("--deadline", type=float, default=60.0, help="per-room receive deadline, seconds")
    demo.add_argument("--timeout", type=float, default=600.0, help="bound on the whole run, seconds")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=_demo)

    doctor = sub.add_parser("doctor", help="what is installed and usable here, and how to fix what is not")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=_doctor)

    bench = sub.add_parser("bench", help="raw Mooncake vs the epd path vs the framed wire, side by side")
    try:
        from transfer import bench as bench_mod

        bench_mod.add_arguments(bench)
    except ImportError:
        pass
    bench.set_defaults(func=_bench)

    boot = sub.add_parser("bootstrap", help="run the HTTP bootstrap server until interrupted")
    boot.add_argument("--host", default="127.0.0.1")
    boot.add_argument("--port", type=int, default=8998)
    boot.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' on PUT /route")
    boot.set_defaults(func=_bootstrap)

    rank = sub.add_parser("rank", help="run ONE rank of a real deployment (what the launch scripts start)")
    rank.add_argument("--role", required=True, choices=["encode", "prefill"])
    rank.add_argument("--rank", type=int, required=True, help="this rank's index within its role")
    rank.add_argument("--encode-ranks", "-E", type=int, default=1)
    rank.add_argument("--prefill-ranks", "-P", type=int, default=1)
    rank.add_argument("--bootstrap", required=True, help="HOST:PORT of the bootstrap server")
    rank.add_argument("--serve-bootstrap", action="store_true", help="also run the bootstrap server here")
    rank.add_argument("--bootstrap-bind", default=None, help="address the served bootstrap binds (default: its host)")
    rank.add_argument("--host", default="127.0.0.1", help="this node's address (engine and sockets)")
    rank.add_argument("--protocol", default="auto", choices=["auto", "tcp", "rdma", "wire"])
    rank.add_argument("--items", type=int, default=64)
    rank.add_argument("--first-room", type=int, default=0, help="rooms are first-room .. first-room + items - 1")
    rank.add_argument("--device", default="", help="Mooncake RDMA device (e.g. mlx5_0); default: all")
    rank.add_argument("--span", type=int, default=1024, help="rows per item")
    rank.add_argument("--hidden", type=int, default=4096)
    rank.add_argument("--dtype", default="torch.bfloat16")
    rank.add_argument("--deepstack", type=int, default=0, help="deepstack width factor k (0: none)")
    rank.add_argument("--identity", action="store_true", help="every prefill rank receives the full rows")
    rank.add_argument("--inflight", type=int, default=8, help="rooms in flight")
    rank.add_argument("--no-integrity", action="store_true", help="skip the checksums of landed bytes")
    rank.add_argument("--token", default=None, help="bootstrap bearer token")
    rank.add_argument("--deadline", type=float, default=60.0, help="per-room deadline, seconds")
    rank.add_argument("--bootstrap-timeout", type=float, default=120.0,
                      help="how long to wait for the bootstrap server and the peers, seconds")
    rank.add_argument("--linger", type=float, default=2.0, help="encode: seconds to stay up after the last room")
    rank.add_argument("--timeout", type=float, default=600.0)
    rank.set_defaults(func=_rank)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `epd-transfer` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
