"""An encode rank's own warnings keep their first line while a peer floods it with malformed requests:
the complaints about those have a line budget of their own."""

from __future__ import annotations

import logging
import threading

from live_helpers import DTYPE, HOST, LogCapture, junk_pusher, pointer, wait_until


def test_a_flood_of_malformed_requests_does_not_silence_the_first_unserved_room_warning(engines, server):
    from transfer.sender import SenderPool

    encode_engine, _ = engines
    capture = LogCapture()
    logger = logging.getLogger("transfer")
    logger.addHandler(capture)
    stop = threading.Event()

    def unserved() -> list[str]:
        return [message for message in capture.take() if "no item sent within" in message]

    try:
        with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, fanout_timeout_s=0.5) as sender:
            flood = junk_pusher(HOST, sender.port)
            ask = junk_pusher(HOST, sender.port)

            def malformed() -> None:
                # Requests of 1 to 12 parts: twelve kinds of complaint, more than a second's budget of lines.
                while not stop.is_set():
                    for parts in range(1, 13):
                        flood.send_multipart([b"x"] * parts)
                    stop.wait(0.001)

            flooding = threading.Thread(target=malformed, daemon=True)
            flooding.start()
            try:
                assert wait_until(lambda: any("malformed request" in m for m in capture.take()), 10)
                # An ask for a room never sent: its receiver is told Failed once the fanout timeout passed,
                # and the encode rank warns of it.
                ask.send_multipart([b"9", HOST.encode(), b"1", b"dead", pointer(4096), pointer(0), b"4", b"4",
                                    DTYPE.encode(), b"0", b"1", b"0", b"4"])
                assert wait_until(lambda: unserved(), 10), [m for m in capture.take() if "malformed" not in m]
            finally:
                stop.set()
                flooding.join(10)
                flood.close(0)
                ask.close(0)
    finally:
        logger.removeHandler(capture)
