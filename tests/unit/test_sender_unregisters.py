"""A sender pool's close withdraws its route from the bootstrap server first, once, bounded and best effort:
whatever the server answers (or does not), closing goes on and raises nothing.

The pool's thread and sockets are live matters (tests/live/test_route_withdrawn.py); here the close
path runs on a room book and a driver stand-in, and the client's DELETE is replaced."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from transfer import sender
from transfer.bootstrap import BootstrapClient
from transfer.drive.encode import RoomBook
from transfer.errors import BootstrapError, BootstrapUnreachable
from transfer.metrics import Metrics

ROUTE = sender._Route("10.0.0.1:8998", "t0k", 4, 2, "10.0.0.7", 7000, 3, "ab" * 16, listed=True)


class _Driver:
    """What _close uses of an EncodeDriver: stop() and whether it was asked, and a thread (never started:
    nothing to join)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.thread = threading.Thread(target=lambda: None)
        self.stop_asked = False

    def stop(self, close_by: float | None = None) -> None:
        self.calls.append("stop")
        self.close_by = close_by
        self.stop_asked = True


@pytest.fixture
def deletes(monkeypatch) -> list:
    """The DELETEs the close path makes: (client's address, token, timeout, arguments, call timeout, instance)."""
    made: list = []

    def unregister_rank(client, *args, timeout, instance=None):
        made.append((client.address, client.token, client.timeout, args, timeout, instance))
        return True
    monkeypatch.setattr(BootstrapClient, "unregister_rank", unregister_rank)
    return made


def test_close_withdraws_the_route_it_registered_before_the_driver_stops_and_only_once(deletes, monkeypatch):
    calls: list = []
    monkeypatch.setattr(sender._Route, "unregister", lambda route, deadline: calls.append(("unregister", route)))
    book, driver = RoomBook(Metrics("epd_test")), _Driver(calls)
    sender._close(book, driver, ROUTE)
    assert calls == [("unregister", ROUTE), "stop"]
    sender._close(book, driver, ROUTE)
    assert calls == [("unregister", ROUTE), "stop"], "a second close asks nothing again"


def test_a_close_interrupted_while_it_withdraws_the_route_leaves_the_withdrawal_and_the_stop_to_the_next(
        deletes, monkeypatch):
    """A stop signal's exception (a rank's SIGTERM handler raises KeyboardInterrupt) taken while close()
    waits for the DELETE's answer: the close raises it, and a close again sends the DELETE and stops the
    driver, which would otherwise serve on."""
    calls: list = []

    def unregister(route, deadline):
        calls.append(("unregister", route))
        if len(calls) == 1:
            raise KeyboardInterrupt
    monkeypatch.setattr(sender._Route, "unregister", unregister)
    book, driver = RoomBook(Metrics("epd_test")), _Driver(calls)
    with pytest.raises(KeyboardInterrupt):
        sender._close(book, driver, ROUTE)
    assert calls == [("unregister", ROUTE)] and book.closed
    sender._close(book, driver, ROUTE)
    assert calls == [("unregister", ROUTE), ("unregister", ROUTE), "stop"]
    sender._close(book, driver, ROUTE)
    assert calls == [("unregister", ROUTE), ("unregister", ROUTE), "stop"], "a close after it asks nothing again"


def test_close_withdraws_no_route_the_server_never_listed(deletes, monkeypatch):
    calls: list = []
    monkeypatch.setattr(sender._Route, "unregister", lambda route, deadline: calls.append(("unregister", route)))
    unlisted = sender._Route("10.0.0.1:8998", "t0k", 4, 2, "10.0.0.7", 7000, 3)  # its registration was refused
    sender._close(RoomBook(Metrics("epd_test")), _Driver(calls), unlisted)
    assert calls == ["stop"]


def test_the_delete_names_this_ranks_endpoint_and_instance_with_its_token_within_a_second(deletes):
    ROUTE.unregister()
    assert deletes == [("10.0.0.1:8998", "t0k", sender.UNREGISTER_TIMEOUT_S, (4, 2, "10.0.0.7", 7000, 3),
                        sender.UNREGISTER_TIMEOUT_S, "ab" * 16)]
    assert sender.UNREGISTER_TIMEOUT_S <= 1.0


def test_close_cuts_the_delete_to_close_timeout_s_and_hands_the_driver_the_same_deadline(deletes):
    """The DELETE takes at most what is left of close_timeout_s, and the driver is told to be done by the
    close's deadline: no step of close() waits past it."""
    calls: list = []
    driver = _Driver(calls)
    before = time.monotonic()
    sender._close(RoomBook(Metrics("epd_test")), driver, ROUTE, close_timeout_s=0.25)
    [(_, _, client_timeout, _, call_timeout, _)] = deletes
    assert 0 < call_timeout <= 0.25 and client_timeout == call_timeout
    assert before + 0.25 <= driver.close_by <= time.monotonic() + 0.25


@pytest.mark.parametrize("error", [
    BootstrapUnreachable("bootstrap server 10.0.0.1:8998 unreachable to unregister encode rank 3: timed out"),
    BootstrapError("bootstrap server 10.0.0.1:8998 did not unregister encode rank 3: HTTP 405: Method Not Allowed"),
    BootstrapError("bootstrap server 10.0.0.1:8998 did not unregister encode rank 3: HTTP 501: Unsupported method"),
    RuntimeError("anything else"),
], ids=["unreachable", "405", "501", "other"])
def test_whatever_the_server_answers_close_goes_on_and_says_so_at_info(monkeypatch, caplog, error):
    def unregister_rank(client, *args, timeout, instance=None):
        raise error
    monkeypatch.setattr(BootstrapClient, "unregister_rank", unregister_rank)
    caplog.set_level(logging.DEBUG, logger="transfer.sender")
    calls: list = []
    sender._close(RoomBook(Metrics("epd_test")), _Driver(calls), ROUTE)
    assert calls == ["stop"]
    [record] = [r for r in caplog.records if r.name == "transfer.sender"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == (f"sender pool of encode rank 3: its route to 10.0.0.7:7000 may stay listed at "
                                   f"bootstrap 10.0.0.1:8998 (prefill ranks sent there wait out their deadlines): "
                                   f"{error}")
