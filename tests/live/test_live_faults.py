"""Live failure paths: each affected room concludes with its reason in bounded time,
while unrelated rooms keep succeeding with every byte checked.

Real Mooncake `tcp` on 127.0.0.1, real ZMQ, a real BootstrapServer; encode ranks run
in their own processes (tests/live/live_helpers.py), prefill ranks in this one or in
their own process where they must die.
"""

from __future__ import annotations

import itertools
import logging
import random
import re
import time

import pytest
from live_helpers import (
    DTYPE,
    HOST,
    LIVE,
    TOKEN,
    RawPrefill,
    Receiver,
    bootstrap_server,
    encode_process,
    epd_threads,
    free_port,
    item_bytes,
    junk_pusher,
    pointer,
    prefill_process,
    wait_until,
)

from transfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from transfer.core.failure import FailureKind
from transfer.harness import SENTINEL
from transfer.receiver import ENCODE_FAILED
from transfer.status import TransferPoll, is_terminal

pytestmark = LIVE

SPAN, HIDDEN = 8, 64
ROW = HIDDEN * 2
ITEM = SPAN * ROW
# A random start: ranks of other deployments on this host must not share our rooms.
_rooms = itertools.count(random.randrange(1 << 20, 1 << 40))


def rooms(n: int) -> list[int]:
    """n rooms no other test of this module uses."""
    return [next(_rooms) for _ in range(n)]


@pytest.fixture(scope="module")
def bootstrap():
    with bootstrap_server() as server:
        yield server


@pytest.fixture(scope="module")
def _engines():
    """Two tcp engines, the sessions of the prefill ranks that live in this process."""
    from transfer.engine import Engine

    with Engine(HOST, protocol="tcp") as a, Engine(HOST, protocol="tcp") as b:
        yield a, b


@pytest.fixture
def engines(_engines):
    """The engines, with the check that a test leaves no registration behind."""
    before = [dict(e.registered()) for e in _engines]
    yield _engines
    after = [dict(e.registered()) for e in _engines]
    for engine, was in zip(_engines, before):
        for addr in set(engine.registered()) - set(was):
            engine.unregister(addr)
    assert after == before, "a test left memory registered"


@pytest.fixture(scope="module")
def encoder(bootstrap):
    """One encode rank (tp 1) in its own process, shared by the tests that do not kill it."""
    rank = encode_process(bootstrap.address)
    yield rank
    rank.close()


def assert_all(results: dict, status: str) -> None:
    """Every room of `results` (room -> (status, reason, ...)) has `status`."""
    wrong = {room: r for room, r in results.items() if r[0] != status}
    assert not wrong, f"expected {status}: {wrong}"


# ------------------------------------------------------------------ geometry


@pytest.mark.parametrize(
    "lie, needle",
    [
        ({"hidden": HIDDEN // 2}, f"hidden {HIDDEN // 2} != item hidden {HIDDEN}"),
        ({"dtype": "torch.float16"}, f"dtype torch.float16 != item dtype {DTYPE}"),
        ({"claimed_span": SPAN + 1}, f"span {SPAN + 1} != item span {SPAN}"),
    ],
    ids=["hidden", "dtype", "span"],
)
def test_geometry_mismatch_fails_every_receiver_and_writes_nothing(bootstrap, encoder, engines, lie, needle):
    bad, *good = rooms(4)
    with Receiver(engines[0], 0, 2, fanout=2) as r0, Receiver(engines[1], 1, 2, fanout=2) as r1:
        for room in good:
            r0.ask(room, bootstrap.address, SPAN)
            r1.ask(room, bootstrap.address, SPAN)
        r0.ask(bad, bootstrap.address, SPAN)
        r1.ask(bad, bootstrap.address, SPAN, **lie)
        encoder.call("send", [bad, *good], SPAN, HIDDEN)
        # Each wait is far inside the rooms' deadlines: a room that waited for one is not concluded.
        sent = encoder.call("wait", [bad, *good], 10.0)
        got = [r.wait([bad, *good], 10.0) for r in (r0, r1)]

        status, reason, _ = sent[bad]
        assert status == "Failed" and needle in reason, reason
        for r, results in zip((r0, r1), got):
            assert results[bad][0] == "Failed"
            assert results[bad][1].startswith(ENCODE_FAILED), results[bad][1]
            assert r.untouched(bad), f"rank {r.rank}: bytes were written for the refused room"
            for room in good:
                assert results[room] == ("Success", None)
                assert r.landed(room) is None, r.landed(room)
        assert_all({room: sent[room] for room in good}, "Success")


# ------------------------------------------------------- a receiver never asks


def test_receiver_that_never_asks_fails_the_room_after_the_fanout_timeout(engines):
    lonely, *good = rooms(3)
    with bootstrap_server() as server, encode_process(server.address, fanout_timeout_s=2.0) as encode:
        with Receiver(engines[0], 0, 2, fanout=2) as r0, Receiver(engines[1], 1, 2, fanout=2) as r1:
            r0.ask(lonely, server.address, SPAN)  # rank 1 never asks for it
            for room in good:
                r0.ask(room, server.address, SPAN)
                r1.ask(room, server.address, SPAN)
            started = time.monotonic()
            encode.call("send", [lonely, *good], SPAN, HIDDEN)
            lonely_result = r0.wait([lonely], 8.0)[lonely]
            told_after = time.monotonic() - started
            sent = encode.call("wait", [lonely, *good], 5.0)

            assert sent[lonely][0] == "Failed"
            assert sent[lonely][1] == "receiver never registered within 2s (1 of 2 prefill ranks asked)"
            # Told Failed by the encode rank (its own deadline is 30 s), only after the timeout.
            assert lonely_result[0] == "Failed" and lonely_result[1].startswith(ENCODE_FAILED), lonely_result
            assert 1.9 <= told_after < 5.0, told_after
            assert r0.untouched(lonely)
            for r in (r0, r1):
                assert r.wait(good, 5.0) == {room: ("Success", None) for room in good}
                for room in good:
                    assert r.landed(room) is None
            assert_all({room: sent[room] for room in good}, "Success")


# ------------------------------------------------------------ processes dying


def test_encode_killed_mid_stream_fails_rooms_by_their_deadline(engines):
    done, cut = rooms(4), rooms(6)
    with bootstrap_server() as server:
        encode = encode_process(server.address)
        try:
            port = encode.info["port"]
            with Receiver(engines[0], 0, 1, fanout=1, slots=16, deadline_s=3.0) as r:
                for room in done:
                    r.ask(room, server.address, SPAN)
                encode.call("send", done, SPAN, HIDDEN)
                assert r.wait(done, 10.0) == {room: ("Success", None) for room in done}
                for room in cut:
                    r.ask(room, server.address, SPAN)
                encode.kill()
                late = rooms(1)[0]
                r.ask(late, server.address, SPAN)  # asked after the crash: same deadline
                results = r.wait(cut + [late], 15.0)
                for room in done:
                    assert r.landed(room) is None
                for room in cut + [late]:
                    status, reason = results[room]
                    assert status == "Failed", (room, status)
                    # Failed by its 3 s deadline (said so), within the wait's 15 s: not hung, not cut short.
                    assert f"encode rank 0 at {HOST}:{port}" in reason and "within 3s" in reason, reason
                    assert r.untouched(room)
        finally:
            encode.kill()


def _ask_then_kill(r, server, encode, cut) -> None:
    """Asks the encode rank for the rooms `cut` and SIGKILLs it once it filed every ask (10 s at most)."""
    for room in cut:
        r.ask(room, server.address, SPAN)
    assert wait_until(lambda: encode.call("state")["asks"] == len(cut), 10.0), "the asks never came"
    encode.kill()


def test_rooms_asked_of_an_encode_rank_that_restarted_at_its_port_fail_at_once(engines):
    """An encode rank killed with rooms asked of it and started again at the same port registers anew:
    once the prefill rank looks its route up and finds the new registration, the rooms asked of the
    process before fail at once, saying so, instead of waiting out their 60 s deadlines; rooms asked of
    the new process succeed."""
    cut, after = rooms(3), rooms(2)
    with bootstrap_server() as server:
        encode = encode_process(server.address)
        try:
            port = encode.info["port"]
            with Receiver(engines[0], 0, 1, fanout=1, slots=16, deadline_s=60.0) as r:
                _ask_then_kill(r, server, encode, cut)
                encode = encode_process(server.address, port=port)
                assert encode.info["port"] == port
                for room in after:  # the first room after the restart looks the route up again
                    r.ask(room, server.address, SPAN)
                results = r.wait(cut, 20.0)
                for room in cut:
                    status, reason = results[room]
                    assert status == "Failed", (room, status, reason)
                    # Concluded within the wait's 20 s, saying why: not at their deadlines.
                    assert f"a new process at {HOST}:{port}" in reason and "ask again" in reason, reason
                encode.call("send", after, SPAN, HIDDEN)
                assert r.wait(after, 20.0) == {room: ("Success", None) for room in after}
        finally:
            encode.kill()


@pytest.mark.parametrize("same_port", [True, False], ids=["same-port", "other-port"])
def test_rooms_asked_of_a_killed_encode_rank_fail_soon_after_its_successor_registers_with_no_new_room(engines,
                                                                                                   same_port):
    """An encode rank killed with rooms asked of it, its successor registering only after the look-up the
    dropped connection made (which still found the killed one listed), and no room received since: the
    prefill rank keeps looking the route up while those rooms wait, and they fail within seconds of the
    successor registering (at the same port under a new registration, or at another port), not at their
    60 s deadlines."""
    cut = rooms(3)
    with bootstrap_server() as server:
        encode = encode_process(server.address)
        try:
            port = encode.info["port"]
            with Receiver(engines[0], 0, 1, fanout=1, slots=16, deadline_s=60.0) as r:
                _ask_then_kill(r, server, encode, cut)
                # The drop is seen within a second (the monitors are read once a second while idle) and its
                # look-up answers at once, naming the killed rank: its successor registers only after that.
                time.sleep(3.0)
                encode = encode_process(server.address, **({"port": port} if same_port else {}))
                assert (encode.info["port"] == port) == same_port
                results = r.wait(cut, 20.0)  # far inside their 60 s deadlines
                now_at = f"a new process at {HOST}:{port}" if same_port else f"now at {HOST}:{encode.info['port']}"
                for room in cut:
                    status, reason = results[room]
                    assert status == "Failed", (room, status, reason)
                    assert now_at in reason and "ask again" in reason, reason
                    assert r.untouched(room)
        finally:
            encode.kill()


def test_prefill_killed_mid_stream_never_stalls_the_sender(engines):
    warmup, doomed, survivors = rooms(4), rooms(200), rooms(60)
    with bootstrap_server() as server, encode_process(server.address) as encode:
        victim = prefill_process(server.address, span=SPAN, hidden=HIDDEN, slots=len(warmup) + len(doomed))
        try:
            victim.call("ask", warmup)
            encode.call("send", warmup, SPAN, HIDDEN)
            assert all(r[0] == "Success" and r[2] for r in victim.call("wait", warmup, 10.0).values())
            assert_all(encode.call("wait", warmup, 5.0), "Success")
            dead_session = victim.info["session"]
            victim.call("ask", doomed)
            # Killed only once the encode rank filed every ask (queued frames die with it).
            assert wait_until(lambda: encode.call("state")["asks"] == len(doomed), 5.0)
            victim.kill()
        finally:
            victim.kill()
        with Receiver(engines[0], 0, 1, fanout=1, slots=len(survivors)) as r:
            for room in survivors:
                r.ask(room, server.address, SPAN)
            # The dead rank's rooms and the live rank's interleaved: statuses for the dead
            # endpoint pile up while the live one must keep getting its rows.
            mixed = [room for pair in itertools.zip_longest(doomed, survivors) for room in pair if room is not None]
            started = time.monotonic()
            encode.call("send", mixed, SPAN, HIDDEN)
            got = r.wait(survivors, 10.0)
            survivors_s = time.monotonic() - started
            assert got == {room: ("Success", None) for room in survivors}
            for room in survivors:
                assert r.landed(room) is None
            # Each batch to the dead session costs Mooncake a reconnect (about 1 s): the session's
            # later writes fail fast, or 200 of them would hold the live rooms ~7 s.
            assert survivors_s < 4.0, f"live rooms stalled {survivors_s:.1f}s behind the dead endpoint"
            sent = encode.call("wait", mixed, 10.0, timeout=20.0)
            assert_all({room: sent[room] for room in survivors}, "Success")
            assert_all({room: sent[room] for room in doomed}, "Failed")
            assert all(f"write to {dead_session}" in sent[room][1] for room in doomed), sent[doomed[-1]]
            state = encode.call("state")
            assert state["items"] == 0 and state["asks"] == 0 and state["table"] == 0


# ------------------------------------------------------------- garbage frames


def _transfer_info(room: bytes = b"1", **override: bytes) -> list[bytes]:
    """A well-formed 13-part TransferInfo, with parts replaced by name."""
    parts = {
        "room": room, "endpoint": HOST.encode(), "port": b"5555", "session": b"127.0.0.1:1",
        "embedding": pointer(0x1000), "deepstack": pointer(0), "rows": b"8", "hidden": b"64", "dtype": DTYPE.encode(),
        "has_deepstack": b"0", "fanout": b"1", "row_start": b"0", "span": b"8",
    }
    parts.update(override)
    return list(parts.values())


ENCODE_JUNK = [
    ([b"x"], "malformed EmbeddingTransferInfo frame: 1 parts < 13"),
    ([b""], "malformed EmbeddingTransferInfo frame: 1 parts < 13"),
    ([b"1"] * 12, "malformed EmbeddingTransferInfo frame: 12 parts < 13"),
    (_transfer_info(b"\xff\xfe"), "room must be ASCII"),
    (_transfer_info(endpoint="h\u00f6st".encode()), "endpoint must be ASCII"),
    (_transfer_info(b"9" * 40), "room is not an integer"),
    (_transfer_info(rows=b"99999999999999999999999"), "rows is not an integer"),
    # Past int()'s own limit of 4300 digits, leading zeros and all: a WireError, not a ValueError.
    (_transfer_info(rows=b"0" * 5000 + b"9" * 20), "rows is not an integer"),
    (_transfer_info(port=b"70000"), "invalid port"),
    (_transfer_info(b"-3"), "negative room"),
    (_transfer_info(embedding=b"\x00" * 7), "embedding pointer must be 8 bytes"),
    ([b"None"], "malformed registration frame: 1 parts < 6"),
    ([b"None", HOST.encode(), b"5555", b"s", b"\x00" * 3, pointer(0)], "embedding pointer must be 8 bytes"),
]


def test_garbage_to_the_encode_listener_is_logged_and_the_next_room_succeeds(bootstrap, encoder, engines):
    host, port = encoder.info["host"], encoder.info["port"]
    logged_before = len(encoder.call("logs"))
    sock = junk_pusher(host, port)
    huge = junk_pusher(host, port)
    try:
        # Beyond the listener's message size bound: ZMQ drops it (and that peer) unbuffered.
        huge.send_multipart([b"1", b"\x00" * (1 << 20)])
        for frames, _ in ENCODE_JUNK:
            sock.send_multipart(frames)
        wanted = [needle for _, needle in ENCODE_JUNK]

        def logged() -> list[str]:
            return [m for m in encoder.call("logs")[logged_before:] if "dropped a malformed request" in m]

        # Each kind of complaint is logged once (repeats within a second are only counted).
        assert wait_until(lambda: all(any(n in m for m in logged()) for n in wanted), 5.0), logged()
        assert len(logged()) == len(set(wanted)), logged()
    finally:
        sock.close(0)
        huge.close(0)

    room = rooms(1)[0]
    with Receiver(engines[0], 0, 1, fanout=1) as r:
        r.ask(room, bootstrap.address, SPAN)
        encoder.call("send", [room], SPAN, HIDDEN)
        assert r.wait([room], 10.0) == {room: ("Success", None)}
        assert r.landed(room) is None
    assert encoder.call("wait", [room], 5.0)[room][0] == "Success"


def test_a_flood_of_bad_statuses_costs_a_log_line_a_second_and_the_room_still_succeeds(bootstrap, encoder, engines,
                                                                                        caplog):
    caplog.set_level(logging.WARNING, logger="transfer.receiver")
    room = rooms(1)[0]
    with Receiver(engines[0], 0, 1, fanout=1) as r:
        r.ask(room, bootstrap.address, SPAN)
        sock = junk_pusher(HOST, r.manager.status_port)
        try:
            for _ in range(2000):
                sock.send_multipart([b"x", b"5", b"0"])
            encoder.call("send", [room], SPAN, HIDDEN)
            assert r.wait([room], 10.0) == {room: ("Success", None)}  # through the same flooded listener
        finally:
            sock.close(0)
        assert r.landed(room) is None
    lines = [m for m in caplog.messages if "dropped a malformed status" in m]
    assert 1 <= len(lines) <= 1 + 10, len(lines)  # one per second at most, however long the flood took
    # Every status is accounted for: its line, the repeats a later line tells, and what the close told.
    told = [m for m in caplog.messages if "more warnings were not logged" in m]
    counted = sum(1 + int(re.search(r"\(and (\d+) more like it", m).group(1)) if "more like it" in m else 1
                  for m in lines)
    counted += sum(int(m.split()[0]) for m in told)
    assert counted == 2000, (lines, told)


def test_garbage_to_the_status_listener_is_logged_and_ignored(bootstrap, encoder, engines, caplog):
    caplog.set_level(logging.DEBUG, logger="transfer.receiver")
    pending, forged, unknown = rooms(3)
    with Receiver(engines[0], 0, 1, fanout=1) as r:
        r.ask(pending, bootstrap.address, SPAN)
        r.ask(forged, bootstrap.address, SPAN)
        assert wait_until(
            lambda: all(r.handle(x).poll() == TransferPoll.WaitingForInput for x in (pending, forged)), 5.0
        )
        p, f, u = (str(x).encode() for x in (pending, forged, unknown))
        junk = [
            [b"1"], [b"1", b"5"],
            [b"x", b"5", b"0"], [b"\xff\xfe", b"5", b"0"], [b"-1", b"5", b"0"],
            [p, b"x", b"0"], [p, b"9", b"0"], [p, b"5", b"r"], [p, b"99999999999999999999999", b"0"],
            [b"0" * 5000 + b"9" * 20, b"5", b"0"],  # past int()'s own 4300-digit limit: not an integer either
            [u, b"5", b"0"], [u, b"0", b"0"],  # unknown room: ignored
            [p, b"5", b"7"], [p, b"0", b"3"],  # wrong encode rank: ignored
            [f, b"5", b"0", b"123"],  # a forged Success whose checksum the landed bytes do not match
            [b"end"],
        ]
        sock = junk_pusher(HOST, r.manager.status_port)
        try:
            for frames in junk:
                sock.send_multipart(frames)

            needles = ("an EPD status has 3 frames", "room is not an integer", "negative room",
                       "status is not an integer", "unknown status", "rank is not an integer",
                       "status from encode rank 7, expected 0")
            # Every kind is logged (once: repeats within a second are only counted). The two statuses from
            # a wrong encode rank are one kind, whichever rank they name: the second is counted, not logged.
            assert wait_until(lambda: all(n in "\n".join(caplog.messages) for n in needles), 5.0), caplog.messages
            assert "status from encode rank 3, expected 0" not in "\n".join(caplog.messages)
            assert wait_until(lambda: r.handle(forged).poll() == TransferPoll.Failed, 5.0)
        finally:
            sock.close(0)
        assert r.handle(pending).poll() == TransferPoll.WaitingForInput  # not concluded by any of it
        assert r.handle(forged).poll() == TransferPoll.Failed
        assert r.handle(forged).failure.startswith("checksum mismatch"), r.handle(forged).failure
        assert set(r.manager._driver.rooms) == {pending, forged}  # the unknown room left no state

        encoder.call("send", [pending, forged], SPAN, HIDDEN)
        assert r.wait([pending], 10.0) == {pending: ("Success", None)}
        assert r.landed(pending) is None
        sent = encoder.call("wait", [pending, forged], 10.0)
        assert_all(sent, "Success")
        assert r.handle(forged).poll() == TransferPoll.Failed  # Failed is sticky


# ------------------------------------------------------------ bootstrap faults


def _unreachable() -> str:
    return f"{HOST}:{free_port()}"


@pytest.mark.parametrize("case", ["unreachable", "no-encode-rank", "no-route"])
def test_bootstrap_failure_fails_the_room_fast_without_raising(engines, case):
    room = rooms(1)[0]
    with bootstrap_server() as server:
        address, tp, rank, needle = server.address, 1, 0, "incomplete parallel info"
        if case == "unreachable":
            address, needle = _unreachable(), "unreachable"
        elif case == "no-route":
            # Two encode ranks announced, only rank 0 registered: prefill rank 1 pairs with rank 1.
            BootstrapClient(server.address, token=TOKEN).register_rank(2, 1, HOST, free_port(), 0, retry_for=2.0)
            tp, rank, needle = 2, 1, "no route for encode rank 1"
        # Fast: the room fails on the bootstrap answer, not by its (60 s) deadline.
        with Receiver(engines[0], rank, tp, fanout=1, deadline_s=60.0) as r:
            handle = r.ask(room, address, SPAN)  # must not raise
            assert wait_until(lambda: is_terminal(handle.poll()), 20.0), "the room waited for its deadline"
            assert handle.poll() == TransferPoll.Failed
            assert handle.failure.startswith("bootstrap"), handle.failure
            assert needle in handle.failure, handle.failure
            assert r.untouched(room)


def test_a_silent_bootstrap_server_costs_one_timeout_not_one_per_room(engines):
    """Rooms behind a server that never answers share one look-up and fail together; rooms
    asked for right after that are not asked again until the pause is over."""
    import socket

    from transfer.receiver import UNREACHABLE_RETRY_S

    silent_rooms = rooms(6)
    with socket.socket() as silent:
        silent.bind((HOST, 0))
        silent.listen(16)  # the kernel accepts; nobody ever answers
        address = f"{HOST}:{silent.getsockname()[1]}"
        with Receiver(engines[0], 0, 1, fanout=1, lookup_timeout_s=0.5) as r:
            handles = [r.ask(room, address, SPAN) for room in silent_rooms]
            assert wait_until(lambda: all(is_terminal(h.poll()) for h in handles), 20.0)
            # One look-up: the server's backlog holds one connection, not one per room.
            assert _accepted(silent) == 1, "one look-up (and one timeout) per room"
            reasons = [h.failure for h in handles]
            assert all(reason.startswith(f"bootstrap {address}: ") and "unreachable" in reason for reason in reasons)
            assert all(h.failure_kind is FailureKind.BOOTSTRAP for h in handles)
            paused = r.ask(rooms(1)[0], address, SPAN)
            assert wait_until(lambda: is_terminal(paused.poll()), 3.0)
            assert "not asked again" in paused.failure, paused.failure
            # Once the pause is over, the server is asked again (and times out again).
            time.sleep(UNREACHABLE_RETRY_S)
            again = r.ask(rooms(1)[0], address, SPAN)
            assert wait_until(lambda: is_terminal(again.poll()), 3.0)
            assert "unreachable" in again.failure and "not asked again" not in again.failure, again.failure


def _accepted(listening) -> int:
    """How many connections wait in a listening socket's backlog (taken and closed)."""
    listening.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = listening.accept()
        except BlockingIOError:
            listening.setblocking(True)
            return count
        conn.close()
        count += 1


def test_a_refusing_bootstrap_server_is_still_asked_by_every_room(engines):
    """A quick refusal (a server not up yet) costs little: no pause, each room tries for itself."""
    with Receiver(engines[0], 0, 1, fanout=1, lookup_timeout_s=0.5) as r:
        address = _unreachable()  # nothing listens there: connection refused at once
        handles = [r.ask(room, address, SPAN) for room in rooms(3)]
        assert wait_until(lambda: all(is_terminal(h.poll()) for h in handles), 5.0)
        reasons = [h.failure for h in handles]
        assert all("unreachable" in reason and "not asked again" not in reason for reason in reasons), reasons


# -------------------------------------------------------------- region safety


def test_destination_outside_the_announced_region_is_refused(bootstrap, encoder):
    from transfer.engine import Engine

    outside, inside, forged, peer = rooms(4)
    announced = 2 * ITEM
    host, port = encoder.info["host"], encoder.info["port"]
    # A session of its own: the encode rank keeps every region a session ever announced,
    # so an earlier manager's buffer at the same address would make the range acceptable.
    with Engine(HOST, protocol="tcp") as engine, RawPrefill(engine, host, port, 4 * ITEM) as raw:
        raw.register((announced, 0))
        # Starts inside the announced region, ends past it (still in registered memory).
        raw.ask(outside, raw.base + announced - ROW, SPAN, HIDDEN, SPAN)
        encoder.call("send", [outside], SPAN, HIDDEN)
        [status] = raw.statuses(1, 5.0)
        assert status[:5] == [str(outside).encode(), b"0", b"0", b"failure", b"region"], status
        assert b"outside registered region" in status[5]
        sent = encoder.call("wait", [outside], 5.0)[outside]
        assert sent[0] == "Failed" and "outside registered region" in sent[1], sent
        assert raw.untouched(), "the refused room wrote bytes"

        raw.ask(inside, raw.base, SPAN, HIDDEN, SPAN)
        encoder.call("send", [inside], SPAN, HIDDEN)
        [status] = raw.statuses(1, 5.0)
        assert status[:3] == [str(inside).encode(), b"5", b"0"]
        assert bytes(raw.buffer[:ITEM].numpy()) == bytes(_item(inside))

        # A registration without lengths from a session that announced them is refused:
        # the announced region still bounds that session's destinations.
        raw.register(None)
        raw.ask(forged, raw.base + announced, SPAN, HIDDEN, SPAN)
        encoder.call("send", [forged], SPAN, HIDDEN)
        [status] = raw.statuses(1, 5.0)
        assert status[:5] == [str(forged).encode(), b"0", b"0", b"failure", b"region"], status
        assert b"outside registered region" in status[5]
        sent = encoder.call("wait", [forged], 5.0)[forged]
        assert sent[0] == "Failed" and "outside registered region" in sent[1], sent
        assert bool((raw.buffer[ITEM:] == SENTINEL).all()), "the refused room wrote bytes"
        assert any("without region lengths" in m for m in encoder.call("logs"))
        assert_all(encoder.call("wait", [inside], 5.0), "Success")

    # A peer's registration carries no lengths: the encode rank writes its sessions as the peers do.
    with Engine(HOST, protocol="tcp") as engine, RawPrefill(engine, host, port, 4 * ITEM) as raw:
        raw.register(None)
        raw.ask(peer, raw.base + announced, SPAN, HIDDEN, SPAN)
        encoder.call("send", [peer], SPAN, HIDDEN)
        [status] = raw.statuses(1, 5.0)
        assert status[:3] == [str(peer).encode(), b"5", b"0"]
        assert bytes(raw.buffer[announced : announced + ITEM].numpy()) == bytes(_item(peer))
        assert_all(encoder.call("wait", [peer], 5.0), "Success")


def _item(room: int):
    """Room's item bytes, as the encode process sends them."""
    return item_bytes(room, ITEM)


# ------------------------------------------------------------- bootstrap token


def test_bootstrap_token_guards_registration(engines, caplog):
    room = rooms(1)[0]
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")  # the server logs each request
    with BootstrapServer(HOST, 0, token="s3cret") as server:
        from transfer.sender import SenderPool

        threads = epd_threads()
        for token in ("wrong", None):
            caplog.clear()
            with pytest.raises(BootstrapError, match="refused encode rank 0: HTTP 401"):
                SenderPool(engines[0], 0, 1, 1, server.address, host=HOST, token=token, register_timeout_s=10.0)
            puts = [m for m in caplog.messages if "PUT /route" in m]
            assert len(puts) == 1 and " 401 " in puts[0], puts  # a refusal is not retried
            assert epd_threads() == threads, "a refused pool left threads running"
        assert server.registered_ranks == 0
        with encode_process(server.address, token="s3cret") as encode, Receiver(engines[0], 0, 1, fanout=1) as r:
            assert server.registered_ranks == 1
            r.ask(room, server.address, SPAN)
            encode.call("send", [room], SPAN, HIDDEN)
            assert r.wait([room], 10.0) == {room: ("Success", None)}
            assert r.landed(room) is None
