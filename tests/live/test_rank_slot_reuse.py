"""A prefill rank of `epd-transfer rank` and `demo` (harness.prefill_rank) reuses a failed room's slot only
once the room's memory is safe (README: reuse a failed room's dst only once handle.safe_to_reuse).

A room that fails on the prefill side (its deadline, a link down between the hosts) may still be held by its
encode rank, which writes it once its fanout asked unless the room's cancel reached it. A slot reused before
that cancel is confirmed is asked for again at the same address: the encode rank then refuses the new room
(its destination overlaps the old room's, still in flight), or a late write of the old item lands in it.

Real Mooncake `tcp` engine and session manager on 127.0.0.1, a real bootstrap server; the encode rank is a
raw ZMQ stand-in, so the test decides when the cancel is confirmed.
"""

from __future__ import annotations

import threading

from live_helpers import HOST, LIVE

from transfer import _io
from transfer.bootstrap import BootstrapClient, BootstrapServer
from transfer.frames import CancelAnswer, TransferInfo, cancel_reply_frames, is_cancel, is_registration
from transfer.frames import parse_cancel, parse_registration, status_frames
from transfer.status import TransferPoll

pytestmark = LIVE

DEADLINE_S = 1.0
#: How long the stand-in listens, after room 0's cancel came, for an ask of room 1 that must not come yet:
#: a slot reused at once is asked for again within milliseconds of the room's failure.
QUIET_S = 3.0
BOUND_S = 30.0


def _next(sock, timeout: float) -> list[bytes] | None:
    return sock.recv_multipart() if sock.poll(int(timeout * 1000)) else None


def test_a_failed_rooms_slot_is_asked_for_again_only_once_its_cancel_is_confirmed():
    from transfer import harness

    sc = harness.Scenario(encode_ranks=1, prefill_ranks=1, items=2, span=8, hidden=64, inflight=1, protocol="tcp",
                          host=HOST, deadline_s=DEADLINE_S)
    encode, port = _io.pull_socket(HOST, 0)
    with BootstrapServer(HOST, 0) as server:
        BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
        result: dict = {}

        def run() -> None:
            try:
                result["report"] = harness.prefill_rank(sc, 0, server.address, lambda: None, lambda: None,
                                                        lambda: None)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                result["error"] = exc

        rank = threading.Thread(target=run, daemon=True)
        rank.start()
        statuses = None
        try:
            asks: list[TransferInfo] = []
            cancelled = None
            while cancelled is None:
                message = _next(encode, BOUND_S)
                assert message is not None, f"no cancel of room 0 within {BOUND_S:g}s; asks: {asks}"
                if is_registration(message):
                    registration = parse_registration(message)
                    if statuses is None:
                        statuses = _io.push_socket(registration.endpoint, registration.port)
                elif is_cancel(message):
                    cancelled = parse_cancel(message)
                else:
                    asks.append(TransferInfo.from_frames(message))
            assert [ask.room for ask in asks] == [0] and cancelled.room == 0
            # Room 0 failed at its deadline; its cancel is not confirmed: its slot must not be asked for.
            early = []
            while (message := _next(encode, QUIET_S)) is not None:
                if not is_registration(message) and not is_cancel(message):
                    early.append(TransferInfo.from_frames(message))
            assert not early, (f"room {early[0].room} was asked for at {early[0].embedding_ptr} before room 0's cancel "
                               f"was confirmed, in room 0's slot {asks[0].embedding_ptr}")
            assert statuses is not None
            statuses.send_multipart(cancel_reply_frames(0, 0, CancelAnswer.CONFIRMED))
            later = None
            while later is None:
                message = _next(encode, BOUND_S)
                assert message is not None, f"room 1 was not asked for within {BOUND_S:g}s of room 0's confirmation"
                if not is_registration(message) and not is_cancel(message):
                    later = TransferInfo.from_frames(message)
            assert later.room == 1 and later.embedding_ptr == asks[0].embedding_ptr  # the slot, once safe
            statuses.send_multipart(status_frames(1, TransferPoll.Failed, 0))
            rank.join(BOUND_S)
            assert not rank.is_alive()
            assert "error" not in result, result.get("error")
            assert [room for room, _ in result["report"]["failed"]] == [0, 1]
        finally:
            if statuses is not None:
                statuses.close(0)
            encode.close(0)
            rank.join(BOUND_S)
