"""An Engine's writes and status checks made from C (native/mooncake.c) against the same
through Mooncake's binding: real engines over tcp on 127.0.0.1, the bytes that landed checked."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from live_helpers import HOST, MOONCAKE_MISSING

from transfer import engine as engine_module
from transfer.engine import Engine, EngineError

pytestmark = [pytest.mark.live, pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING or "n/a")]

SPAN = (8 << 20) + 4096


def _engine(direct: bool) -> Engine:
    """An engine started with EPD_MOONCAKE_DIRECT set to `direct`."""
    before = os.environ.get("EPD_MOONCAKE_DIRECT")
    os.environ["EPD_MOONCAKE_DIRECT"] = "1" if direct else "0"
    try:
        return Engine(HOST, "tcp")
    finally:
        if before is None:
            del os.environ["EPD_MOONCAKE_DIRECT"]
        else:
            os.environ["EPD_MOONCAKE_DIRECT"] = before


@pytest.fixture(scope="module")
def trio():
    """{'direct': writer, 'binding': writer}, the reader, and their registered tensors."""
    writers = {"direct": _engine(True), "binding": _engine(False)}
    reader = Engine(HOST, "tcp")
    src = torch.randint(0, 256, (SPAN,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    dst = torch.zeros(SPAN, dtype=torch.uint8)
    srcs = {name: w.register(src)[0] for name, w in writers.items()}
    yield writers, reader, src, dst, srcs, reader.register(dst)[0]
    for e in (*writers.values(), reader):
        e.close()


def test_the_checked_wheel_gets_the_direct_calls(trio):
    writers = trio[0]
    ok, why = engine_module.direct_calls_verdict(engine_module._installed_mooncake(), True, True)
    assert writers["direct"].calls == ("direct" if ok else "binding"), writers["direct"].calls_reason
    assert writers["direct"].calls_reason == why
    assert writers["binding"].calls == "binding"
    assert writers["binding"].calls_reason == "EPD_MOONCAKE_DIRECT=0"


@pytest.mark.parametrize("way", ["direct", "binding"])
@pytest.mark.parametrize("src_at, dst_at, length", [(0, 0, 1), (5, 4099, 4096), (1, 3, 512 << 10),
                                                    (4093, 7, 8 << 20)])
def test_the_bytes_land_where_asked_and_nowhere_else(trio, way, src_at, dst_at, length):
    writers, reader, src, dst, srcs, dst_addr = trio
    dst.zero_()
    writers[way].write(reader.session_id, [srcs[way] + src_at], [dst_addr + dst_at], [length])
    assert torch.equal(dst[dst_at:dst_at + length], src[src_at:src_at + length])
    assert not dst[:dst_at].any() and not dst[dst_at + length:].any()


@pytest.mark.parametrize("way", ["direct", "binding"])
def test_many_writes_in_flight_polled_newest_first_all_land(trio, way):
    writers, reader, src, dst, srcs, dst_addr = trio
    writer, piece = writers[way], 64 << 10
    dst.zero_()
    tickets = [writer.write_async(reader.session_id, [srcs[way] + i * piece], [dst_addr + i * piece], [piece])
               for i in range(64)]
    for ticket in reversed(tickets):
        writer.wait(ticket, timeout_s=60)
    assert torch.equal(dst[:64 * piece], src[:64 * piece])
    if writer.calls == "direct":
        assert reader.session_id in writer._handles  # the later writes went through the C calls


@pytest.mark.parametrize("way", ["direct", "binding"])
def test_a_destination_the_peer_never_registered_fails_the_write(trio, way):
    writers, reader, src, dst, srcs, dst_addr = trio
    writers[way].write(reader.session_id, [srcs[way]], [dst_addr], [4096])  # the segment is open
    with pytest.raises(EngineError, match=r"write to .* failed \(rc=-1\)"):
        writers[way].write(reader.session_id, [srcs[way]], [dst_addr + SPAN + (1 << 20)], [4096])
    dst.zero_()
    writers[way].write(reader.session_id, [srcs[way]], [dst_addr], [4096])  # and the next one lands
    assert torch.equal(dst[:4096], src[:4096])


@pytest.mark.parametrize("way", ["direct", "binding"])
def test_a_write_to_a_peer_that_closed_fails(trio, way):
    writers, _, src, _, srcs, _ = trio
    peer = Engine(HOST, "tcp")
    target = torch.zeros(4096, dtype=torch.uint8)
    at = peer.register(target)[0]
    writers[way].write(peer.session_id, [srcs[way]], [at], [4096])
    assert torch.equal(target, src[:4096])
    session = peer.session_id
    peer.close()
    with pytest.raises(EngineError, match=f"write to {session} failed"):
        writers[way].write(session, [srcs[way]], [at], [4096])


def test_the_c_calls_refuse_an_unknown_segment_and_the_engine_goes_on(trio):
    writers, reader, src, dst, srcs, dst_addr = trio
    writer = writers["direct"]
    if writer.calls != "direct":
        pytest.skip(f"the direct calls are off here: {writer.calls_reason}")
    from transfer import _native
    # Mooncake answers a handle it never gave out with a Status whose message the call frees.
    assert _native.mooncake_write(writer._direct, 1 << 40, srcs["direct"], dst_addr, 4096) == 0
    assert _native.mooncake_open(writer._direct, f"{HOST}:1") == -1  # nothing listens there
    dst.zero_()
    writer.write(reader.session_id, [srcs["direct"]], [dst_addr], [4096])
    assert torch.equal(dst[:4096], src[:4096])


# A refused write in a process whose C++ operators AddressSanitizer replaces (preloaded, as a sanitized
# build of the native core runs): the Status' message comes from its new[] and must go back to its delete[].
REFUSED_UNDER_ASAN = f"""
    import os, sys
    os.environ["EPD_MOONCAKE_DIRECT"] = "1"
    import torch
    from transfer import _native
    from transfer.engine import Engine

    engine = Engine({HOST!r}, "tcp")
    if engine.calls != "direct":
        print("direct calls off:", engine.calls_reason)
        sys.exit(3)
    src = torch.zeros(4096, dtype=torch.uint8)
    addr = engine.register(src)[0]
    print(_native.mooncake_write(engine._direct, 1 << 40, addr, addr, 4096))
    engine.close()
"""


def test_a_refused_write_frees_mooncakes_message_with_the_delete_that_pairs_its_new():
    """The message's delete[] was looked up in Mooncake's library scope, where libstdc++'s forwards to
    the global scalar delete: with AddressSanitizer preloaded that is its operator delete, and it aborts
    the process on the mismatch with the new[] Mooncake's own reference bound to."""
    asan = ctypes.util.find_library("asan")
    if asan is None:
        pytest.skip("no libasan to preload (it comes with gcc)")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(engine_module.__file__)))
    env = dict(os.environ, LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0",
               PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(REFUSED_UNDER_ASAN)], capture_output=True,
                          text=True, timeout=120, cwd=package_root, env=env)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert "alloc-dealloc-mismatch" not in done.stderr, done.stderr[-3000:]
    assert (done.returncode, done.stdout.strip()) == (0, "0"), done.stderr[-3000:]


@pytest.mark.parametrize("way", ["direct", "binding"])
def test_other_python_threads_run_while_a_write_is_handed_to_mooncake(trio, way):
    """Over tcp Mooncake copies much of a write inside its submission call (milliseconds for 8 MiB):
    the encode process's other Python threads, the model's among them, must not wait for it. A thread
    stamping the clock in a loop shows in the first half of write_async()'s call only if the call let
    go of the interpreter: holding it, nothing else runs until the C call returned."""
    writers, reader, src, dst, srcs, dst_addr = trio
    writer = writers[way]
    writer.write(reader.session_id, [srcs[way]], [dst_addr], [4096])  # the segment is open: no handshake below
    ran_meanwhile, long_calls = 0, 0
    for _ in range(12):
        stamps: list[float] = []
        stop = threading.Event()

        def stamp() -> None:
            while not stop.is_set():
                stamps.append(time.monotonic())
                time.sleep(0)  # lets go of the interpreter every turn

        thread = threading.Thread(target=stamp)
        thread.start()
        try:
            time.sleep(0.005)
            started = time.monotonic()
            ticket = writer.write_async(reader.session_id, [srcs[way]], [dst_addr], [8 << 20])
            returned = time.monotonic()
        finally:
            stop.set()
            thread.join(10)
        writer.wait(ticket, timeout_s=60)
        if returned - started < 0.0005:
            continue  # too short a call to tell
        long_calls += 1
        halfway = started + (returned - started) / 2
        ran_meanwhile += any(started < at < halfway for at in stamps)
    if long_calls < 3:
        pytest.skip(f"only {long_calls} of 12 submissions of 8 MiB took 0.5 ms or more: too short to tell")
    assert ran_meanwhile > 0, f"no other thread ran in the first half of any of {long_calls} submissions of 8 MiB"


@pytest.mark.parametrize("way", ["direct", "binding"])
def test_a_failed_buffer_among_landed_ones_fails_the_write_once_every_batch_settled(trio, way):
    """A write of three buffers whose second goes where the peer registered nothing: the write fails
    (rc=-1), and only once every batch it submitted settled (none is left in flight), the others landed."""
    writers, reader, src, dst, srcs, dst_addr = trio
    writer, piece = writers[way], 64 << 10
    writer.write(reader.session_id, [srcs[way]], [dst_addr], [4096])  # the segment is open
    dst.zero_()
    ticket = writer.write_async(reader.session_id, [srcs[way], srcs[way] + piece, srcs[way] + 2 * piece],
                                [dst_addr, dst_addr + SPAN + (1 << 20), dst_addr + 2 * piece], [piece] * 3)
    pending = writer._pending[ticket]
    with pytest.raises(EngineError, match=r"write to .* failed \(rc=-1\)"):
        writer.wait(ticket, timeout_s=60)
    assert pending.batches == []
    assert ticket not in writer._pending
    assert torch.equal(dst[:piece], src[:piece]) and torch.equal(dst[2 * piece:3 * piece], src[2 * piece:3 * piece])


def test_settle_takes_off_the_batches_over_in_order_and_stops_at_a_failed_one(trio):
    """mooncake_settle(engine, batches): each batch over is taken off the list (Mooncake freed it when it
    answered); a failed one is answered with its code, those after it left for the next call; 1 once
    none is left, 0 while the first is in flight."""
    writers, reader, src, dst, srcs, dst_addr = trio
    writer = writers["direct"]
    if writer.calls != "direct":
        pytest.skip(f"the direct calls are off here: {writer.calls_reason}")
    from transfer import _native
    writer.write(reader.session_id, [srcs["direct"]], [dst_addr], [4096])  # the segment is open
    handle = writer._handles[reader.session_id]
    piece = 64 << 10
    dst.zero_()
    targets = [dst_addr, dst_addr + piece, dst_addr + SPAN + (1 << 20), dst_addr + 3 * piece]
    batches = [_native.mooncake_write(writer._direct, handle, srcs["direct"] + i * piece, at, piece)
               for i, at in enumerate(targets)]
    assert all(batches)
    submitted = list(batches)
    answers = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = list(batches)
        rc = _native.mooncake_settle(writer._direct, batches)
        if rc == 0:
            # The first left is in flight: those over before it were taken off the front, none after it.
            assert batches == left[len(left) - len(batches):]
            time.sleep(0.001)
            continue
        answers.append((rc, len(batches)))
        if rc == 1:
            break
    assert answers == [(-1, 1), (1, 0)]  # the failed one and those before it went in one call
    assert batches == [] and len(submitted) == 4
    assert torch.equal(dst[:2 * piece], src[:2 * piece])
    assert torch.equal(dst[3 * piece:4 * piece], src[3 * piece:4 * piece])
    assert _native.mooncake_settle(writer._direct, []) == 1


def test_the_cpu_inside_the_write_and_status_calls_is_counted_only_while_asked(trio):
    from transfer import _native

    writers, reader, src, dst, srcs, dst_addr = trio
    writer, piece = writers["direct"], 512 << 10
    if writer.calls != "direct":
        pytest.skip(f"Mooncake's calls go through the binding here: {writer.calls_reason}")

    def writes(n: int) -> None:
        for _ in range(n):
            writer.write(reader.session_id, [srcs["direct"]], [dst_addr], [piece])

    dst.zero_()
    before = _native.mooncake_cpu()
    writes(4)
    assert _native.mooncake_cpu() == before  # not asked: nothing counted
    _native.mooncake_account(True)
    try:
        counted_at, spent_at = _native.mooncake_cpu(), time.thread_time()
        writes(20)
        counted, spent = _native.mooncake_cpu() - counted_at, time.thread_time() - spent_at
    finally:
        _native.mooncake_account(False)
    # Inside the calls, on this thread: a part of its CPU over the same writes, never more.
    assert 0 < counted <= spent, (counted, spent)
    after = _native.mooncake_cpu()
    writes(4)
    assert _native.mooncake_cpu() == after
    assert torch.equal(dst[:piece], src[:piece])
