"""What an operator meets first, without starting anything: the command line's refusals, the token
from the environment, the metrics exposition, and the launch scripts on disk."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import cli
from transfer.metrics import Metrics, serve


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


BAD_ARGUMENTS = [
    (["demo", "-E", "0"], "--encode-ranks"),
    (["demo", "-P", "0"], "--prefill-ranks"),
    (["demo", "--items", "0"], "--items"),
    (["demo", "--span", "0"], "--span"),
    (["demo", "--hidden", "-4"], "--hidden"),
    (["demo", "--inflight", "0"], "--inflight"),
    (["demo", "--deepstack", "-1"], "--deepstack"),
    (["demo", "--deadline", "-1"], "--deadline"),
    (["demo", "--timeout", "0"], "--timeout"),
    (["demo", "--timeout", "nan"], "--timeout"),
    (["demo", "--dtype", "torch.foo"], "--dtype"),
    (["bootstrap", "--port", "70000"], "--port"),
    (["bootstrap", "--port", "-1"], "--port"),
    (["bootstrap", "--token", "two\nlines"], "--token"),
    (["bootstrap", "--token", "caf\u20ac"], "--token"),
    (["rank", "--role", "encode", "--rank", "0", "--bootstrap", "nocolon"], "--bootstrap"),
    (["rank", "--role", "encode", "--rank", "0", "--bootstrap", "127.0.0.1:abc"], "--bootstrap"),
    (["rank", "--role", "encode", "--rank", "0", "--bootstrap", "127.0.0.1:70000"], "--bootstrap"),
    (["rank", "--role", "encode", "--rank", "-1", "--bootstrap", "127.0.0.1:8998"], "--rank"),
    (["rank", "--role", "encode", "--rank", "0", "-E", "0", "--bootstrap", "127.0.0.1:8998"], "--encode-ranks"),
    (["rank", "--role", "prefill", "--rank", "0", "--bootstrap", "127.0.0.1:8998", "--bootstrap-timeout", "0"],
     "--bootstrap-timeout"),
    # IPv6: ZMQ fails with "No such device", and with ZMQ's IPV6 set Mooncake cannot reach the sessions.
    (["demo", "--host", "::1"], "--host"),
    (["bench", "--host", "[::1]"], "--host"),
    (["rank", "--role", "encode", "--rank", "0", "--bootstrap", "127.0.0.1:8998", "--host", "fe80::1"], "--host"),
]


@pytest.mark.parametrize("argv, option", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_in_one_line(argv, option, capsys):
    # Parsing alone refuses these: let through, they would divide by zero, hang for the
    # whole --timeout, or print a traceback from deep inside a rank.
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert option in err and "error:" in err


def test_the_token_can_come_from_the_environment(monkeypatch):
    # So the launch scripts need not put it on a command line, where `ps` shows it to everyone.
    monkeypatch.setenv("EPD_TOKEN", "-s3cret 'x'")
    assert cli.parse_args(["bootstrap"]).token == "-s3cret 'x'"
    rank = cli.parse_args(["rank", "--role", "encode", "--rank", "0", "--bootstrap", "h:1"])
    assert rank.token == "-s3cret 'x'"
    assert cli.parse_args(["bootstrap", "--token=other"]).token == "other"
    monkeypatch.delenv("EPD_TOKEN")
    assert cli.parse_args(["bootstrap"]).token is None


def _metrics() -> Metrics:
    """A small set: one counter, one histogram."""
    m = Metrics("epd_prefill", buckets=(0.01, 0.1))
    m.inc("rooms_started_total", 3)
    m.observe("room_latency_seconds", 0.05)
    return m


def test_one_endpoint_refuses_two_sources_with_one_namespace():
    # Two families of the same name in one exposition: Prometheus rejects the whole scrape.
    with pytest.raises(ValueError, match="namespaces 'epd_prefill' and 'epd_prefill' could name the same family"):
        serve(_metrics(), _metrics())


@pytest.mark.parametrize("first, second", [("a", "a_b"), ("a_b", "a")])
def test_one_endpoint_refuses_a_namespace_that_extends_anothers(first, second):
    # a's b_c_total and a_b's c_total would both be a_b_c_total.
    with pytest.raises(ValueError, match=f"namespaces '{first}' and '{second}' could name the same family"):
        serve(Metrics(first), Metrics(second))


def test_namespaces_that_merely_start_alike_do_not_overlap():
    from transfer.metrics import _overlapping

    assert not _overlapping("epd_prefill", "epd_prefill2") and not _overlapping("epd_prefill", "epd_encode")
    assert _overlapping("epd", "epd_prefill") and _overlapping("epd_prefill", "epd_prefill")


def test_serve_names_a_source_that_is_not_metrics():
    # serve(host, port) reads like the method's signature but takes them as sources: the
    # scrape would fail on every request instead of the call failing once.
    with pytest.raises(TypeError, match="metric source '127.0.0.1' is not a Metrics"):
        serve("127.0.0.1", 9100)


_LABEL_TEXT = st.text(alphabet=st.sampled_from('ab"\\\n{}=, é'), max_size=12)
_HELP_TEXT = st.text(alphabet=st.sampled_from('ab"\\\n{}=,é'), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=20),
       reason=_LABEL_TEXT, help_text=_HELP_TEXT)
def test_exposition_parses_back(values, reason, help_text):
    """Whatever the label values and HELP text, the text format parses back to the same samples."""
    from prometheus_client.parser import text_string_to_metric_families

    m = Metrics("epd", buckets=(0.5, 5.0))
    m.inc("rooms_failed_total", reason=reason)
    m.describe("rooms_failed_total", help_text)
    for value in values:
        m.observe("room_latency_seconds", value)
    families = {f.name: f for f in text_string_to_metric_families(m.prometheus_text())}
    failed = families["epd_rooms_failed"]
    assert failed.type == "counter" and failed.documentation == help_text
    assert [(s.labels, s.value) for s in failed.samples] == [({"reason": reason}, 1)]
    if values:
        hist = families["epd_room_latency_seconds"]
        buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
        assert [s.labels["le"] for s in buckets] == ["0.5", "5.0", "+Inf"]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and counts[-1] == len(values)
        count = [s.value for s in hist.samples if s.name.endswith("_count")]
        assert count == [len(values)]


def test_the_launch_scripts_exist_and_are_executable():
    for name in ("launch.sh", "launch-encode.sh", "launch-prefill.sh", "netns-cluster.sh"):
        path = os.path.join(REPO, "scripts", name)
        assert os.access(path, os.X_OK), f"{name} is missing or not executable"


def test_rank_refuses_a_rank_outside_its_role(capsys):
    from transfer import cli

    assert cli.main(["rank", "--role", "prefill", "--rank", "2", "-P", "2", "--bootstrap", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == ("epd-transfer rank: --rank 2 is no prefill rank: with -P/--prefill-ranks 2 they "
                                       "are 0 to 1 on each prefill node; give a --rank below 2, or the deployment's "
                                       "-P/--prefill-ranks\n")
    assert cli.main(["rank", "--role", "encode", "--rank", "1", "--bootstrap", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == ("epd-transfer rank: --rank 1 is no encode rank: with -E/--encode-ranks 1 they are "
                                       "0 to 0; give a --rank below 1, or the deployment's -E/--encode-ranks\n")
