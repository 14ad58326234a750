"""transfer.config: EPD_* variables as defaults, arguments first, bad values refused naming the variable."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import cli, config
from transfer.config import SETTINGS, renamed, resolve, setting
from transfer.errors import ConfigError, ConfigTypeError

README = Path(__file__).resolve().parents[2] / "README.md"


class Untouchable:
    """An engine stand-in: a constructor that touches it before checking its settings fails the test."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the engine was used ({name}) before the settings were checked")


# ------------------------------------------------------------------ resolve


@pytest.mark.parametrize("entry", SETTINGS, ids=lambda s: s.env)
def test_an_unset_or_empty_variable_gives_the_documented_default(entry):
    assert resolve(entry.env, environ={}) == entry.default
    assert resolve(entry.env, environ={entry.env: ""}) == entry.default


def test_the_environment_sets_the_default_and_an_argument_wins_over_it():
    environ = {"EPD_DEADLINE_S": "5.5", "EPD_SEND_DEPTH": "4", "EPD_MAX_PARKED_BYTES": "1048576",
               "EPD_DEVICE": "mlx5_0", "EPD_ZMQ_SCHED_BATCH": "off"}
    assert resolve("EPD_DEADLINE_S", environ=environ) == 5.5
    assert resolve("EPD_SEND_DEPTH", environ=environ) == 4
    assert resolve("EPD_MAX_PARKED_BYTES", environ=environ) == 1 << 20
    assert resolve("EPD_DEVICE", environ=environ) == "mlx5_0"
    assert resolve("EPD_ZMQ_SCHED_BATCH", environ=environ) is False
    assert resolve("EPD_DEADLINE_S", 9.0, environ=environ) == 9.0
    assert resolve("EPD_SEND_DEPTH", 1, environ=environ) == 1


def test_an_argument_wins_even_over_a_variable_that_would_not_parse():
    assert resolve("EPD_DEADLINE_S", 3.0, environ={"EPD_DEADLINE_S": "soon"}) == 3.0


@pytest.mark.parametrize("env, text, what", [
    ("EPD_DEADLINE_S", "soon", "a positive number of seconds"),
    ("EPD_DEADLINE_S", "0", "a positive number of seconds"),
    ("EPD_LOOKUP_TIMEOUT_S", "-2", "a positive number of seconds"),
    ("EPD_FANOUT_TIMEOUT_S", "inf", "a positive number of seconds"),
    ("EPD_REGISTER_TIMEOUT_S", "nan", "a positive number of seconds"),
    ("EPD_LOOKUP_TIMEOUT_S", "1e10", "a positive number of seconds up to 1000000"),
    ("EPD_SEND_DEPTH", "0", "a positive integer"),
    ("EPD_SEND_DEPTH", "2.5", "a positive integer"),
    ("EPD_MAX_PARKED_BYTES", "64MiB", "a positive number of bytes"),
    ("EPD_QUARANTINE_S", "-1", "a non-negative number of seconds"),
    ("EPD_FALLBACK_GRACE_S", "x", "a non-negative number of seconds"),
    ("EPD_QUARANTINE_S", "2e6", "a non-negative number of seconds up to 1000000"),
    ("EPD_ZMQ_SCHED_BATCH", "maybe", "one of 1, 0, true, false"),
    ("EPD_DEADLINE_S", "\u0663", "a positive number of seconds"),
    ("EPD_FALLBACK_GRACE_S", "\uff15", "a non-negative number of seconds"),
    ("EPD_SEND_DEPTH", "\uff11\uff16", "a positive integer"),
    ("EPD_MAX_PARKED_BYTES", "1\u0660\u0660", "a positive number of bytes"),
])
def test_a_bad_value_is_refused_naming_the_variable_the_value_and_what_it_sets(env, text, what):
    entry = setting(env)
    with pytest.raises(ConfigError) as err:
        resolve(env, environ={env: text})
    message = str(err.value)
    assert message.startswith(f"{env}={text!r} is not {what}"), message
    assert entry.component in message and entry.argument in message


def test_an_argument_of_any_number_type_is_taken_as_a_plain_number():
    import numpy as np

    assert resolve("EPD_SEND_DEPTH", np.int64(4)) == 4 and type(resolve("EPD_SEND_DEPTH", np.int64(4))) is int
    assert resolve("EPD_DEADLINE_S", 5) == 5.0 and type(resolve("EPD_DEADLINE_S", 5)) is float
    with pytest.raises(ConfigError, match=r"^deadline_s=-1 is not a positive number of seconds"):
        resolve("EPD_DEADLINE_S", -1)


def test_zero_is_a_valid_quarantine_and_grace():
    assert resolve("EPD_QUARANTINE_S", environ={"EPD_QUARANTINE_S": "0"}) == 0.0
    assert resolve("EPD_FALLBACK_GRACE_S", 0) == 0


@pytest.mark.parametrize("text, value", [("1", True), ("yes", True), ("ON", True), ("0", False), ("false", False),
                                         ("no", False)])
def test_flags_read_the_usual_spellings(text, value):
    assert resolve("EPD_ZMQ_SCHED_BATCH", environ={"EPD_ZMQ_SCHED_BATCH": text}) is value


@pytest.mark.parametrize("env, value", [
    ("EPD_DEADLINE_S", -1.0), ("EPD_DEADLINE_S", float("nan")), ("EPD_SEND_DEPTH", 0),
    ("EPD_MAX_PARKED_BYTES", -5), ("EPD_QUARANTINE_S", -0.5),
])
def test_a_bad_argument_is_refused_naming_the_argument(env, value):
    with pytest.raises(ConfigError, match=rf"^{setting(env).argument}={re.escape(repr(value))} is not "):
        resolve(env, value, environ={})


@pytest.mark.parametrize("env, value", [
    ("EPD_DEADLINE_S", "60"), ("EPD_DEADLINE_S", True), ("EPD_FALLBACK_GRACE_S", [1]),
    ("EPD_SEND_DEPTH", 2.0), ("EPD_SEND_DEPTH", True), ("EPD_MAX_PARKED_BYTES", "1048576"),
])
def test_an_argument_of_the_wrong_type_is_a_config_type_error_as_everywhere_else(env, value):
    with pytest.raises(ConfigTypeError, match=rf"^{setting(env).argument}={re.escape(repr(value))} is not "):
        resolve(env, value, environ={})


def test_a_name_outside_the_table_is_a_programming_error():
    with pytest.raises(KeyError):
        resolve("EPD_NO_SUCH_THING", environ={})


# ------------------------------------------------------------------ renamed keywords


def test_the_new_keyword_alone_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert renamed("SenderPool", "bootstrap_timeout_s", None, "fanout_timeout_s", 5.0) == 5.0
        assert renamed("SenderPool", "bootstrap_timeout_s", None, "fanout_timeout_s", None) is None


def test_the_old_keyword_still_works_with_a_warning_naming_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"SenderPool\(bootstrap_timeout_s=\) is deprecated: use "
                                                r"fanout_timeout_s="):
        assert renamed("SenderPool", "bootstrap_timeout_s", 7.0, "fanout_timeout_s", None, stacklevel=2) == 7.0


def test_both_keywords_at_once_are_refused():
    with pytest.raises(ConfigError, match=r"give fanout_timeout_s= only \(bootstrap_timeout_s= is its deprecated"):
        renamed("SenderPool", "bootstrap_timeout_s", 7.0, "fanout_timeout_s", 8.0)


# ------------------------------------------------------------------ the components read it at construction


def test_a_session_manager_refuses_a_bad_variable_before_it_starts_anything(monkeypatch):
    from transfer.receiver import SessionManager

    monkeypatch.setenv("EPD_LOOKUP_TIMEOUT_S", "two")
    with pytest.raises(ConfigError, match=r"^EPD_LOOKUP_TIMEOUT_S='two' is not a positive number of seconds "
                                          r"up to 1000000 \(SessionManager lookup_timeout_s"):
        SessionManager(Untouchable(), 0, 1, buffer=object())


def test_a_session_managers_old_keyword_warns_at_the_callers_line(monkeypatch):
    from transfer.receiver import SessionManager

    monkeypatch.setenv("EPD_DEADLINE_S", "-1")  # stops the constructor right after the keywords are read
    with pytest.warns(DeprecationWarning, match=r"SessionManager\(bootstrap_timeout_s=\) is deprecated: use "
                                                r"lookup_timeout_s=") as caught, pytest.raises(ConfigError):
        SessionManager(Untouchable(), 0, 1, buffer=object(), bootstrap_timeout_s=1.0)
    assert caught[0].filename == __file__
    with pytest.raises(ConfigError, match="give lookup_timeout_s= only"):
        SessionManager(Untouchable(), 0, 1, buffer=object(), bootstrap_timeout_s=1.0, lookup_timeout_s=1.0)


@pytest.mark.parametrize("env, text", [("EPD_FANOUT_TIMEOUT_S", "2m"), ("EPD_REGISTER_TIMEOUT_S", "0"),
                                       ("EPD_SEND_DEPTH", "-3"), ("EPD_MAX_PARKED_BYTES", "lots"),
                                       ("EPD_POLL_MIN_S", "0"), ("EPD_POLL_MAX_S", "fast")])
def test_a_sender_pool_refuses_a_bad_variable_before_it_starts_anything(monkeypatch, env, text):
    from transfer.sender import SenderPool

    monkeypatch.setenv(env, text)
    with pytest.raises(ConfigError, match=rf"^{env}={text!r} is not .*\(SenderPool "):
        SenderPool(Untouchable(), 0, 1, 1, "127.0.0.1:8998")


@pytest.mark.parametrize("given, message", [
    ({"bootstrap_addr": "localhost"}, r"^bootstrap address must be host:port \(a port of 1-65535\), got 'localhost'$"),
    ({"bootstrap_addr": 8998}, r"^bootstrap address must be a 'host:port' str, got int 8998$"),
    ({"token": "two\nlines"}, r"^the token must be 1 to 4096 printable ASCII characters"),
])
def test_a_sender_pool_refuses_a_bad_bootstrap_address_or_token_before_it_starts_anything(given, message):
    from transfer.sender import SenderPool

    arguments = {"bootstrap_addr": "127.0.0.1:8998", **given}
    with pytest.raises(ConfigError, match=message):
        SenderPool(Untouchable(), 0, 1, 1, **arguments)


@pytest.mark.parametrize("given, environ, message", [
    ({"poll_min_s": 2e-3}, {}, r"^SenderPool: poll_min_s \(EPD_POLL_MIN_S\) 0.002 s is above poll_max_s "
                               r"\(EPD_POLL_MAX_S\) 0.001 s$"),
    ({}, {"EPD_POLL_MIN_S": "0.01", "EPD_POLL_MAX_S": "0.005"}, r"poll_min_s \(EPD_POLL_MIN_S\) 0.01 s is above"),
    ({"poll_max_s": 5.0}, {}, r"^SenderPool: poll_max_s \(EPD_POLL_MAX_S\) is 5 s; at most 1 s, or a finished "
                              r"write waits that long to be noticed$"),
])
def test_a_sender_pool_refuses_a_poll_schedule_that_cannot_hold(monkeypatch, given, environ, message):
    from transfer.sender import SenderPool

    for env, text in environ.items():
        monkeypatch.setenv(env, text)
    with pytest.raises(ConfigError, match=message):
        SenderPool(Untouchable(), 0, 1, 1, "127.0.0.1:8998", **given)


@pytest.mark.parametrize("component", ["SenderPool", "SessionManager"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_integrity_must_be_true_or_false(component, value):
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    make = {"SenderPool": lambda: SenderPool(Untouchable(), 0, 1, 1, "127.0.0.1:8998", integrity=value),
            "SessionManager": lambda: SessionManager(Untouchable(), 0, 1, buffer=object(), integrity=value)}
    with pytest.raises(ConfigTypeError, match=rf"^{component}: integrity={value!r} must be True or False$"):
        make[component]()


@pytest.mark.parametrize("value, zero_ok, error", [
    (float("nan"), False, ConfigError), (float("inf"), True, ConfigError), (-1, True, ConfigError),
    (0, False, ConfigError), (1e300, False, ConfigError), (10**400, False, ConfigError),
    ("3", False, ConfigTypeError), (True, False, ConfigTypeError), (None, True, ConfigTypeError),
])
def test_check_seconds_refuses_what_would_bound_nothing(value, zero_ok, error):
    with pytest.raises(error, match=rf"^timeout={re.escape(repr(value))} is not a "):
        config.check_seconds("timeout", value, zero_ok)


def test_check_seconds_takes_any_real_number_in_range():
    import numpy as np

    assert config.check_seconds("timeout", np.float32(0.5)) == 0.5
    assert config.check_seconds("timeout", 0, zero_ok=True) == 0.0
    assert config.check_seconds("timeout", 1e6) == 1e6


@settings(max_examples=1000, deadline=None)
@given(st.floats() | st.integers(-10, 10**7) | st.sampled_from([-0.0, 5e-324, 1e6, 1e6 + 1, 10**6]), st.booleans())
def test_check_seconds_reads_a_plain_number_as_its_text_would_be_read(value, zero_ok):
    try:
        expected: object = config.parse_seconds(str(float(value)), zero_ok)
    except ConfigError:
        expected = ConfigError
    try:
        got: object = config.check_seconds("timeout", value, zero_ok)
    except ConfigError:
        got = ConfigError
    assert got == expected and type(got) is type(expected)
    if type(got) is float:
        assert str(got) == str(expected)  # -0.0 and 0.0 told apart


@pytest.mark.parametrize("env, text", [("EPD_SEND_DEPTH", "99999999999999999999999"),
                                       ("EPD_MAX_PARKED_BYTES", str(10**30))])
def test_counts_and_bytes_past_any_machine_are_refused(env, text):
    with pytest.raises(ConfigError, match=rf"^{env}='{text}' is not a positive .* up to "):
        resolve(env, environ={env: text})


def test_a_number_too_large_for_a_float_is_refused_as_a_bad_argument():
    with pytest.raises(ConfigError, match=r"^deadline_s=1000.* is not a positive number of seconds"):
        resolve("EPD_DEADLINE_S", 10**400)


def test_negative_zero_seconds_read_as_zero():
    assert str(resolve("EPD_QUARANTINE_S", environ={"EPD_QUARANTINE_S": "-0"})) == "0.0"


def test_sub_second_defaults_read_in_their_own_unit():
    assert setting("EPD_POLL_MIN_S").default_text() == "100 us"
    assert setting("EPD_POLL_MAX_S").default_text() == "1 ms"
    assert setting("EPD_DEADLINE_S").default_text() == "60 s"


def test_a_sender_pool_refuses_both_names_of_its_fanout_timeout():
    from transfer.sender import SenderPool

    with pytest.raises(ConfigError, match="give fanout_timeout_s= only"):
        SenderPool(Untouchable(), 0, 1, 1, "127.0.0.1:8998", fanout_timeout_s=1.0, bootstrap_timeout_s=1.0)


def test_a_receive_pool_takes_its_quarantine_from_the_environment_unless_given(monkeypatch):
    from fakes import RecordingEngine

    from transfer.buffers import ReceivePool

    monkeypatch.setenv("EPD_QUARANTINE_S", "12.5")
    monkeypatch.setenv("EPD_FALLBACK_GRACE_S", "3")
    with ReceivePool(RecordingEngine(), 64, 64) as pool:
        assert (pool.quarantine_s, pool.grace_s) == (12.5, 3.0)
    with ReceivePool(RecordingEngine(), 64, 64, quarantine_s=1.0, grace_s=0.0) as pool:
        assert (pool.quarantine_s, pool.grace_s) == (1.0, 0.0)
    monkeypatch.setenv("EPD_QUARANTINE_S", "-1")
    engine = RecordingEngine()
    with pytest.raises(ConfigError, match=r"^EPD_QUARANTINE_S='-1'"):
        ReceivePool(engine, 64, 64)
    assert engine.log == []


# ------------------------------------------------------------------ the command line


def test_the_rank_commands_deadline_and_bootstrap_wait_default_from_the_environment(monkeypatch):
    monkeypatch.setenv("EPD_DEADLINE_S", "7")
    monkeypatch.setenv("EPD_FANOUT_TIMEOUT_S", "9")
    base = ["rank", "--role", "prefill", "--rank", "0", "--bootstrap", "h:1"]
    args = cli.parse_args(base)
    assert (args.deadline, args.bootstrap_timeout) == (7.0, 9.0)
    args = cli.parse_args([*base, "--deadline", "2", "--bootstrap-timeout", "3"])
    assert (args.deadline, args.bootstrap_timeout) == (2.0, 3.0)
    assert cli.parse_args(["demo"]).deadline == 7.0


def test_the_command_line_names_a_bad_variable_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("EPD_DEADLINE_S", "soon")
    assert cli.main(["demo", "--items", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epd-transfer: EPD_DEADLINE_S='soon' is not a positive number of seconds")
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv", [["bootstrap", "--help"], ["doctor", "--help"], ["--version"]])
def test_a_bad_variable_leaves_the_commands_that_do_not_read_it_working(monkeypatch, capsys, argv):
    monkeypatch.setenv("EPD_DEADLINE_S", "soon")
    monkeypatch.setenv("EPD_FANOUT_TIMEOUT_S", "0")
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 0
    assert "EPD_" not in capsys.readouterr().err


def test_a_bad_token_in_the_environment_is_named_as_the_variable_without_its_value(monkeypatch, capsys):
    monkeypatch.setenv("EPD_TOKEN", "bad\x01token")
    assert cli.main(["bootstrap", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epd-transfer: EPD_TOKEN: the token must be 1 to 4096 printable ASCII")
    assert "bad" not in err and "token'" not in err


# ------------------------------------------------------------------ one table in the README


def _readme_rows() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `(EPD_[A-Z_]+)` \|.*$", text, re.M)}


def test_the_readme_table_lists_every_variable_with_its_default_and_argument():
    rows = _readme_rows()
    assert set(rows) == {entry.env for entry in SETTINGS}
    for entry in SETTINGS:
        cells = [cell.strip() for cell in rows[entry.env].strip("|").split("|")]
        assert entry.default_text() in cells[1], (entry.env, cells)
        assert entry.component in cells[3] and entry.argument in cells[3], (entry.env, cells)


def test_the_settings_defaults_are_the_components_own():
    from transfer import buffers
    from transfer.core import parked
    from transfer.drive import encode

    assert setting("EPD_MAX_PARKED_BYTES").default == parked.MAX_PARKED_BYTES
    assert (setting("EPD_POLL_MIN_S").default, setting("EPD_POLL_MAX_S").default) == (encode.POLL_MIN_S,
                                                                                      encode.POLL_MAX_S)
    assert setting("EPD_QUARANTINE_S").default == buffers.QUARANTINE_S
    assert config.setting("EPD_QUARANTINE_S").default > setting("EPD_FANOUT_TIMEOUT_S").default


# ------------------------------------------------------------------ the engine argument


@pytest.mark.parametrize("component", ["SenderPool", "SessionManager", "ReceivePool"])
@pytest.mark.parametrize("engine, got", [(None, "got NoneType$"), ("127.0.0.1", "got str without ")])
def test_a_component_given_no_engine_says_which_argument_it_needs(component, engine, got):
    from transfer.buffers import ReceivePool
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    make = {"SenderPool": lambda: SenderPool(engine, 0, 1, 1, "127.0.0.1:8998"),
            "SessionManager": lambda: SessionManager(engine, 0, 1, buffer=object()),
            "ReceivePool": lambda: ReceivePool(engine, 1024, 256)}[component]
    with pytest.raises(ConfigTypeError, match=rf"^{component}: engine must be a transfer engine "
                                              rf"\(transfer.engine.Engine, transfer.wire_engine.WireEngine, or one "
                                              rf"with .*\), {got}"):
        make()
