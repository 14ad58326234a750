"""`epd-transfer`: demo | doctor | bench | bootstrap."""

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
        integrity=not args.no_integrity, writers=args.writers, deadline_s=args.deadline,
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
    demo.add_argument("--writers", type=int, default=2, help="writer threads per encode rank")
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
