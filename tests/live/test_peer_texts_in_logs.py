"""The hosts a prefill peer announces, quoted in an encode rank's log lines: printable and bounded, so a
hostile peer's text can neither forge log lines nor flood them."""

from __future__ import annotations

import logging

from live_helpers import DTYPE, HOST, LogCapture, junk_pusher, pointer, wait_until

FORGED = "10.0.0.1\nCRITICAL transfer: every room verified" + "x" * 4000


def test_a_status_endpoint_a_peer_announces_is_logged_printable_and_bounded(engines, server):
    from transfer.sender import SenderPool

    encode_engine, _ = engines
    capture = LogCapture()
    logger = logging.getLogger("transfer")
    logger.addHandler(capture)

    def quoting() -> list[str]:
        return [message for message in capture.take() if "10.0.0.1" in message]

    try:
        with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as sender:
            push = junk_pusher(HOST, sender.port)
            try:
                # An ask, whose Failed status (the pool closes with it parked) cannot be pushed, then a
                # registration, whose status connection cannot be opened (logged once the ask was filed, since
                # one socket's requests are filed in order): both are logged with the endpoint they name.
                push.send_multipart([b"7", FORGED.encode(), b"5556", b"s2", pointer(4096), pointer(0), b"4", b"4",
                                     DTYPE.encode(), b"0", b"1", b"0", b"4"])
                push.send_multipart([b"None", FORGED.encode(), b"5555", b"s1", pointer(4096), pointer(0)])
                assert wait_until(lambda: len(quoting()) == 1, 10), capture.take()
            finally:
                push.close(0)
    finally:
        logger.removeHandler(capture)
    assert len(quoting()) == 2, capture.take()
    for message in quoting():
        assert message.isprintable(), repr(message[:200])
        assert len(message) < 1000, repr(message[:200])
