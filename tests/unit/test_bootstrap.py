"""The bootstrap client refuses a malformed address or a timeout that bounds nothing before any I/O; the route
table's DELETE rule and the client's DELETE and 404 (the HTTP round trip: tests/live/test_bootstrap_server.py)."""

from __future__ import annotations

import json

import pytest

from transfer.bootstrap import BootstrapClient, _RequestError, _RouteTable
from transfer.errors import BootstrapError, BootstrapNoRoute, BootstrapUnreachable, ConfigError, ConfigTypeError


def test_bad_address_is_rejected():
    with pytest.raises(ValueError, match="host:port"):
        BootstrapClient("localhost")


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 0])
def test_a_client_timeout_that_bounds_nothing_is_refused(timeout):
    with pytest.raises(ConfigError, match=r"^timeout=.* is not a positive number of seconds up to 1000000"):
        BootstrapClient("127.0.0.1:8998", timeout=timeout)


@pytest.mark.parametrize("timeout, error", [(float("nan"), ConfigError), (float("inf"), ConfigError),
                                            ("3", ConfigTypeError)])
def test_wait_ready_refuses_a_timeout_that_bounds_nothing_before_asking(timeout, error):
    with pytest.raises(error, match=r"^timeout=.* is not a non-negative number of seconds"):
        BootstrapClient("127.0.0.1:8998").wait_ready(timeout)


# ------------------------------------------------------------------ DELETE /route (ours)


def _registered(table: _RouteTable, port: int, engine_rank: int = 0, world_size: int = 2) -> tuple[int, int]:
    return table.put(world_size, 1, "10.0.0.1", port, engine_rank)


def test_a_route_is_removed_only_while_it_still_leads_to_the_endpoint_that_withdraws_it():
    table = _RouteTable()
    _registered(table, 7000)
    assert table.remove(2, 1, "10.0.0.1", 7000, 0) == ((0, 0), None, True)
    assert table.get(0, 0) is None and len(table) == 0
    assert table.remove(2, 1, "10.0.0.1", 7000, 0) == ((0, 0), None, False), "a second DELETE removes nothing"


def test_a_dropped_pools_delete_after_its_successor_registered_leaves_the_successors_route():
    table = _RouteTable()
    _registered(table, 7000)
    _registered(table, 7001)  # the rank restarted at another port
    assert table.remove(2, 1, "10.0.0.1", 7000, 0) == ((0, 0), ("10.0.0.1", 7001), False)
    assert table.remove(2, 1, "10.0.0.2", 7001, 0)[2] is False, "another host at the same port is another endpoint"
    assert table.get(0, 0) == ("10.0.0.1", 7001)


def test_a_late_delete_of_an_instance_leaves_its_successors_registration_at_the_same_endpoint():
    table = _RouteTable()
    table.put(2, 1, "10.0.0.1", 7000, 0, "a" * 32)
    table.put(2, 1, "10.0.0.1", 7000, 0, "b" * 32)  # the rank restarted at the same host and port
    assert table.remove(2, 1, "10.0.0.1", 7000, 0, "a" * 32) == ((0, 0), ("10.0.0.1", 7000), False)
    assert table.get(0, 0) == ("10.0.0.1", 7000)
    assert table.remove(2, 1, "10.0.0.1", 7000, 0, "b" * 32) == ((0, 0), None, True)


def test_a_delete_without_an_instance_removes_by_endpoint_and_one_with_it_leaves_a_registration_without_one():
    table = _RouteTable()
    _registered(table, 7000)  # a peer's registration, or an older one of ours: no instance
    assert table.remove(2, 1, "10.0.0.1", 7000, 0, "a" * 32)[2] is False
    table.put(2, 1, "10.0.0.1", 7000, 0, "b" * 32)
    assert table.remove(2, 1, "10.0.0.1", 7000, 0)[2] is True, "an older peer of ours names no instance"


def test_an_instances_registration_after_its_own_delete_is_refused_and_lists_nothing():
    table = _RouteTable()
    assert table.remove(2, 1, "10.0.0.1", 7000, 0, "a" * 32) == ((0, 0), None, False)  # before its late PUT
    with pytest.raises(_RequestError) as refused:
        table.put(2, 1, "10.0.0.1", 7000, 0, "a" * 32)
    assert refused.value.status == 410 and "withdrew its route (DELETE /route) already" in refused.value.text
    assert table.get(0, 0) is None and table.sizes() == (None, None), "a late PUT lists nothing, fixes nothing"
    table.put(2, 1, "10.0.0.1", 7000, 0, "b" * 32)  # a restarted rank: a new instance
    assert table.remove(2, 1, "10.0.0.1", 7000, 0, "b" * 32)[2] is True
    with pytest.raises(_RequestError, match="withdrew its route"):
        table.put(2, 1, "10.0.0.1", 7000, 0, "b" * 32)  # a retried PUT of it, come after its DELETE removed it
    table.put(2, 1, "10.0.0.1", 7000, 0)  # a peer's: no instance
    assert table.get(0, 0) == ("10.0.0.1", 7000)


def test_a_registration_only_where_absent_replaces_no_other_and_changes_nothing():
    table = _RouteTable()
    assert table.claim(2, 1, "10.0.0.1", 7000, 0, "a" * 32, only_if_absent=True) == ((0, 0), None)  # none there
    assert table.claim(2, 1, "10.0.0.1", 7000, 0, "a" * 32, only_if_absent=True)[0] == (0, 0), "its own: kept"
    for port, instance in ((7000, "b" * 32), (7001, "a" * 32), (7000, None)):
        with pytest.raises(_RequestError) as refused:
            table.claim(2, 1, "10.0.0.1", port, 0, instance, only_if_absent=True)
        assert refused.value.status == 412 and "registered at 10.0.0.1:7000" in refused.value.text
    assert table.registration(0, 0) == (("10.0.0.1", 7000), "a" * 32)
    table.put(2, 1, "10.0.0.1", 7001, 0, "b" * 32)  # without the condition: replaced, as the SPEC says
    assert table.registration(0, 0) == (("10.0.0.1", 7001), "b" * 32)


def test_the_withdrawn_instances_remembered_are_bounded_oldest_first():
    table = _RouteTable()
    table.max_withdrawn = 2
    for instance in ("a", "b", "c"):
        table.remove(2, 1, "10.0.0.1", 7000, 0, instance * 32)
    table.put(2, 1, "10.0.0.1", 7000, 0, "a" * 32)  # forgotten: the oldest of three
    for instance in ("b", "c"):
        with pytest.raises(_RequestError, match="withdrew its route"):
            table.put(2, 1, "10.0.0.1", 7000, 0, instance * 32)


def test_a_delete_removes_its_own_rank_only():
    table = _RouteTable()
    _registered(table, 7000, engine_rank=0)
    _registered(table, 7001, engine_rank=1)
    assert table.remove(2, 1, "10.0.0.1", 7001, 1) == ((0, 1), None, True)
    assert table.get(0, 0) == ("10.0.0.1", 7000) and table.get(1, 0) is None


def test_the_sizes_stay_fixed_once_set_whatever_is_removed():
    table = _RouteTable()
    assert table.remove(2, 1, "10.0.0.1", 7000, 0) == ((0, 0), None, False)
    assert table.sizes() == (None, None), "a DELETE before any PUT fixes nothing"
    _registered(table, 7000)
    with pytest.raises(_RequestError) as refused:
        table.remove(4, 2, "10.0.0.1", 7000, 0)
    assert refused.value.status == 409 and "the DELETE says world_size=4 dp_size=2" in refused.value.text
    assert table.get(0, 0) == ("10.0.0.1", 7000), "a refused DELETE removes nothing"
    assert table.remove(2, 1, "10.0.0.1", 7000, 0)[2] is True
    assert table.sizes() == (2, 1), "the last route gone, the sizes stay"
    with pytest.raises(_RequestError) as refused:
        table.put(4, 2, "10.0.0.1", 7000, 0)
    assert refused.value.status == 409


def test_a_conflict_for_other_sizes_says_the_sizes_stay_until_a_restart_and_what_to_do():
    table = _RouteTable()
    _registered(table, 7000)
    table.remove(2, 1, "10.0.0.1", 7000, 0)  # every route withdrawn: the sizes stay all the same
    with pytest.raises(_RequestError) as refused:
        table.put(4, 2, "10.0.0.1", 7000, 0)
    assert refused.value.status == 409
    assert refused.value.text == (
        "world_size/dp_size mismatch: this server has world_size=2 dp_size=1, the PUT says world_size=4 dp_size=2: "
        "the bootstrap server keeps the sizes of its first registration until it restarts: give this encode rank "
        "the sizes it has, or restart the bootstrap server (`epd-transfer bootstrap`, or a new BootstrapServer) to "
        "serve a deployment of other sizes")


@pytest.mark.parametrize("text", [b"world_size/dp_size mismatch", b"Conflict"])
def test_a_registration_refused_with_a_conflict_says_what_to_do_whatever_the_server_said(text):
    with pytest.raises(BootstrapError) as refused:
        _replying(409, text).register_rank(4, 2, "10.0.0.9", 7000, 3, retry_for=0)
    said = str(refused.value)
    assert said.startswith(f"bootstrap server 127.0.0.1:1 refused encode rank 3: HTTP 409: {text.decode()}")
    assert said.count("restart the bootstrap server") == 1 and "give this encode rank the sizes it has" in said


def test_a_conflict_our_server_explains_is_passed_on_once():
    table = _RouteTable()
    _registered(table, 7000)
    with pytest.raises(_RequestError) as refused:
        table.put(4, 2, "10.0.0.1", 7000, 0)
    with pytest.raises(BootstrapError) as error:
        _replying(409, refused.value.text.encode()).register_rank(4, 2, "10.0.0.9", 7000, 3, retry_for=0)
    assert str(error.value) == f"bootstrap server 127.0.0.1:1 refused encode rank 3: HTTP 409: {refused.value.text}"
    assert str(error.value).count("restart the bootstrap server") == 1


def _replying(status: int, raw: bytes, sent: list | None = None) -> BootstrapClient:
    client = BootstrapClient("127.0.0.1:1", token="t0k")

    def request(method, path, body=None, headers=None, timeout=None, answered=None):
        if sent is not None:
            sent.append((method, path, json.loads(body), headers, timeout))
        return status, raw
    client._request = request
    return client


def test_unregister_rank_sends_the_puts_body_with_the_token_once_within_its_timeout():
    sent: list = []
    assert _replying(200, b'{"status": "OK", "removed": true}', sent).unregister_rank(4, 2, "10.0.0.9", 7000, 3) is True
    [(method, path, body, headers, timeout)] = sent
    assert (method, path, timeout) == ("DELETE", "/route", 1.0)
    assert body == {"role": "Prefill", "world_size": 4, "dp_size": 2, "rank_ip": "10.0.0.9", "rank_port": 7000,
                    "engine_rank": 3}
    assert headers["Authorization"] == "Bearer t0k"
    assert _replying(200, b'{"status": "OK", "removed": false}').unregister_rank(4, 2, "10.0.0.9", 7000, 3,
                                                                                 timeout=0.5) is False


def test_register_and_unregister_send_the_instance_in_a_header_and_the_body_unchanged():
    sent: list = []
    _replying(200, b'{"status": "OK", "dp_group": 0, "tp_rank": 3}', sent).register_rank(
        4, 2, "10.0.0.9", 7000, 3, retry_for=0, instance="c" * 32)
    _replying(200, b'{"status": "OK", "removed": true}', sent).unregister_rank(4, 2, "10.0.0.9", 7000, 3,
                                                                             instance="c" * 32)
    _replying(200, b'{"status": "OK", "removed": true}', sent).unregister_rank(4, 2, "10.0.0.9", 7000, 3)
    body = {"role": "Prefill", "world_size": 4, "dp_size": 2, "rank_ip": "10.0.0.9", "rank_port": 7000,
            "engine_rank": 3}
    assert [(method, b) for method, _, b, _, _ in sent] == [("PUT", body), ("DELETE", body), ("DELETE", body)]
    assert [headers.get("X-EPD-Instance") for *_, headers, _ in sent] == ["c" * 32, "c" * 32, None]


@pytest.mark.parametrize("instance", ["", "a b", "x" * 65, 7])
def test_an_instance_the_server_would_refuse_is_a_config_error_before_any_request(instance):
    sent: list = []
    with pytest.raises(ConfigError, match="an instance must be 1 to 64 letters"):
        _replying(200, b"", sent).unregister_rank(1, 1, "10.0.0.9", 7000, 0, instance=instance)
    assert sent == []


@pytest.mark.parametrize("status, raw", [(404, b"no such path"), (405, b"Method Not Allowed"),
                                         (501, b"Unsupported method ('DELETE')"), (401, b"needs a token"),
                                         (200, b"OK"), (200, b'{"status": "OK"}'), (200, b"<html>")])
def test_unregister_rank_raises_bootstrap_error_for_any_other_answer(status, raw):
    with pytest.raises(BootstrapError, match=f"HTTP {status}") as raised:
        _replying(status, raw).unregister_rank(1, 1, "10.0.0.9", 7000, 0)
    assert not isinstance(raised.value, BootstrapUnreachable)


def test_unregister_rank_without_an_answer_is_unreachable():
    client = BootstrapClient("127.0.0.1:1")

    def refuse(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")
    client._request = refuse
    with pytest.raises(BootstrapUnreachable, match="unreachable to unregister encode rank 0"):
        client.unregister_rank(1, 1, "10.0.0.9", 7000, 0)


def test_a_404_for_a_route_is_bootstrap_no_route():
    with pytest.raises(BootstrapNoRoute, match="no route for encode rank 1 in dp group 0 at 127.0.0.1:1"):
        _replying(404, b"no route for encode rank 1 in dp group 0").route(1, 0)
    with pytest.raises(BootstrapError) as other:
        _replying(500, b"boom").route(1, 0)
    assert not isinstance(other.value, BootstrapNoRoute)


@pytest.mark.parametrize("header, instance", [
    ("ab" * 16, "ab" * 16),  # ours: the registration's nonce
    (None, None),  # a peer's server names none
    ("not an instance!", None),  # nor is a malformed one taken
])
def test_a_route_names_the_registration_its_server_named(header, instance):
    client = BootstrapClient("127.0.0.1:1")

    def request(method, path, body=None, headers=None, timeout=None, answered=None):
        if header is not None:
            answered["X-EPD-Instance"] = header
        return 200, b'{"rank_ip": "10.0.0.7", "rank_port": 7000}'
    client._request = request
    assert client.registration(0, 0) == ("10.0.0.7", 7000, instance)
    assert client.route(0, 0) == ("10.0.0.7", 7000)


def test_the_route_table_remembers_which_registration_made_each_route():
    table = _RouteTable()
    table.put(2, 1, "10.0.0.7", 7000, 0, "first")
    table.put(2, 1, "10.0.0.8", 7000, 1)
    assert table.registration(0, 0) == (("10.0.0.7", 7000), "first")
    assert table.registration(1, 0) == (("10.0.0.8", 7000), None)
    table.put(2, 1, "10.0.0.7", 7000, 0, "second")
    assert table.registration(0, 0) == (("10.0.0.7", 7000), "second")
    assert table.registration(0, 1) is None


def test_register_rank_without_an_answer_is_unreachable_and_says_to_start_the_server():
    client = BootstrapClient("127.0.0.1:1")

    def refuse(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")
    client._request = refuse
    with pytest.raises(BootstrapUnreachable, match=r"^could not register encode rank 0 with bootstrap server "
                                                   r"127\.0\.0\.1:1 within 0s \(1 try\), the last: "
                                                   r"ConnectionRefusedError: .*"
                                                   r"nothing answered there: start the bootstrap server"):
        client.register_rank(1, 1, "10.0.0.9", 7000, 0, retry_for=0)
    assert client.may_have_registered is False


def test_register_rank_answered_only_with_errors_is_a_bootstrap_error_not_unreachable():
    with pytest.raises(BootstrapError, match=r"within 0s \(1 try\), the last: HTTP 503: busy$") as raised:
        _replying(503, b"busy").register_rank(1, 1, "10.0.0.9", 7000, 0, retry_for=0)
    assert not isinstance(raised.value, BootstrapUnreachable)


@pytest.mark.parametrize("token, sent", [(None, "no token was sent"), ("t0k", "the token sent is not the server's")])
def test_a_registration_refused_for_its_token_says_which_and_where_to_give_it(token, sent):
    client = BootstrapClient("127.0.0.1:1", token=token)
    client._request = lambda *args, **kwargs: (401, b"PUT /route needs Authorization: Bearer <token>")
    with pytest.raises(BootstrapError, match=rf"^bootstrap server 127\.0\.0\.1:1 refused encode rank 0: HTTP 401: PUT "
                                             rf"/route needs Authorization: Bearer <token> \({sent}\): give the sender "
                                             rf"pool the server's token \(token=; `epd-transfer rank`: --token or "
                                             rf"EPD_TOKEN\)$"):
        client.register_rank(1, 1, "10.0.0.9", 7000, 0, retry_for=0)


@pytest.mark.parametrize("encode_rank, said", [(None, "no encode rank registered at bootstrap"),
                                               (1, "encode rank 1 \\(dp group 0\\) never registered at bootstrap")])
def test_wait_ready_gives_each_look_up_what_is_left_of_its_wait_not_the_clients_timeout(monkeypatch, encode_rank,
                                                                                         said):
    """Against a server that never answers, each look-up waits out the bound it is given: wait_ready(0.3) on
    a client of 5 s gives none more than the 0.3 s it has left (at least 0.05 s), and ends once they are spent."""
    import transfer.bootstrap
    from fakes import FakeTime

    clock = FakeTime(100.0)
    monkeypatch.setattr(transfer.bootstrap, "time", clock)
    client = BootstrapClient("10.0.0.1:8998", timeout=5.0)
    bounds: list[tuple[float, float]] = []

    def silent(method, path, body=None, headers=None, timeout=None, answered=None):
        bounds.append((clock.now, timeout))
        clock.now += timeout  # a silent server: the read waits out its bound
        raise TimeoutError("timed out")

    client._request = silent
    with pytest.raises(BootstrapError, match=rf"^{said} 10.0.0.1:8998 within 0.3s \(.*last: .*timed out"):
        client.wait_ready(0.3, encode_rank=encode_rank)
    assert bounds and all(bound == max(0.05, min(5.0, 100.3 - at)) for at, bound in bounds), bounds
    assert clock.now <= 100.3 + 0.05 + 0.5, clock.now  # the last look-up and sleep started before the end


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit], ids=["KeyboardInterrupt", "SystemExit"])
def test_a_registration_interrupted_in_flight_may_have_registered(stop):
    """A stop signal's exception (a rank's SIGTERM handler raises KeyboardInterrupt) taken while an attempt
    waits for its answer: the server may have taken the PUT, so the pool's close must withdraw the route."""
    client = BootstrapClient("127.0.0.1:1")

    def interrupted(method, path, body=None, headers=None, timeout=None, answered=None):
        raise stop()

    client._request = interrupted
    with pytest.raises(stop):
        client.register_rank(1, 1, "10.0.0.1", 7000, 0, retry_for=5.0)
    assert client.may_have_registered is True


def test_a_registration_interrupted_while_its_answer_is_read_may_have_registered(monkeypatch):
    """The stop signal lands after the server's 200 came back, while the answer is read: the server lists
    the route, so the pool's close must withdraw it."""
    from transfer import bootstrap

    def interrupted(raw):
        raise KeyboardInterrupt

    client = BootstrapClient("127.0.0.1:1")
    client._request = lambda *args, **kwargs: (200, b'{"status": "OK"}')
    monkeypatch.setattr(bootstrap, "_registered", interrupted)
    with pytest.raises(KeyboardInterrupt):
        client.register_rank(1, 1, "10.0.0.1", 7000, 0, retry_for=5.0)
    assert client.may_have_registered is True

