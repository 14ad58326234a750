"""The bootstrap server tells the operator who registered (each registration at INFO, a WARNING when a
second endpoint claims an encode rank already claimed), and a client can wait until the encode side is up."""

from __future__ import annotations

import logging

import pytest

from transfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer

pytestmark = pytest.mark.live


def _records(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "transfer.bootstrap" and r.levelno == level]


def test_each_registration_is_logged_and_a_second_claim_warns(caplog):
    caplog.set_level(logging.INFO, logger="transfer")
    with BootstrapServer("127.0.0.1", 0) as server:
        client = BootstrapClient(server.address)
        client.register_rank(2, 1, "10.0.0.1", 7001, engine_rank=0)
        client.register_rank(2, 1, "10.0.0.1", 7001, engine_rank=0)  # a retry: the same endpoint
        client.register_rank(2, 1, "10.0.0.2", 7002, engine_rank=1)
        assert not _records(caplog, logging.WARNING)
        client.register_rank(2, 1, "10.0.0.9", 7009, engine_rank=0)
        route = client.route(0, 0)
    info = _records(caplog, logging.INFO)
    assert any("encode rank 0 (dp group 0, tp rank 0) registered at 10.0.0.1:7001 (1 rank(s) known)" in m
               for m in info), info
    assert any("encode rank 0 (dp group 0, tp rank 0) registered at 10.0.0.1:7001 again" in m for m in info), info
    assert any("encode rank 1 (dp group 0, tp rank 1) registered at 10.0.0.2:7002 (2 rank(s) known)" in m
               for m in info), info
    (warning,) = _records(caplog, logging.WARNING)
    assert ("encode rank 0 (dp group 0, tp rank 0), registered at 10.0.0.1:7001, is now claimed by 10.0.0.9:7009 "
            "(from 127.0.0.1)") in warning
    assert route == ("10.0.0.9", 7009)


def test_a_claim_whose_answer_never_reaches_the_client_is_logged_all_the_same(caplog, monkeypatch):
    """The route changes when the server files the PUT: a client gone before the answer (a reset, here the
    answer's write failing) must not leave a takeover unlogged. The same for a DELETE."""
    from transfer import bootstrap

    caplog.set_level(logging.INFO, logger="transfer")
    with BootstrapServer("127.0.0.1", 0) as server:
        client = BootstrapClient(server.address, timeout=2.0)
        client.register_rank(2, 1, "10.0.0.1", 7001, engine_rank=0)

        def reset(*_args, **_kwargs):
            raise ConnectionResetError("the client reset the connection")

        monkeypatch.setattr(bootstrap._Handler, "_json", reset)
        for call in (lambda: client.register_rank(2, 1, "10.0.0.9", 7009, engine_rank=0, retry_for=0),
                     lambda: client.unregister_rank(2, 1, "10.0.0.9", 7009, engine_rank=0)):
            with pytest.raises(BootstrapError):
                call()
        monkeypatch.undo()
        with pytest.raises(BootstrapError, match="no route for encode rank 0 in dp group 0"):
            client.route(0, 0)  # both reached the table
    (warning,) = _records(caplog, logging.WARNING)
    assert "is now claimed by 10.0.0.9:7009" in warning
    assert any("encode rank 0 (dp group 0, tp rank 0) unregistered from 10.0.0.9:7009" in m
               for m in _records(caplog, logging.INFO)), _records(caplog, logging.INFO)


def test_wait_ready_returns_once_the_encode_rank_registered():
    import threading

    with BootstrapServer("127.0.0.1", 0) as server:
        client = BootstrapClient(server.address, timeout=1.0)
        with pytest.raises(BootstrapError, match=rf"encode rank 1 \(dp group 0\) never registered at bootstrap "
                                                 rf"{server.address} within 0.3s \(\d+ tries\), the last: .*no encode "
                                                 r"rank registered yet"):
            client.wait_ready(0.3, encode_rank=1)
        later = threading.Timer(0.3, lambda: client.register_rank(2, 1, "10.0.0.2", 7002, engine_rank=1))
        later.start()
        try:
            assert client.wait_ready(30, encode_rank=1) == (2, 1)
        finally:
            later.join()
        assert client.route(1, 0) == ("10.0.0.2", 7002)


@pytest.mark.parametrize("encode_rank, said", [(None, "no encode rank registered at bootstrap"),
                                               (1, "encode rank 1 \\(dp group 0\\) never registered at bootstrap")])
def test_wait_ready_against_a_silent_server_ends_at_its_own_bound_not_the_clients(encode_rank, said):
    """Each look-up gets what is left of the wait, not the client's whole timeout (5 s here): over a real
    socket, the look-up times out and the wait ends saying so (the bounds each look-up is given:
    tests/unit/test_bootstrap.py::test_wait_ready_gives_each_look_up_what_is_left_of_its_wait_not_the_clients_timeout)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the kernel's backlog), never answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        client = BootstrapClient(address, timeout=5.0)
        with pytest.raises(BootstrapError, match=rf"^{said} {address} within 0.3s \(.*last: .*timed out"):
            client.wait_ready(0.3, encode_rank=encode_rank)


def test_an_access_log_line_shows_the_control_characters_a_client_sent_as_question_marks(caplog):
    """A request line is the client's text: written to the log as sent, an escape sequence or a newline
    would forge log lines or drive the operator's terminal."""
    import socket

    caplog.set_level(logging.DEBUG, logger="transfer")
    with BootstrapServer("127.0.0.1", 0) as server:
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET /health?\x1b[31mred\rforged HTTP/1.0\r\n\r\n")
            while sock.recv(4096):
                pass
    lines = [m for m in _records(caplog, logging.DEBUG) if "red" in m]
    assert lines and all(m.isprintable() for m in lines), lines
    assert any("GET /health??[31mred?forged HTTP/1.0" in m for m in lines), lines
