"""A prefill rank clears a room and asks for it again at once while its item is sent (real Mooncake tcp, ZMQ)."""

from __future__ import annotations

import threading
import time

from live_helpers import HOST, LIVE, wait_until

from transfer.bootstrap import BootstrapServer

pytestmark = LIVE

BF16 = "torch.bfloat16"
ROOMS = 20
#: The rooms' deadline at both ends: a new ask left waiting would fail only then.
DEADLINE_S = 30.0
#: Well inside that deadline (the machine may be slow): a new ask is served or told why by then.
CONCLUDED_WITHIN_S = 20.0


def test_a_room_cleared_and_asked_again_while_its_item_is_sent_is_served_or_told_why(engines):
    """Each re-ask concludes Success with the item in its new destination (the first send waited for it, or
    the first send landed in the given-up ask's memory and the room's send again served it), or Failed
    saying its own cancel had failed the item (the cancel met the write in flight)."""
    import torch

    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    rows, hidden = 4, 64
    # Per room: the given-up ask's destination and the new ask's, both zero until written.
    buf = torch.zeros(2 * ROOMS + 1, rows, hidden, dtype=torch.bfloat16)
    old_bufs, new_bufs = buf[:ROOMS + 1], buf[ROOMS + 1:]
    items = [torch.randn(rows, hidden).to(torch.bfloat16) for _ in range(ROOMS)]
    for item in items:
        encode_engine.register(item)

    def holds(dst: torch.Tensor, room: int) -> bool:
        return torch.equal(dst.view(torch.uint8), items[room].view(torch.uint8))

    outcomes: list[tuple[int, str, float]] = []
    try:
        with BootstrapServer(HOST, 0) as server, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, fanout_timeout_s=DEADLINE_S) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=DEADLINE_S) as manager:
            # A first cancel answered: the encode rank is known to answer them, so no new ask waits for one.
            first = manager.receive(999, server.address, old_bufs[ROOMS])
            assert wait_until(lambda: sender._core.parked.get(999) is not None, 5), "the ask never reached the rank"
            first.clear()
            assert wait_until(lambda: first.safe_to_reuse, 5), "the encode rank never confirmed the cancel"
            for room in range(ROOMS):
                old = manager.receive(room, server.address, old_bufs[room])
                assert wait_until(lambda room=room: sender._core.parked.get(room) is not None, 5)
                go = threading.Barrier(2)
                sent: list = []

                def send(room=room):
                    go.wait(5)
                    sent.append(sender.send(room, items[room]))

                sending = threading.Thread(target=send)
                sending.start()
                go.wait(5)
                old.clear()  # its cancel goes out, and the new ask right after it (a gap of 0)
                new = manager.receive(room, server.address, new_bufs[room])
                began = time.monotonic()
                sending.join(5)
                [first_send] = sent
                # What a retry does: the room is sent again once its first send concluded.
                assert first_send.wait(CONCLUDED_WITHIN_S) in (TransferPoll.Success, TransferPoll.Failed), \
                    f"room {room}: its first send did not conclude"
                first_send.clear()
                again = sender.send(room, items[room])
                status = new.wait(CONCLUDED_WITHIN_S)
                took = time.monotonic() - began
                if status == TransferPoll.Success:
                    assert holds(new_bufs[room], room), f"room {room}: Success, but its new destination lacks the item"
                    # The first send served the new ask, or it had landed in the given-up ask's memory.
                    how = "served by the send again" if holds(old_bufs[room], room) else "served by the first send"
                    outcomes.append((room, how, took))
                else:
                    assert status == TransferPoll.Failed, f"room {room}: not concluded within {CONCLUDED_WITHIN_S}s"
                    assert "asked for it again" in str(new.failure), f"room {room}: {new.failure}"
                    outcomes.append((room, "told why", took))
                new.clear()
                again.clear()
    finally:
        for item in items:
            encode_engine.unregister(item.data_ptr())
    counts = {how: sum(1 for _, h, _ in outcomes if h == how)
              for how in ("served by the first send", "served by the send again", "told why")}
    print(f"\nof {ROOMS} re-asked rooms: " + ", ".join(f"{n} {how}" for how, n in counts.items())
          + f"; slowest {max(took for *_, took in outcomes):.2f}s")
    assert len(outcomes) == ROOMS
