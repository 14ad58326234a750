"""The bootstrap server's and client's bounds on parallel sizes, checked without sockets."""

from __future__ import annotations

import http.client
import json

import pytest

from transfer.bootstrap import (
    MAX_BODY,
    MAX_HOST_CHARS,
    MAX_WORLD_SIZE,
    BootstrapClient,
    BootstrapError,
    _parse_registration,
    _RequestError,
    _RouteTable,
    check_token,
    split_address,
)
from transfer.errors import ConfigError
from transfer.frames import MAX_REASON_BYTES


def _body(**fields) -> bytes:
    base = {"role": "Prefill", "world_size": 2, "dp_size": 1, "rank_ip": "10.0.0.1",
            "rank_port": 17000, "engine_rank": 0}
    base.update(fields)
    return json.dumps(base).encode()


@pytest.mark.parametrize("world_size", [10**30, MAX_WORLD_SIZE + 1])
def test_a_world_size_no_deployment_has_is_a_400_naming_the_field(world_size):
    with pytest.raises(_RequestError) as refused:
        _parse_registration(_body(world_size=world_size))
    assert refused.value.status == 400
    assert refused.value.text.startswith("world_size out of range")


def test_a_refused_world_size_does_not_fix_the_sizes_for_legitimate_ranks():
    table = _RouteTable()
    with pytest.raises(_RequestError):
        table.put(*_parse_registration(_body(world_size=10**30)))
    assert table.sizes() == (None, None)
    assert table.put(*_parse_registration(_body(world_size=2, engine_rank=1))) == (0, 1)
    assert table.sizes() == (2, 1)


def test_the_largest_world_size_is_accepted():
    parsed = _parse_registration(_body(world_size=MAX_WORLD_SIZE, engine_rank=MAX_WORLD_SIZE - 1))
    assert parsed[0] == MAX_WORLD_SIZE and parsed[4] == MAX_WORLD_SIZE - 1


@pytest.mark.parametrize("fields, starts", [
    ({"role": "P" * (MAX_BODY - 200)}, 'role must be "Prefill" (the encode side), got \'PPP'),
    ({"role": ["\u2028"] * 5000}, 'role must be "Prefill" (the encode side), got [\''),
    ({"world_size": 10**4000}, "world_size out of range: 1000"),
    ({"rank_port": -(10**4000)}, "rank_port out of range: -1000"),
    ({"engine_rank": 10**300}, "engine_rank out of range: 1000"),
])
def test_a_400_quotes_what_the_body_sent_cut_short_and_printable(fields, starts):
    # A peer logs the answer's text as it is: a body of up to MAX_BODY bytes must not make a text as long.
    with pytest.raises(_RequestError) as refused:
        _parse_registration(_body(**fields))
    text = refused.value.text
    assert refused.value.status == 400 and text.startswith(starts) and len(text) <= 160 and text.isprintable(), text


def test_a_dp_size_above_world_size_is_a_400():
    with pytest.raises(_RequestError) as refused:
        _parse_registration(_body(world_size=2, dp_size=4))
    assert refused.value.status == 400 and refused.value.text.startswith("dp_size out of range")


def test_an_overlong_rank_ip_is_a_400():
    with pytest.raises(_RequestError) as refused:
        _parse_registration(_body(rank_ip="a" * (MAX_HOST_CHARS + 1)))
    assert refused.value.status == 400 and "rank_ip" in refused.value.text


@pytest.mark.parametrize("rank_ip", ["a b", "10.0.0.1\nforged log line", "x;tcp://y", "h/1", "\u00e9t\u00e9", ""])
def test_a_rank_ip_that_is_no_address_is_a_400(rank_ip):
    with pytest.raises(_RequestError) as refused:
        _parse_registration(_body(rank_ip=rank_ip))
    assert refused.value.status == 400 and refused.value.text.startswith("rank_ip must be an IP address or host name")


@pytest.mark.parametrize("rank_ip", ["10.0.0.1", "fe80::1%eth0", "encode-0.cluster_a.local", "2001:db8::7"])
def test_addresses_and_host_names_are_taken_as_rank_ips(rank_ip):
    assert _parse_registration(_body(rank_ip=rank_ip))[2] == rank_ip


@pytest.mark.parametrize("token", ["\u20acuro", "a\r\nX-Evil: 1", "t" * 4097, b"bytes"])
def test_a_token_no_http_header_can_carry_is_refused_by_the_client(token):
    with pytest.raises(ConfigError, match=r"^the token must be 1 to 4096 printable ASCII characters"):
        BootstrapClient("127.0.0.1:8998", token=token)
    assert check_token("") is None and check_token(None) is None and check_token("s3cret x") == "s3cret x"


@pytest.mark.parametrize("address", ["127.0.0.1:\u00b2", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:" + "9" * 5000])
def test_a_bootstrap_address_without_a_real_port_is_refused(address):
    with pytest.raises(ConfigError, match=r"^bootstrap address must be host:port \(a port of 1-65535\)"):
        BootstrapClient(address)


def test_a_port_written_with_leading_zeros_is_its_number():
    assert split_address("127.0.0.1:" + "0" * 5000 + "8998") == ("127.0.0.1", 8998)


@pytest.mark.parametrize("address", ["10.0.0..1:8998", ".example:8998", "a" * 64 + ".example:8998"])
def test_a_bootstrap_address_whose_host_no_resolver_takes_is_refused(address):
    """An empty label or one over 63 characters fails in the resolver's encoding, not as a lookup."""
    with pytest.raises(ConfigError, match=r"^bootstrap address must be host:port with a host name the resolver "
                                          r"takes \(dot-separated labels of 1 to 63 characters\), got '"):
        BootstrapClient(address)


@pytest.mark.parametrize("address", [" 10.0.0.1:8998", "10.0.0.1 :8998", "10.0.0.1\n:8998", "encode 0:8998",
                                     "[::1\t]:8998", "10.0.0.1\x7f:8998"])
def test_a_bootstrap_address_whose_host_holds_a_space_or_control_character_is_refused(address):
    """No host has one, and HTTP refuses to send it: every request would fail without being sent (a
    registration retried for its whole bound, then said to have found no server), not at the call."""
    with pytest.raises(ConfigError, match=r"^bootstrap address must be host:port with no space or control "
                                          r"character in its host \(a stray space or newline\?\), got '"):
        BootstrapClient(address)


@pytest.mark.parametrize("address", ["[fe80::1%eth0]:8998", "::1:8998", "encode-0.cluster.local.:8998",
                                     "b\u00fccher.example:8998"])
def test_addresses_and_host_names_are_taken_as_bootstrap_addresses(address):
    assert BootstrapClient(address).port == 8998


def test_receive_splitting_an_address_it_split_before_does_not_encode_its_host_again():
    """receive() splits its bootstrap address on every call: the host's IDNA encoding (a Python codec, 8
    calls) is checked once per address, not each time."""
    import cProfile

    from transfer.bootstrap import split_address

    address = "encode-0.cluster.local:8998"
    assert split_address(address) == ("encode-0.cluster.local", 8998)
    profile = cProfile.Profile()
    profile.enable()
    again = split_address(address)
    profile.disable()
    assert again == ("encode-0.cluster.local", 8998)
    encoded = [entry.code for entry in profile.getstats()
               if not isinstance(entry.code, str) and entry.code.co_filename.endswith(("idna.py", "codecs.py"))]
    assert encoded == []


def _client_answering(answer: dict) -> BootstrapClient:
    client = BootstrapClient("127.0.0.1:1")
    client._request = lambda *args, **kwargs: (200, json.dumps(answer).encode())
    return client


@pytest.mark.parametrize("sizes", [(10**30, 1), (MAX_WORLD_SIZE + 1, 1), (4, 3)])
def test_the_client_refuses_parallel_sizes_no_deployment_has(sizes):
    client = _client_answering({"prefill_tp_size": sizes[0], "prefill_dp_size": sizes[1]})
    with pytest.raises(BootstrapError, match="parallel sizes no deployment has"):
        client.parallel_info()


def test_the_client_accepts_plausible_parallel_sizes():
    assert _client_answering({"prefill_tp_size": 8, "prefill_dp_size": 2}).parallel_info() == (8, 2)


@pytest.mark.parametrize("route", [{"rank_ip": "10.0.0.1", "rank_port": 10**30}, {"rank_ip": "10.0.0.1", "rank_port": 0},
                                   {"rank_ip": "h" * (MAX_HOST_CHARS + 1), "rank_port": 17000},
                                   {"rank_ip": "", "rank_port": 17000}, {"rank_ip": "\ud800", "rank_port": 17000},
                                   {"rank_ip": "encode 1", "rank_port": 17000}])
def test_the_client_refuses_a_route_no_encode_rank_has(route):
    with pytest.raises(BootstrapError, match="a route no encode rank has"):
        _client_answering(route).route(0, 0)


def test_the_client_accepts_a_plausible_route():
    assert _client_answering({"rank_ip": "10.0.0.1", "rank_port": 17000}).route(0, 0) == ("10.0.0.1", 17000)


#: What a hostile server might send: lines that would forge log entries, an escape that
#: would clear a terminal, and far more text than any failure reason should carry.
_HOSTILE_TEXT = "boom\n2026-12-04 INFO transfer: room 7 Success\n\x1b[2J" + "A" * 70_000


def _client_replying(status: int, raw: bytes) -> BootstrapClient:
    client = BootstrapClient("127.0.0.1:1")
    client._request = lambda *args, **kwargs: (status, raw)
    return client


def _client_failing(error: Exception) -> BootstrapClient:
    client = BootstrapClient("127.0.0.1:1")

    def fail(*args, **kwargs):
        raise error
    client._request = fail
    return client


def _assert_fit_for_a_failure_reason(text: str) -> None:
    assert len(text) < 2 * MAX_REASON_BYTES
    assert text.isprintable()
    assert "..." in text


_CALLS = {
    "parallel info": lambda client: client.parallel_info(),
    "route": lambda client: client.route(0, 0),
    "registration": lambda client: client.register_rank(2, 1, "10.0.0.1", 17000, 0, retry_for=0),
}


@pytest.mark.parametrize("status", [400, 500])
@pytest.mark.parametrize("call", _CALLS.values(), ids=_CALLS.keys())
def test_an_error_body_reaches_the_failure_printable_and_cut(call, status):
    with pytest.raises(BootstrapError) as caught:
        call(_client_replying(status, _HOSTILE_TEXT.encode()))
    _assert_fit_for_a_failure_reason(str(caught.value))
    assert "boom?2026-12-04 INFO" in str(caught.value)


@pytest.mark.parametrize("call", _CALLS.values(), ids=_CALLS.keys())
def test_a_transport_error_quoting_the_server_reaches_the_failure_printable_and_cut(call):
    with pytest.raises(BootstrapError) as caught:
        call(_client_failing(http.client.BadStatusLine(_HOSTILE_TEXT)))
    _assert_fit_for_a_failure_reason(str(caught.value))


@pytest.mark.parametrize("call", [_CALLS["parallel info"], _CALLS["route"]], ids=["parallel info", "route"])
def test_an_incomplete_answer_is_quoted_printable_and_cut(call):
    with pytest.raises(BootstrapError, match="incomplete") as caught:
        # Short enough to be read whole (MAX_BODY), far longer than a reason.
        call(_client_answering({"prefill_tp_size": None, "rank_ip": None, "pad": _HOSTILE_TEXT[:MAX_BODY // 2]}))
    _assert_fit_for_a_failure_reason(str(caught.value))


@pytest.mark.parametrize("call, answer", [
    (_CALLS["parallel info"], {"prefill_tp_size": 10**4000, "prefill_dp_size": 1}),
    (_CALLS["parallel info"], {"prefill_tp_size": 4, "prefill_dp_size": 10**4000}),
    (_CALLS["route"], {"rank_ip": "10.0.0.1", "rank_port": 10**4000}),
], ids=["tp size", "dp size", "port"])
def test_a_number_no_deployment_has_is_quoted_cut(call, answer):
    """JSON carries integers of up to 4300 digits: one quoted in full would make a 4 KiB error."""
    with pytest.raises(BootstrapError, match="no deployment has|no encode rank has") as caught:
        call(_client_answering(answer))
    _assert_fit_for_a_failure_reason(str(caught.value))


def _register(client: BootstrapClient) -> None:
    client.register_rank(2, 1, "10.0.0.1", 17000, 0, retry_for=30)


@pytest.mark.parametrize("raw", [b'{"status": "OK", "dp_group": 0, "tp_rank": 0}', b"OK", b"OK\n", b""])
def test_a_registration_is_taken_from_our_servers_json_a_peers_plain_ok_or_an_empty_answer(raw):
    _register(_client_replying(200, raw))


@pytest.mark.parametrize("raw", [b"<html><body>Welcome</body></html>", b'{"status": "fine"}', b'"OK"',
                                 b"OKAY", b'{"status": "OK", "pad": "' + b"x" * MAX_BODY],
                         ids=["html", "other json", "a json string", "another word", "json cut short"])
def test_a_200_no_bootstrap_server_answers_is_refused_without_retrying(raw):
    with pytest.raises(BootstrapError, match="which no bootstrap server answers"):
        _register(_client_replying(200, raw[:MAX_BODY]))


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirected_registration_is_refused_without_retrying(status):
    with pytest.raises(BootstrapError, match=f"redirected encode rank 0's registration \\(HTTP {status}\\)"):
        _register(_client_replying(status, b""))


@pytest.mark.parametrize("retry_for", [float("nan"), float("inf"), -1.0])
def test_register_rank_refuses_a_retry_bound_that_is_no_bound_before_any_request(retry_for):
    client = BootstrapClient("127.0.0.1:1")

    def request(*_args, **_kwargs):
        raise AssertionError("register_rank sent a request")

    client._request = request
    with pytest.raises(ConfigError, match="retry_for"):
        client.register_rank(2, 1, "10.0.0.1", 7001, engine_rank=0, retry_for=retry_for)


@pytest.mark.parametrize("address", ["10.0.0.1:8998", "[::1]:8998", "encode-0.cluster.local:0008998"])
def test_a_checked_address_is_split_as_split_address_splits_it(address):
    from transfer.bootstrap import checked_address

    assert checked_address(address) == split_address(address)


def test_an_address_checked_and_refused_is_refused_again():
    """checked_address remembers what it split, never what it refused."""
    from transfer.bootstrap import checked_address

    for _ in range(2):
        with pytest.raises(ConfigError, match=r"^bootstrap address must be host:port \(a port of 1-65535\)"):
            checked_address("10.0.0.1:0")
