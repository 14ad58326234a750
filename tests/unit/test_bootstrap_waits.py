"""A library call that waits for the bootstrap server says so in the `transfer.bootstrap` log, not on a terminal:
BootstrapClient.wait_ready (a prefill rank started before its encode ranks) and register_rank retrying a server
that refuses or answers 5xx. What they log and raise, on a fake clock, with answers a real server gives."""

from __future__ import annotations

import json
import logging

import pytest
from fakes import FakeTime

import transfer.bootstrap
from transfer.bootstrap import BootstrapClient
from transfer.errors import BootstrapError, BootstrapUnreachable

ADDRESS = "10.0.0.1:8998"
NO_RANK_YET = json.dumps({"prefill_tp_size": None, "prefill_dp_size": None}).encode()
SIZES = json.dumps({"prefill_tp_size": 2, "prefill_dp_size": 1}).encode()
ROUTE = json.dumps({"rank_ip": "10.0.0.2", "rank_port": 7002}).encode()


@pytest.fixture
def clock(monkeypatch) -> FakeTime:
    clock = FakeTime(100.0)
    monkeypatch.setattr(transfer.bootstrap, "time", clock)
    return clock


def _server(clock: FakeTime, answers, try_s: float = 0.0):
    """A `_request` that answers each request with the next of `answers` (the last again once they run out): a
    (status, body) pair, or an OSError raised as the transport raises it; each request takes `try_s`."""
    seen: list[tuple[str, str]] = []

    def request(method, path, body=None, headers=None, timeout=None, answered=None):
        seen.append((method, path))
        clock.now += try_s
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return request, seen


def _lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "transfer.bootstrap"]


def test_wait_ready_met_at_its_first_try_logs_nothing(clock, caplog):
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")
    client = BootstrapClient(ADDRESS)
    client._request, _ = _server(clock, [(200, SIZES), (200, ROUTE)])
    assert client.wait_ready(60, encode_rank=1) == (2, 1)
    assert _lines(caplog) == []


def test_wait_ready_logs_what_it_waits_for_then_every_ten_seconds_how_it_goes_then_that_it_ended(clock, caplog):
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")
    client = BootstrapClient(ADDRESS)
    refused = ConnectionRefusedError(111, "Connection refused")
    # Refused for 80 tries (0.05, 0.1, 0.2, 0.4 s apart, then 0.5 s: 38.75 s), then listed.
    client._request, _ = _server(clock, [refused] * 80 + [(200, SIZES), (200, ROUTE)])
    assert client.wait_ready(120, encode_rank=1) == (2, 1)
    (first_level, first), *still, (last_level, last) = _lines(caplog)
    what = f"encode rank 1 (dp group 0) to register at bootstrap {ADDRESS}"
    assert first_level == logging.INFO
    assert first.startswith("BootstrapClient.wait_ready: waiting up to 120s (timeout, until "), first
    assert first.endswith(f") for {what}; not yet: connection refused (nothing listens there)"), first
    assert [level for level, _ in still] == [logging.WARNING] * 3
    assert [line.split(": ")[2].split(",")[0] for _, line in still] == ["10s of 120s", "20s of 120s",
                                                                           "30s of 120s"]
    assert all(line.startswith(f"BootstrapClient.wait_ready: still waiting for {what}: ") for _, line in still)
    assert all(line.endswith(" tries; last: connection refused (nothing listens there)") for _, line in still)
    assert last_level == logging.INFO
    assert last == f"BootstrapClient.wait_ready: done waiting for {what}, after 39s (81 tries)", last


def test_wait_ready_that_times_out_names_the_address_the_tries_and_the_last_reason(clock, caplog):
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")
    client = BootstrapClient(ADDRESS)
    client._request, seen = _server(clock, [(200, NO_RANK_YET)], try_s=0.5)
    with pytest.raises(BootstrapError) as raised:
        client.wait_ready(30)
    assert str(raised.value) == (
        f"no encode rank registered at bootstrap {ADDRESS} within 30s ({len(seen)} tries), the last: bootstrap "
        f"server {ADDRESS} has incomplete parallel info (no encode rank registered yet?): "
        f"{{'prefill_tp_size': None, 'prefill_dp_size': None}}: start the encode ranks (and the bootstrap server), "
        f"or give the address they register at")
    levels = [level for level, _ in _lines(caplog)]
    # Every quarter of a 30 s wait: at 7.5 s, 15 s and 22.5 s (tries end 1 s apart: at 8, 16 and 24 s).
    assert levels[0] == logging.INFO and levels[1:] == [logging.WARNING] * 3, _lines(caplog)


def test_register_rank_retrying_a_busy_server_logs_how_it_goes_at_most_every_ten_seconds(clock, caplog):
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")
    client = BootstrapClient(ADDRESS)
    client._request, seen = _server(clock, [(503, b"busy")] * 60 + [(200, b'{"status": "OK"}')])
    assert client.register_rank(2, 1, "10.0.0.2", 7002, 1, retry_for=60)
    (first_level, first), *still, (last_level, last) = _lines(caplog)
    what = f"encode rank 1 to be registered at bootstrap {ADDRESS}"
    assert first_level == logging.INFO
    assert first.startswith("BootstrapClient.register_rank: waiting up to 60s (retry_for, until "), first
    assert first.endswith(f") for {what}; not yet: HTTP 503: busy"), first
    assert [level for level, _ in still] == [logging.WARNING] * 2, still  # 0.5 s apart: 28.75 s of 503s
    assert all(line.startswith(f"BootstrapClient.register_rank: still waiting for {what}: ") for _, line in still)
    assert all(line.endswith(" tries; last: HTTP 503: busy") for _, line in still)
    assert last_level == logging.INFO and last.endswith(f"done waiting for {what}, after 29s ({len(seen)} tries)")


def test_register_rank_refused_in_words_while_it_retries(clock, caplog):
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")
    client = BootstrapClient(ADDRESS)
    client._request, _ = _server(clock, [ConnectionRefusedError(111, "Connection refused")])
    with pytest.raises(BootstrapUnreachable, match=r"within 30s \(\d+ tries\), the last: ConnectionRefusedError: "):
        client.register_rank(2, 1, "10.0.0.2", 7002, 1, retry_for=30)
    lines = _lines(caplog)
    assert lines and all(line.endswith("connection refused (nothing listens there)") for _, line in lines), lines


def test_a_single_registration_try_logs_nothing_of_a_wait(clock, caplog):
    # The route keeper's registration again: one try (retry_for=0), whose failure its caller logs, throttled.
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")
    client = BootstrapClient(ADDRESS)
    client._request, _ = _server(clock, [(503, b"busy")])
    with pytest.raises(BootstrapError, match="HTTP 503: busy"):
        client.register_rank(2, 1, "10.0.0.2", 7002, 1, retry_for=0)
    assert _lines(caplog) == []


def test_register_rank_that_gives_up_names_its_tries_as_wait_ready_does(clock):
    client = BootstrapClient(ADDRESS)
    client._request, seen = _server(clock, [(503, b"busy")], try_s=0.5)
    with pytest.raises(BootstrapError) as raised:
        client.register_rank(2, 1, "10.0.0.2", 7002, 1, retry_for=30)
    assert str(raised.value) == (f"could not register encode rank 1 with bootstrap server {ADDRESS} within 30s "
                                 f"({len(seen)} tries), the last: HTTP 503: busy")
    client._request, seen = _server(clock, [(503, b"busy")])
    with pytest.raises(BootstrapError, match=r"within 0s \(1 try\), the last: HTTP 503: busy$"):
        client.register_rank(2, 1, "10.0.0.2", 7002, 1, retry_for=0)
